"""Transition reports that met a foreign record of their step: held here, their steps repaired in shared walks.

A party's JetStream publish with a kernel key's subject as its reply subject makes nats-server store its
acknowledgement there (docs/security.md "Replies"). A report whose step's records (``tr.``, ``idp.``) hold
such a value is judged once the records are written again from the signed log
(:meth:`gateway.kernel.state.KernelState.repair_steps`), which takes a walk of the whole log.

That walk is what an agent could make the kernel pay for: an acknowledgement aimed at the key of a step of
its own (even one it never declared) and a report of the step, two publishes, cost a read and a signature
check of every record of the log. And the reports are judged one after another, so every other agent's
report waited behind each walk. So:

- the reports' loop does not wait: a report that meets a foreign record is handed to :class:`StepRepairs`
  and the loop goes on with the next; it is acked once judged, and told the server it is still in progress
  meanwhile (``+WPI``), so its ``ack_wait`` does not run out and nothing is redelivered;
- one walk at a time serves every step asked for before it began, and the next walk begins no sooner than
  ``SPACING`` times the last one's length after it ended (and at least ``MIN_GAP_S``): however many such
  reports come, the walks take at most a fifth of the time;
- each report is judged after its walk, in the order the reports came; a later report of a step that still
  has one waiting here waits too (its turn after them, with no walk of its own), so the step's reports are
  judged in order;
- a held report holds a place of the consumer's unacknowledged messages (its ``max_ack_pending``), which
  every agent's reports need: at most ``MAX_HELD_PER_AGENT`` of one agent's and ``MAX_HELD`` in all are held.
  A report past its agent's share is dead-lettered at once, recorded in ``PGW_DEADLETTER`` with the reason
  (:func:`overflow_reason`): handed back, it would come again and again until ``max_deliver``, holding a
  place each time. One that finds only the places of all taken (by other agents' reports) is handed back
  and redelivered after ``OVERFLOW_DELAY_S``, so no agent's flood dead-letters another agent's report.

A report whose record is foreign again when it is judged (the value aimed at the key once more meanwhile)
fails as any report that cannot be recorded: redelivered, and dead-lettered after ``max_deliver``
(docs/security.md "Replies", the residual).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import structlog

from gateway.kernel.eventlog import EventLog
from gateway.kernel.state import KernelState
from pgwcore.logs import get_logger
from pgwcore.loop import retrieve

log = get_logger("pgw.kernel")

SPACING = 4.0  # the gap after a walk, in walks of its length: walks take at most 1 / (1 + SPACING) of the time
MIN_GAP_S = 1.0
# Reports held at most, of one agent and in all: each holds a place of the consumer's unacknowledged
# messages (its max_ack_pending, the server's 1,000), which the other agents' reports need.
MAX_HELD_PER_AGENT = 32
MAX_HELD = 256
# A report past its agent's share is dead-lettered at once (handed back, it would cycle through the consumer's
# places until max_deliver); one that finds only the places of all taken (MAX_HELD: other agents' reports) is
# handed back and redelivered after OVERFLOW_DELAY_S, as is any with dead letters off (ops.dead_letter).
OVERFLOW_DELAY_S = 2.0


def overflow_reason() -> str:
    """The dead letter's reason for a report past its agent's share."""
    return (f"more than {MAX_HELD_PER_AGENT} of this agent's transition reports were waiting for the kernel to "
            "write their steps' records again from its log (docs/kernel.md)")


Step = tuple[str, str]  # (agent, idp_id)


class StepNeedsRepair(Exception):
    """Raised by ``handle_transition`` (when its caller can hold the report): the step's records are foreign."""

    def __init__(self, agent: str, idp_id: str, *, walk: bool = True) -> None:
        super().__init__(f"a record of step {idp_id} of {agent} holds no record of the kernel's" if walk
                         else f"a report of step {idp_id} of {agent} is held before this one")
        self.step = (agent, idp_id)
        self.walk = walk  # False: the records were not read, a report of the step is held already


class StepRepairs:
    """Holds reports until their steps are repaired; repairs steps in shared, spaced walks (module docstring)."""

    def __init__(self, state: KernelState, eventlog: EventLog, judge: Callable[[Any], Awaitable[None]],
                 beat_s: float) -> None:
        self.state = state
        self.eventlog = eventlog
        self.judge = judge  # judges a held report again and settles its message (acks, naks or dead-letters it)
        self.beat_s = beat_s  # how often a held report is said to be in progress
        self._steps: dict[Step, asyncio.Future[bool] | None] = {}  # the next walk's steps; a future if awaited
        self._walking: dict[Step, asyncio.Future[bool] | None] = {}  # the steps of the walk under way
        self._held: list[tuple[Step, Any]] = []  # (step, message), in the order they came
        self._judging: list[tuple[Step, Any]] = []  # taken for the walk under way, not judged yet
        self._next_at = 0.0  # monotonic time before which no walk begins
        self._runner: asyncio.Task[None] | None = None
        self._in_judgement = False  # close() lets a judgement finish; it cuts a wait or a walk short
        self._closing = False
        self.walks = 0  # walks of the log made (tests, docs/kernel.md)

    def holds(self, step: Step) -> bool:
        """Whether a report of ``step`` is waiting here (a later one waits behind it)."""
        key = (step[0], step[1].lower())
        return any((s[0], s[1].lower()) == key for s, _ in (*self._judging, *self._held))

    def waiting(self, agent: str | None = None) -> int:
        """How many reports are held (of ``agent``, or of all agents)."""
        return sum(agent is None or s[0] == agent for s, _ in (*self._judging, *self._held))

    def room(self, agent: str) -> Literal["yes", "share", "all"]:
        """Whether one more report of ``agent`` may be held: ``yes``; ``share``: ``agent`` has
        ``MAX_HELD_PER_AGENT`` held; ``all``: ``MAX_HELD`` are held, of every agent."""
        if self.waiting(agent) >= MAX_HELD_PER_AGENT:
            return "share"
        return "all" if self.waiting() >= MAX_HELD else "yes"

    def hold(self, msg: Any, step: Step, *, walk: bool) -> None:
        """Keep ``msg`` (a report of ``step``) until its walk; ``walk`` False: only in order behind another."""
        self._held.append((step, msg))
        if walk:
            self._steps.setdefault(step, None)
        self._start()

    async def repair(self, step: Step) -> bool:
        """Repair ``step`` in the next walk and wait for it; whether the log declared it."""
        fut = self._steps.get(step)
        if fut is None:
            fut = self._steps[step] = asyncio.get_running_loop().create_future()
        self._start()
        return await asyncio.shield(fut)

    def _start(self) -> None:
        if not self._closing and (self._runner is None or self._runner.done()):
            self._runner = asyncio.create_task(self._run(), name="kernel-step-repairs")

    async def _run(self) -> None:
        structlog.contextvars.clear_contextvars()  # its log lines name no one report's agent
        beat = asyncio.create_task(self._beat(), name="kernel-step-repairs-beat")
        try:
            while not self._closing:
                if not (self._steps or self._held):
                    self._runner = None  # at once, before any await: the next hold starts a runner of its own
                    return
                self._judging, self._held = self._held, []
                if self._steps:
                    await asyncio.sleep(max(0.0, self._next_at - time.monotonic()))
                    self._judging += self._held  # those held while it waited: their steps are in this walk
                    self._held = []
                    self._walking, self._steps = self._steps, {}
                    await self._walk(self._walking)
                    self._walking = {}
                # else: only reports in order behind others, whose walk is done: judged without one
                while self._judging and not self._closing:
                    msg = self._judging[0][1]
                    self._in_judgement = True
                    try:
                        await self.judge(msg)
                    except Exception:  # the judge settles every message itself; one unsettled is redelivered
                        log.exception("judging a report held for a walk of the log failed")
                    finally:
                        self._in_judgement = False
                        self._judging.pop(0)
        finally:
            beat.cancel()

    async def _walk(self, steps: dict[Step, asyncio.Future[bool] | None]) -> None:
        t0 = time.monotonic()
        error: BaseException | None = None
        declared: set[Step] = set()
        failed: set[Step] = set()
        try:
            declared, failed = await self.state.repair_steps(self.eventlog, list(steps))
        except Exception as e:
            log.exception("repairing the records of steps from the log failed", steps=len(steps))
            error = e
        finally:
            self.walks += 1
            took = time.monotonic() - t0
            self._next_at = time.monotonic() + max(MIN_GAP_S, SPACING * took)
            log.info("steps' records written again from the log", steps=len(steps), declared=len(declared),
                     failed=len(failed), walk_s=round(took, 3))
        for step, fut in steps.items():
            if fut is None or fut.done():
                continue
            if error is not None or step in failed:
                fut.set_exception(error or RuntimeError(f"the records of step {step[1]} could not be written again"))
                fut.add_done_callback(retrieve)
            else:
                fut.set_result(step in declared)

    async def _beat(self) -> None:
        """Every ``beat_s``: each held report is still in progress (its ``ack_wait`` starts again)."""
        while True:
            await asyncio.sleep(self.beat_s)
            for _, msg in (*self._judging, *self._held):
                with contextlib.suppress(Exception):
                    await msg.in_progress()

    async def close(self) -> None:
        """Stop: a judgement under way finishes; the reports still held are handed back to the server at once
        (a nak: redelivered, to this kernel after a restart or to another), the waits for a walk cancelled."""
        self._closing = True
        runner, self._runner = self._runner, None
        if runner is not None and not runner.done():
            if not self._in_judgement:
                runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await runner
        for fut in (*self._steps.values(), *self._walking.values()):
            if fut is not None and not fut.done():
                fut.cancel()
        for _, msg in (*self._judging, *self._held):
            with contextlib.suppress(Exception):
                await msg.nak()
        self._steps, self._walking, self._held, self._judging = {}, {}, [], []
