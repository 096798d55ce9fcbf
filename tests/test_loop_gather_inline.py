"""pgwcore.loop.gather_inline: asyncio.gather's answers with the first awaitable run in the caller's own task."""

from __future__ import annotations

import asyncio
import gc

import pytest

from pgwcore.loop import gather_inline


class Jobs:
    """Awaitables that log when they start, wait for a gate, and log how they end."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.log: list[str] = []
        self.tasks: dict[str, asyncio.Task[object] | None] = {}
        self.moved = asyncio.Event()  # set by each start

    async def job(self, name: str, fail: bool = False) -> str:
        self.log.append(f"start {name}")
        self.moved.set()
        self.tasks[name] = asyncio.current_task()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.log.append(f"cancelled {name}")
            raise
        if fail:
            raise ValueError(f"{name} refused")
        self.log.append(f"done {name}")
        return name

    async def started(self, n: int) -> None:
        while sum(e.startswith("start") for e in self.log) < n:
            self.moved.clear()
            await self.moved.wait()


async def test_results_keep_their_order_and_the_first_runs_first_in_the_callers_task() -> None:
    """All run together, the first in the caller's task and started before any other; results come in the order given."""
    jobs = Jobs()
    caller: list[asyncio.Task[object] | None] = []

    async def call() -> list[object]:
        caller.append(asyncio.current_task())
        return await gather_inline(jobs.job("a"), jobs.job("b"), jobs.job("c"))

    run = asyncio.ensure_future(call())
    await asyncio.wait_for(jobs.started(3), 5)  # all in flight before any may finish
    assert jobs.log == ["start a", "start b", "start c"]
    assert jobs.tasks["a"] is caller[0] and jobs.tasks["b"] is not caller[0]
    jobs.gate.set()
    assert await run == ["a", "b", "c"]


async def test_a_future_is_taken_as_it_is() -> None:
    """An awaitable already wrapped in a task is awaited, not wrapped again, and its result is returned in its place."""
    jobs = Jobs()
    ahead = asyncio.ensure_future(jobs.job("ahead"))
    run = asyncio.ensure_future(gather_inline(jobs.job("first"), ahead))
    await asyncio.wait_for(jobs.started(2), 5)
    jobs.gate.set()
    assert await run == ["first", "ahead"]


@pytest.mark.parametrize("failing", ["a", "b"])
async def test_an_error_is_raised_and_the_others_still_finish(failing: str) -> None:
    """An error of any is raised, and the others are not cancelled: each runs to its end, its own error retrieved."""
    unretrieved: list[object] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx.get("message")))
    jobs = Jobs()

    async def scenario() -> None:  # every reference to the tasks and the raised error ends with it
        run = asyncio.ensure_future(gather_inline(jobs.job("a", fail=failing == "a"),
                                                  jobs.job("b", fail=failing == "b"), jobs.job("c", fail=True)))
        await asyncio.wait_for(jobs.started(3), 5)
        jobs.gate.set()
        with pytest.raises(ValueError, match=f"{failing} refused"):
            await run
        await asyncio.wait_for(asyncio.wait([t for t in jobs.tasks.values() if t is not None and t is not run]), 5)

    await scenario()
    assert not any(e.startswith("cancelled") for e in jobs.log)
    assert [e for e in jobs.log if e.startswith("done")] == [f"done {n}" for n in "ab" if n != failing]
    jobs.tasks.clear()
    gc.collect()  # a task whose error nobody retrieved says so when it is collected
    assert unretrieved == []


async def test_return_exceptions_puts_each_error_in_its_place() -> None:
    """With return_exceptions, each Exception is returned in its place, as asyncio.gather returns it."""
    jobs = Jobs()
    run = asyncio.ensure_future(gather_inline(jobs.job("a", fail=True), jobs.job("b"), jobs.job("c", fail=True),
                                              return_exceptions=True))
    await asyncio.wait_for(jobs.started(3), 5)
    jobs.gate.set()
    a, b, c = await run
    assert isinstance(a, ValueError) and str(a) == "a refused"
    assert b == "b"
    assert isinstance(c, ValueError) and str(c) == "c refused"


@pytest.mark.parametrize("return_exceptions", [False, True])
async def test_cancelling_the_caller_cancels_them_all(return_exceptions: bool) -> None:
    """Cancelling the caller cancels every awaitable still pending, and the cancellation is raised."""
    jobs = Jobs()
    run = asyncio.ensure_future(gather_inline(jobs.job("a"), jobs.job("b"), jobs.job("c"),
                                              return_exceptions=return_exceptions))
    await asyncio.wait_for(jobs.started(3), 5)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    await asyncio.wait_for(asyncio.wait([t for n, t in jobs.tasks.items() if n != "a" and t is not None]), 5)
    assert sorted(e for e in jobs.log if e.startswith("cancelled")) == ["cancelled a", "cancelled b", "cancelled c"]
