"""The notifier's reads meet records no service wrote (docs/notifications.md "Records the notifier did not write").

What the reply rule cannot stop (docs/security.md "Replies"): an agent publishes its own envelope
with a reply subject, and nats-server sends its acknowledgement, ``{"stream": "PGW_INBOUND",
"seq": N}``, there; a bucket or stream capturing that subject stores it. Here the attacker is
agent ``mallory``, bound to bob only, with its own credentials on a server running the
authorization block ``pgw creds`` generates; the gateway and the notifier run as their own parties,
alice's surface as ``principal:alice``. Each test aims the acknowledgement at the notifier's stores
as the attacker does, then shows the notifier still notifies through real receivers: the webhook
receiver that checks the signature (tests/notify_peers.py) and a push service that decrypts with
the reference ``http_ece`` (tests/push_peer.py).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass, field
from email import policy
from email.parser import BytesParser
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec
import pytest

from consumers.notify.answers import USED_BUCKET, Tokens
from consumers.notify.service import MOMENTS_BUCKET, SURFACE_STREAM, Notifier
from consumers.notify.store import DLQ_STREAM, JOBS_BUCKET, SUBS_BUCKET, dead_letters, status
from gateway.app import Gateway
from gateway.security import EmbeddedAuth, Party, embedded_auth
from pgwcore.config import Config, load_config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams
from subjects.client import Agent
from tests.gauntlet.bed import flushed
from tests.logcapture import capture_logs_with_context
from tests.moments import good_moment
from tests.notify_peers import Hook, Relay, smtp_server, webhook_receiver
from tests.polling import until, until_drained
from tests.push_peer import push_service
from tests.test_notify_email_answers import answer_links, get, post

pytestmark = pytest.mark.security

KEY = "answer-link-test-key-0123456789abcdefghij"
WAIT = 20.0  # guard only: each wait is for an event or a stored record
PUBACK = "PGW_INBOUND"  # what the stored acknowledgement says; never to be logged
SKIPPED = "a stored value the notifier did not write; skipped"


@dataclass
class Bed:
    server: EmbeddedServer
    auth: EmbeddedAuth
    hook: Hook
    conns: dict[str, Any] = field(default_factory=dict)

    async def conn(self, role: str, name: str) -> Any:
        label = f"{role}-{name}"
        if label not in self.conns:
            creds = self.auth.creds_for(Party(role, name))  # type: ignore[arg-type]
            self.conns[label] = await connect(self.server.client_url, creds=str(creds), name=label)
        return self.conns[label]

    async def aim(self, *targets: str) -> None:
        """Agent mallory publishes its own envelope with each target as the reply subject (docs/security.md
        "Replies"); returns once the server has stored its acknowledgement at each."""
        mallory = await self.conn("agent", "mallory")
        for reply in targets:
            await mallory.publish("pgw.agent.mallory.envelope", b'{"x": "junk"}', reply=reply)
        await flushed(mallory)
        ops = await self.conn("ops", "olive")
        for reply in targets:
            stream = ("KV_" + reply.split(".")[1] if reply.startswith("$KV.")
                      else DLQ_STREAM if reply.endswith(".notify.deadletter") else SURFACE_STREAM)

            async def stored(subject: str = reply, stream: str = stream) -> bool:
                got = await ops.request(f"$JS.API.STREAM.MSG.GET.{stream}",
                                        json.dumps({"last_by_subj": subject}).encode(), timeout=WAIT)
                return b'"message"' in got.data

            await until(stored, timeout=WAIT, what=f"the acknowledgement stored at {reply}")


def settings(hook: Hook, relay: Relay | None, **notifier: Any) -> dict[str, Any]:
    """alice: webhook and Web Push (and, with a relay, e-mail she can answer from); bob: webhook.
    mallory may send to bob only."""
    hooked = {"webhook_url": hook.url, "webhook_secret_file": str(hook.secret_file)}
    alice = dict(hooked)
    mail: dict[str, Any] = {}
    if relay is not None:
        alice.update(email="alice@example.com", answer_by_email=True)
        mail = {"answer_port": 0, "smtp": {
            "host": relay.host, "port": relay.port, "credentials_file": str(relay.credentials_file),
            "ca_file": str(relay.ca_file), "from_addr": "pgw@pgw.example"}}
    return {"presence_grace_s": 0, "push_hosts": ["127.0.0.1"], "push_allow_http": True,
            "principals": {"alice": alice, "bob": dict(hooked)}, **mail, **notifier}


def make_config(tmp: Path, hook: Hook, relay: Relay | None = None, **notifier: Any) -> Config:
    return load_config(None, data_dir=str(tmp / "data"),
                       agents={"planner": {"principals": ["alice"]}, "mallory": {"principals": ["bob"]}},
                       security={"ops": ["olive"]}, notifier=settings(hook, relay, **notifier))


@contextlib.asynccontextmanager
async def secured(tmp: Path, hook: Hook, relay: Relay | None = None) -> AsyncIterator[tuple[Bed, Config]]:
    """A server with `pgw creds`'s block, the streams made and the gateway running as ``service:gateway``."""
    config = make_config(tmp, hook, relay)
    auth = embedded_auth(config)
    server = EmbeddedServer(tmp / "nats", port=-1, monitor_port=-1, websocket_port=-1,
                            authorization=auth.server_block)
    await server.start()
    config = msgspec.structs.replace(config, nats_url=server.client_url)  # the answer pages connect as alice
    bed = Bed(server, auth, hook)
    try:
        gw = await bed.conn("service", "gateway")
        await ensure_streams(gw.jetstream(), config.subjects)
        async with Gateway(config, gw):
            yield bed, config
    finally:
        for c in bed.conns.values():
            with contextlib.suppress(Exception):
                await c.drain()
        await server.stop()


async def moment(bed: Bed, agent: str, principal: str) -> str:
    """``agent`` sends a moment to ``principal``; its moment id, from the gateway's outcome."""
    a = Agent(await bed.conn("agent", agent), agent)
    try:
        eid = await a.send_moment(principal, good_moment(), expires_in_s=600)
        return (await a.outcome_for(eid, timeout=WAIT)).moment_id
    finally:
        await a.close()


def warned(logs: list[MutableMapping[str, Any]], store: str, key: str) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e.get("event") == SKIPPED and e.get("store") == store and e.get("key") == key]


def never_logged_the_value(logs: list[MutableMapping[str, Any]]) -> None:
    assert not [e for e in logs if PUBACK in repr(e)], [e for e in logs if PUBACK in repr(e)]


async def test_a_junk_key_among_alice_s_push_subscriptions_stops_none_of_her_notifications(tmp_path: Path) -> None:
    """Mallory, bound to bob, aims its acknowledgement at a key under alice's Web Push subscriptions (and at
    surface subjects the notifier reads); alice's next moment still reaches her phone and her webhook, the
    notifier's durable drains, and the key is named in one warning, its value never logged."""
    async with webhook_receiver(tmp_path) as hook, push_service() as ps, secured(tmp_path, hook) as (bed, config):
        n_nc = await bed.conn("service", "notifier")
        with capture_logs_with_context() as logs:
            async with Notifier(config, n_nc):
                alice = await bed.conn("principal", "alice")
                _, sub = await ps.new_subscription()
                r = await alice.request(config.subjects.push("alice", "subscribe"),
                                        json.dumps({"subscription": sub, "device": "phone"}).encode(), timeout=WAIT)
                assert json.loads(r.data)["ok"] is True, r.data
                # A key under alice's prefix of PGW_PUSH_SUBS, a surface subject of hers and one whose
                # principal token is no token: what the notifier reads, each holding the acknowledgement.
                await bed.aim(f"$KV.{SUBS_BUCKET}.alice.x1", "pgw.principal.alice.surface",
                              "pgw.principal.al!ce.surface")
                await moment(bed, "planner", "alice")

                async def notified() -> bool:
                    return len(hook.accepted) == 1 and len(await ps.received()) == 1

                await until(notified, timeout=WAIT, what="alice notified by webhook and push")
                assert hook.accepted[0]["principal"] == "alice"
                await until_drained(n_nc.jetstream(), SURFACE_STREAM, config.notifier.durable, timeout=WAIT)
        assert len(warned(logs, SUBS_BUCKET, "alice.x1")) == 1, logs
        assert warned(logs, SURFACE_STREAM, "pgw.principal.alice.surface"), logs
        assert warned(logs, SURFACE_STREAM, "pgw.principal.al!ce.surface"), logs
        assert not [e for e in logs if e.get("event", "").startswith("surface item not handled")], logs
        never_logged_the_value(logs)


async def test_junk_job_keys_stop_no_start_from_resuming_earlier_jobs(tmp_path: Path) -> None:
    """Alice's jobs wait when the notifier stops; mallory aims its acknowledgement at made-up PGW_NOTIFY keys
    (one listed before alice's: the server lists keys in order, so a start stopped by it resumes none of
    hers), at the job key of its own moment to bob, sent while the notifier was down, and at the gateway's
    record of alice's second moment. At the next start alice's first job is resumed and sent, bob's moment
    is notified (the junk at its job key is written over), and the moment with no record is skipped."""
    async with webhook_receiver(tmp_path) as hook, secured(tmp_path, hook) as (bed, config):
        n_nc = await bed.conn("service", "notifier")
        # The first run hears no surface yet (a long presence grace): alice's job is made and waits.
        waiting = make_config(tmp_path, hook, presence_grace_s=600)
        async with Notifier(waiting, n_nc) as first:
            alice_mid, gone_mid = await moment(bed, "planner", "alice"), await moment(bed, "planner", "alice")

            async def scheduled() -> bool:
                got = [await first.store.get_job(f"alice.{m}.first.webhook") for m in (alice_mid, gone_mid)]
                return all(g is not None and g[0].status == "scheduled" for g in got)

            await until(scheduled, timeout=WAIT, what="alice's jobs scheduled")
        assert not hook.accepted
        bob_mid = await moment(bed, "mallory", "bob")  # the notifier is down: it reads this item at its start
        junk = ["aa.junk", f"bob.{'0' * 32}.first.push-x", f"bob.{bob_mid}.first.webhook"]
        # And the gateway's record of alice's second moment: no moment record, so no moment that waits.
        await bed.aim(*(f"$KV.{JOBS_BUCKET}.{k}" for k in junk), f"$KV.{MOMENTS_BUCKET}.alice.{gone_mid}")
        with capture_logs_with_context() as logs:
            async with Notifier(config, n_nc) as second:
                async def settled() -> bool:
                    got = await second.store.get_job(f"alice.{gone_mid}.first.webhook")
                    sent = {h["moment_id"] for h in hook.accepted} >= {alice_mid, bob_mid}
                    return sent and got is not None and got[0].status == "skipped"

                await until(settled, timeout=WAIT, what="alice's resumed job and bob's job sent, one skipped")
        assert sorted((h["principal"], h["moment_id"]) for h in hook.accepted) == [
            ("alice", alice_mid), ("bob", bob_mid)]
        assert len(warned(logs, MOMENTS_BUCKET, f"alice.{gone_mid}")) == 1, logs
        assert not [e for e in logs if e.get("event", "").startswith("resuming earlier jobs failed")], logs
        for key in junk:
            assert len(warned(logs, JOBS_BUCKET, key)) == 1, (key, logs)
        never_logged_the_value(logs)


async def test_junk_answer_link_dead_letter_and_subscription_records_mislead_no_reader(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mallory aims its acknowledgement at the used-link key of an answer link in alice's mail, at the
    dead-letter subject and at made-up keys among the push subscriptions and jobs: the link still opens
    and answers once, the dead letters list the one real letter and the status counts no junk."""
    monkeypatch.setenv("PGW_ANSWER_KEY", KEY)
    with smtp_server(tmp_path) as relay:
        async with webhook_receiver(tmp_path) as hook, secured(tmp_path, hook, relay) as (bed, config):
            hook.status = [400]  # alice's webhook refuses her notification for good: one real dead letter
            async with Notifier(config, await bed.conn("service", "notifier")):
                mid = await moment(bed, "planner", "alice")

                async def mailed() -> bool:
                    return len(relay.box.envelopes) == 1

                await until(mailed, timeout=WAIT, what="alice's mail at the relay")
                mail = BytesParser(policy=policy.default).parsebytes(relay.box.envelopes[0].original_content)
                link = answer_links(mail)["o0"]  # type: ignore[arg-type]
                claims = Tokens(KEY.encode()).verify(parse_qs(urlsplit(link).query)["t"][0])
                await bed.aim(f"$KV.{USED_BUCKET}.{claims.used_key}", config.subjects.notify_deadletter,
                              f"$KV.{SUBS_BUCKET}.bob.x2", f"$KV.{JOBS_BUCKET}.aa.junk")

                code, page = await get(link)
                assert code == 200 and "Send this answer" in page, page
                code, page = await post(link)
                assert code == 200 and "Answer sent" in page, page
                code, page = await post(link)
                assert code == 409 and 'data-code="used"' in page, "the link still answers once"

                ops = (await bed.conn("ops", "olive")).jetstream()

                async def settled() -> Any:
                    st = await status(ops, config.subjects)
                    return st if st.jobs == {"dead": 1, "sent": 1} else None

                st = await until(settled, timeout=WAIT, what="alice's mail sent and her webhook dead-lettered")
                assert st.push_subscriptions == 0, st
                [letter] = await dead_letters(ops)
                assert (letter.job.principal, letter.job.moment_id, letter.job.channel) == ("alice", mid, "webhook")
