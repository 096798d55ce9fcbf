"""``tests.polling.until``: the suite's one bounded poll of server-side state."""

from __future__ import annotations

import nats.errors
import pytest

from tests.polling import until


async def test_a_probe_that_times_out_counts_as_not_yet_within_the_bound() -> None:
    """A request the server answers late (nats-py's TimeoutError) is polled again, as a falsy answer is."""
    calls = []

    async def probe() -> str | None:
        calls.append(1)
        if len(calls) < 3:
            raise nats.errors.TimeoutError
        return "there"

    assert await until(probe, timeout=5, interval=0) == "there"
    assert len(calls) == 3


async def test_a_probe_that_keeps_timing_out_fails_at_the_deadline_with_its_timeout_as_cause() -> None:
    async def probe() -> bool:
        raise nats.errors.TimeoutError

    with pytest.raises(TimeoutError, match=r"stream full not reached within 0\.05 s .*timed out") as e:
        await until(probe, timeout=0.05, interval=0.01, what="stream full")
    assert isinstance(e.value.__cause__, nats.errors.TimeoutError)


async def test_any_other_error_of_the_probe_is_raised_at_once() -> None:
    calls = []

    async def probe() -> bool:
        calls.append(1)
        raise nats.errors.NoRespondersError

    with pytest.raises(nats.errors.NoRespondersError):
        await until(probe, timeout=5, interval=0)
    assert len(calls) == 1


async def test_a_falsy_answer_until_the_deadline_fails_without_a_cause() -> None:
    with pytest.raises(TimeoutError, match=r"condition not reached within 0\.02 s$") as e:
        await until(_never, timeout=0.02, interval=0.005)
    assert e.value.__cause__ is None


async def _never() -> int:
    return 0
