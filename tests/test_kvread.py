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
