"""The notifier end to end (issue 17): real gateway, real nats-server, real receivers on loopback.

Web Push goes to a push service that decrypts with the reference ``http_ece``
(Node.js) and checks the VAPID JWT with ``node:crypto`` (tests/push_peer.py);
mail to aiosmtpd with STARTTLS and AUTH; the webhook to a receiver that
verifies the signature and refuses replays (tests/notify_peers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from consumers.notify.service import Notifier
from consumers.notify.store import dead_letters
from gateway.app import Gateway
from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.metrics import REGISTRY
from subjects.client import Agent, OptionChoice, Presence, Surface, envelope
from tests.moments import good_moment
from tests.notify_peers import Hook, Relay, smtp_server, webhook_receiver
from tests.polling import until, until_drained
from tests.push_peer import PushService, push_service

SURFACE_URL = "https://pgw.example/surface"


@dataclass
class Bed:
    config: Config
    relay: Relay
    hook: Hook
    push: PushService
    notifier: Notifier
    agent: Agent
    nc: Any
    push_sid: str | None = None  # the push service's id of alice's subscription

    async def jobs(self) -> dict[str, Any]:
        out = {}
        for key in await self.notifier.store.job_keys():
            got = await self.notifier.store.get_job(key)
            if got:
                out[key] = got[0]
        return out


async def eventually(pred, *, timeout: float = 15.0, what: str = "condition") -> Any:
    async def probe() -> Any:
        return await pred() if asyncio.iscoroutinefunction(pred) else pred()

    return await until(probe, timeout=timeout, interval=0.05, what=what)


def notifier_settings(relay: Relay, hook: Hook, **principal: Any) -> dict[str, Any]:
    alice = {"email": "alice@example.com", "webhook_url": hook.url, "webhook_secret_file": str(hook.secret_file)}
    alice.update(principal)
    return {
        "presence_grace_s": 0, "push_hosts": ["127.0.0.1"], "push_allow_http": True,
        "backoff_base_s": 0.2, "backoff_max_s": 0.5, "max_attempts": 3, "surface_url": SURFACE_URL,
        "smtp": {"host": relay.host, "port": relay.port, "credentials_file": str(relay.credentials_file),
                 "ca_file": str(relay.ca_file), "from_addr": "pgw@pgw.example"},
        "principals": {"alice": alice},
    }


@contextlib.asynccontextmanager
async def running(tmp_path: Path, make_config, nats_server, nc, *, push: bool = True,
                  pipeline: dict[str, Any] | None = None, settings: dict[str, Any] | None = None,
                  **principal: Any) -> AsyncIterator[Bed]:
    with smtp_server(tmp_path) as relay:
        async with webhook_receiver(tmp_path) as hook, push_service() as ps:
            overrides: dict[str, Any] = {"notifier": {**notifier_settings(relay, hook, **principal), **(settings or {})}}
            if pipeline:
                overrides["pipeline"] = pipeline
            config = make_config(**overrides)
            gw_nc = await connect(nats_server.client_url, name="gateway")
            n_nc = await connect(nats_server.client_url, name="notifier")
            try:
                async with Gateway(config, gw_nc), Notifier(config, n_nc) as notifier:
                    bed = Bed(config, relay, hook, ps, notifier, Agent(nc, "planner"), nc)
                    if push:
                        sid, sub = await ps.new_subscription()
                        r = await nc.request(config.subjects.push("alice", "subscribe"),
                                             json.dumps({"subscription": sub, "device": "phone"}).encode(), timeout=5)
                        assert json.loads(r.data)["ok"] is True
                        bed.push_sid = sid
                    try:
                        yield bed
                    finally:
                        await bed.agent.close()
            finally:
                await gw_nc.drain()
                await n_nc.drain()


async def settled(bed: Bed, n: int) -> dict[str, Any]:
    """Wait until ``n`` jobs exist and none is open any more."""
    async def done() -> dict[str, Any] | None:
        jobs = await bed.jobs()
        return jobs if len(jobs) >= n and all(j.status not in ("scheduled", "sending") for j in jobs.values()) else None

    return await eventually(done, what=f"{n} notification jobs settled")


async def test_every_channel_once_and_no_decision_content(tmp_path, make_config, nats_server, nc) -> None:
    """One push (decrypted by http_ece, VAPID verified), one mail (STARTTLS+AUTH), one signed webhook; no synopsis."""
    def sent(channel: str) -> float:
        return REGISTRY.get_sample_value("pgw_notifier_notifications_total",
                                         {"channel": channel, "result": "sent"}) or 0.0

    before = {c: sent(c) for c in ("email", "webhook", "push")}
    async with running(tmp_path, make_config, nats_server, nc) as bed:
        await bed.agent.send_moment("alice", good_moment(), expires_in_s=600)
        jobs = await settled(bed, 3)
        assert {c: sent(c) - before[c] for c in before} == {"email": 1, "webhook": 1, "push": 1}
        assert {j.channel.split("-")[0] for j in jobs.values()} == {"email", "webhook", "push"}
        assert {j.status for j in jobs.values()} == {"sent"}
        moment_id = next(iter(jobs.values())).moment_id

        [push] = await bed.push.received()
        assert push["vapid_ok"], push["vapid_error"]
        assert push["claims"]["aud"] == bed.push.base and push["claims"]["sub"] == "mailto:pgw@localhost"
        assert push["encoding"] == "aes128gcm" and push["urgency"] == "high" and push["topic"] == moment_id[:32]
        assert push["payload"] == {"title": "A decision waits", "body": "A decision from agent planner waits.",
                                   "url": SURFACE_URL, "moment_id": moment_id, "tag": f"pgw-{moment_id}"}
        key = (await nc.request(bed.config.subjects.push("alice", "key"), b"{}", timeout=5)).data
        assert push["vapid_k"].encode() in key, "signed with the key the surfaces were given"

        [mail] = bed.relay.box.messages
        assert bed.relay.box.tls == [True] and bed.relay.box.logins == ["pgw-mailer"]
        assert mail["To"] == "alice@example.com" and mail["Subject"] == "A decision waits"
        text = mail.get_payload(decode=True).decode()
        assert "A decision from agent planner waits." in text and SURFACE_URL in text
        assert mail["Message-ID"] == f"<{next(j for j in jobs.values() if j.channel == 'email').notification_id}@pgw-notifier>"

        [hooked] = bed.hook.accepted
        assert hooked["type"] == "moment.waiting" and hooked["moment_id"] == moment_id and hooked["url"] == SURFACE_URL
        assert "synopsis" not in hooked
        everything = repr(await bed.push.received()) + text + repr(hooked)
        assert "Harbor" not in everything and "tax summary" not in everything, "no decision content by default"

        # A replay of the very request the receiver took is refused by its verify().
        headers, body = bed.hook.raw[-1]
        async with aiohttp.ClientSession() as s, s.post(bed.hook.url, data=body, headers=headers) as r:
            assert r.status == 409
        assert bed.hook.replays == [hooked["id"]] and len(bed.hook.accepted) == 1
        tampered = body.replace(b"planner", b"plannex")
        async with aiohttp.ClientSession() as s, s.post(bed.hook.url, data=tampered, headers=headers) as r:
            assert r.status == 401
        assert "does not match" in bed.hook.refused[-1]


async def test_synopsis_opt_in_never_carries_a_redacted_secret(tmp_path, make_config, nats_server, nc) -> None:
    """show_synopsis: the synopsis as the gateway redacted it (SR-1), never the secret."""
    secret = "sk-live-9f8e7d6c5b4a3210"
    moment = good_moment()
    moment["synopsis"] = f"Rotate the payment key {secret} before Harbor Accounting uses it again."
    async with running(tmp_path, make_config, nats_server, nc, show_synopsis=True,
                       pipeline={"secrets": {"values": [secret]}}) as bed:
        await bed.agent.send_moment("alice", moment, expires_in_s=600)
        await settled(bed, 3)
        [push], [mail], [hooked] = await bed.push.received(), bed.relay.box.messages, bed.hook.accepted
        text = mail.get_payload(decode=True).decode()
        for where in (push["payload"]["body"], text, hooked["synopsis"], hooked["text"]):
            assert "Rotate the payment key" in where and "Harbor Accounting" in where, "the synopsis was opted in"
            assert secret not in where and "9f8e7d6c" not in where
        jobs = await bed.jobs()
        assert all(secret not in (j.synopsis or "") for j in jobs.values()), "not even in the notifier's own records"


async def test_push_410_drops_the_subscription(tmp_path, make_config, nats_server, nc) -> None:
    async with running(tmp_path, make_config, nats_server, nc) as bed:
        await bed.push.respond(bed.push_sid, 410)
        await bed.agent.send_moment("alice", good_moment(), expires_in_s=600)
        jobs = await settled(bed, 3)
        assert [j.status for j in jobs.values() if j.channel.startswith("push-")] == ["dropped"]
        assert await bed.notifier.store.subscriptions("alice") == {}
        await bed.agent.send_moment("alice", good_moment(), expires_in_s=600)
        jobs = await settled(bed, 5)
        assert len([j for j in jobs.values() if j.channel.startswith("push-")]) == 1, "no push job for a dropped subscription"
        assert len(await bed.push.received()) == 1


async def test_push_5xx_and_webhook_503_are_retried_then_delivered_once(tmp_path, make_config, nats_server, nc) -> None:
    async with running(tmp_path, make_config, nats_server, nc) as bed:
        await bed.push.respond(bed.push_sid, 500, 503)
        bed.hook.status += [503]
        await bed.agent.send_moment("alice", good_moment(), expires_in_s=600)
        jobs = await settled(bed, 3)
        by = {j.channel.split("-")[0]: j for j in jobs.values()}
        assert by["push"].status == "sent" and by["push"].attempts == 3
        assert by["webhook"].status == "sent" and by["webhook"].attempts == 2
        assert [r["status"] for r in await bed.push.received()] == [500, 503, 201]
        assert len(bed.hook.accepted) == 1 and len(bed.relay.box.messages) == 1


async def test_outage_beyond_max_attempts_goes_to_the_dead_letter(tmp_path, make_config, nats_server, nc) -> None:
    async with running(tmp_path, make_config, nats_server, nc, push=False) as bed:
        bed.hook.status += [503, 503, 503, 503]
        await bed.agent.send_moment("alice", good_moment(), expires_in_s=600)
        jobs = await settled(bed, 2)
        hook_job = next(j for j in jobs.values() if j.channel == "webhook")
        assert hook_job.status == "dead" and hook_job.attempts == 3
        [dead] = await dead_letters(nc.jetstream())
        assert dead.job.moment_id == hook_job.moment_id and "gave up after 3 attempts" in dead.reason
        assert "503" in dead.reason
        # ops see it with `pgw notifications --dead` (and the counts with `pgw notifications`)
        pgw = [str(Path(sys.executable).parent / "pgw"), "--server", nats_server.client_url]
        out = await asyncio.to_thread(subprocess.run, [*pgw, "notifications", "--dead"], capture_output=True,
                                      text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert hook_job.moment_id in out.stdout and "gave up after 3 attempts" in out.stdout
        assert "1 dead letter(s)" in out.stdout
        out = await asyncio.to_thread(subprocess.run, [*pgw, "notifications", "--json"], capture_output=True,
                                      text=True, timeout=60)
        status = json.loads(out.stdout)
        assert status["dead_letters"] == 1 and status["jobs"] == {"dead": 1, "sent": 1}


async def test_a_bad_channel_file_stops_pgw_notifier_with_its_path(tmp_path, nats_server) -> None:
    secret = tmp_path / "hook.secret"
    secret.write_text("a-long-enough-webhook-secret\n")
    secret.chmod(0o644)
    cfg = tmp_path / "pgw.toml"
    cfg.write_text(f'[notifier.principals.alice]\nwebhook_url = "https://hooks.example/x"\n'
                   f'webhook_secret_file = "{secret}"\n')
    pgw = str(Path(sys.executable).parent / "pgw")
    out = await asyncio.to_thread(subprocess.run, [pgw, "--server", nats_server.client_url, "--config", str(cfg),
                                  "--data-dir", str(tmp_path / "data"), "notifier"],
                                  capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert str(secret) in out.stderr and "0600" in out.stderr


async def test_presence_suppresses_notifications(tmp_path, make_config, nats_server, nc) -> None:
    async with running(tmp_path, make_config, nats_server, nc) as bed:
        async with Presence(nc, "alice", surface="web", ttl_s=30):
            await eventually(lambda: bed.notifier.presence.present("alice"), what="presence heard")
            await bed.agent.send_moment("alice", good_moment(), expires_in_s=600)
            jobs = await settled(bed, 3)
        assert {j.status for j in jobs.values()} == {"suppressed"}
        assert not bed.hook.accepted and not bed.relay.box.messages and not await bed.push.received()
        # Surface gone (ttl_s 0): the next moment is notified again.
        await eventually(lambda: not bed.notifier.presence.present("alice"), what="presence gone")
        await bed.agent.send_moment("alice", good_moment(), expires_in_s=600)
        jobs = await settled(bed, 6)
        assert sorted(j.status for j in jobs.values()) == ["sent"] * 3 + ["suppressed"] * 3


async def test_an_answered_moment_is_not_notified(tmp_path, make_config, nats_server, nc) -> None:
    """The principal answers during the notifier's presence grace: every job is skipped, nothing sent."""
    async with running(tmp_path, make_config, nats_server, nc, settings={"presence_grace_s": 5.0}) as bed:
        await bed.agent.send_moment("alice", good_moment(), expires_in_s=600)
        surface = Surface(nc, "alice", presence=False)
        [item] = await eventually(surface.pending, what="the moment is pending")
        assert (await surface.resolve(item.moment_id, OptionChoice(index=0))).status == "accepted"
        assert {j.status for j in (await bed.jobs()).values()} <= {"scheduled"}, "held by the grace so far"
        jobs = await settled(bed, 3)
        assert {j.status for j in jobs.values()} == {"skipped"}
        assert not bed.hook.accepted and not bed.relay.box.messages and not await bed.push.received()


async def test_a_moment_that_expires_first_is_not_notified(tmp_path, make_config, nats_server, nc) -> None:
    """The moment expires while the jobs wait (here: the start-up grace): nothing is sent."""
    async with running(tmp_path, make_config, nats_server, nc, settings={"presence_grace_s": 3.0}) as bed:
        await bed.agent.send_moment("alice", good_moment(), expires_in_s=1)
        jobs = await settled(bed, 3)
        assert {j.status for j in jobs.values()} == {"skipped"}
        assert not bed.hook.accepted and not bed.relay.box.messages and not await bed.push.received()


async def test_history_of_closed_moments_makes_no_jobs(tmp_path, make_config, nats_server, nc) -> None:
    """A notifier started after moments were answered reads them from PGW_SURFACE and makes no job for them."""
    async with running(tmp_path, make_config, nats_server, nc) as bed:
        await bed.notifier.drain()  # as if no notifier ran yet
        await bed.agent.send_moment("alice", good_moment(), expires_in_s=600)
        surface = Surface(nc, "alice", presence=False)
        [item] = await eventually(surface.pending, what="the moment is pending")
        assert (await surface.resolve(item.moment_id, OptionChoice(index=0))).status == "accepted"
        await bed.agent.send_moment("alice", good_moment(), expires_in_s=600)  # this one still waits
        n_nc = await connect(nats_server.client_url, name="notifier-2")
        try:
            async with Notifier(bed.config, n_nc) as again:
                bed.notifier = again
                await settled(bed, 3)

                # both items (and the withdrawn one) read and acked
                await until_drained(nc.jetstream(), "PGW_SURFACE", bed.config.notifier.durable, timeout=10,
                                    what="the notifier read the whole surface stream")
                jobs = await bed.jobs()
        finally:
            await n_nc.drain()
        assert len(jobs) == 3, "jobs for the waiting moment only"
        assert item.moment_id not in {j.moment_id for j in jobs.values()}


async def test_quiet_hours_hold_notifications_until_they_end(tmp_path, make_config, nats_server, nc) -> None:
    from datetime import datetime, timedelta
    from zoneinfo import ZoneInfo

    tz = ZoneInfo("Asia/Tokyo")
    now = datetime.now(tz)
    start, end = (now - timedelta(hours=1)).strftime("%H:%M"), (now + timedelta(hours=2)).strftime("%H:%M")
    async with running(tmp_path, make_config, nats_server, nc, quiet_hours=f"{start}-{end}",
                       timezone="Asia/Tokyo") as bed:
        await bed.agent.send_moment("alice", good_moment(), expires_in_s=6 * 3600)

        async def held() -> dict[str, Any] | None:
            jobs = await bed.jobs()
            return jobs if len(jobs) == 3 and all(j.due > time.time() + 3600 for j in jobs.values()) else None

        jobs = await eventually(held, what="jobs deferred to the end of quiet hours")
        wake = next(iter(jobs.values())).due
        assert datetime.fromtimestamp(wake, tz).strftime("%H:%M") == end
        assert {j.status for j in jobs.values()} == {"scheduled"}
        assert not bed.hook.accepted and not bed.relay.box.messages and not await bed.push.received()


async def test_reminder_before_expiry(tmp_path, make_config, nats_server, nc) -> None:
    async with running(tmp_path, make_config, nats_server, nc, push=False, reminder_before_s=3) as bed:
        await bed.agent.send_moment("alice", good_moment(), expires_in_s=5)
        await eventually(lambda: len(bed.hook.accepted) == 2, timeout=20, what="first notice and reminder")
        first, reminder = bed.hook.accepted
        assert first["type"] == "moment.waiting" and reminder["type"] == "moment.reminder"
        assert reminder["moment_id"] == first["moment_id"] and reminder["id"] != first["id"]
        assert "expires at" in reminder["text"]
        await eventually(lambda: len(bed.relay.box.messages) == 2, what="both mails")
        subjects = sorted(m["Subject"] for m in bed.relay.box.messages)
        assert subjects == ["A decision waits", "Reminder: a decision waits"]


async def test_a_clarification_is_a_question_waiting(tmp_path, make_config, nats_server, nc) -> None:
    async with running(tmp_path, make_config, nats_server, nc, push=False) as bed:
        body = envelope("clarification.request", {"questions": [{"id": "q1", "question": "Which account?"}]})
        await bed.agent.send(body, principal="alice")
        await settled(bed, 2)
        [hooked] = bed.hook.accepted
        assert hooked["item"] == "clarification" and hooked["title"] == "A question waits"
        assert hooked["text"] == "A question from agent planner waits." and "Which account" not in repr(hooked)


@pytest.mark.parametrize("opt", [None, 3])
async def test_no_channel_no_job(tmp_path, make_config, nats_server, nc, opt) -> None:
    """A principal with nothing configured and no push subscription gets no job at all."""
    async with running(tmp_path, make_config, nats_server, nc, push=False) as bed:
        await bed.agent.send_moment("bob", good_moment(), expires_in_s=opt or 600)
        await bed.agent.send_moment("alice", good_moment(), expires_in_s=600)
        jobs = await settled(bed, 2)
        assert {j.principal for j in jobs.values()} == {"alice"}
