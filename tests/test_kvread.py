"""pgwcore.kvread.get_last gives kv.get's answers (issue 18: the kernel's reads)."""

from __future__ import annotations

from typing import Any

import pytest
from nats.js.errors import KeyNotFoundError

from pgwcore.kvread import get_last
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
