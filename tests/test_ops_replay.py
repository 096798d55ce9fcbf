"""``pgw replay`` (issue 8 "Ops"): re-drive a stream range by subject, sequence or time."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest
from nats.js.api import StreamConfig

from consumers.replay import REPLAY_HEADER, Replayer, ReplayError, ReplayRange, read_range
from subjects.names import Subjects

S = Subjects("pgw")


def _env(i: int, corr: str | None = None) -> bytes:
    return json.dumps({
        "type": "error", "envelopeId": f"e{i}", "correlationId": corr or f"c{i}",
        "payload": {"code": "x", "message": "m"},
        "meta": {"source": "ai-generation", "ts": "2026-01-01T00:00:00Z"},
    }).encode()


async def _fill(nc, n: int = 5, agent: str = "bot") -> None:
    js = nc.jetstream()
    for i in range(1, n + 1):
        await js.publish(S.envelope(agent), _env(i), headers={"Nats-Msg-Id": f"{agent}:e{i}"})


async def _gather(nc, subject: str, want: int) -> tuple[list, object]:
    got: list = []
    done = asyncio.get_running_loop().create_future()

    async def cb(msg) -> None:
        got.append(msg)
        if len(got) >= want and not done.done():
            done.set_result(None)

    sub = await nc.subscribe(subject, cb=cb)
    await nc.flush()
    return got, (done, sub)


async def test_sequence_range_to_a_core_subject(nc) -> None:
    """Replaying seq 2..4 to a plain subject republishes exactly those three, tagged with their origin."""
    await _fill(nc)
    got, (done, sub) = await _gather(nc, "ops.debug", 3)
    report = await Replayer(nc, S).replay(
        ReplayRange(stream="PGW_INBOUND", from_seq=2, to_seq=4), "ops.debug")
    await asyncio.wait_for(done, 5)
    await sub.unsubscribe()
    assert [a.seq for a in report.actions] == [2, 3, 4]
    assert [m.headers[REPLAY_HEADER] for m in got] == ["PGW_INBOUND:2", "PGW_INBOUND:3", "PGW_INBOUND:4"]
    assert [json.loads(m.data)["envelopeId"] for m in got] == ["e2", "e3", "e4"]


async def test_replay_into_a_stream_is_idempotent(nc) -> None:
    """Running the same replay twice into a stream stores each message once (replay Nats-Msg-Id)."""
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="OPS_COPY", subjects=["ops.copy"]))
    await _fill(nc, 4)
    r = Replayer(nc, S)
    first = await r.replay(ReplayRange(subject=S.envelope("bot")), "ops.copy")
    second = await r.replay(ReplayRange(subject=S.envelope("bot")), "ops.copy")
    assert first.counts() == {"published": 4}
    assert second.counts() == {"duplicate": 4}
    assert (await js.stream_info("OPS_COPY")).state.messages == 4


async def test_dry_run_publishes_nothing(nc) -> None:
    """A dry run lists what would be republished and leaves the target stream untouched."""
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="OPS_DRY", subjects=["ops.dry"]))
    await _fill(nc, 3)
    report = await Replayer(nc, S).replay(ReplayRange(stream="PGW_INBOUND"), "ops.dry", dry_run=True)
    assert report.counts() == {"republish": 3}
    assert all(a.target == "ops.dry" for a in report.actions)
    assert (await js.stream_info("OPS_DRY")).state.messages == 0


async def test_subject_filter_selects_one_agent(nc) -> None:
    """A subject filter replays only the matching agent's envelopes."""
    await _fill(nc, 3, agent="alpha")
    await _fill(nc, 2, agent="beta")
    report = await Replayer(nc, S).replay(ReplayRange(subject=S.envelope("beta")), "ops.x", dry_run=True)
    assert [a.subject for a in report.actions] == [S.envelope("beta")] * 2


async def test_time_range(nc) -> None:
    """--since in the future selects nothing; --since in the past with --until now selects everything."""
    await _fill(nc, 3)
    now = datetime.now(UTC)
    r = Replayer(nc, S)
    future = await r.replay(ReplayRange(stream="PGW_INBOUND", since=now + timedelta(hours=1)), "ops.x",
                            dry_run=True)
    assert future.actions == []
    past = await r.replay(ReplayRange(stream="PGW_INBOUND", since=now - timedelta(hours=1),
                                      until=now + timedelta(seconds=5)), "ops.x", dry_run=True)
    assert len(past.actions) == 3
    before = await r.replay(ReplayRange(stream="PGW_INBOUND", until=now - timedelta(hours=1)), "ops.x",
                            dry_run=True)
    assert before.actions == []


async def test_limit(nc) -> None:
    """--limit caps the number of messages re-driven."""
    await _fill(nc, 5)
    report = await Replayer(nc, S).replay(ReplayRange(stream="PGW_INBOUND", limit=2), "ops.x", dry_run=True)
    assert [a.seq for a in report.actions] == [1, 2]


@pytest.mark.parametrize("target", ["pgw.verdict.blocked", "pgw.principal.alice.surface",
                                    "pgw.agent.bot.outcome", "pgw.capsule.register", "pgw.log.X", "a.*"])
async def test_gateway_output_subjects_are_refused(nc, target: str) -> None:
    """Replaying into the gateway's own output subjects (or a wildcard) is refused."""
    await _fill(nc, 1)
    with pytest.raises(ReplayError):
        await Replayer(nc, S).replay(ReplayRange(stream="PGW_INBOUND"), target)


async def test_gateway_target_keeps_msg_id_and_is_deduplicated_by_the_stream(nc) -> None:
    """Through the gateway with the original Nats-Msg-Id inside the window: the stream drops it."""
    js = nc.jetstream()
    await _fill(nc, 2)
    report = await Replayer(nc, S).replay(ReplayRange(stream="PGW_INBOUND"), "gateway")
    assert report.counts() == {"duplicate": 2}
    assert [a.msg_id for a in report.actions] == ["bot:e1", "bot:e2"]
    assert [a.correlation_id for a in report.actions] == ["c1", "c2"]
    assert (await js.stream_info("PGW_INBOUND")).state.messages == 2


async def test_gateway_target_fresh_msg_id_reaches_the_stream_once(nc) -> None:
    """--fresh-msg-id republishes each envelope once on its inbound subject, even if run twice."""
    js = nc.jetstream()
    await _fill(nc, 2)
    r = Replayer(nc, S)
    first = await r.replay(ReplayRange(stream="PGW_INBOUND", to_seq=2), "gateway", fresh_msg_id=True)
    second = await r.replay(ReplayRange(stream="PGW_INBOUND", to_seq=2), "gateway", fresh_msg_id=True)
    assert first.counts() == {"published": 2} and second.counts() == {"duplicate": 2}
    assert first.actions[0].target == S.envelope("bot")
    assert (await js.stream_info("PGW_INBOUND")).state.messages == 4


async def test_gateway_target_skips_non_inputs(nc) -> None:
    """Through the gateway only agent envelopes/transitions are re-driven; outcomes are skipped."""
    js = nc.jetstream()
    await js.publish(S.outcome("bot"), b"{}", headers={"Nats-Msg-Id": "o1"})
    report = await Replayer(nc, S).replay(ReplayRange(stream="PGW_OUTBOUND"), "gateway")
    assert report.counts() == {"skip": 1}


async def test_unknown_stream_is_a_clear_error(nc) -> None:
    """A missing stream is a ReplayError naming it, not a traceback."""
    with pytest.raises(ReplayError, match="NOPE"):
        await Replayer(nc, S).replay(ReplayRange(stream="NOPE"), "ops.x")


async def test_a_processed_turn_that_held_a_secret_leaves_inbound_and_replays_redacted(nats_server, tmp_path, nc) -> None:
    """With a secret configured, a processed turn that held it (or a secret: token) is gone from PGW_INBOUND and
    kept redacted in PGW_INBOUND_REDACTED at its own sequence, while a clean turn stays as sent; a replay of the
    range yields all three in order at their own sequences and Nats-Msg-Ids, no secret in any, and re-driven to the
    gateway the copy is published once and adds no verdict."""
    from gateway.stages.base import INBOUND_DURABLE
    from pgwcore.streams import INBOUND_REDACTED_BUCKET
    from subjects.client import Agent
    from tests.pipeline_helpers import running_gateway
    from tests.stored import acks

    secret = "NYX-inbound-Key-7719-Quartz"
    js = nc.jetstream()
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"secrets": {"values": [secret]}}), \
            acks(nc, "PGW_INBOUND", INBOUND_DURABLE) as acked:
        agent = Agent(nc, "bot")
        try:
            bodies = [json.loads(_env(i)) for i in (1, 2, 3)]
            bodies[0]["payload"]["message"] = f"the key is {secret}"
            bodies[2]["payload"]["message"] = "the token is secret:Plover-tick-2204"
            for b in bodies:
                await agent.send(b)
                await agent.outcome_for(b["envelopeId"], timeout=10)

            await acked(3, timeout=10)  # each turn settled at rest, then acked
            assert (await js.stream_info("PGW_INBOUND")).state.messages == 1  # the two that held a secret erased
            kept = await js.get_msg("PGW_INBOUND", 2)
            assert json.loads(kept.data)["envelopeId"] == "e2"  # the clean turn, as sent
            copies = await js.stream_info(f"KV_{INBOUND_REDACTED_BUCKET}")
            assert copies.state.messages == 2
            report = await Replayer(nc, S).replay(ReplayRange(stream="PGW_INBOUND"), "gateway", dry_run=True)
            assert [(a.seq, a.subject, a.msg_id) for a in report.actions] == [
                (n, S.envelope("bot"), f"bot:e{n}") for n in (1, 2, 3)]
            read = [m async for m in read_range(nc, ReplayRange(stream="PGW_INBOUND"))]
            assert all(secret.encode() not in m.data and b"Plover-tick" not in m.data for m in read)
            assert b"the key is [REDACTED" in read[0].data
            verdicts = (await js.stream_info("PGW_VERDICTS")).state.messages
            again = await Replayer(nc, S).replay(ReplayRange(stream="PGW_INBOUND", to_seq=1), "gateway",
                                                 fresh_msg_id=True)
            assert again.counts() == {"published": 1}
            await acked(4, timeout=10)  # the gateway has taken and acked the replayed turn
            assert (await js.stream_info("PGW_VERDICTS")).state.messages == verdicts
        finally:
            await agent.close()
