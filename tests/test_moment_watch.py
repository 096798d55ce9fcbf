"""The moment desk follows every record of PGW_MOMENTS, whoever wrote it (DESIGN §6).

A record written by another instance (or before this one started) is
expired here when its time comes, and a terminal record whose outcome was
never published (its writer died in between) is re-driven here.
"""

from __future__ import annotations

import time

import msgspec

from gateway.moment_record import MomentRecord
from gateway.moments import BUCKET
from subjects.wire import MomentExpired, WithdrawnItem
from tests.moments import good_moment
from tests.pipeline_helpers import Recorder, moment_env, running_gateway
from tests.polling import until

_dec = msgspec.json.Decoder(MomentRecord)


async def _record(nc, principal: str, moment_id: str) -> tuple[MomentRecord, int]:
    kv = await nc.jetstream().key_value(BUCKET)
    entry = await kv.get(f"{principal}.{moment_id}")
    return _dec.decode(entry.value), entry.revision


async def _published(nc, principal: str, moment_id: str) -> bool:
    """The record says its outcome went out (stored just after the publishes)."""

    async def probe() -> bool:
        rec, _ = await _record(nc, principal, moment_id)
        return rec.published

    return await until(probe, timeout=10, what="the record marked published")


async def _put(nc, rec: MomentRecord) -> None:
    kv = await nc.jetstream().key_value(BUCKET)
    await kv.put(f"{rec.principal}.{rec.moment_id}", msgspec.json.encode(rec))


async def test_a_record_rewritten_elsewhere_expires_here(nats_server, tmp_path, nc):
    """Another instance shortens a pending moment's expiry: this one sees the write and expires it."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        out = await rec.roundtrip("planner", moment_env("alice", good_moment(), expires_in_s=3600))
        record, _ = await _record(nc, "alice", out.moment_id)
        record.expires_at = time.time() + 0.5
        await _put(nc, record)
        w = await rec.item(lambda i: isinstance(i, WithdrawnItem) and i.moment_id == out.moment_id, timeout=15)
        assert w.reason == "expired"
        assert await _published(nc, "alice", out.moment_id)
        after, _ = await _record(nc, "alice", out.moment_id)
        assert after.status == "expired"


async def test_records_stored_before_start_are_followed(nats_server, tmp_path, nc):
    """A pending record left by a stopped instance is expired by the next one to start."""
    async with running_gateway(nats_server, str(tmp_path / "a")), Recorder(nc) as rec:
        out = await rec.roundtrip("planner", moment_env("alice", good_moment(), expires_in_s=3600))
    record, _ = await _record(nc, "alice", out.moment_id)
    record.expires_at = time.time() + 0.5
    await _put(nc, record)  # written while no gateway runs
    async with Recorder(nc) as rec, running_gateway(nats_server, str(tmp_path / "b")):
        w = await rec.item(lambda i: isinstance(i, WithdrawnItem) and i.moment_id == out.moment_id, timeout=15)
        assert w.reason == "expired"


async def test_an_unpublished_terminal_record_is_re_driven(nats_server, tmp_path, nc):
    """A writer died after storing 'expired' but before publishing it: the desk publishes it, once."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        out = await rec.roundtrip("planner", moment_env("alice", good_moment(), expires_in_s=3600))
        record, _ = await _record(nc, "alice", out.moment_id)
        record.status, record.published, record.resolved_at = "expired", False, time.time()
        await _put(nc, record)
        await rec.until(lambda: next((o for o in rec.outcomes if isinstance(o, MomentExpired)
                                      and o.moment_id == out.moment_id), None), timeout=15)
        await rec.item(lambda i: isinstance(i, WithdrawnItem) and i.moment_id == out.moment_id, timeout=15)
        assert await _published(nc, "alice", out.moment_id)
        assert sum(isinstance(o, MomentExpired) and o.moment_id == out.moment_id for o in rec.outcomes) == 1
