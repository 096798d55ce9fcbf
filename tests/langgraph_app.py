"""A LangGraph agent process for tests/test_integrations_langgraph.py: one graph, a sqlite checkpointer.

    python -m tests.langgraph_app NATS_URL DB_FILE THREAD_ID

Starts (or, when the thread has a checkpoint, resumes) the graph: ``draft`` ->
``review`` (asks the principal through the gateway) -> ``finish``. Prints
``ASKING`` when the review node asks, and one JSON line ``RESULT {...}`` with
the final state.

With ``LG_APP_DIE_AFTER_ANSWER=1`` the review node, once it has the answer,
waits until its outcome consumer has acknowledged it (the answer is gone from
the consumer for good), prints ``ANSWERED {...}`` and kills its own process
with SIGKILL: the crash window between reading the answer and LangGraph's
checkpoint of the node, made deterministic.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any, TypedDict

from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import END, START, StateGraph

from integrations.langgraph import approve
from pgwcore.connect import connect
from subjects.client import OUTBOUND_STREAM, Agent, outcome_durable
from tests.polling import until


class State(TypedDict, total=False):
    invoice: str
    drafts: int
    decision: str
    text: str | None


async def main(url: str, db: str, thread: str) -> None:
    nc = await connect(url, name="langgraph-app")
    pgw = Agent(nc, "planner")

    async def draft(state: State) -> dict[str, Any]:
        return {"drafts": state.get("drafts", 0) + 1}

    async def review(state: State) -> dict[str, Any]:
        print("ASKING", flush=True)
        d = await approve(pgw, "alice", f"send invoice {state['invoice']}", [f"invoice = {state['invoice']}", "total = 120 EUR"])
        if os.environ.get("LG_APP_DIE_AFTER_ANSWER") == "1":
            await nc.flush()

            async def acked() -> bool:
                info = await pgw.js.consumer_info(OUTBOUND_STREAM, outcome_durable("planner"))
                return info.num_ack_pending == 0 and info.num_pending == 0

            await until(acked, timeout=30, what="the answer acknowledged")
            print("ANSWERED " + json.dumps({"decision": d.kind}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return {"decision": d.kind, "text": d.text}

    async def finish(state: State) -> dict[str, Any]:
        return {}

    g = StateGraph(State)
    g.add_node("draft", draft)
    g.add_node("review", review)
    g.add_node("finish", finish)
    g.add_edge(START, "draft")
    g.add_edge("draft", "review")
    g.add_edge("review", "finish")
    g.add_edge("finish", END)
    async with AsyncSqliteSaver.from_conn_string(db) as saver:
        graph = g.compile(checkpointer=saver)
        config: Any = {"configurable": {"thread_id": thread}}
        snapshot = await graph.aget_state(config)
        # A thread with an unfinished step resumes from its checkpoint; a new thread starts.
        first = None if snapshot.next else {"invoice": "INV-7"}
        print("RESUMING" if first is None else "STARTING", flush=True)
        out = await graph.ainvoke(first, config)
    print("RESULT " + json.dumps(out, sort_keys=True), flush=True)
    await pgw.close()
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
