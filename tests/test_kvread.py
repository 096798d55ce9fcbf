"""pgwcore.kvread: get_last gives kv.get's answers (the kernel's reads); kv_keys and live_keys list a bucket's keys
without trusting nats-py's "initial values done" marker."""

from __future__ import annotations

from typing import Any

import pytest
from nats.js.errors import KeyNotFoundError

from pgwcore.kvread import get_last, kv_keys, listing, live_keys, purge_markers
from pgwcore.streams import ensure_kv


async def test_get_last_answers_as_kv_get(nc: Any) -> None:
    js = nc.jetstream()
    kv = await ensure_kv(js, "PGW_T")
    await kv.put("a.b", b"one")
    rev = await kv.put("a.b", b"two")
    await kv.put("gone", b"x")
    await kv.delete("gone")
    await kv.put("purged", b"x")
    await kv.purge("purged")

    assert await get_last(nc, js._prefix, "PGW_T", "a.b", 5) == (b"two", rev)
    e = await kv.get("a.b")
    assert (e.value, e.revision) == (b"two", rev)
    for key in ("gone", "purged", "never"):
        assert await get_last(nc, js._prefix, "PGW_T", key, 5) is None
        with pytest.raises(KeyNotFoundError):
            await kv.get(key)
    # A delete marker, then a new value: the value again.
    rev2 = await kv.create("gone", b"back")
    assert await get_last(nc, js._prefix, "PGW_T", "gone", 5) == (b"back", rev2)


async def test_batch_reader_answers_as_get_last(nc: Any) -> None:
    from pgwcore.kvread import BatchReader, enable_direct

    js = nc.jetstream()
    kv = await ensure_kv(js, "PGW_T")
    assert await enable_direct(js, "PGW_T")
    r1 = await kv.put("a.b", b"one")
    await kv.put("gone", b"x")
    await kv.delete("gone")
    r2 = await kv.put("c", b"two")
    reader = BatchReader(nc, js._prefix, "PGW_T", 5)
    await reader.start()
    try:
        keys = ["a.b", "gone", "never", "c"]
        assert await reader.get_many(keys) == [(b"one", r1), None, None, (b"two", r2)]
        assert await reader.get_many(keys) == [await get_last(nc, js._prefix, "PGW_T", k, 5) for k in keys]
        assert await reader.get_many(["never", "gone"]) == [None, None]  # the server's 404: no results
    finally:
        await reader.close()


async def test_batch_reader_times_out_and_forgets_a_read_nobody_answers(nc: Any) -> None:
    """A batched read whose answer never comes fails with nats' TimeoutError after the reader's timeout, and a read
    that is cancelled is cancelled; neither is left pending."""
    import asyncio

    import nats.errors

    from pgwcore.kvread import BatchReader, enable_direct

    js = nc.jetstream()
    await ensure_kv(js, "PGW_T")
    assert await enable_direct(js, "PGW_T")
    reader = BatchReader(nc, js._prefix, "PGW_T", 0.3)

    answered = asyncio.Event()

    def deaf(_token: str, _msg: Any) -> None:  # the answers are dropped, as if lost
        answered.set()

    reader._replies._handle = deaf
    await reader.start()
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await reader.get_many(["a"])
        answered.clear()
        task = asyncio.ensure_future(reader.get_many(["a"]))
        await answered.wait()  # sent, answered (and dropped): the read is waiting
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert reader._pending == {}
    finally:
        await reader.close()


async def test_key_listings_see_every_key_just_written_and_live_keys_skip_markers(nc: Any) -> None:
    """kv_keys lists every key with an entry (a marker included) from the server's subject index, live_keys only
    those whose last entry is a value; both see a key written just before they are asked, every time (a
    listing read through nats-py's watcher missed one now and then under load: its "done" marker came first)."""
    js = nc.jetstream()
    assert await kv_keys(js, "PGW_KEYS_ABSENT") == []
    kv = await ensure_kv(js, "PGW_KEYS_T")
    assert await kv_keys(js, "PGW_KEYS_T") == [] and await live_keys(js, kv, "PGW_KEYS_T") == []
    await kv.put("a.one", b"1")
    await kv.put("a.two", b"2")
    await kv.put("b.one", b"3")
    await kv.put("a.gone", b"x")
    await kv.delete("a.gone")
    await kv.put("a.purged", b"x")
    await kv.purge("a.purged")
    assert sorted(await kv_keys(js, "PGW_KEYS_T", "a.*")) == ["a.gone", "a.one", "a.purged", "a.two"]
    assert sorted(await live_keys(js, kv, "PGW_KEYS_T", "a.*")) == ["a.one", "a.two"]
    assert sorted(await live_keys(js, kv, "PGW_KEYS_T")) == ["a.one", "a.two", "b.one"]
    for i in range(100):  # the watcher missed 8 of 300 such listings on a quiet host
        await kv.put(f"c.k{i}", b"v")
        assert f"c.k{i}" in await kv_keys(js, "PGW_KEYS_T", "c.*")
        assert len(await live_keys(js, kv, "PGW_KEYS_T", "c.*")) == i + 1


async def test_old_markers_are_purged_and_a_value_written_after_the_listing_stays(nc: Any) -> None:
    """listing names each key whose last entry is a delete or purge marker, with the marker's sequence and time;
    purge_markers removes those stored before the cut-off (a key's subject up to its marker), oldest first and no
    more than asked, and a value written to a marked key after the listing stays."""
    js = nc.jetstream()
    kv = await ensure_kv(js, "PGW_MARKS_T")
    await kv.put("live", b"v")
    for k in ("d1", "d2", "d3"):
        await kv.put(k, b"x")
        await kv.delete(k)
    await kv.put("p1", b"x")
    await kv.purge("p1")
    live, markers = await listing(js, kv, "PGW_MARKS_T")
    assert live == ["live"] and sorted(m.key for m in markers) == ["d1", "d2", "d3", "p1"]
    info = await js.stream_info("KV_PGW_MARKS_T")
    assert all(0 < m.seq <= info.state.last_seq and m.at > 0 for m in markers)
    assert await purge_markers(js, "PGW_MARKS_T", markers, older_than=min(m.at for m in markers)) == 0  # none older
    rev = await kv.create("d2", b"back")  # written after the listing, over d2's marker
    far = max(m.at for m in markers) + 1
    assert await purge_markers(js, "PGW_MARKS_T", markers, older_than=far, most=2) == 2  # the two oldest: d1, d2
    assert sorted(await kv_keys(js, "PGW_MARKS_T")) == ["d2", "d3", "live", "p1"]
    assert (await kv.get("d2")).revision == rev  # d2's new value stayed
    assert await purge_markers(js, "PGW_MARKS_T", markers, older_than=far) == 4  # d2's purge again takes nothing
    assert sorted(await kv_keys(js, "PGW_MARKS_T")) == ["d2", "live"]
    live, markers = await listing(js, kv, "PGW_MARKS_T")
    assert sorted(live) == ["d2", "live"] and markers == []
