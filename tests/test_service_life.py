"""The life cycle the services of their own share (pgwcore/service.py, STYLE.md "Lifecycles")."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from nats.errors import NoRespondersError

from consumers.registrar import Registrar
from pgwcore.logs import get_logger
from pgwcore.service import PullService, fetch_batch
from subjects.errors import PgwError

log = get_logger("pgw.test")


class Recorder(PullService):
    """A service whose loop and hooks write down when they run."""

    name = "life-test"

    def __init__(self, config: Any, nc: Any, *, fail: bool = False) -> None:
        super().__init__(config, nc)
        self.fail = fail
        self.events: list[str] = []
        self.looping = asyncio.Event()

    async def start(self) -> None:
        self._sub = await self.js.pull_subscribe("pgw.agent.*.envelope", durable="life-test", stream="PGW_INBOUND")
        self.spawn(self._loop(), name="life-test-loop")
        await self.looping.wait()
        if self.fail:
            raise PgwError("start failed on purpose")

    async def _loop(self) -> None:
        self.looping.set()
        while not self.stopping.is_set():
            await self.fetch(lambda: self._sub.fetch(1, timeout=0.1), log)
        self.events.append("loop ended")

    async def stop_inputs(self) -> None:
        self.events.append("inputs stopped")

    async def close(self) -> None:
        self.events.append(f"closed, subscription {'held' if self._sub else 'released'}")


async def _listed(nc: Any, name: str) -> bool:
    """Whether an instance answers the services API's PING for ``pgw-{name}`` (what `nats micro ls` sends)."""
    try:
        await nc.request(f"$SRV.PING.pgw-{name}", b"", timeout=1.0)
    except NoRespondersError:
        return False
    return True


async def test_drain_stops_inputs_then_loops_then_closes_once_the_subscription_is_released(nc, make_config) -> None:
    """drain() stops the extra inputs, lets the loop end, releases the subscription, then closes; a second drain is harmless."""
    svc = Recorder(make_config(), nc)
    async with svc:
        assert await _listed(nc, "life-test")
        await svc.drain()
        assert svc.events == ["inputs stopped", "loop ended", "closed, subscription released"]
        assert not await _listed(nc, "life-test")
    assert svc.events.count("loop ended") == 1


async def test_a_start_that_fails_leaves_no_loop_and_no_registration(nc, make_config) -> None:
    """A service whose start() raises after its loop began is drained before the error goes on: the loop has ended and `nats micro ls` no longer lists it."""
    svc = Recorder(make_config(), nc, fail=True)
    with pytest.raises(PgwError, match="on purpose"):
        async with svc:
            pass
    assert svc.events == ["inputs stopped", "loop ended", "closed, subscription released"]
    assert not await _listed(nc, "life-test")


async def test_a_registrar_with_a_bad_pinned_key_fails_at_start_and_unregisters(nc, make_config) -> None:
    """A registrar whose configured Transparency Service key cannot be read fails at start and leaves no services-API registration (and no HTTP client) behind."""
    config = make_config(registrar={"ts_url": "http://127.0.0.1:9", "ts_public_key": "not-a-key"})
    registrar = Registrar(config, nc)
    with pytest.raises(PgwError):
        async with registrar:
            pass
    assert not await _listed(nc, "registrar")
    assert registrar.client is None


async def test_fetch_batch_answers_empty_on_timeout_and_none_once_stopping(nc) -> None:
    """A fetch that times out gives [] (the loop goes on); a failing fetch while stopping gives None (the loop ends)."""
    sub = await nc.jetstream().pull_subscribe("pgw.agent.*.envelope", durable="fetch-test", stream="PGW_INBOUND")
    stopping = asyncio.Event()
    assert await fetch_batch(lambda: sub.fetch(1, timeout=0.1), stopping, nc, log) == []
    stopping.set()

    async def broken() -> list[Any]:
        raise RuntimeError("connection gone")

    assert await fetch_batch(broken, stopping, nc, log) is None
    await sub.unsubscribe()


async def test_a_loop_that_ends_by_an_error_says_so(nc, make_config) -> None:
    """A service loop that ends by an error while the service runs is logged as an error naming the service and the
    loop (it leaves the service registered but taking no work), and a loop ended by drain() is not."""
    import structlog

    class Broken(Recorder):
        async def _loop(self) -> None:
            self.looping.set()
            raise RuntimeError("lost on purpose")

    with structlog.testing.capture_logs() as logs:
        with pytest.raises(RuntimeError, match="lost on purpose"):  # drain() hands the loop's error on
            async with Broken(make_config(), nc) as svc:
                task = svc._tasks[0]
                await asyncio.wait([task])  # the service's done callback was registered first: it has run
        async with Recorder(make_config(), nc):
            pass
    ended = [e for e in logs if "no longer takes work" in e["event"]]
    assert len(ended) == 1 and ended[0]["service"] == "life-test" and ended[0]["loop"] == "life-test-loop", logs
    assert "lost on purpose" in ended[0]["error"]


async def test_every_service_process_collects_in_larger_steps_after_start(nc, make_config) -> None:
    """run_services freezes the start-up heap and sets the collector's thresholds for any service, not just the gateway."""
    import gc

    from pgwcore.service import GC_THRESHOLDS, run_services

    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults
    stop = asyncio.Event()
    seen: list[tuple[int, int, int]] = []
    try:
        await run_services([Recorder(make_config(), nc)], stop,
                           on_started=lambda: (seen.append(gc.get_threshold()), stop.set()))
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
    assert seen == [GC_THRESHOLDS] and GC_THRESHOLDS[0] > 700
