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
