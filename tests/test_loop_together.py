"""pgwcore.loop.together: asyncio.gather's answers for two awaitables, with one task fewer."""

from __future__ import annotations

import asyncio

import pytest

from pgwcore.loop import together


class Two:
    """Two awaitables that report when they have started and wait for a gate."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.both_started = asyncio.Event()
        self.started: list[str] = []
        self.cancelled: list[str] = []

    async def one(self, name: str) -> str:
        self.started.append(name)
        if len(self.started) == 2:
            self.both_started.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append(name)
            raise
        return name


async def test_both_run_together_and_results_keep_their_order() -> None:
    two = Two()
    call = asyncio.ensure_future(together(two.one("first"), two.one("second")))
    await asyncio.wait_for(two.both_started.wait(), 5)  # both in flight before either may finish
    two.gate.set()
    assert await call == ("first", "second")


@pytest.mark.parametrize("failing", ["first", "second"])
async def test_an_error_is_raised_and_the_other_write_still_finishes(failing: str) -> None:
    gate = asyncio.Event()
    finished = asyncio.Event()

    async def ok() -> str:
        await gate.wait()
        finished.set()
        return "ok"

    async def bad() -> str:
        raise ValueError("refused")

    first, second = (bad(), ok()) if failing == "first" else (ok(), bad())
    call = asyncio.ensure_future(together(first, second))
    if failing == "first":
        gate.set()  # the first one's error is raised once the second, awaited in place, is done
    with pytest.raises(ValueError, match="refused"):
        await call
    gate.set()
    await asyncio.wait_for(finished.wait(), 5)  # not cancelled: a durable write in flight completes


async def test_cancelling_the_caller_cancels_both() -> None:
    two = Two()
    call = asyncio.ensure_future(together(two.one("first"), two.one("second")))
    await asyncio.wait_for(two.both_started.wait(), 5)
    first = asyncio.all_tasks() - {asyncio.current_task(), call}  # the task together() made
    assert len(first) == 1
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await asyncio.wait(first, timeout=5)
    assert sorted(two.cancelled) == ["first", "second"]
