"""Every verdict is counted once, by the publisher, whoever publishes it."""

from __future__ import annotations

import asyncio
import copy

import pytest
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from pgwcore import metrics
from pgwcore.publish import ATOMIC_MIN, MAX_INFLIGHT, KvWriter, Publisher, kv_delete
from pgwcore.streams import ensure_kv, ensure_streams, stream_plans
from subjects.names import Subjects
from subjects.util import now_rfc3339, stable_id
from subjects.wire import Verdict
from tests.stored import stored_msgs


def count(verdict_class: str) -> float:
    return metrics.REGISTRY.get_sample_value("pgw_verdicts_total", {"verdict_class": verdict_class}) or 0.0


async def test_verdict_counted_once_even_when_republished(nc):
    """A verdict published twice (a redelivery) is stored and counted once."""
    pub = Publisher(nc.jetstream(), Subjects())
    v = Verdict(
        verdict_id=stable_id("count-test"), verdict_class="blocked", decision="reject", approver="policy",
        human_disposed=False, ts=now_rfc3339(), agent="a", action_type="pgw.envelope", action_id="x",
    )
    before = count("blocked")
    await pub.verdict(v)
    await pub.verdict(v)
    assert count("blocked") == before + 1
    info = await nc.jetstream().stream_info("PGW_VERDICTS")
    assert info.state.messages == 1


def _verdicts(n: int, tag: str) -> list[Verdict]:
    return [
        Verdict(
            verdict_id=stable_id(tag, str(i)), verdict_class="blocked", decision="reject", approver="policy",
            human_disposed=False, ts=now_rfc3339(), agent="a", action_type="pgw.envelope", action_id=str(i),
        )
        for i in range(n)
    ]


async def _batches(pub: Publisher) -> list[int]:
    """Spy on the publisher's atomic batches of verdicts: the sizes it sends."""
    sizes: list[int] = []
    gc = pub._streams["PGW_VERDICTS"]
    send = gc._batch

    async def spy(batch):
        sizes.append(len(batch))
        await send(batch)

    gc._batch = spy  # type: ignore[method-assign]
    return sizes


async def test_concurrent_publishes_go_as_atomic_batches_and_each_is_stored_once(nc):
    """Verdicts published concurrently are grouped into atomic batches; republishing them all
    (a redelivery: every Msg-Id already stored) stores and counts nothing twice."""
    pub = Publisher(nc.jetstream(), Subjects())
    sizes = await _batches(pub)
    vs = _verdicts(120, "batch-test")
    before = count("blocked")
    await asyncio.gather(*(pub.verdict(v) for v in vs))
    assert sizes and max(sizes) > 1  # grouped, not one request per message
    assert count("blocked") == before + 120
    await asyncio.gather(*(pub.verdict(v) for v in vs))  # the batch is refused as a whole: one by one
    assert count("blocked") == before + 120
    info = await nc.jetstream().stream_info("PGW_VERDICTS")
    assert info.state.messages == 120
    stored = {m.headers["Nats-Msg-Id"] for m in await stored_msgs(nc, "PGW_VERDICTS")}
    assert stored == {v.verdict_id for v in vs}


async def test_a_short_queue_goes_as_plain_writes_not_a_batch(nc):
    """Fewer than ATOMIC_MIN writes waiting behind the ones in flight go out as plain writes, all at
    once (an atomic batch has a fixed price of several plain writes); each is stored once."""
    pub = Publisher(nc.jetstream(), Subjects())
    sizes = await _batches(pub)
    n = MAX_INFLIGHT + ATOMIC_MIN - 1  # in flight at once, then a queue one short of a batch
    vs = _verdicts(n, "short-queue")
    await asyncio.gather(*(pub.verdict(v) for v in vs))
    assert sizes == []
    stored = {m.headers["Nats-Msg-Id"] for m in await stored_msgs(nc, "PGW_VERDICTS")}
    assert stored == {v.verdict_id for v in vs}
    assert not any("Nats-Batch-Id" in (m.headers or {}) for m in await stored_msgs(nc, "PGW_VERDICTS"))


async def test_stream_without_allow_atomic_gets_plain_publishes_then_the_flag(nc):
    """A stream created before allow_atomic was planned still takes every message (one by one);
    ensure_streams then adds the flag as an update, keeping the stream and its messages."""
    js = nc.jetstream()
    await js.delete_stream("PGW_VERDICTS")  # the fixture made it with the flag: make it as before
    plan = next(p for p in stream_plans(Subjects()) if p.name == "PGW_VERDICTS")
    old = copy.copy(plan.config)
    old.allow_atomic = None
    await js.add_stream(old)
    pub = Publisher(js, Subjects())
    sizes = await _batches(pub)
    await asyncio.gather(*(pub.verdict(v) for v in _verdicts(40, "plain-test")))
    assert sizes == []
    assert (await js.stream_info("PGW_VERDICTS")).state.messages == 40
    assert (await ensure_streams(js, Subjects()))["PGW_VERDICTS"] == "exists"
    info = await js.stream_info("PGW_VERDICTS")
    assert info.config.allow_atomic and info.state.messages == 40


async def test_kv_writes_grouped_keep_compare_and_set(nc):
    """KV creates and updates issued together go out as atomic batches, return the revision the
    bucket stored, and keep compare-and-set: a create of an existing key and the second of two
    updates from one revision fail alone, whatever else was in flight with them."""
    js = nc.jetstream()
    kv = await ensure_kv(js, "PGW_TEST_GROUPED", atomic=True)
    writer = KvWriter(js, kv, "PGW_TEST_GROUPED")
    sizes: list[int] = []
    send = writer._gc._batch

    async def spy(batch):
        sizes.append(len(batch))
        await send(batch)

    writer._gc._batch = spy  # type: ignore[method-assign]
    revs = await asyncio.gather(*(writer.create(f"k{i}", b"v") for i in range(50)))
    assert sizes and max(sizes) > 1
    assert revs == [(await kv.get(f"k{i}")).revision for i in range(50)]
    results = await asyncio.gather(
        *(writer.create(f"n{i}", b"v") for i in range(20)),
        writer.create("k3", b"again"),
        writer.update("k4", b"first", last=revs[4]),
        writer.update("k4", b"second", last=revs[4]),
        return_exceptions=True,
    )
    assert all(isinstance(r, int) for r in results[:20])
    assert isinstance(results[20], KeyWrongLastSequenceError)
    assert [isinstance(r, KeyWrongLastSequenceError) for r in results[21:]].count(True) == 1
    assert (await kv.get("k3")).value == b"v"
    assert (await kv.get("k4")).value in (b"first", b"second")


async def test_kv_writer_one_at_a_time_answers_as_nats_kv(nc):
    """Plain (unbatched) KV writes: the bucket's revision; a create over a deleted key succeeds, as nats'
    create does; a create of a live key and an update from a stale revision raise KeyWrongLastSequenceError."""
    js = nc.jetstream()
    kv = await ensure_kv(js, "PGW_TEST_PLAIN")
    writer = KvWriter(js, kv, "PGW_TEST_PLAIN")
    r1 = await writer.create("a", b"1")
    assert r1 == (await kv.get("a")).revision
    r2 = await writer.update("a", b"2", last=r1)
    assert (await kv.get("a")).value == b"2" and r2 > r1
    for bad in (writer.create("a", b"x"), writer.update("a", b"x", last=r1)):
        try:
            await bad
        except KeyWrongLastSequenceError:
            continue
        raise AssertionError("a stale compare-and-set was stored")
    await kv.delete("a")
    r3 = await writer.create("a", b"3")
    assert (await kv.get("a")).value == b"3" and r3 == (await kv.get("a")).revision


async def test_kv_delete_writes_the_marker_nats_kv_delete_writes(nc):
    """kv_delete leaves what KeyValue.delete leaves: the same stored marker, a read that finds no key, a watcher's DEL."""
    js = nc.jetstream()
    kv = await js.create_key_value(bucket="PUBT_DEL", history=2)
    await kv.put("ours", b"v")
    await kv.put("theirs", b"v")
    seq = await kv_delete(js, "PUBT_DEL", "ours")
    await kv.delete("theirs")
    ours = await js.get_msg("KV_PUBT_DEL", seq)
    theirs = await js.get_msg("KV_PUBT_DEL", subject="$KV.PUBT_DEL.theirs", direct=False)
    assert ours.subject == "$KV.PUBT_DEL.ours" and not ours.data and not theirs.data  # empty (nats-py: None)
    assert ours.headers == theirs.headers == {"KV-Operation": "DEL"}
    for key in ("ours", "theirs"):
        with pytest.raises(KeyNotFoundError):
            await kv.get(key)
    entry = await (await kv.watch("ours", include_history=False)).updates(timeout=2)
    assert entry is not None and entry.operation == "DEL"
