"""The isolation matrix of DESIGN §7, proved against a real nats-server.

One nats-server runs with the authorization block `pgw creds` generates. For
every ordered pair of principals (Q attacks P) and of agents (B attacks A),
each attack is made with the attacker's own credentials and must be refused
by the *server* (a ``Permissions Violation`` error) with 0 messages reaching
the attacker or the victim's subject. Positive controls prove each party can
still do what it is allowed to, so a refusal is never just a broken setup.

"0 delivered" is checked without sleeping: the publisher flushes (the server
has routed the message, queueing it on every subscriber's connection) and
then the attacker flushes (its PONG is queued behind anything routed to it),
so any delivered message is in the attacker's pending queue by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
import pytest_asyncio
from nats.js.api import ConsumerConfig

from gateway.security import Party, agent_durable, embedded_auth, principal_durable
from gateway.security.accounts import Operator, operator_auth
from gateway.security.part import ensure_principal_consumer
from pgwcore.config import Config, load_config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from pgwcore.slack_config import SLACK_BUCKET, ensure_slack_state, slack_durable
from pgwcore.streams import ensure_streams
from subjects.client import ensure_agent_consumer
from tests.gauntlet.bed import flushed

pytestmark = [pytest.mark.security, pytest.mark.asyncio(loop_scope="module")]

PRINCIPALS = ["p1", "p2", "p3"]
SLACK_PRINCIPALS = ["p1", "p2"]
AGENTS = ["a1", "a2"]
AGENT_BINDINGS = {"a1": ["p1", "p2"], "a2": ["p3"]}
# Executors of the gate (docs/gate.md): only the gateway's identity may send to them.
EXECUTORS = {"files": ["WriteFile"], "mail": ["SendMail"]}
TABLE = "isolation matrix"
WAIT = 5.0  # guard only: every wait below is for an event that should come at once


@dataclass
class Conn:
    party: Party
    nc: nats.NATS
    errors: asyncio.Queue[str] = field(default_factory=asyncio.Queue)

    async def violation(self, subject: str) -> str:
        """Wait for the server's permissions violation naming ``subject``."""
        while True:
            err = await asyncio.wait_for(self.errors.get(), WAIT)
            # nats-py lower-cases the server's -ERR text.
            if "permissions violation" in err.lower() and subject.lower() in err.lower():
                return err


@dataclass
class Bed:
    config: Config
    server: EmbeddedServer
    creds_dir: Path
    service: Conn
    conns: dict[str, Conn]
    pending_replies: list[str] = field(default_factory=list)
    moment_replies: list[str] = field(default_factory=list)
    mode: str = "nkey"  # "nkey": the generated authorization block; "operator": JWT accounts

    @property
    def table(self) -> str:
        return TABLE if self.mode == "nkey" else f"{TABLE} (operator mode, JWT users)"

    @property
    def subjects(self):
        return self.config.subjects


async def open_conn(server: EmbeddedServer, creds: Path, party: Party) -> Conn:
    errors: asyncio.Queue[str] = asyncio.Queue()

    async def on_error(e: Exception) -> None:
        errors.put_nowait(str(e))

    nc = await connect(
        server.client_url, creds=str(creds), name=party.label, error_cb=on_error,
        allow_reconnect=False, max_reconnect_attempts=0,
    )
    return Conn(party, nc, errors)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["nkey", "operator"])
async def bed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bed]:
    """A server running the generated auth (the nkey block, or operator mode with one JWT user per party),
    the streams, the gateway-made durables, and one connection per party."""
    mode: str = request.param
    tmp = tmp_path_factory.mktemp("secmatrix")
    config = load_config(
        None,
        data_dir=str(tmp / "data"),
        agents={a: {"principals": ps} for a, ps in AGENT_BINDINGS.items()},
        # One Slack surface identity per principal (slack:P, docs/surfaces.md).
        slack={"enabled": True, "principals": {p: {"user": f"U0{p.upper()}"} for p in SLACK_PRINCIPALS}},
        kernel={"executors": {k: {"actions": acts} for k, acts in EXECUTORS.items()}},
    )
    auth = embedded_auth(config) if mode == "nkey" else operator_auth(config, tenant="acme")
    server = EmbeddedServer(tmp / "nats", port=-1, monitor_port=-1, websocket_port=-1, authorization=auth.server_block)
    await server.start()
    conns: dict[str, Conn] = {}
    try:
        service = await open_conn(server, auth.service_creds, Party("service", "services"))
        js = service.nc.jetstream()
        await ensure_streams(js, config.subjects)
        for a in AGENTS:
            await ensure_agent_consumer(js, a, prefix=config.prefix)
        for p in PRINCIPALS:
            await ensure_principal_consumer(js, p, prefix=config.prefix)
        for p in SLACK_PRINCIPALS:
            await ensure_slack_state(js, p, prefix=config.prefix)
        for party in auth.parties:
            if party.role in ("agent", "principal", "slack", "executor"):
                conns[party.label] = await open_conn(server, auth.creds_for(party), party)
        bed = Bed(config, server, auth.party_creds_dir, service, conns, mode=mode)

        async def pending_responder(msg) -> None:  # stands in for the gateway's pending service
            bed.pending_replies.append(msg.reply)
            await msg.respond(b'{"items": []}')

        async def caps_responder(msg) -> None:  # stands in for the capabilities service
            await msg.respond(b'{"reply": "for the requester only"}')

        async def moment_responder(msg) -> None:  # stands in for the gateway's moment query service
            bed.moment_replies.append(msg.reply)
            await msg.respond(b'{"status": "unknown"}')

        # Requests are taken on the services' answering connection (responder:services), which
        # the service connection is not allowed to be (docs/security.md "Replies").
        answering = await open_conn(server, auth.creds_for(Party("responder", "services")), Party("responder", "services"))
        conns["responder:services"] = answering
        await answering.nc.subscribe(config.subjects.all_principals("pending"), cb=pending_responder)
        await answering.nc.subscribe(config.subjects.all_agents("moment"), cb=moment_responder)
        await answering.nc.subscribe(config.subjects.capabilities, cb=caps_responder)
        await flushed(answering.nc)
        yield bed
    finally:
        for c in [*conns.values()]:
            with contextlib.suppress(Exception):
                await c.nc.close()
        with contextlib.suppress(Exception):
            await service.nc.close()
        await server.stop()


async def settle(*conns: Conn) -> None:
    """Every command of ``conns`` has reached the server and been answered. The server
    writes a connection's messages in order, so whatever it delivered before the PONG
    was parsed, and queued on its subscription (``pending_msgs``), before ``flush``
    returns: nothing else to wait for."""
    for c in conns:
        await flushed(c.nc)


# ---------------------------------------------------------------------------
# Attacks. Each returns the observed result text and raises AssertionError when
# the server let anything through.
# ---------------------------------------------------------------------------

Attack = Callable[[Bed, Conn, Conn], Awaitable[str]]


async def _sub_attack(bed: Bed, attacker: Conn, subject: str, deliver: str, publisher: Conn) -> str:
    sub = await attacker.nc.subscribe(subject)
    await flushed(attacker.nc)
    err = await attacker.violation(subject)
    await publisher.nc.publish(deliver, b'{"secret": "for the victim only"}')
    await settle(publisher, attacker)
    assert sub.pending_msgs == 0, f"{sub.pending_msgs} message(s) delivered on {subject}"
    return f"refused ({_short(err)}), 0 delivered"


async def read_inbox(bed: Bed, attacker: Conn, victim: Conn) -> str:
    """Attacker subscribes to the victim's inbox; the victim makes a real request and gets its reply."""
    subject = f"{victim.party.inbox_prefix}.>"
    sub = await attacker.nc.subscribe(subject)
    await flushed(attacker.nc)
    err = await attacker.violation(subject)

    # Answered by the bed's capabilities responder (installed once: no subscribe churn).
    reply = await victim.nc.request(bed.subjects.capabilities, b"{}", timeout=WAIT)
    assert reply.subject.startswith(victim.party.inbox_prefix + ".")
    await settle(attacker)
    assert sub.pending_msgs == 0, "the victim's reply reached the attacker"
    return f"refused ({_short(err)}), 0 delivered"


def sub_to(template: str, deliver_template: str, publisher: str = "service") -> Attack:
    """Attacker subscribes to ``template``; someone publishes to the victim's ``deliver_template``."""

    async def attack(bed: Bed, attacker: Conn, victim: Conn) -> str:
        pub = bed.service if publisher == "service" else victim
        subject = template.format(pre=bed.config.prefix, v=victim.party.name, vin=victim.party.inbox_prefix)
        deliver = deliver_template.format(pre=bed.config.prefix, v=victim.party.name, vin=victim.party.inbox_prefix)
        return await _sub_attack(bed, attacker, subject, deliver, pub)

    return attack


def pub_to(template: str, body: bytes = b'{"moment_id": "00000000000000000000000000000000", "forged": true}') -> Attack:
    """Attacker publishes ``body`` to the victim's ``template``; an observer with read rights sees nothing."""

    async def attack(bed: Bed, attacker: Conn, victim: Conn) -> str:
        subject = template.format(pre=bed.config.prefix, v=victim.party.name)
        obs = await bed.service.nc.subscribe(subject)
        await flushed(bed.service.nc)
        try:
            await attacker.nc.publish(subject, body)
            err = await attacker.violation(subject)
            await settle(attacker, bed.service)
            assert obs.pending_msgs == 0, "the forged message reached the subject"
        finally:
            await obs.unsubscribe()
        return f"refused ({_short(err)}), 0 delivered"

    return attack


def _short(err: str) -> str:
    return "Permissions Violation for " + ("Publish" if "publish" in err.lower() else "Subscription")


def js_api(template: str, body: dict[str, object] | None = None) -> Attack:
    """Attacker sends a JetStream API request; the server refuses it and no reply arrives."""

    async def attack(bed: Bed, attacker: Conn, victim: Conn) -> str:
        pre, v = bed.config.prefix, victim.party.name
        subject = template.format(
            pre=pre, v=v, adur=agent_durable(v) if victim.party.role == "agent" else "",
            pdur=principal_durable(v) if victim.party.role == "principal" else "",
        )
        data = json.dumps(body or {}).replace("{pre}", pre).replace("{v}", v).encode()
        # The proof is the server's permissions violation for this subject: it is sent
        # while the PUB is processed, and a refused PUB never reaches the API. The reply
        # inbox is a second net: a plain subscription, so what arrived before the flush
        # is queued there when settle() returns (the API answers from its own goroutine,
        # so a late answer could follow the flush: this net alone proves nothing).
        inbox = attacker.nc.new_inbox()
        replies = await attacker.nc.subscribe(inbox)
        try:
            await attacker.nc.publish(subject, data, reply=inbox)
            err = await attacker.violation(subject)
            await settle(attacker)
            answers = []
            while replies.pending_msgs:
                msg = replies._pending_queue.get_nowait()
                if not (msg.headers or {}).get("Status"):  # a status (no responders) is no answer
                    answers.append(msg)
            assert not answers, "the JetStream API answered the attacker"
        finally:
            await replies.unsubscribe()
        return f"refused ({_short(err)}), no reply"

    return attack


async def create_consumer_on(bed: Bed, attacker: Conn, victim: Conn, stream: str, filt: str) -> str:
    js = attacker.nc.jetstream(timeout=WAIT)
    name = f"steal-{attacker.party.name}-{victim.party.name}"
    task = asyncio.ensure_future(
        js.add_consumer(stream, ConsumerConfig(name=name, filter_subject=filt.format(pre=bed.config.prefix, v=victim.party.name)))
    )
    try:
        err = await attacker.violation(f"$JS.API.CONSUMER.CREATE.{stream}")
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
    names = [c.name for c in await bed.service.nc.jetstream().consumers_info(stream)]
    assert name not in names, f"consumer {name} was created"
    return f"refused ({_short(err)}), no consumer"


def surface_consumer(bed: Bed, a: Conn, v: Conn) -> Awaitable[str]:
    return create_consumer_on(bed, a, v, "PGW_SURFACE", "{pre}.principal.{v}.surface")


def outbound_consumer(bed: Bed, a: Conn, v: Conn) -> Awaitable[str]:
    return create_consumer_on(bed, a, v, "PGW_OUTBOUND", "{pre}.agent.{v}.outcome")


PRINCIPAL_ATTACKS: dict[str, Attack] = {
    "subscribe P's surface": sub_to("{pre}.principal.{v}.surface", "{pre}.principal.{v}.surface"),
    "subscribe principal.*.surface": sub_to("{pre}.principal.*.surface", "{pre}.principal.{v}.surface"),
    "subscribe {prefix}.>": sub_to("{pre}.>", "{pre}.principal.{v}.surface"),
    "subscribe >": sub_to(">", "{pre}.principal.{v}.surface"),
    "read P's inbox (replies)": read_inbox,
    "intercept P's resolutions": sub_to("{pre}.principal.{v}.resolve", "{pre}.principal.{v}.resolve", publisher="victim"),
    "publish a resolution for P": pub_to("{pre}.principal.{v}.resolve"),
    "list P's pending items": pub_to("{pre}.principal.{v}.pending"),
    "forge an item on P's surface": pub_to("{pre}.principal.{v}.surface"),
    "create consumer on PGW_SURFACE": surface_consumer,
    "legacy durable create": js_api("$JS.API.CONSUMER.DURABLE.CREATE.PGW_SURFACE.steal"),
    "direct-get from PGW_SURFACE": js_api("$JS.API.DIRECT.GET.PGW_SURFACE", {"last_by_subj": "{pre}.principal.{v}.surface"}),
    "stream msg get PGW_SURFACE": js_api("$JS.API.STREAM.MSG.GET.PGW_SURFACE", {"last_by_subj": "{pre}.principal.{v}.surface"}),
    "pull from P's durable": js_api("$JS.API.CONSUMER.MSG.NEXT.PGW_SURFACE.{pdur}", {"batch": 1}),
    "stream info / purge PGW_SURFACE": js_api("$JS.API.STREAM.PURGE.PGW_SURFACE"),
    # issue 17: a principal's presence and push subscriptions are its own (docs/notifications.md)
    "announce presence as P": pub_to("{pre}.principal.{v}.presence"),
    "subscribe a push endpoint for P": pub_to("{pre}.principal.{v}.push.subscribe"),
    "unsubscribe P's push endpoint": pub_to("{pre}.principal.{v}.push.unsubscribe"),
    "ask the push key as P": pub_to("{pre}.principal.{v}.push.key"),
    "hear P's presence": sub_to("{pre}.principal.*.presence", "{pre}.principal.{v}.presence", publisher="victim"),
    "intercept P's push requests": sub_to("{pre}.principal.{v}.push.*", "{pre}.principal.{v}.push.subscribe", publisher="victim"),
}

AGENT_ATTACKS: dict[str, Attack] = {
    "subscribe A's outcomes": sub_to("{pre}.agent.{v}.outcome", "{pre}.agent.{v}.outcome"),
    "subscribe agent.*.outcome": sub_to("{pre}.agent.*.outcome", "{pre}.agent.{v}.outcome"),
    "subscribe {prefix}.>": sub_to("{pre}.>", "{pre}.agent.{v}.outcome"),
    "read A's inbox (replies, PubAcks)": read_inbox,
    "snoop A's envelopes": sub_to("{pre}.agent.*.envelope", "{pre}.agent.{v}.envelope", publisher="victim"),
    "publish an envelope as A": pub_to("{pre}.agent.{v}.envelope"),
    "publish an IDP as A": pub_to("{pre}.agent.{v}.idp"),
    "publish a transition as A": pub_to("{pre}.agent.{v}.transition"),
    "forge an outcome for A": pub_to("{pre}.agent.{v}.outcome"),
    "query A's moments": pub_to("{pre}.agent.{v}.moment"),
    "list A's moments": pub_to("{pre}.agent.{v}.moment", b'{"list": "all", "limit": 50}'),
    "list A's moments in the index (KV_PGW_AGENT_MOMENTS)": js_api(
        "$JS.API.STREAM.INFO.KV_PGW_AGENT_MOMENTS", {"subjects_filter": "$KV.PGW_AGENT_MOMENTS.{v}.>"}),
    "direct-get A's moment index": js_api("$JS.API.DIRECT.GET.KV_PGW_AGENT_MOMENTS", {"last_by_subj": "$KV.PGW_AGENT_MOMENTS.{v}.>"}),
    "create consumer on PGW_OUTBOUND": outbound_consumer,
    "direct-get from PGW_OUTBOUND": js_api("$JS.API.DIRECT.GET.PGW_OUTBOUND", {"last_by_subj": "{pre}.agent.{v}.outcome"}),
    "direct-get A's envelopes (PGW_INBOUND)": js_api("$JS.API.DIRECT.GET.PGW_INBOUND", {"last_by_subj": "{pre}.agent.{v}.envelope"}),
    "pull from A's outcome durable": js_api("$JS.API.CONSUMER.MSG.NEXT.PGW_OUTBOUND.{adur}", {"batch": 1}),
    "delete A's outcome durable": js_api("$JS.API.CONSUMER.DELETE.PGW_OUTBOUND.{adur}"),
    # spec 003 §8.2 "MUST NOT permit agents to write directly to the Event Log", and §8.7: no
    # agent may publish a verification record (match_result) of its own.
    "write the event log (pgw.log.*)": pub_to("{pre}.log.IDP_SUBMITTED"),
    "forge a commitment verification": pub_to("{pre}.log.IDP_COMMITMENT_VERIFIED"),
}

def _exec_bucket_get(bed: Bed, attacker: Conn, victim: Conn) -> Awaitable[str]:
    bucket = "PGW_EXEC_" + victim.party.name.upper()
    return js_api(f"$JS.API.DIRECT.GET.KV_{bucket}", {"last_by_subj": f"$KV.{bucket}.>"})(bed, attacker, victim)


# spec 003 §8.7 (docs/gate.md): an action is reached only through the kernel. Attacker: an agent
# (or a principal); victim: an executor kind.
EXEC_ATTACKS: dict[str, Attack] = {
    "publish to an executor (exec.{kind}.{action})": pub_to("{pre}.exec.{v}.Run", b'{"idempotency_key": "00", "forged": true}'),
    "ask an executor's stored result (exec.{kind}._result)": pub_to("{pre}.exec.{v}._result"),
    "serve an executor's actions (subscribe exec.>)": sub_to("{pre}.exec.>", "{pre}.exec.{v}.Run"),
    "read an executor's results bucket": _exec_bucket_get,
}
# An executor of one kind against another kind, and against the contract: it answers requests only.
EXECUTOR_ATTACKS: dict[str, Attack] = {
    "serve another kind's actions": sub_to("{pre}.exec.{v}.>", "{pre}.exec.{v}.Run"),
    "call another executor": pub_to("{pre}.exec.{v}.Run"),
    "read another kind's results bucket": _exec_bucket_get,
    "write the event log": pub_to("{pre}.log.STATE_TRANSITIONED"),
    "forge a verdict": pub_to("{pre}.verdict.executed"),
    "submit a gated action as an agent": pub_to("{pre}.agent.a1.act"),
}

# Cross-role: an agent against a principal it is bound to, a principal against an agent.
CROSS_ATTACKS: dict[str, Attack] = {
    # Operator mode used to need `_INBOX.>` for every user, and then an agent read other parties' replies.
    "agent reads principal's inbox (replies)": read_inbox,
    "agent subscribes the shared _INBOX.>": sub_to("_INBOX.>", "_INBOX.{v}"),
    "agent subscribes principal's surface": sub_to("{pre}.principal.{v}.surface", "{pre}.principal.{v}.surface"),
    "agent answers principal's moment": pub_to("{pre}.principal.{v}.resolve"),
    "agent pulls principal's durable": js_api("$JS.API.CONSUMER.MSG.NEXT.PGW_SURFACE.{pdur}", {"batch": 1}),
}
REVERSE_CROSS: dict[str, Attack] = {
    "principal publishes as agent": pub_to("{pre}.agent.{v}.envelope"),
    "principal reads agent's outcomes": sub_to("{pre}.agent.{v}.outcome", "{pre}.agent.{v}.outcome"),
    "principal queries agent's moments": pub_to("{pre}.agent.{v}.moment"),
    "principal lists agent's moments": pub_to("{pre}.agent.{v}.moment", b'{"list": "open"}'),
}


def _cases() -> list[tuple[str, str, str, str]]:
    out: list[tuple[str, str, str, str]] = []
    for q, p in itertools.permutations(PRINCIPALS, 2):
        out += [("principal", name, f"principal:{q}", f"principal:{p}") for name in PRINCIPAL_ATTACKS]
    for b, a in itertools.permutations(AGENTS, 2):
        out += [("agent", name, f"agent:{b}", f"agent:{a}") for name in AGENT_ATTACKS]
    for a, ps in AGENT_BINDINGS.items():
        p = ps[0]
        out += [("cross", name, f"agent:{a}", f"principal:{p}") for name in CROSS_ATTACKS]
        out += [("reverse", name, f"principal:{p}", f"agent:{a}") for name in REVERSE_CROSS]
    for actor in ("agent:a1", "principal:p1"):
        out += [("exec", name, actor, f"executor:{k}") for k in EXECUTORS for name in EXEC_ATTACKS]
    for x, y in itertools.permutations(EXECUTORS, 2):
        out += [("executor", name, f"executor:{x}", f"executor:{y}") for name in EXECUTOR_ATTACKS]
    return out


ATTACKS = {"principal": PRINCIPAL_ATTACKS, "agent": AGENT_ATTACKS, "cross": CROSS_ATTACKS, "reverse": REVERSE_CROSS,
           "exec": EXEC_ATTACKS, "executor": EXECUTOR_ATTACKS}


@pytest.mark.parametrize(("group", "attack", "actor", "target"), _cases(), ids=lambda v: str(v).replace(" ", "_"))
async def test_attack_is_refused_by_the_server(bed: Bed, security_table, group: str, attack: str, actor: str, target: str) -> None:
    """Another party's credentials attempting this attack are refused by nats-server itself, with 0 messages delivered."""
    attacker, victim = bed.conns[actor], bed.conns[target]
    observed, ok = "", False
    try:
        observed = await ATTACKS[group][attack](bed, attacker, victim)
        ok = True
    except (AssertionError, TimeoutError) as e:
        observed = f"NOT REFUSED: {e!s}"[:120] if isinstance(e, AssertionError) else "no violation reported"
        raise
    finally:
        security_table.record(bed.table, attack, actor, target, "refused, 0 delivered", observed, ok)
        assert not attacker.nc.is_closed, "a permissions violation must not cost the attacker its connection"


# ---------------------------------------------------------------------------
# Positive controls: without these, a matrix of refusals could be a broken setup.
# ---------------------------------------------------------------------------


async def test_principal_receives_and_answers_its_own(bed: Bed, security_table) -> None:
    """Principal P receives its own surface items, pulls its own durable, and its own resolve reaches the gateway."""
    p = bed.conns["principal:p1"]
    s = bed.subjects
    sub = await p.nc.subscribe(s.surface("p1"))
    await flushed(p.nc)
    js = bed.service.nc.jetstream()
    await js.publish(s.surface("p1"), b'{"item": "own"}')
    msg = await sub.next_msg(timeout=WAIT)
    assert msg.data == b'{"item": "own"}'
    pulled = await p.nc.jetstream().pull_subscribe_bind(principal_durable("p1"), "PGW_SURFACE")
    got = await pulled.fetch(100, timeout=WAIT)
    assert {m.subject for m in got} == {s.surface("p1")}, "the durable carries only P's own subject"
    assert b'{"item": "own"}' in [m.data for m in got]
    for m in got:
        await m.ack()
    obs = await bed.service.nc.subscribe(s.resolve("p1"))
    await flushed(bed.service.nc)
    await p.nc.publish(s.resolve("p1"), b"{}")
    assert (await obs.next_msg(timeout=WAIT)).data == b"{}"
    await obs.unsubscribe()
    await sub.unsubscribe()
    security_table.record(bed.table, "own surface, durable and resolve", "principal:p1", "principal:p1", "allowed", "allowed", True)


async def test_principal_request_reply_uses_its_own_inbox(bed: Bed, security_table) -> None:
    """A principal's request is answered on its own inbox prefix, which the answering service may reply to."""
    p = bed.conns["principal:p2"]
    s = bed.subjects

    reply = await p.nc.request(s.pending("p2"), b"{}", timeout=WAIT)  # answered by the bed's pending responder
    assert reply.data == b'{"items": []}'
    assert bed.pending_replies[-1].startswith("_INBOX_principal_p2.")
    security_table.record(bed.table, "pending request-reply", "principal:p2", "principal:p2", "allowed", "allowed", True)


async def test_principal_presence_and_push_are_its_own(bed: Bed, security_table) -> None:
    """Issue 17: P publishes its own presence and push requests (answered on its own inbox)."""
    p = bed.conns["principal:p3"]
    pre = bed.config.prefix
    obs = await bed.service.nc.subscribe(f"{pre}.principal.p3.presence")

    async def push_responder(msg) -> None:  # stands in for the notifier
        await msg.respond(b'{"ok": true}')

    answering = bed.conns["responder:services"]  # requests are taken on the answering connection
    push = await answering.nc.subscribe(f"{pre}.principal.*.push.*", cb=push_responder)
    await flushed(bed.service.nc)
    await flushed(answering.nc)
    try:
        await p.nc.publish(f"{pre}.principal.p3.presence", b'{"instance": "i", "surface": "web", "ttl_s": 30}')
        assert b'"ttl_s": 30' in (await obs.next_msg(timeout=WAIT)).data
        for verb in ("key", "subscribe", "unsubscribe"):
            reply = await p.nc.request(f"{pre}.principal.p3.push.{verb}", b"{}", timeout=WAIT)
            assert reply.data == b'{"ok": true}'
    finally:
        await obs.unsubscribe()
        await push.unsubscribe()
    security_table.record(bed.table, "own presence and push requests", "principal:p3", "principal:p3", "allowed", "allowed", True)


async def test_notifier_identity_hears_push_and_presence_only(bed: Bed, security_table) -> None:
    """service:notifier hears every principal's presence and its responder takes their push requests;
    neither may forge a surface item nor answer a moment, and the responder may publish on no contract subject."""
    party = Party("service", "notifier")
    conn = await open_conn(bed.server, bed.creds_dir / party.filename, party)
    rparty = Party("responder", "notifier")
    rconn = await open_conn(bed.server, bed.creds_dir / rparty.filename, rparty)
    pre = bed.config.prefix
    try:
        pres = await conn.nc.subscribe(f"{pre}.principal.*.presence")
        push = await rconn.nc.subscribe(f"{pre}.principal.*.push.*", queue="pgw-notifier")
        await flushed(conn.nc)
        await flushed(rconn.nc)
        assert conn.errors.empty() and rconn.errors.empty(), "the notifier may hear presence; its responder push requests"
        # The service connection takes no request; the answering one writes nothing of the contract's.
        await conn.nc.subscribe(f"{pre}.principal.*.push.*", queue="pgw-notifier")
        await conn.violation(f"{pre}.principal.*.push.*")
        for subject in (f"{pre}.principal.p1.surface", f"{pre}.verdict.blocked", "$KV.PGW_PUSH_SUBS.p1.x"):
            await rconn.nc.publish(subject, b'{"forged": true}')
            await rconn.violation(subject)
        await bed.conns["principal:p1"].nc.publish(f"{pre}.principal.p1.presence", b"{}")
        await settle(bed.conns["principal:p1"])
        assert (await pres.next_msg(timeout=WAIT)).subject == f"{pre}.principal.p1.presence"
        await push.unsubscribe()
        await conn.nc.publish(f"{pre}.principal.p1.surface", b'{"forged": true}')
        await conn.violation(f"{pre}.principal.p1.surface")
        await conn.nc.subscribe(f"{pre}.principal.p1.resolve")
        await conn.violation(f"{pre}.principal.p1.resolve")
        # E-mail answers go out with the principal's own credentials, never the notifier's.
        await conn.nc.publish(f"{pre}.principal.p1.resolve", b'{"forged": true}')
        await conn.violation(f"{pre}.principal.p1.resolve")
    finally:
        await conn.nc.close()
        await rconn.nc.close()
    security_table.record(bed.table, "notifier: push+presence only", "service:notifier", "principal:p1", "allowed/refused", "allowed/refused", True)


async def test_agent_queries_its_own_moments_on_its_own_inbox(bed: Bed, security_table) -> None:
    """Agent A's moment query reaches the gateway and is answered on A's own inbox prefix."""
    a = bed.conns["agent:a2"]
    reply = await a.nc.request(bed.subjects.moment("a2"), b'{"moment_id": "00000000000000000000000000000000"}', timeout=WAIT)
    assert reply.data == b'{"status": "unknown"}'
    assert bed.moment_replies[-1].startswith("_INBOX_agent_a2.")
    security_table.record(bed.table, "moment query request-reply", "agent:a2", "agent:a2", "allowed", "allowed", True)
    # The list form rides the same subject, so the same permission: A's own, on A's own inbox.
    reply = await a.nc.request(bed.subjects.moment("a2"), b'{"list": "open"}', timeout=WAIT)
    assert reply.data == b'{"status": "unknown"}' and bed.moment_replies[-1].startswith("_INBOX_agent_a2.")
    security_table.record(bed.table, "moment list request-reply", "agent:a2", "agent:a2", "allowed", "allowed", True)


async def test_agent_publishes_and_pulls_its_own(bed: Bed, security_table) -> None:
    """Agent A publishes envelopes to PGW_INBOUND (PubAck on its own inbox) and pulls its own outcomes."""
    a = bed.conns["agent:a1"]
    s = bed.subjects
    ack = await a.nc.jetstream().publish(s.envelope("a1"), b"{}", headers={"Nats-Msg-Id": "a1:own-1"})
    assert ack.stream == "PGW_INBOUND"
    await bed.service.nc.jetstream().publish(s.outcome("a1"), b'{"outcome": "own"}')
    pulled = await a.nc.jetstream().pull_subscribe_bind(agent_durable("a1"), "PGW_OUTBOUND")
    got = await pulled.fetch(100, timeout=WAIT)
    assert {m.subject for m in got} == {s.outcome("a1")}, "the durable carries only A's own outcomes"
    assert b'{"outcome": "own"}' in [m.data for m in got]
    for m in got:
        await m.ack()
    security_table.record(bed.table, "own envelope and outcome durable", "agent:a1", "agent:a1", "allowed", "allowed", True)


async def test_anonymous_and_unknown_keys_are_refused(bed: Bed, security_table, tmp_path: Path) -> None:
    """A connection without credentials, or with an nkey not in the block, is refused at connect."""
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(bed.server.client_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    from pgwcore.identity import load_or_create_creds

    if bed.mode == "nkey":
        stranger = load_or_create_creds(tmp_path / "other", Party("agent", "a1")).path  # same name, different key
    else:  # a user JWT for the same party, signed by an account of an operator the server does not trust
        stranger = Operator(tmp_path / "other-operator").mint_user(
            "acme", bed.config.prefix, Party("agent", "a1"), tmp_path / "stranger.creds")
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await connect(bed.server.client_url, creds=str(stranger), allow_reconnect=False, max_reconnect_attempts=0)
    security_table.record(bed.table, "connect without / with unknown nkey", "anonymous", "server", "refused", "refused", True)


async def test_slack_surface_reaches_only_its_principal(bed: Bed, security_table) -> None:
    """The Slack surface identity of p1 pulls p1's items from its own durable, answers p1's moments and keeps
    p1's records; p2's resolve, pending, durable, records and surface, and a key read by message get, are each
    refused by the server with nothing delivered."""
    from nats.js.kv import KeyValue

    me, s = bed.conns["slack:p1"], bed.subjects
    sjs, mjs = bed.service.nc.jetstream(), me.nc.jetstream()
    await sjs.publish(s.surface("p1"), b'{"item": "own"}')
    await sjs.publish(s.surface("p2"), b'{"item": "not yours"}')
    await sjs.publish(f"$KV.{SLACK_BUCKET}.p2.m1", b"p2's record")
    pulled = await mjs.pull_subscribe_bind(slack_durable("p1"), "PGW_SURFACE")
    got = await pulled.fetch(100, timeout=WAIT)
    assert {m.subject for m in got} == {s.surface("p1")}
    for m in got:
        await m.ack()
    kv = KeyValue(name=SLACK_BUCKET, stream=f"KV_{SLACK_BUCKET}", pre=f"$KV.{SLACK_BUCKET}.", js=mjs, direct=True)
    await kv.put("p1.m1", b"mine")
    assert (await kv.get("p1.m1")).value == b"mine"
    obs = await bed.service.nc.subscribe(s.resolve("p1"))
    await flushed(bed.service.nc)
    await me.nc.publish(s.resolve("p1"), b"{}")
    assert (await obs.next_msg(timeout=WAIT)).data == b"{}"
    await obs.unsubscribe()

    refused = [s.resolve("p2"), s.pending("p2"), s.surface("p1"), f"$KV.{SLACK_BUCKET}.p2.m1",
               f"$JS.API.DIRECT.GET.KV_{SLACK_BUCKET}.$KV.{SLACK_BUCKET}.p2.m1",
               f"$JS.API.STREAM.MSG.GET.KV_{SLACK_BUCKET}", f"$JS.API.CONSUMER.MSG.NEXT.PGW_SURFACE.{slack_durable('p2')}",
               f"$JS.API.CONSUMER.CREATE.PGW_SURFACE.x.{s.surface('p2')}", "$JS.API.DIRECT.GET.PGW_SURFACE"]
    watch = [await bed.service.nc.subscribe(subj) for subj in (s.resolve("p2"), s.pending("p2"))]
    await flushed(bed.service.nc)
    for subject in refused:
        await me.nc.publish(subject, b'{"last_by_subj": "$KV.PGW_SLACK.p2.m1"}', reply=f"{me.party.inbox_prefix}.x")
        await me.violation(subject)
    sub = await me.nc.subscribe(s.surface("p2"))
    await flushed(me.nc)
    await me.violation(s.surface("p2"))
    await sjs.publish(s.surface("p2"), b'{"item": "not yours"}')
    await settle(me, bed.service)
    assert sub.pending_msgs == 0 and all(w.pending_msgs == 0 for w in watch)
    assert (await kv.get("p1.m1")).value == b"mine"
    for w in watch:
        await w.unsubscribe()
    security_table.record(bed.table, "Slack surface: only its principal's items, answers and records", "slack:p1",
                          "principal:p2", "refused (9 subjects + surface)", "refused, 0 delivered", True)


async def test_executor_serves_the_gateway_and_agents_reach_it_only_through_act(bed: Bed, security_table) -> None:
    """An executor with its own credentials keeps its results bucket and answers the gateway's identity (the
    SDK, subjects/executor.py); an agent may send agent.{agent}.act, which only the gateway serves."""
    from subjects.executor import Executor
    from subjects.gate import ExecRequest, ExecResponse

    x = bed.conns["executor:files"]
    async with Executor(x.nc, "files", prefix=bed.config.prefix) as ex:

        @ex.action("WriteFile")
        async def write(args: dict) -> dict:
            return {"ok": args["n"]}

        await flushed(x.nc)
        req = ExecRequest(idempotency_key="ab" * 16, action="WriteFile", arguments={"n": 1}, idp_id="i", so_id="s",
                          agent="a1", principal="p1")
        import msgspec

        reply = await bed.service.nc.request(bed.subjects.exec("files", "WriteFile"), msgspec.json.encode(req), timeout=WAIT)
        assert msgspec.json.decode(reply.data, type=ExecResponse).result == {"ok": 1}
        assert ex.runs == 1
    security_table.record(bed.table, "executor serves the gateway", "executor:files", "service:services", "allowed",
                          "allowed", True)
    a = bed.conns["agent:a1"]
    obs = await bed.service.nc.subscribe(bed.subjects.act("a1"))
    await flushed(bed.service.nc)
    await a.nc.publish(bed.subjects.act("a1"), b"{}")
    await settle(a, bed.service)
    assert obs.pending_msgs == 1
    await obs.unsubscribe()
    security_table.record(bed.table, "own gated action (agent.{agent}.act)", "agent:a1", "agent:a1", "allowed", "allowed", True)
