"""The agent's moment query (``agent.{agent}.moment``, subjects/momentquery.py): an answer an agent process
read and lost is asked of the gateway again, so a restarted process gets it instead of waiting for nothing."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from subjects.client import Agent, Surface
from subjects.errors import RefusedError
from subjects.momentquery import MomentState, moment_state_decoder
from subjects.wire import BindingMomentItem, FreeTextAnswer, MomentExpired, ResolutionOutcome
from tests.moments import good_moment
from tests.polling import until


async def first_item(surface: Surface) -> BindingMomentItem:
    items = await until(surface.pending, timeout=20, what="a moment on alice's surface")
    assert isinstance(items[0], BindingMomentItem)
    return items[0]


async def test_an_answer_one_process_read_is_returned_to_the_next_by_the_moment_query(gateway, nc):
    """The first Agent reads (and acks) alice's answer and goes away; a new Agent of the same agent waiting on that
    moment gets the same resolution at once from the gateway, though the outcome consumer will never deliver it again."""
    surface, first = Surface(nc, "alice"), Agent(nc, "planner")
    asking = asyncio.create_task(first.ask("alice", good_moment(), timeout=30))
    item = await first_item(surface)
    assert (await surface.resolve(item.moment_id, FreeTextAnswer(text="only the summary, and no ledger"))).status == "accepted"
    res = await asking
    await first.close()

    second = Agent(nc, "planner")
    try:
        state = await second.moment_state(item.moment_id)
        assert state.status == "closed" and state.outcome == res, state
        again = await second.resolution_for(item.moment_id, timeout=10)
        assert isinstance(again, ResolutionOutcome) and again.resolution == FreeTextAnswer(text="only the summary, and no ledger")
        assert again == res
        # The principal hint reads the record directly, with the same answer; a wrong one finds nothing.
        assert (await second.moment_state(item.moment_id, principal="~alice")).outcome == res
        assert (await second.moment_state(item.moment_id, principal="bob")).status == "unknown"
    finally:
        await second.close()


async def test_pending_unknown_foreign_and_malformed_queries(gateway, nc):
    """An open moment is pending; a made-up id and another agent's moment are both unknown (no existence oracle);
    a wait on an unknown moment fails at once; a malformed query is refused with invalid_query."""
    planner, other = Agent(nc, "planner"), Agent(nc, "intruder")
    try:
        eid = await planner.send_moment("alice", good_moment())
        accepted = await planner.outcome_for(eid, timeout=20)
        assert accepted.status == "accepted" and accepted.moment_id
        mid = accepted.moment_id
        assert (await planner.moment_state(mid)) == MomentState("pending", mid)
        assert (await other.moment_state(mid)).status == "unknown"
        assert (await planner.moment_state(uuid.uuid4().hex)).status == "unknown"
        with pytest.raises(RefusedError) as e:
            await other.final_outcome(mid, timeout=10)
        assert e.value.code == "unknown_moment"
        for body in (b'{"moment_id": "not-hex"}', b"not json", b'{"moment_id": "' + mid.encode() + b'", "extra": 1}'):
            reply = moment_state_decoder.decode((await nc.request(planner.subjects.moment("planner"), body, timeout=5)).data)
            assert reply.status == "refused" and reply.refusal is not None and reply.refusal.code == "invalid_query", body
    finally:
        await planner.close()
        await other.close()


async def test_an_expiry_is_the_closing_outcome_the_query_returns(gateway, nc):
    """A moment that expired unanswered is closed with moment_expired, to the query as on the outcome subject."""
    planner = Agent(nc, "planner")
    try:
        eid = await planner.send_moment("alice", good_moment(), expires_in_s=1)
        mid = (await planner.outcome_for(eid, timeout=20)).moment_id
        assert mid
        final = await planner.final_outcome(mid, timeout=30)
        assert isinstance(final, MomentExpired) and final.moment_id == mid
        state = await planner.moment_state(mid)
        assert state.status == "closed" and state.outcome == final
        with pytest.raises(RefusedError) as e:
            await planner.resolution_for(mid, timeout=10)
        assert e.value.code == "expired"
    finally:
        await planner.close()


async def test_an_agent_lists_its_own_open_and_closed_moments_newest_first(gateway, nc):
    """The list form: open moments newest first with their ids and synopses, closed ones apart, limit and more;
    another agent's list holds none of them; a malformed list query is refused with invalid_query."""
    planner, other, surface = Agent(nc, "planner"), Agent(nc, "intruder"), Surface(nc, "alice")
    try:
        mids = []
        for i in range(3):
            moment = good_moment()
            moment["synopsis"] = f"moment number {i}: {moment['synopsis']}"
            eid = await planner.send_moment("alice", moment)
            mid = (await planner.outcome_for(eid, timeout=20)).moment_id
            assert mid
            mids.append(mid)
        assert (await surface.resolve(mids[0], FreeTextAnswer(text="the first one, answered"))).status == "accepted"
        await planner.final_outcome(mids[0], timeout=20)

        opened = await planner.open_moments()
        assert [m.moment_id for m in opened] == [mids[2], mids[1]]  # newest first, the answered one left out
        assert opened[0].status == "pending" and opened[0].kind == "binding_moment" and opened[0].principal == "alice"
        assert opened[0].synopsis and opened[0].synopsis.startswith("moment number 2")
        closed = await planner.list_moments("closed")
        assert [(m.moment_id, m.status) for m in closed.moments or []] == [(mids[0], "resolved")] and not closed.more
        assert closed.moments and closed.moments[0].closed_at
        everything = await planner.list_moments("all", limit=2)
        assert [m.moment_id for m in everything.moments or []] == [mids[2], mids[1]] and everything.more
        assert [m.moment_id for m in await planner.open_moments(principal="alice")] == [mids[2], mids[1]]
        assert await planner.open_moments(principal="bob") == []
        # Another agent's list is its own: none of planner's moments, whatever it asks for.
        assert (await other.list_moments("all")).moments == []
        for body in (b'{"list": "pending"}', b'{"list": "open", "limit": 0}', b'{"list": "open", "limit": 51}',
                     b'{"list": "open", "moment_id": "' + mids[1].encode() + b'"}', b'{}', b'{"moment_id": "' + mids[1].encode() + b'", "limit": 5}',
                     b'{"list": "open", "principal": "*"}', b'{"list": ["open"]}'):
            reply = moment_state_decoder.decode((await nc.request(planner.subjects.moment("planner"), body, timeout=5)).data)
            assert reply.status == "refused" and reply.refusal is not None and reply.refusal.code == "invalid_query", body
    finally:
        await planner.close()
        await other.close()
