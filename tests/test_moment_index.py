"""The agents' index of their moments (gateway.moment_list) costs no write of its own: it is derived from the
moment records' writes that every desk already follows, and answers as the old written index did, on every
instance, after a restart, and for moments stored by the previous version (its index bucket still read)."""

from __future__ import annotations

import time

import msgspec
import pytest
from nats.js.errors import NotFoundError

from gateway.moment_list import INDEX_BUCKET, index_key, list_moments
from gateway.moment_record import STATE_HEADER, MomentRecord, moment_key
from gateway.moments import BUCKET, MomentDesk
from pgwcore.connect import connect
from pgwcore.publish import Publisher
from subjects.client import Agent, Surface
from subjects.util import stable_id
from subjects.wire import FreeTextAnswer
from tests.moments import good_moment


async def _desk(gateway, url: str):
    """Another instance's moment desk, on its own connection, following the same bucket."""
    conn = await connect(url, name="second-desk")
    desk = MomentDesk(conn.jetstream(), gateway.subjects, Publisher(conn.jetstream(), gateway.subjects))
    await desk.start()
    return conn, desk


async def _listing(desk, which="all", **kw):
    moments, more = await list_moments(desk, "planner", which, **kw)
    return [(m.moment_id, m.principal, m.status) for m in moments], more


async def _index_messages(js) -> int:
    try:
        return (await js.stream_info(f"KV_{INDEX_BUCKET}")).state.messages
    except NotFoundError:
        return 0


async def test_the_list_is_derived_without_an_index_write_and_is_the_same_on_every_instance_and_after_a_restart(
        gateway, nc, nats_server):
    """Three moments (one answered): nothing is written to the old index bucket, and the gateway, a second desk
    started before them and a desk started after them (a restart) list the same moments in the same order,
    the newest listed by the second desk right after its outcome was read."""
    js = nc.jetstream()
    planner, surface = Agent(nc, "planner"), Surface(nc, "alice")
    conn, second = await _desk(gateway, nats_server.client_url)
    try:
        mids = []
        for i in range(3):
            moment = good_moment()
            moment["synopsis"] = f"moment number {i}: {moment['synopsis']}"
            eid = await planner.send_moment("alice" if i != 1 else "bob", moment)
            mid = (await planner.outcome_for(eid, timeout=20)).moment_id
            assert mid
            mids.append(mid)
            # Read-your-writes on another instance: the outcome was read, so the moment is listed.
            assert (await _listing(second))[0][0][0] == mid
        assert (await surface.resolve(mids[0], FreeTextAnswer(text="the first one"))).status == "accepted"
        await planner.final_outcome(mids[0], timeout=20)

        expected = ([(mids[2], "alice", "pending"), (mids[1], "bob", "pending"), (mids[0], "alice", "resolved")], False)
        assert await _listing(gateway.desk) == expected
        assert await _listing(second) == expected
        assert await _listing(second, "open", principal="alice") == ([(mids[2], "alice", "pending")], False)
        assert await _listing(second, "all", limit=1) == ([(mids[2], "alice", "pending")], True)
        assert (await list_moments(second, "intruder", "all")) == ([], False)
        assert await _index_messages(js) == 0  # the dedicated write is gone

        conn2, restarted = await _desk(gateway, nats_server.client_url)
        try:
            assert await _listing(restarted) == expected
        finally:
            await restarted.close()
            await conn2.drain()
    finally:
        await planner.close()
        await second.close()
        await conn.drain()


async def test_a_moment_stored_by_the_previous_version_is_still_listed(gateway, nc, nats_server):
    """A moment record written the old way (``Pgw-Moment-State`` only, its agent in an entry of the old index
    bucket ``PGW_AGENT_MOMENTS``) is listed by the gateway and by a restarted desk, beside a new one, newest first."""
    js = nc.jetstream()
    planner = Agent(nc, "planner")
    try:
        eid = await planner.send_moment("alice", good_moment())
        new_mid = (await planner.outcome_for(eid, timeout=20)).moment_id
        assert new_mid
        kv = await js.key_value(BUCKET)
        rec = msgspec.json.decode((await kv.get(moment_key("alice", new_mid))).value, type=MomentRecord)
        # The same moment as the previous version would have stored it, a minute earlier, under another id.
        old_mid = stable_id("moment", "planner", "an-envelope-of-the-previous-version")
        rec.moment_id, rec.envelope_id, rec.created_at = old_mid, "an-envelope-of-the-previous-version", time.time() - 60
        rec.item.moment_id = old_mid
        await js.publish(f"$KV.{BUCKET}.{moment_key('alice', old_mid)}", msgspec.json.encode(rec),
                         headers={STATE_HEADER: "pending;;1"})
        index = await js.key_value(INDEX_BUCKET)
        await index.create(index_key(rec), str(rec.created_at).encode())

        expected = ([(new_mid, "alice", "pending"), (old_mid, "alice", "pending")], False)
        assert await _listing(gateway.desk) == expected
        conn, restarted = await _desk(gateway, nats_server.client_url)
        try:
            assert await _listing(restarted) == expected
            assert await _listing(restarted, "open", principal="alice") == expected
        finally:
            await restarted.close()
            await conn.drain()
    finally:
        await planner.close()


class _KilledAfterTheRecord(Publisher):
    """A publisher whose process dies (here: raises) at the first surface item or verdict: the moment record is
    stored, nothing after it, as a kill -9 between the record and the old index write would leave it."""

    async def surface(self, item, msg_id):
        raise RuntimeError("killed")

    async def verdict(self, verdict):
        raise RuntimeError("killed")


async def test_a_moment_stored_when_its_instance_dies_is_listed_once_and_stays_once_after_the_redelivery(
        gateway, nc, nats_server):
    """An instance dies right after storing a moment record: another instance lists it at once (no index write
    was lost, there is none), and the redelivered dispatch, completed by a restarted desk, leaves it listed once."""
    from subjects.wire import BindingMoment

    moment = msgspec.convert(good_moment(), BindingMoment)
    kw = dict(agent="planner", principal="alice", binding_moment=moment, envelope_id="e-killed", correlation_id="c-killed")
    conn, dying = await _desk(gateway, nats_server.client_url)
    dying.publisher = _KilledAfterTheRecord(conn.jetstream(), gateway.subjects)
    try:
        try:
            await dying.dispatch(**kw)
        except RuntimeError:
            pass
        else:
            raise AssertionError("the dispatch should have died after the record")
    finally:
        await dying.close()
        await conn.drain()
    mid = stable_id("moment", "planner", "e-killed")
    assert await _listing(gateway.desk) == ([(mid, "alice", "pending")], False)
    conn2, restarted = await _desk(gateway, nats_server.client_url)
    try:
        assert await restarted.dispatch(**kw) == mid  # the redelivery: same moment, its item and verdict now
        assert await _listing(restarted) == ([(mid, "alice", "pending")], False)
        assert await _listing(gateway.desk) == ([(mid, "alice", "pending")], False)
        assert [i.moment_id for i in await restarted.pending("alice")] == [mid]
    finally:
        await restarted.close()
        await conn2.drain()


async def test_a_desk_that_cannot_follow_the_bucket_refuses_to_list_rather_than_answer_short(gateway, nc, nats_server):
    """A desk whose watcher stopped following PGW_MOMENTS does not list from a stale index: the list query fails
    (the gateway answers it with engine_failure) once it has waited its bounded time for the moment just stored."""
    planner = Agent(nc, "planner")
    conn, stalled = await _desk(gateway, nats_server.client_url)
    try:
        await stalled._watcher.unsubscribe()
        eid = await planner.send_moment("alice", good_moment())
        assert (await planner.outcome_for(eid, timeout=20)).moment_id
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await list_moments(stalled, "planner", "all")
        assert time.monotonic() - started < 4.5  # below the agent's 5 s request timeout
    finally:
        await planner.close()
        stalled._watcher = None
        await stalled.close()
        await conn.drain()
