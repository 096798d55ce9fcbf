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

from subjects.client import Surface
from subjects.wire import BindingMomentItem, FreeTextAnswer, OptionChoice
from tests.polling import until

REPO = Path(__file__).resolve().parent.parent


async def start_graph(url: str, db: Path, thread: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.langgraph_app", url, str(db), thread,
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
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
