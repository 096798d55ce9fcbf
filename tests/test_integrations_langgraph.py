"""LangGraph (issue 16): a node asks the principal through the gateway; a graph process killed while the
principal thinks is restarted from its sqlite checkpoint and gets the answer to the SAME moment."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("langgraph.checkpoint.sqlite")

from subjects.client import OUTBOUND_STREAM, Surface, outcome_durable
from subjects.wire import BindingMomentItem, FreeTextAnswer, OptionChoice
from tests.polling import until

REPO = Path(__file__).resolve().parent.parent


async def start_graph(url: str, db: Path, thread: str, **env: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.langgraph_app", url, str(db), thread,
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )


async def line_starting(proc: asyncio.subprocess.Process, prefix: str, seen: list[str]) -> str:
    assert proc.stdout is not None
    while True:
        raw = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not raw:
            raise AssertionError(f"the graph process ended before {prefix!r}: {''.join(seen)[-3000:]}")
        line = raw.decode()
        seen.append(line)
        if line.startswith(prefix):
            return line


async def one_pending(surface: Surface) -> BindingMomentItem:
    items = await until(surface.pending, timeout=30, what="the review moment on alice's surface")
    assert len(items) == 1, items
    assert isinstance(items[0], BindingMomentItem)
    return items[0]


async def killed(proc: asyncio.subprocess.Process) -> None:
    proc.send_signal(signal.SIGKILL)
    assert await proc.wait() == -signal.SIGKILL


async def test_a_graph_killed_while_the_principal_thinks_resumes_the_same_moment(nats_server, gateway, nc, tmp_path):
    """Killed (-9) after asking, restarted from the sqlite checkpoint: it waits on the same moment and finishes with its answer."""
    db, seen = tmp_path / "graph.sqlite", []
    surface = Surface(nc, "alice")
    first = await start_graph(nats_server.client_url, db, "thread-1")
    await line_starting(first, "ASKING", seen)
    item = await one_pending(surface)
    assert item.binding_moment.question.options[0].label == "Approve"
    assert "invoice = INV-7" in item.binding_moment.findings
    await killed(first)

    second = await start_graph(nats_server.client_url, db, "thread-1")
    await line_starting(second, "RESUMING", seen)
    await line_starting(second, "ASKING", seen)
    reply = await surface.resolve(item.moment_id, OptionChoice(index=0))
    assert reply.status == "accepted", reply
    result = json.loads((await line_starting(second, "RESULT", seen)).split(" ", 1)[1])
    assert await second.wait() == 0
    # Only a wait on the first moment could get this answer; and no second moment was left open.
    assert result["decision"] == "approve" and result["drafts"] == 1, result
    assert await surface.pending() == []


async def test_an_answer_given_while_the_graph_process_is_down_is_not_lost(nats_server, gateway, nc, tmp_path):
    """The principal answers (free text) while the graph process is dead; the restarted graph gets that answer."""
    db, seen = tmp_path / "graph.sqlite", []
    surface = Surface(nc, "alice")
    first = await start_graph(nats_server.client_url, db, "thread-2")
    await line_starting(first, "ASKING", seen)
    item = await one_pending(surface)
    await killed(first)
    reply = await surface.resolve(item.moment_id, FreeTextAnswer(text="send it next Monday instead"))
    assert reply.status == "accepted", reply

    second = await start_graph(nats_server.client_url, db, "thread-2")
    result = json.loads((await line_starting(second, "RESULT", seen)).split(" ", 1)[1])
    assert await second.wait() == 0
    assert result["decision"] == "free_text" and result["text"] == "send it next Monday instead", result
    assert await surface.pending() == []


async def test_a_graph_killed_after_reading_the_answer_but_before_its_checkpoint_gets_the_same_answer(nats_server, gateway, nc, tmp_path):
    """Killed (-9) after the node read alice's answer and its outcome consumer acknowledged it, before LangGraph wrote
    the node's checkpoint: the restarted graph re-runs the node, which finds the same moment and its answer (the
    gateway's moment query), finishes at once, and alice was asked exactly once."""
    db, seen = tmp_path / "graph.sqlite", []
    surface = Surface(nc, "alice")
    first = await start_graph(nats_server.client_url, db, "thread-4", LG_APP_DIE_AFTER_ANSWER="1")
    await line_starting(first, "ASKING", seen)
    item = await one_pending(surface)
    assert (await surface.resolve(item.moment_id, FreeTextAnswer(text="send it, but copy finance"))).status == "accepted"
    await line_starting(first, "ANSWERED", seen)
    assert await first.wait() == -signal.SIGKILL
    # The answer is consumed for good: nothing left in the agent's outcome consumer to redeliver.
    info = await nc.jetstream().consumer_info(OUTBOUND_STREAM, outcome_durable("planner"))
    assert info.num_pending == 0 and info.num_ack_pending == 0, info

    second = await start_graph(nats_server.client_url, db, "thread-4")
    await line_starting(second, "RESUMING", seen)  # the review node had no checkpoint: LangGraph re-runs it
    result = json.loads((await line_starting(second, "RESULT", seen)).split(" ", 1)[1])
    assert await second.wait() == 0
    assert result["decision"] == "free_text" and result["text"] == "send it, but copy finance", result
    assert result["drafts"] == 1, result
    # Exactly one moment: one record in the moment desk, one dispatch verdict, nothing pending.
    moments = await nc.jetstream().stream_info("KV_PGW_MOMENTS", subjects_filter="$KV.PGW_MOMENTS.alice.*")
    assert list(moments.state.subjects or {}) == [f"$KV.PGW_MOMENTS.alice.{item.moment_id}"]
    dispatched = await nc.jetstream().stream_info("PGW_VERDICTS", subjects_filter="pgw.verdict.hitl_dispatched")
    assert (dispatched.state.subjects or {}).get("pgw.verdict.hitl_dispatched") == 1
    assert await surface.pending() == []


async def test_asks_in_one_node_are_told_apart_and_a_retried_node_gets_its_answers_again(nats_server, gateway, nc, tmp_path):
    """Two asks in one node are two moments; when LangGraph retries the node (RetryPolicy), its asks return the
    answers already given instead of opening new moments."""
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
    from langgraph.graph import START, StateGraph
    from langgraph.types import RetryPolicy

    from integrations.langgraph import approve
    from subjects.client import Agent

    pgw, attempts = Agent(nc, "planner"), []

    async def review(state: dict) -> dict:
        pay = await approve(pgw, "alice", "pay invoice NW-311", ["total = 120 EUR"])
        mail = await approve(pgw, "alice", "email the supplier", ["to = billing@northwind.example"])
        attempts.append((pay.kind, mail.kind))
        if len(attempts) == 1:
            raise ConnectionError("the payment API was down")  # retried by LangGraph
        return {"decisions": [pay.kind, mail.kind]}

    graph = StateGraph(dict)
    graph.add_node("review", review, retry_policy=RetryPolicy(max_attempts=2, initial_interval=0.01, retry_on=ConnectionError))
    graph.add_edge(START, "review")
    surface = Surface(nc, "alice")
    answered: list[str] = []

    async def principal() -> None:
        async for item in surface.items():
            if isinstance(item, BindingMomentItem):
                answered.append(item.binding_moment.synopsis)
                index = 0 if "pay" in item.binding_moment.synopsis else 1
                assert (await surface.resolve(item.moment_id, OptionChoice(index=index))).status == "accepted"

    answering = asyncio.create_task(principal())
    try:
        async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "g.sqlite")) as saver:
            app = graph.compile(checkpointer=saver)
            out = await asyncio.wait_for(app.ainvoke({}, {"configurable": {"thread_id": "t-3"}}), 60)
    finally:
        answering.cancel()
        await pgw.close()
    assert out["decisions"] == ["approve", "reject"]
    assert attempts == [("approve", "reject"), ("approve", "reject")]
    assert answered == ["I propose to pay invoice NW-311.", "I propose to email the supplier."]
    assert await surface.pending() == []
