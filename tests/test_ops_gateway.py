"""Ops promises that need the running gateway: traceparent, dead letters, metrics, replay."""

from __future__ import annotations

import json

import msgspec
import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig

from consumers.replay import Replayer, ReplayRange
from gateway.app import Gateway
from gateway.deadletter import DeadLetters
from pgwcore import metrics
from subjects.client import BINDING_MOMENT_KIND, envelope
from subjects.wire import OptionChoice, ResolveRequest
from tests.chaos.checker import read_stream
from tests.logcapture import capture_logs_with_context
from tests.moments import good_moment
from tests.polling import until, until_drained
from tests.stored import arrived

TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _moment_env(eid: str, principal: str = "alice") -> dict:
    return envelope(BINDING_MOMENT_KIND, {"principal": principal, "binding_moment": good_moment()},
                    envelope_id=eid)


async def _send(js, agent: str, body: dict | list, *, headers: dict | None = None) -> None:
    first = body[0] if isinstance(body, list) else body
    h = {"Nats-Msg-Id": f"{agent}:{first['envelopeId']}", **(headers or {})}
    await js.publish(f"pgw.agent.{agent}.envelope", json.dumps(body).encode(), headers=h)


async def test_traceparent_reaches_every_message_the_envelope_causes(nc, make_config) -> None:
    """An inbound traceparent header is on the outcome, the surface item and the verdict it causes."""
    js = nc.jetstream()
    async with Gateway(make_config(), nc):
        await _send(js, "tracer", _moment_env("t1"), headers={"traceparent": TRACE})
        verdicts = await arrived(js, "PGW_VERDICTS", timeout=10)
        outs = await arrived(js, "PGW_OUTBOUND", subject="pgw.agent.tracer.outcome", timeout=10)
        items = await arrived(js, "PGW_SURFACE", timeout=10)
    for m in (*verdicts, *outs, *items):
        assert m.headers.get("traceparent") == TRACE, m.subject
        assert json.loads(m.data)["traceparent"] == TRACE


async def test_traceparent_is_on_the_log_lines_it_causes(nc, make_config) -> None:
    """The envelope's summary line and the moment's expiry line carry the envelope's traceparent;
    a resolve request's line carries the resolve request's own."""
    js = nc.jetstream()
    answer_trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with capture_logs_with_context() as logs:
        async with Gateway(make_config(), nc):
            expiring = _moment_env("t-expiring")
            expiring["payload"]["expires_in_s"] = 1
            await _send(js, "tracer", expiring, headers={"traceparent": TRACE})
            await _send(js, "tracer", _moment_env("t-answered"), headers={"traceparent": TRACE})
            items = await arrived(js, "PGW_SURFACE", 2, timeout=10)
            answered = next(json.loads(m.data) for m in items if b"t-answered" in m.data)
            body = msgspec.json.encode(ResolveRequest(moment_id=answered["moment_id"], resolution=OptionChoice(index=0)))
            await nc.request("pgw.principal.alice.resolve", body, timeout=10, headers={"traceparent": answer_trace})
            await until(lambda: _logged(logs, "moment expired"), timeout=10)
    envelope_lines = [e for e in logs if e["event"] == "envelope"]
    assert len(envelope_lines) == 2 and all(e["traceparent"] == TRACE for e in envelope_lines)
    assert [e["traceparent"] for e in logs if e["event"] == "moment expired"] == [TRACE]
    assert [e["traceparent"] for e in logs if e["event"] == "resolution"] == [answer_trace]


async def _logged(logs: list, event: str) -> bool:
    return any(e["event"] == event for e in logs)


@pytest.mark.parametrize("max_deliver", [2])
async def test_poison_message_is_dead_lettered_not_redelivered_forever(nc, make_config, max_deliver) -> None:
    """A turn that fails on every delivery ends in one dead letter with its sequence and reason,
    one engine_failure verdict and one engine_failure outcome, and is not delivered again."""
    js = nc.jetstream()
    config = make_config(gateway={"max_deliver": max_deliver, "ack_wait_s": 5.0})
    attempts: list[int] = []

    async def poison_stage(ctx) -> None:
        if ctx.raw.get("envelopeId") == "poison":
            attempts.append(ctx.turn.num_delivered)
            raise RuntimeError("injected fault")

    async with Gateway(config, nc) as gw:
        gw.worker.pipeline.stages.insert(0, poison_stage)
        await _send(js, "bot", _moment_env("poison"))
        await _send(js, "bot", _moment_env("healthy"))
        dl = await arrived(js, "PGW_DEADLETTER", timeout=10)
        outs = await arrived(js, "PGW_OUTBOUND", subject="pgw.agent.bot.outcome", timeout=10)
        await arrived(js, "PGW_OUTBOUND", 2, timeout=10)
        info = await js.consumer_info("PGW_INBOUND", "pgw-gateway")
    record = json.loads(dl[0].data)
    assert len(dl) == 1
    assert record["stream_seq"] == 1 and record["deliveries"] == max_deliver
    assert "max_deliver" in record["reason"] and record["envelope_id"] == "poison"
    assert attempts == list(range(1, max_deliver + 1))
    verdicts = [json.loads(m.data) for m in await read_stream(js, "PGW_VERDICTS")]
    failures = [v for v in verdicts if v["verdict_class"] == "engine_failure"]
    assert len(failures) == 1 and failures[0]["envelope_id"] == "poison"
    outs = [json.loads(m.data) for m in await read_stream(js, "PGW_OUTBOUND")]
    assert [o["code"] for o in outs if o["envelope_id"] == "poison"] == ["engine_failure"]
    assert [o["status"] for o in outs if o["envelope_id"] == "healthy"] == ["accepted"]
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def _never_acked(js, subject: str, durable: str) -> list:
    """The one message on ``subject`` delivered twice on ``durable`` (max_deliver 2) and never acked, as by a
    worker that dies mid-message; the dead letters once the server gave up on it (its MAX_DELIVERIES advisory),
    with the verdict stored."""
    psub = await js.pull_subscribe(
        subject, durable=durable, stream="PGW_INBOUND",
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=0.3, max_deliver=2, filter_subject=subject))
    for _ in range(2):
        (_m,) = await psub.fetch(1, timeout=5)
    # The restarted worker asks again; the server gives up on the message (max_deliver)
    # and emits the MAX_DELIVERIES advisory instead of a third delivery.
    with pytest.raises(NatsTimeout):
        await psub.fetch(1, timeout=1.5)
    dl = await arrived(js, "PGW_DEADLETTER", timeout=10)
    await arrived(js, "PGW_VERDICTS", timeout=10)
    await psub.unsubscribe()
    return dl


async def test_unacknowledged_message_is_dead_lettered_from_the_advisory(nc, make_config) -> None:
    """A message never acknowledged (worker crashes each time) is dead-lettered from the
    server's MAX_DELIVERIES advisory: one record, one engine_failure verdict."""
    js = nc.jetstream()
    config = make_config()
    gw = Gateway(config, nc)  # not entered: no worker; the crashing 'worker' is simulated below
    async with DeadLetters(gw):
        await _send(js, "bot", _moment_env("crasher"), headers={"traceparent": TRACE})
        dl = await _never_acked(js, "pgw.agent.*.envelope", "pgw-gateway")
    rec = json.loads(dl[0].data)
    assert rec["stream_seq"] == 1 and rec["deliveries"] == 2 and "not acknowledged" in rec["reason"]
    assert rec["traceparent"] == TRACE and rec["agent"] == "bot"
    (v,) = [json.loads(x.data) for x in await read_stream(js, "PGW_VERDICTS")]
    assert v["verdict_class"] == "engine_failure" and v["envelope_id"] == "crasher"


async def test_unacknowledged_transition_report_is_dead_lettered_from_the_advisory(nc, make_config) -> None:
    """A transition report the kernel never acknowledges (it dies on each delivery) is dead-lettered from the
    server's MAX_DELIVERIES advisory of ``pgw-kernel``: one record naming the consumer and the report's idp_id,
    one engine_failure verdict, no outcome (a report has none)."""
    js = nc.jetstream()
    gw = Gateway(make_config(), nc)  # not entered: no kernel; the crashing kernel is simulated below
    async with DeadLetters(gw):
        report = {"idp_id": "8c6f0c1e-9b4e-4d55-9e57-0d1c4ad1b6a1", "executed_action": "CloseBooking",
                  "effect": {"type": "booking.close", "status": "confirmed"}}
        await js.publish("pgw.agent.bot.transition", json.dumps(report).encode(),
                         headers={"Nats-Msg-Id": "bot:report", "traceparent": TRACE})
        dl = await _never_acked(js, "pgw.agent.*.transition", "pgw-kernel")
    rec = json.loads(dl[0].data)
    assert (rec["consumer"], rec["idp_id"], rec["deliveries"]) == ("pgw-kernel", report["idp_id"], 2)
    assert "not acknowledged" in rec["reason"] and rec["agent"] == "bot"
    (v,) = [json.loads(x.data) for x in await read_stream(js, "PGW_VERDICTS")]
    assert (v["verdict_class"], v["action_type"], v["idp_id"]) == ("engine_failure", "idp.transition", report["idp_id"])
    assert not await read_stream(js, "PGW_OUTBOUND")


async def test_dead_letter_recording_is_idempotent(nc, make_config) -> None:
    """Recording the same dead letter twice (hook and advisory) leaves one record, verdict, outcome."""
    js = nc.jetstream()
    gw = Gateway(make_config(), nc)
    async with DeadLetters(gw) as dlq:
        for _ in range(2):
            await dlq.record(stream_seq=7, subject="pgw.agent.bot.envelope", agent="bot", deliveries=3,
                             body=b'{"envelopeId": "e7"}', msg_id="bot:e7", traceparent=None, reason="x")
    assert len(await read_stream(js, "PGW_DEADLETTER")) == 1
    assert len(await read_stream(js, "PGW_VERDICTS")) == 1
    assert len(await read_stream(js, "PGW_OUTBOUND")) == 1


async def test_gateway_counts_envelopes_moments_and_latency(nc, make_config) -> None:
    """A processed binding moment increments the accepted-envelope, moment and latency metrics."""
    js = nc.jetstream()
    acc = metrics.REGISTRY.get_sample_value("pgw_envelopes_total", {"outcome": "accepted", "code": "none"}) or 0
    mom = metrics.REGISTRY.get_sample_value("pgw_binding_moments_total", {"agent": "counter"}) or 0
    lat = metrics.REGISTRY.get_sample_value("pgw_latency_seconds_count", {"stage": "turn"}) or 0
    async with Gateway(make_config(), nc):
        await _send(js, "counter", _moment_env("m1"))
        await arrived(js, "PGW_OUTBOUND", subject="pgw.agent.counter.outcome", timeout=10)
        await until(lambda: _metric_above("pgw_latency_seconds_count", {"stage": "turn"}, lat), timeout=10)
    assert metrics.REGISTRY.get_sample_value("pgw_envelopes_total", {"outcome": "accepted", "code": "none"}) == acc + 1
    assert metrics.REGISTRY.get_sample_value("pgw_binding_moments_total", {"agent": "counter"}) == mom + 1


async def test_dialogue_resolutions_feed_the_dialogue_hatch_rate(nc, make_config) -> None:
    """A principal's dialogue answer counts in the dialogue-hatch counter and the resolutions
    denominator, labelled by agent and decision_class, never by principal."""
    from subjects.client import Surface
    from subjects.wire import DialogueVeto

    js = nc.jetstream()
    labels = {"agent": "veto", "decision_class": "consent"}
    d0 = metrics.REGISTRY.get_sample_value("pgw_dialogue_hatch_total", labels) or 0
    r0 = metrics.REGISTRY.get_sample_value("pgw_resolutions_total", labels) or 0
    async with Gateway(make_config(), nc):
        await _send(js, "veto", _moment_env("v1", principal="carol"))
        outs = await arrived(js, "PGW_OUTBOUND", subject="pgw.agent.veto.outcome", timeout=10)
        moment_id = json.loads(outs[0].data)["moment_id"]
        reply = await Surface(nc, "carol").resolve(moment_id, DialogueVeto(objection="wrong question"))
        assert reply.status == "accepted"
    assert metrics.REGISTRY.get_sample_value("pgw_dialogue_hatch_total", labels) == d0 + 1
    assert metrics.REGISTRY.get_sample_value("pgw_resolutions_total", labels) == r0 + 1


async def _metric_above(name: str, labels: dict, v: float) -> bool:
    return (metrics.REGISTRY.get_sample_value(name, labels) or 0) > v


async def test_replay_through_the_gateway_publishes_no_new_items_or_verdicts(nc, make_config) -> None:
    """Re-driving envelopes through the gateway is answered from the correlationId cache: no new
    surface item, no new verdict (so no second capsule), no second outcome (spec 002 replay)."""
    js = nc.jetstream()
    replays = metrics.REGISTRY.get_sample_value("pgw_replays_total", {"agent": "rp"}) or 0
    async with Gateway(make_config(), nc):
        for i in range(3):
            await _send(js, "rp", _moment_env(f"r{i}"))
        await arrived(js, "PGW_OUTBOUND", 3, timeout=10)
        await until_drained(js, "PGW_INBOUND", "pgw-gateway", timeout=10)
        counts = {s: (await js.stream_info(s)).state.messages for s in ("PGW_SURFACE", "PGW_VERDICTS", "PGW_OUTBOUND")}
        dry = await Replayer(nc, gw_subjects(), dedup_lookup=_cached(js)).replay(
            ReplayRange(subject="pgw.agent.rp.envelope"), "gateway", fresh_msg_id=True, dry_run=True)
        report = await Replayer(nc, gw_subjects()).replay(
            ReplayRange(subject="pgw.agent.rp.envelope"), "gateway", fresh_msg_id=True)
        assert report.counts() == {"published": 3}
        await until(lambda: _metric_above("pgw_replays_total", {"agent": "rp"}, replays + 2), timeout=10)
        await until_drained(js, "PGW_INBOUND", "pgw-gateway", timeout=10)
    assert [a.cached for a in dry.actions] == [True, True, True]
    assert {s: (await js.stream_info(s)).state.messages for s in counts} == counts == {
        "PGW_SURFACE": 3, "PGW_VERDICTS": 3, "PGW_OUTBOUND": 3}
    assert metrics.REGISTRY.get_sample_value("pgw_replays_total", {"agent": "rp"}) == replays + 3


def _cached(js):
    from gateway.stages.dedup import cached_outcome_exists

    async def lookup(agent: str, corr: str) -> bool:
        return await cached_outcome_exists(js, agent, corr)

    return lookup


def gw_subjects():
    from subjects.names import Subjects

    return Subjects("pgw")


