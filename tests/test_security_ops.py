"""Ops is read-only (DESIGN §1, §7; issue 19), proved against a real nats-server.

With the ``ops:oncall`` credentials the generated block gives, every verb that
creates, changes or consumes state is refused by the server itself, no answer
or message reaches ops, and a snapshot of every stream and consumer (messages,
last sequence, filter, paused, delivered and ack floor) is the same after the
attempt as before. Positive controls prove what ops may still do: read stream
and consumer info, get messages, subscribe to contract subjects, and run
``pgw tail`` with history and ``pgw replay --dry-run`` over the message-get path.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio

from consumers.replay import Replayer, ReplayRange
from consumers.tail import tail
from gateway.security import Party, agent_durable, embedded_auth, principal_durable
from gateway.security.part import ensure_principal_consumer
from pgwcore.config import Config, load_config
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams
from subjects.client import ensure_agent_consumer
from tests.gauntlet.bed import flushed
from tests.test_security_matrix import WAIT, Conn, open_conn

pytestmark = [pytest.mark.security, pytest.mark.asyncio(loop_scope="module")]

TABLE = "ops read-only"
OPS = "ops:oncall"


@dataclass
class OpsBed:
    config: Config
    server: EmbeddedServer
    service: Conn
    ops: Conn
    kv_bucket: str


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def obed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[OpsBed]:
    """A secured server with the streams, the durables, stored items for p1 and a1, a KV bucket, and an ops connection."""
    tmp = tmp_path_factory.mktemp("secops")
    config = load_config(None, data_dir=str(tmp / "data"), agents={"a1": {"principals": ["p1"]}, "a2": {"principals": ["p2"]}},
                         security={"ops": ["oncall"]})
    auth = embedded_auth(config)
    server = EmbeddedServer(tmp / "nats", port=-1, monitor_port=-1, websocket_port=None, authorization=auth.server_block)
    await server.start()
    service = ops = None
    try:
        service = await open_conn(server, auth.service_creds, Party("service", "services"))
        js = service.nc.jetstream()
        await ensure_streams(js, config.subjects)
        s = config.subjects
        for a in ("a1", "a2"):
            await ensure_agent_consumer(js, a, prefix=config.prefix)
        for p in ("p1", "p2"):
            await ensure_principal_consumer(js, p, prefix=config.prefix)
        for i in range(3):
            await js.publish(s.surface("p1"), json.dumps({"item": i, "for": "p1"}).encode(), headers={"Nats-Msg-Id": f"s{i}"})
            await js.publish(s.outcome("a1"), json.dumps({"outcome": i}).encode(), headers={"Nats-Msg-Id": f"o{i}"})
        await js.publish(s.capsule_register, b"\xd2\x84capsule", headers={"Nats-Msg-Id": "c1"})
        kv = await js.create_key_value(bucket="PGW_OPS_TEST")
        await kv.put("k", b"v")
        ops = await open_conn(server, auth.creds_for(Party("ops", "oncall")), Party("ops", "oncall"))
        yield OpsBed(config, server, service, ops, "PGW_OPS_TEST")
    finally:
        for c in (ops, service):
            if c is not None:
                with contextlib.suppress(Exception):
                    await c.nc.close()
        await server.stop()


async def snapshot(bed: OpsBed) -> dict[str, Any]:
    """Every stream's and consumer's state, read with the service's credentials."""
    js = bed.service.nc.jetstream()
    out: dict[str, Any] = {}
    for info in await js.streams_info():
        st = info.state
        out[info.config.name] = (st.messages, st.last_seq, st.first_seq, st.consumer_count)
        for c in await js.consumers_info(info.config.name):
            cfg = c.config
            out[f"{info.config.name}/{c.name}"] = (
                cfg.filter_subject, tuple(cfg.filter_subjects or ()), cfg.deliver_subject, cfg.ack_policy,
                getattr(c, "paused", None), c.delivered.stream_seq, c.ack_floor.stream_seq, c.num_ack_pending,
                c.num_pending, c.num_redelivered,
            )
    kv = await js.key_value(bed.kv_bucket)
    out["kv"] = (await kv.get("k")).value
    return out


async def _violation(conn: Conn, subject: str) -> str:
    while True:
        err = await asyncio.wait_for(conn.errors.get(), WAIT)
        if "permissions violation" in err.lower() and subject.lower() in err.lower():
            return err


async def refused_request(bed: OpsBed, subject: str, body: dict[str, Any] | bytes | None = None) -> str:
    """Ops publishes ``subject`` with a reply inbox: the server's violation names it, and nothing answers."""
    data = body if isinstance(body, bytes) else json.dumps(body or {}).encode()
    nc = bed.ops.nc
    inbox = nc.new_inbox()
    replies = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, data, reply=inbox)
        await _violation(bed.ops, subject)
        await flushed(nc)
        answers = []
        while replies.pending_msgs:
            msg = replies._pending_queue.get_nowait()
            if not (msg.headers or {}).get("Status"):
                answers.append(msg)
        assert not answers, f"the server answered ops: {answers[0].data[:120]!r}"
    finally:
        await replies.unsubscribe()
    return "refused (Permissions Violation for Publish), no reply"


def req(template: str, body: dict[str, Any] | bytes | None = None) -> Callable[[OpsBed], Awaitable[str]]:
    async def attack(bed: OpsBed) -> str:
        s = bed.config.subjects
        subject = template.format(pre=bed.config.prefix, p1=principal_durable("p1"), a1=agent_durable("a1"),
                                  surface=s.surface("p1"), outcome2=s.outcome("a2"))
        b = body
        if isinstance(b, dict):
            b = json.loads(json.dumps(b).replace("{inbox}", f"{bed.ops.party.inbox_prefix}.steal")
                           .replace("{outcome2}", s.outcome("a2")).replace("{a1}", agent_durable("a1"))
                           .replace("{surface}", s.surface("p1")))
        return await refused_request(bed, subject, b)

    return attack


async def queue_steal(bed: OpsBed) -> str:
    """Ops joins the gateway's queue group on IDP requests: refused, so no request is taken from the gateway."""
    subject = bed.config.subjects.all_agents("idp")
    sub = await bed.ops.nc.subscribe(subject, queue="pgw-gateway")
    await flushed(bed.ops.nc)
    await _violation(bed.ops, subject)
    await bed.service.nc.publish(bed.config.subjects.idp("a1"), b"{}")
    await flushed(bed.service.nc)
    await flushed(bed.ops.nc)
    assert sub.pending_msgs == 0, "a queue-group request reached ops"
    return "refused (Permissions Violation for Subscription), 0 delivered"


PUSH = {"config": {"deliver_subject": "{inbox}", "ack_policy": "none", "filter_subject": "{surface}"}}
ATTACKS: dict[str, Callable[[OpsBed], Awaitable[str]]] = {
    "push consumer to ops inbox (named create)": req("$JS.API.CONSUMER.CREATE.PGW_SURFACE.opsgrab.{surface}",
                                                     {"stream_name": "PGW_SURFACE", **PUSH}),
    "ephemeral consumer (old create form)": req("$JS.API.CONSUMER.CREATE.PGW_SURFACE", {"stream_name": "PGW_SURFACE", **PUSH}),
    "durable consumer (legacy create)": req("$JS.API.CONSUMER.DURABLE.CREATE.PGW_SURFACE.opsgrab",
                                            {"stream_name": "PGW_SURFACE", "config": {**PUSH["config"], "durable_name": "opsgrab"}}),
    "re-filter outcome-a1 to a2's outcomes": req("$JS.API.CONSUMER.CREATE.PGW_OUTBOUND.{a1}",
                                                 {"stream_name": "PGW_OUTBOUND", "config": {"durable_name": "{a1}", "name": "{a1}",
                                                  "filter_subject": "{outcome2}", "ack_policy": "explicit"}}),
    "pause surface-p1 until 2099": req("$JS.API.CONSUMER.PAUSE.PGW_SURFACE.{p1}", {"pause_until": "2099-01-01T00:00:00Z"}),
    "unpin surface-p1": req("$JS.API.CONSUMER.UNPIN.PGW_SURFACE.{p1}", {"group": "g"}),
    "delete surface-p1": req("$JS.API.CONSUMER.DELETE.PGW_SURFACE.{p1}"),
    "pull from surface-p1 (MSG.NEXT)": req("$JS.API.CONSUMER.MSG.NEXT.PGW_SURFACE.{p1}", {"batch": 1, "expires": 1_000_000_000}),
    "pull from outcome-a1 (MSG.NEXT)": req("$JS.API.CONSUMER.MSG.NEXT.PGW_OUTBOUND.{a1}", {"batch": 1}),
    "ack a delivery of surface-p1": req("$JS.ACK.PGW_SURFACE.{p1}.1.1.1.0.0", b"+ACK"),
    "ack the registration work queue": req("$JS.ACK.PGW_REGISTRATION.registrar.1.1.1.0.0", b"+ACK"),
    "consumer leader stepdown": req("$JS.API.CONSUMER.LEADER.STEPDOWN.PGW_SURFACE.{p1}"),
    "stream purge": req("$JS.API.STREAM.PURGE.PGW_SURFACE"),
    "stream delete": req("$JS.API.STREAM.DELETE.PGW_OUTBOUND"),
    "stream update (drop subjects)": req("$JS.API.STREAM.UPDATE.PGW_SURFACE", {"name": "PGW_SURFACE", "subjects": ["x.y"]}),
    "stream create": req("$JS.API.STREAM.CREATE.OPS_GRAB", {"name": "OPS_GRAB", "subjects": ["{pre}.>"]}),
    "stream msg delete": req("$JS.API.STREAM.MSG.DELETE.PGW_SURFACE", {"seq": 1}),
    "stream snapshot": req("$JS.API.STREAM.SNAPSHOT.PGW_SURFACE", {"deliver_subject": "{inbox}"}),
    "KV put": req("$KV.PGW_OPS_TEST.k", b"forged"),
    "publish an item on p1's surface": req("{surface}", b'{"forged": true}'),
    "publish an envelope as a1": req("{pre}.agent.a1.envelope", b"{}"),
    "answer p1's moment": req("{pre}.principal.p1.resolve", b"{}"),
    "queue-group steal of IDP requests": queue_steal,
}


@pytest.mark.parametrize("attack", list(ATTACKS), ids=lambda v: v.replace(" ", "_"))
async def test_ops_cannot_change_or_consume_state(obed: OpsBed, security_table, attack: str) -> None:
    """An ops write or consume attempt is refused by nats-server, nothing reaches ops, and no stream, consumer or KV state changes."""
    before = await snapshot(obed)
    observed, ok = "", False
    try:
        observed = await ATTACKS[attack](obed)
        after = await snapshot(obed)
        assert after == before, f"state changed: {[k for k in after if after.get(k) != before.get(k)]}"
        observed += ", no state changed"
        ok = True
    except (AssertionError, TimeoutError) as e:
        observed = f"NOT REFUSED: {e!s}"[:120] if isinstance(e, AssertionError) else "no violation reported"
        raise
    finally:
        security_table.record(TABLE, attack, OPS, "bus", "refused, nothing delivered, no state changed", observed, ok)
        assert not obed.ops.nc.is_closed


async def test_ops_reads_info_and_messages(obed: OpsBed, security_table) -> None:
    """Ops reads stream info, consumer info and names, a stored message by get, and live contract subjects."""
    js = obed.ops.nc.jetstream(timeout=WAIT)
    s = obed.config.subjects
    assert (await js.stream_info("PGW_SURFACE")).state.messages == 3
    assert (await js.consumer_info("PGW_SURFACE", principal_durable("p1"))).num_pending == 3
    names = [c.name for c in await js.consumers_info("PGW_SURFACE")]
    assert principal_durable("p1") in names
    got = await js.get_msg("PGW_SURFACE", 1)
    assert json.loads(got.data)["for"] == "p1"
    live = await obed.ops.nc.subscribe(s.all_verdicts)
    await flushed(obed.ops.nc)
    await obed.service.nc.publish(s.verdict("denied"), b'{"v": 1}')
    assert (await live.next_msg(timeout=WAIT)).data == b'{"v": 1}'
    await live.unsubscribe()
    security_table.record(TABLE, "stream/consumer info, msg get, live subscribe", OPS, "bus", "allowed", "allowed", True)


async def test_ops_tail_and_replay_need_no_consumer(obed: OpsBed, security_table) -> None:
    """`pgw tail --all` and `pgw replay --dry-run` with ops credentials read history and live messages, creating no consumer."""
    before = await snapshot(obed)
    s = obed.config.subjects
    out = io.StringIO()
    started = asyncio.Event()
    task = asyncio.create_task(tail(obed.ops.nc, s.outcome("a1"), out=out, history="all", count=4, fmt="json", started=started))
    await asyncio.wait_for(started.wait(), WAIT)
    await obed.service.nc.jetstream().publish(s.outcome("a1"), b'{"outcome": 3}', headers={"Nats-Msg-Id": "o3"})
    assert await asyncio.wait_for(task, WAIT) == 4
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["body"]["outcome"] for x in lines] == [0, 1, 2, 3]
    assert [x["seq"] for x in lines] == sorted(x["seq"] for x in lines)
    report = await Replayer(obed.ops.nc, s).replay(ReplayRange(subject=s.all_agents("outcome")), "ops.sink", dry_run=True)
    assert len(report.actions) == 4
    after = await snapshot(obed)
    assert {k for k in after if "/" in k} == {k for k in before if "/" in k}, "a consumer was created or removed"
    assert obed.ops.errors.empty() or all("permissions" not in e.lower() for e in list(obed.ops.errors._queue))
    security_table.record(TABLE, "pgw tail --all, pgw replay --dry-run", OPS, "bus", "allowed, no consumer", "allowed, no consumer", True)


async def test_ops_permissions_have_no_state_changing_verb() -> None:
    """The generated block gives ops no consumer create/pause/delete/pull, no ack, and no stream or KV write."""
    from gateway.security.jsapi import VERBS, grants

    ops = Party("ops", "oncall")
    allowed = {v.name for v in VERBS if grants("pgw", v, ops)}
    assert allowed == {v.name for v in VERBS if not v.writes}
