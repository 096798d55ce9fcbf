"""Dedup and replay by correlationId (spec 002 "Replay determinism", DESIGN §3.2 step 8)."""

from __future__ import annotations

import asyncio
import time

from gateway.pipeline import DURABLE
from gateway.stages import dedup
from subjects.wire import BindingMomentItem, EnvelopeOutcome, outcome_decoder
from tests.moments import good_moment
from tests.pipeline_helpers import (
    Recorder,
    env,
    moment_env,
    running_gateway,
    stream_bytes,
    stream_count,
)
from tests.polling import until, until_drained

STREAMS = ("PGW_OUTBOUND", "PGW_SURFACE", "PGW_VERDICTS")


async def counts(nc, at_least: dict[str, int]) -> dict[str, int]:
    """Stored message counts once the streams hold at least ``at_least`` (a core
    subscriber may see a message a moment before its stream reports it stored)."""

    async def settled() -> dict[str, int] | None:
        c = {s: await stream_count(nc, s) for s in STREAMS}
        return c if all(c[k] >= v for k, v in at_least.items()) else None

    return await until(settled, timeout=10, interval=0.02, what=f"streams holding {at_least}")


async def stored_outcomes(nc) -> list:
    return [outcome_decoder.decode(b) for b in await stream_bytes(nc, "PGW_OUTBOUND")]


async def drained_counts(nc) -> dict[str, int]:
    """Stored message counts once the gateway has acked every envelope stored so far. An envelope
    is acked only after everything it caused is stored, so nothing it would still store is missed
    (the gateway takes a batch of envelopes at once, so one sent last may be finished first)."""
    await until_drained(nc.jetstream(), "PGW_INBOUND", DURABLE, timeout=10, interval=0.02,
                        what="the gateway acking every envelope")
    return {s: await stream_count(nc, s) for s in STREAMS}


async def test_replay_under_a_new_envelope_id_gets_the_cached_outcome_once(nats_server, tmp_path, nc):
    """A re-emission with a seen correlationId and the same type, under a new envelopeId, gets the cached outcome
    addressed to its own envelopeId and flagged as a replay (issue 15 point 4); no new item or verdict; the same
    re-emission stored again (another Nats-Msg-Id) adds nothing."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        first = moment_env("alice", good_moment(), correlation_id="run1:node1:0")
        o1 = await rec.roundtrip("planner", first)
        assert o1.status == "accepted"
        await rec.item(lambda i: isinstance(i, BindingMomentItem))
        await rec.verdict(lambda v: v.verdict_class == "hitl_dispatched")
        before = await counts(nc, {"PGW_OUTBOUND": 1, "PGW_SURFACE": 1, "PGW_VERDICTS": 1})
        assert await dedup.cached_outcome_exists(nc.jetstream(), "planner", "run1:node1:0")
        again = moment_env("alice", good_moment(), correlation_id="run1:node1:0")
        replay = await rec.roundtrip("planner", again)
        assert replay.replayed and replay.status == "accepted"
        assert replay.moment_id == o1.moment_id and replay.envelope_id == again["envelopeId"] != o1.envelope_id
        await rec.send("planner", again, msg_id=f"planner:{again['envelopeId']}:retry")  # stored a second time
        after = await drained_counts(nc)
        assert after == {**before, "PGW_OUTBOUND": before["PGW_OUTBOUND"] + 1}  # one outcome for the new envelope
        assert len([v for v in rec.verdicts if v.verdict_class == "hitl_dispatched"]) == 1
        stored = [o for o in await stored_outcomes(nc) if getattr(o, "envelope_id", None) == again["envelopeId"]]
        assert len(stored) == 1 and stored[0].replayed


async def test_other_type_is_correlation_conflict(nats_server, tmp_path, nc):
    """A seen correlationId with another type is refused with envelope_correlation_conflict."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        o1 = await rec.roundtrip("planner", env("error", {"code": "a", "message": "b"}, correlation_id="c-1"))
        assert o1.status == "accepted"
        o2 = await rec.roundtrip("planner", env("schema.response", {"envelopeType": "error", "ack": True}, correlation_id="c-1"))
        assert (o2.status, o2.code) == ("invalid", "envelope_correlation_conflict")
        other_agent = await rec.roundtrip("writer", env("schema.response", {"envelopeType": "error", "ack": True}, correlation_id="c-1"))
        assert other_agent.status == "accepted"  # the cache is per agent


async def test_refusal_after_dedup_releases_the_correlation_id(nats_server, tmp_path, nc):
    """A refusal after the dedup stage (principal_not_bound) is not cached: a corrected re-emission is processed."""
    agents = {"planner": {"principals": ["alice"]}}
    async with running_gateway(nats_server, str(tmp_path / "d"), agents=agents), Recorder(nc) as rec:
        o1 = await rec.roundtrip("planner", moment_env("bob", good_moment(), correlation_id="c-9"))
        assert o1.code == "principal_not_bound"
        o2 = await rec.roundtrip("planner", moment_env("alice", good_moment(), correlation_id="c-9"))
        assert o2.status == "accepted" and not o2.replayed


async def test_dedup_survives_gateway_restart(nats_server, tmp_path, nc):
    """After the gateway restarts, a re-emission still gets the cached outcome, addressed to it, and nothing else new."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        o1 = await rec.roundtrip("planner", moment_env("alice", good_moment(), correlation_id="r-1"))
        assert o1.status == "accepted"
        await rec.verdict(lambda v: v.verdict_class == "hitl_dispatched")
    before = await counts(nc, {"PGW_OUTBOUND": 1, "PGW_SURFACE": 1, "PGW_VERDICTS": 1})
    async with running_gateway(nats_server, str(tmp_path / "d2")), Recorder(nc) as rec:
        again = moment_env("alice", good_moment(), correlation_id="r-1")
        out = await rec.roundtrip("planner", again)
        assert out.replayed and out.moment_id == o1.moment_id
        after = await drained_counts(nc)
        assert after == {**before, "PGW_OUTBOUND": before["PGW_OUTBOUND"] + 1}


async def test_two_instances_race_one_outcome(nats_server, tmp_path, nc):
    """Two gateway instances racing on one correlationId dispatch one moment: one item, one dispatch verdict."""
    async with (
        running_gateway(nats_server, str(tmp_path / "a"), gateway={"batch": 1}),
        running_gateway(nats_server, str(tmp_path / "b"), gateway={"batch": 1}),
        Recorder(nc) as rec,
    ):
        envs = [moment_env("alice", good_moment(), correlation_id="race-1") for _ in range(6)]
        await asyncio.gather(*(rec.send("planner", e) for e in envs))
        def answered() -> list[EnvelopeOutcome] | None:
            o = [o for o in rec.outcomes if isinstance(o, EnvelopeOutcome)]
            return o if len(o) >= 6 else None

        outs = await rec.until(answered, timeout=30)
        assert all(o.status == "accepted" for o in outs)
        moment_ids = {o.moment_id for o in outs}
        assert len(moment_ids) == 1
        assert (await counts(nc, {"PGW_SURFACE": 1}))["PGW_SURFACE"] == 1
        verdicts = [v for v in rec.verdicts if v.verdict_class == "hitl_dispatched"]
        assert len(verdicts) == 1


async def test_own_redelivery_after_a_lost_outcome_publishes_it_unflagged(nats_server, tmp_path, nc):
    """The outcome and the correlationId record are stored together. When the outcome's publish fails but the
    record was stored, the redelivered message publishes the cached outcome, once, not marked as a replay."""
    async with running_gateway(nats_server, str(tmp_path / "d")) as gw, Recorder(nc) as rec:
        real = gw.publisher.outcome
        failed: list[str] = []

        async def outcome(o, msg_id, body=None):
            if not failed:
                failed.append(msg_id)
                raise RuntimeError("outcome publish lost")
            return await real(o, msg_id, body)

        gw.publisher.outcome = outcome
        first = moment_env("alice", good_moment(), correlation_id="lost-1")
        await rec.send("planner", first)
        out = await rec.outcome(first["envelopeId"])
        assert failed and out.status == "accepted" and not out.replayed
        await rec.item(lambda i: isinstance(i, BindingMomentItem))
        assert await drained_counts(nc) == {"PGW_OUTBOUND": 1, "PGW_SURFACE": 1, "PGW_VERDICTS": 1}


async def _stale_claim_rig(nc):
    """The gateway's durable on PGW_INBOUND holding two messages (the first acked, the second delivered and
    unacked), their stream positions, and a stage context whose state is the one a gateway builds."""
    import types

    from nats.js.api import AckPolicy, ConsumerConfig

    from gateway.stages.state import StageStateCell
    from pgwcore.config import Config

    js = nc.jetstream()
    sub = await js.pull_subscribe("pgw.agent.*.envelope", durable=DURABLE, stream="PGW_INBOUND",
                                  config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30))
    seqs = [(await js.publish("pgw.agent.held.envelope", b"{}")).seq for _ in range(2)]
    first, _second = await sub.fetch(2, timeout=5)
    await first.ack_sync()
    config = Config()
    host = types.SimpleNamespace(js=js, config=config, kinds={}, desk=types.SimpleNamespace())
    state = await StageStateCell(host).get()
    return seqs, types.SimpleNamespace(gw=host, state=state), config.gateway


def _claim(owner: str, age: float) -> dedup.DedupRecord:
    return dedup.DedupRecord("t", owner, time.time() - age)


async def test_a_stale_claim_is_taken_over_only_once_its_owners_message_cannot_come_back(nc):
    """Another envelope may take over a stale correlationId claim only when the owner's message is acked (or
    terminated) or the claim is older than twice the ack wait (the owner's redelivery would have renewed it);
    while the owner's message can still be redelivered, finishing what it began, the
    claim is left to it (else the correlationId would get a second moment beside a half-published first)."""
    seqs, ctx, gateway = await _stale_claim_rig(nc)
    stale = gateway.ack_wait_s + 1
    assert await dedup._owner_may_return(ctx, _claim(f"{seqs[1]}:0", stale))  # delivered, not acked
    assert not await dedup._owner_may_return(ctx, _claim(f"{seqs[0]}:0", stale))  # acked
    past_last = 2 * gateway.ack_wait_s + 1
    assert not await dedup._owner_may_return(ctx, _claim(f"{seqs[1]}:0", past_last))
    assert not await dedup._owner_may_return(ctx, _claim("not-a-position", stale))


async def test_envelopes_waiting_on_stale_claims_share_one_read_of_the_ack_floor(nc):
    """Many envelopes of one gateway waiting on stale claims at once ask the server for the durable's ack floor
    once between them, not once each, and every one still gets the rule's answer for its own claim."""
    seqs, ctx, gateway = await _stale_claim_rig(nc)
    js = ctx.gw.js
    asked: list[tuple[str, str]] = []
    real = js.consumer_info

    async def consumer_info(stream, consumer, *args, **kwargs):
        asked.append((stream, consumer))
        return await real(stream, consumer, *args, **kwargs)

    js.consumer_info = consumer_info
    stale = gateway.ack_wait_s + 1
    owners = [f"{seqs[i % 2]}:{i}" for i in range(16)]  # half unacked (may return), half acked
    answers = await asyncio.gather(*(dedup._owner_may_return(ctx, _claim(o, stale)) for o in owners))
    assert answers == [o.startswith(f"{seqs[1]}:") for o in owners]
    assert asked == [("PGW_INBOUND", DURABLE)]


async def test_a_failed_ack_floor_read_is_not_kept_and_a_kept_one_expires(nc):
    """A failed read of the ack floor makes every envelope sharing it wait (as an unreadable consumer always
    did) and is not remembered: the next poll asks the server again; a reading is reused only for its bound."""
    seqs, ctx, gateway = await _stale_claim_rig(nc)
    js = ctx.gw.js
    asked: list[str] = []
    real = js.consumer_info

    async def consumer_info(stream, consumer, *args, **kwargs):
        asked.append(consumer)
        if len(asked) == 1:
            raise TimeoutError("no answer from the server")
        return await real(stream, consumer, *args, **kwargs)

    js.consumer_info = consumer_info
    acked = _claim(f"{seqs[0]}:0", gateway.ack_wait_s + 1)
    assert await asyncio.gather(*(dedup._owner_may_return(ctx, acked) for _ in range(4))) == [True] * 4
    assert len(asked) == 1  # the four shared the failed read
    assert not await dedup._owner_may_return(ctx, acked)  # asked again, and the floor is past the owner
    assert len(asked) == 2
    floor = dedup.AckFloor(js, max_age=0.0)  # nothing is kept: every call asks
    assert await floor.get() == await floor.get() == seqs[0]
    assert len(asked) == 4
