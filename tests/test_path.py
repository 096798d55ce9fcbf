"""The first path end to end on a real nats-server: moment -> surface -> resolution -> agent."""

from __future__ import annotations

import asyncio

import pytest

from subjects.client import Agent, Surface
from subjects.wire import (
    BindingMomentItem,
    DialogueVeto,
    FreeTextAnswer,
    OptionChoice,
    ResolutionOutcome,
    WithdrawnItem,
)
from tests.moments import good_moment
from tests.stored import stored_json


async def first_item(surface: Surface, kind: type) -> object:
    async for item in surface.items():
        if isinstance(item, kind):
            return item
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("resolution", "verdict_decision"),
    [
        (OptionChoice(index=1), "accept"),
        (FreeTextAnswer(text="Send the summary and the Q4 bank statements."), "accept"),
        (DialogueVeto(objection="I haven't decided to keep Harbor at all."), "reject"),
    ],
)
async def test_each_resolution_reaches_the_agent_distinctly(gateway, nc, resolution, verdict_decision):
    """A moment reaches alice's surface; each of the three resolutions comes back to the agent as itself."""
    agent = Agent(nc, "planner")
    surface = Surface(nc, "alice")
    task = asyncio.create_task(first_item(surface, BindingMomentItem))
    ask = asyncio.create_task(agent.ask("~alice", good_moment(), timeout=10))
    item = await asyncio.wait_for(task, 10)
    assert item.binding_moment.question.recommended_idx == 0
    reply = await surface.resolve(item.moment_id, resolution)
    assert reply.status == "accepted", reply
    res = await ask
    assert isinstance(res, ResolutionOutcome)
    assert res.resolution == resolution
    assert res.moment_id == item.moment_id
    await agent.close()
    verdicts = await stored_json(nc, "PGW_VERDICTS")
    classes = sorted(v["verdict_class"] for v in verdicts)
    assert classes == ["hitl_dispatched", "resolved"]
    resolved = next(v for v in verdicts if v["verdict_class"] == "resolved")
    dispatched = next(v for v in verdicts if v["verdict_class"] == "hitl_dispatched")
    assert resolved["decision"] == verdict_decision
    assert resolved["human_disposed"] is True and resolved["approver"] == "human"
    assert resolved["supersedes"] == dispatched["verdict_id"]
    assert "text" not in resolved  # spec 000 §13: only a digest of free text


async def test_second_resolution_is_refused(gateway, nc):
    """The first answer wins; a second answer to the same moment is refused as already resolved."""
    agent = Agent(nc, "planner")
    surface = Surface(nc, "alice")
    task = asyncio.create_task(first_item(surface, BindingMomentItem))
    ask = asyncio.create_task(agent.ask("alice", good_moment(), timeout=10))
    item = await asyncio.wait_for(task, 10)
    assert (await surface.resolve(item.moment_id, OptionChoice(index=0))).status == "accepted"
    second = await surface.resolve(item.moment_id, OptionChoice(index=2))
    assert (second.status, second.code) == ("refused", "already_resolved")
    res = await ask
    assert res.resolution == OptionChoice(index=0)
    await agent.close()


async def test_closed_hatch_and_bad_index_are_refused(gateway, nc):
    """With the answer-space hatch closed a free-text answer is refused; so is an out-of-range index."""
    agent = Agent(nc, "planner")
    surface = Surface(nc, "alice")
    task = asyncio.create_task(first_item(surface, BindingMomentItem))
    moment = good_moment(hatches={"free_text": False, "dialogue": True})
    ask = asyncio.create_task(agent.ask("alice", moment, timeout=10))
    item = await asyncio.wait_for(task, 10)
    r = await surface.resolve(item.moment_id, FreeTextAnswer(text="something else"))
    assert (r.status, r.code) == ("refused", "hatch_closed")
    r = await surface.resolve(item.moment_id, OptionChoice(index=3))
    assert (r.status, r.code) == ("refused", "index_out_of_range")
    assert (await surface.resolve(item.moment_id, DialogueVeto())).status == "accepted"
    assert isinstance((await ask).resolution, DialogueVeto)
    await agent.close()


async def test_other_surfaces_get_withdrawn_and_late_surface_gets_pending(gateway, nc):
    """A surface connecting late still sees a pending moment; once answered, every surface gets withdrawn."""
    agent = Agent(nc, "planner")
    eid = await agent.send_moment("alice", good_moment())
    out = await agent.outcome_for(eid, timeout=10)
    assert out.status == "accepted"
    late = Surface(nc, "alice")
    pending = await late.pending()
    assert [i.moment_id for i in pending] == [out.moment_id]
    gen = late.items()
    first = await asyncio.wait_for(gen.__anext__(), 5)
    assert first.moment_id == out.moment_id
    assert (await late.resolve(out.moment_id, OptionChoice(index=0))).status == "accepted"
    withdrawn = await asyncio.wait_for(gen.__anext__(), 5)
    assert isinstance(withdrawn, WithdrawnItem) and withdrawn.reason == "resolved"
    await gen.aclose()
    assert await late.pending() == []
    await agent.close()


async def test_pending_lists_exactly_the_principals_open_moments(gateway, nc):
    """pending() returns every open moment of that principal, oldest first, none answered and none of a look-alike principal."""
    agent = Agent(nc, "planner")
    mids = []
    for i in range(12):
        eid = await agent.send_moment("alice", good_moment(stem=f"Which records should Harbor receive, batch {i}?"))
        mids.append((await agent.outcome_for(eid, timeout=10)).moment_id)
    eid = await agent.send_moment("alice2", good_moment())
    assert (await agent.outcome_for(eid, timeout=10)).status == "accepted"
    alice = Surface(nc, "alice")
    assert (await alice.resolve(mids[3], OptionChoice(index=0))).status == "accepted"
    listed = [i.moment_id for i in await alice.pending()]
    assert listed == [m for k, m in enumerate(mids) if k != 3]
    await agent.close()
