"""docs/integrations.md's worked LangGraph and OpenAI Agents SDK examples run against a real gateway, a principal answering."""

from __future__ import annotations

import asyncio

import pytest

from subjects.client import Surface
from subjects.wire import BindingMomentItem, OptionChoice
from tests.test_readme import DOCS, python_block

pytest.importorskip("langgraph.checkpoint.sqlite")
pytest.importorskip("agents")


async def approve_first(nc) -> str:
    """alice approves the first moment she sees (option 0)."""
    surface = Surface(nc, "alice")
    async for item in surface.items():
        if isinstance(item, BindingMomentItem):
            return (await surface.resolve(item.moment_id, OptionChoice(index=0))).status
    raise AssertionError("no moment")


def example(heading: str) -> dict:
    ns: dict = {}
    exec(compile(python_block(heading, DOCS / "integrations.md"), "docs/integrations.md", "exec"), ns)
    return ns


async def test_the_langgraph_example_runs(gateway, nc, tmp_path):
    """The LangGraph example's node asks alice; her approval comes back as the node's decision."""
    answering = asyncio.create_task(approve_first(nc))
    assert await asyncio.wait_for(example("### A LangGraph node that asks alice")["main"](nc, str(tmp_path / "g.sqlite")), 60) == "approve"
    assert await answering == "accepted"


async def test_the_openai_agents_example_runs(gateway, nc):
    """The Agents SDK example's pay_invoice call is approved by alice and runs."""
    from agents import set_tracing_disabled

    from tests.scripted_model import ScriptedModel

    set_tracing_disabled(True)
    answering = asyncio.create_task(approve_first(nc))
    model = ScriptedModel("pay_invoice", {"invoice": "NW-311", "amount_eur": 120})
    out = await asyncio.wait_for(example("### An Agents SDK tool that waits for alice")["main"](nc, model), 60)
    assert out == "tool said: paid NW-311"
    assert await answering == "accepted"
