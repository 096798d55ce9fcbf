"""The terminal surface ``pgw surface`` end to end, on a real nats-server and gateway.

Interactive mode is driven through a real pseudo-terminal (pexpect): an agent
publishes, the moment appears, key presses answer it, the agent receives the
resolution. ``--json`` mode covers late-connecting surfaces and several
devices of one principal (first answer wins, the others see ``withdrawn``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pexpect
import pytest

from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from subjects.client import Agent
from subjects.wire import (
    DialogueVeto,
    FreeTextAnswer,
    MomentExpired,
    OptionChoice,
    ResolutionOutcome,
)

sys.path.insert(0, str(Path(__file__).parent / "web"))
from surface_kit import REPO, accepted_moment, moment, planner_agent, running_gateway

WAIT = 20.0


@pytest.fixture
async def gateway(nats_server: EmbeddedServer, tmp_path: Path) -> AsyncIterator[Any]:
    async with running_gateway(nats_server, tmp_path / "gw") as gw:
        yield gw


@pytest.fixture
async def agent(nats_server: EmbeddedServer, gateway: Any) -> AsyncIterator[Agent]:
    async with planner_agent(nats_server) as a:
        yield a


def pgw_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(TERM="xterm-256color", PGW_DATA_DIR=str(tmp_path / "surface-data"), PYTHONUNBUFFERED="1")
    env.pop("NATS_CREDS", None)
    # The pty's own size decides the layout: a pytest-xdist worker carries LINES=24 COLUMNS=80,
    # which shutil.get_terminal_size would prefer, clipping the moment's hatches off the screen.
    env.pop("LINES", None)
    env.pop("COLUMNS", None)
    return env


def pgw_argv(server: EmbeddedServer, *args: str) -> list[str]:
    return ["-m", "pgwcli", "--server", server.client_url, "surface", "--principal", "alice", *args]


# ---------------------------------------------------------------------------
# Interactive, through a real terminal
# ---------------------------------------------------------------------------


async def test_terminal_keys_answer_moments_and_agent_receives_each_resolution(
    nats_server: EmbeddedServer, agent: Agent, tmp_path: Path
) -> None:
    """In a real terminal, ↓↓ Enter picks option 2, f + text answers in own words, d rejects the question; the agent gets each."""
    m_option = await accepted_moment(agent)
    m_free = await accepted_moment(agent, moment(stem="Which auditor contact should receive the summary?"))
    child = pexpect.spawn(
        sys.executable, pgw_argv(nats_server), cwd=str(REPO), env=pgw_env(tmp_path),
        dimensions=(60, 140), encoding="utf-8", timeout=WAIT,
    )

    async def expect(pattern: str) -> None:
        await asyncio.to_thread(child.expect, pattern)

    try:
        # The pending moment is rendered with its briefing, its recommended option and both hatches.
        await expect("Send Acme's auditors the summary")
        await expect(r"Send the summary only.*recommended")
        await expect(r"\[d\].*Reject the question")
        child.send("\x1b[B")  # ↓ selects option 1
        child.send("\x1b[B")  # ↓ selects option 2
        child.send("\r")
        # The redrawn screen shows the next pending moment, then the gateway's reply on the status line.
        await expect("Which auditor contact.*Accepted: option 2")
        out = await agent.final_outcome(m_option, timeout=WAIT)
        assert isinstance(out, ResolutionOutcome) and out.resolution == OptionChoice(index=1)

        # The next pending moment: the answer-space hatch, typed text, Enter.
        child.send("f")
        await expect("Your answer in your own words")
        child.send("Send it to Dana at the audit firm")
        child.send("\r")
        await expect("Accepted: your own answer")
        out = await agent.final_outcome(m_free, timeout=WAIT)
        assert isinstance(out, ResolutionOutcome)
        assert out.resolution == FreeTextAnswer(text="Send it to Dana at the audit firm")

        # A moment that arrives while the surface is open: the question-space hatch.
        m_dialogue = await accepted_moment(agent, moment(stem="Should the board pack include the audit summary?"))
        await expect("Should the board pack include")
        child.send("d")
        await expect("What is wrong with the question")
        child.send("The board meets next quarter\r")
        await expect("Accepted: you rejected the question")
        out = await agent.final_outcome(m_dialogue, timeout=WAIT)
        assert isinstance(out, ResolutionOutcome)
        assert out.resolution == DialogueVeto(objection="The board meets next quarter")
        child.send("q")
        await asyncio.to_thread(child.expect, pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


async def test_terminal_removes_a_moment_answered_on_another_device(
    nats_server: EmbeddedServer, agent: Agent, tmp_path: Path
) -> None:
    """A moment answered elsewhere is withdrawn from the open terminal surface."""
    from consumers.surfaces.feed import SurfaceFeed

    mid = await accepted_moment(agent)
    child = pexpect.spawn(
        sys.executable, pgw_argv(nats_server), cwd=str(REPO), env=pgw_env(tmp_path),
        dimensions=(60, 140), encoding="utf-8", timeout=WAIT,
    )
    nc = await connect(nats_server.client_url, name="phone")
    try:
        await asyncio.to_thread(child.expect, "Send Acme's auditors the summary")
        reply = await SurfaceFeed(nc, "alice").resolve(mid, OptionChoice(index=0))
        assert reply.status == "accepted"
        await asyncio.to_thread(child.expect, r"Nothing is waiting for you.*withdrawn \(resolved\)")
        child.send("q")
        await asyncio.to_thread(child.expect, pexpect.EOF)
    finally:
        child.close(force=True)
        await nc.drain()


async def test_terminal_says_connecting_until_the_first_pending_list_answers(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """Until the first pending request is answered the terminal says it is connecting, never "Nothing is waiting
    for you"; once the (empty) list is in, it says nothing is waiting."""
    nc = await connect(nats_server.client_url, name="test-slow-gateway")
    asked: asyncio.Queue[Any] = asyncio.Queue()
    await nc.subscribe("pgw.principal.alice.pending", cb=asked.put)  # a gateway that answers when told to
    await nc.flush()
    child = pexpect.spawn(
        sys.executable, pgw_argv(nats_server), cwd=str(REPO), env=pgw_env(tmp_path),
        dimensions=(60, 140), encoding="utf-8", timeout=WAIT,
    )
    try:
        request = await asyncio.wait_for(asked.get(), WAIT)
        await asyncio.to_thread(child.expect, "Connecting to the gateway")
        assert "Nothing is waiting" not in child.before
        await request.respond(b'{"items": []}')
        await asyncio.to_thread(child.expect, "Nothing is waiting for you")
        assert "Connecting to the gateway" not in child.before.rsplit("\x1b[2J", 1)[-1]  # the frame drawn last
        child.send("q")
        await asyncio.to_thread(child.expect, pexpect.EOF)
    finally:
        child.close(force=True)
        await nc.drain()


# ---------------------------------------------------------------------------
# --json mode: late connection, several devices
# ---------------------------------------------------------------------------


class JsonSurface:
    """A ``pgw surface --json`` child process: JSON lines out, answers in."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def start(cls, server: EmbeddedServer, tmp_path: Path, *args: str) -> JsonSurface:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *pgw_argv(server, "--json", *args), cwd=str(REPO), env=pgw_env(tmp_path),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def wait_for(self, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        for e in self.events:
            if pred(e):
                return e

        async def read() -> dict[str, Any]:
            assert self.proc.stdout is not None
            while True:
                line = await self.proc.stdout.readline()
                if not line:
                    err = await self.proc.stderr.read() if self.proc.stderr else b""
                    raise AssertionError(f"surface exited; events {self.events}; stderr {err[-2000:]!r}")
                event = json.loads(line)
                self.events.append(event)
                if pred(event):
                    return event

        return await asyncio.wait_for(read(), WAIT)

    async def answer(self, moment_id: str, resolution: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"moment_id": moment_id, "resolution": resolution}).encode() + b"\n")
        await self.proc.stdin.drain()
        event = await self.wait_for(lambda e: e["event"] == "reply" and e["moment_id"] == moment_id)
        return event["reply"]

    async def close(self) -> int:
        if self.proc.stdin and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        try:
            return await asyncio.wait_for(self.proc.wait(), WAIT)
        except TimeoutError:
            self.proc.kill()
            return await self.proc.wait()


def item_event(moment_id: str, kind: str = "binding_moment") -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "item" and e["item"].get("item") == kind and e["item"].get("moment_id") == moment_id


async def test_late_surface_gets_pending_but_not_answered_or_expired(
    nats_server: EmbeddedServer, agent: Agent, tmp_path: Path
) -> None:
    """A surface that connects later gets the still-pending moment, and neither the answered nor the expired one."""
    from consumers.surfaces.feed import SurfaceFeed

    answered = await accepted_moment(agent, moment(stem="Answered already?"))
    expired = await accepted_moment(agent, moment(stem="Expired already?"), expires_in_s=1)
    pending = await accepted_moment(agent, moment(stem="Still waiting?"))
    nc = await connect(nats_server.client_url, name="laptop")
    try:
        assert (await SurfaceFeed(nc, "alice").resolve(answered, OptionChoice(index=0))).status == "accepted"
    finally:
        await nc.drain()
    assert isinstance(await agent.final_outcome(answered, timeout=WAIT), ResolutionOutcome)
    assert isinstance(await agent.final_outcome(expired, timeout=WAIT), MomentExpired)  # the event, not a sleep

    surface = await JsonSurface.start(nats_server, tmp_path)
    surface.proc.stdin.close()  # type: ignore[union-attr]  # no answers: print the snapshot and exit
    assert await surface.close() == 0
    raw = (await surface.proc.stdout.read()).decode()  # type: ignore[union-attr]
    events = surface.events + [json.loads(ln) for ln in raw.splitlines() if ln.strip()]
    ids = [e["item"].get("moment_id") for e in events if e["event"] == "item"]
    assert ids == [pending], events
    plan = next(e["plan"] for e in events if e["event"] == "item")
    assert plan["plan"] == "decision" and plan["stem"] == "Still waiting?"


async def test_two_devices_first_answer_wins_and_the_other_sees_withdrawn(
    nats_server: EmbeddedServer, agent: Agent, tmp_path: Path
) -> None:
    """Both of alice's surfaces get the moment; the first answer is accepted, the other device sees withdrawn and is refused."""
    phone = await JsonSurface.start(nats_server, tmp_path, "--follow")
    laptop = await JsonSurface.start(nats_server, tmp_path, "--follow")
    try:
        # Both surfaces are live (their pending snapshot is an empty list, so wait on a first item).
        mid = await accepted_moment(agent)
        await phone.wait_for(item_event(mid))
        await laptop.wait_for(item_event(mid))
        reply = await phone.answer(mid, {"kind": "option", "index": 2})
        assert reply["status"] == "accepted"
        withdrawn = await laptop.wait_for(item_event(mid, "withdrawn"))
        assert withdrawn["plan"] == {**withdrawn["plan"], "plan": "withdraw", "reason": "resolved"}
        late = await laptop.answer(mid, {"kind": "option", "index": 0})
        assert late["status"] == "refused" and late["code"] == "already_resolved"
        out = await agent.final_outcome(mid, timeout=WAIT)
        assert isinstance(out, ResolutionOutcome) and out.resolution == OptionChoice(index=2)
    finally:
        for s in (phone, laptop):
            s.proc.terminate()
            await s.close()


async def test_json_mode_reports_invalid_answer_lines_and_keeps_going(
    nats_server: EmbeddedServer, agent: Agent, tmp_path: Path
) -> None:
    """A line that is not a resolve request is reported as an error event; the next valid answer still goes through."""
    mid = await accepted_moment(agent)
    surface = await JsonSurface.start(nats_server, tmp_path)
    try:
        await surface.wait_for(item_event(mid))
        surface.proc.stdin.write(b'{"moment_id": "nope"}\n')  # type: ignore[union-attr]
        err = await surface.wait_for(lambda e: e["event"] == "error")
        assert "resolve request" in err["error"]
        reply = await surface.answer(mid, {"kind": "free_text", "text": "Only totals, please"})
        assert reply["status"] == "accepted"
    finally:
        assert await surface.close() == 0
    out = await agent.final_outcome(mid, timeout=WAIT)
    assert isinstance(out, ResolutionOutcome) and out.resolution == FreeTextAnswer(text="Only totals, please")


async def test_terminal_answers_a_clarification_question_by_question(
    nats_server: EmbeddedServer, gateway: Any, agent: Agent, tmp_path: Path
) -> None:
    """A clarification is shown as its questions; Enter, then one typed answer per question, reaches the agent as answers."""
    from subjects.client import ensure_agent_consumer
    from subjects.wire import ClarificationAnswers, ClarificationQuestion

    # The agent never sent an envelope here, so its outcome consumer is made up front
    # (subjects.client.Agent cannot create it itself once bound; reported to the lead).
    await ensure_agent_consumer(gateway.js, "planner")
    mid = await gateway.desk.dispatch(
        agent="planner", principal="alice", envelope_id="env-clar", correlation_id="c-clar",
        questions=[
            ClarificationQuestion(id="account", question="Which account should be billed?"),
            ClarificationQuestion(id="when", question="By when do you need it?"),
        ],
    )
    child = pexpect.spawn(
        sys.executable, pgw_argv(nats_server), cwd=str(REPO), env=pgw_env(tmp_path),
        dimensions=(60, 140), encoding="utf-8", timeout=WAIT,
    )
    try:
        await asyncio.to_thread(child.expect, "By when do you need it")
        child.send("\r")
        await asyncio.to_thread(child.expect, "1. Which account should be billed")
        child.send("ACME-42\r")
        await asyncio.to_thread(child.expect, "2. By when do you need it")
        child.send("Friday\r")
        await asyncio.to_thread(child.expect, "Accepted: your answers")
        child.send("q")
        await asyncio.to_thread(child.expect, pexpect.EOF)
    finally:
        child.close(force=True)
    out = await agent.final_outcome(mid, timeout=WAIT)
    assert isinstance(out, ResolutionOutcome)
    assert out.resolution == ClarificationAnswers(answers={"account": "ACME-42", "when": "Friday"})
