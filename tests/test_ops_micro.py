"""Services register with the NATS services API (issue 8 "Ops": nats micro ls finds them)."""

from __future__ import annotations

import asyncio
import contextlib
import json

from pgwcore import metrics
from pgwcore.micro import MicroRegistration, service_name


async def _collect(nc, subject: str, want: int, timeout: float = 2.0) -> list[dict]:
    """Send one request on ``subject`` and gather up to ``want`` replies (scatter-gather)."""
    inbox = nc.new_inbox()
    got: list[dict] = []
    done = asyncio.get_running_loop().create_future()

    async def on_reply(msg) -> None:
        if not msg.data:  # a 503 "no responders" status: nobody is registered
            return
        got.append(json.loads(msg.data))
        if len(got) >= want and not done.done():
            done.set_result(None)

    sub = await nc.subscribe(inbox, cb=on_reply)
    await nc.publish(subject, b"", reply=inbox)
    try:
        await asyncio.wait_for(done, timeout)
    finally:
        await sub.unsubscribe()
    return got


async def test_ping_finds_every_registered_role(nc) -> None:
    """$SRV.PING answers once per registered gateway, signer and registrar instance."""
    async with (
        MicroRegistration(nc, "gateway"),
        MicroRegistration(nc, "signer"),
        MicroRegistration(nc, "registrar"),
    ):
        replies = await _collect(nc, "$SRV.PING", 3)
    assert sorted(r["name"] for r in replies) == sorted(
        service_name(r) for r in ("gateway", "signer", "registrar")
    )
    assert all(r["type"] == "io.nats.micro.v1.ping_response" for r in replies)


async def test_stats_carry_the_metric_counters(nc) -> None:
    """$SRV.STATS for the gateway reports the envelope counter totals in its endpoint data."""
    metrics.count_envelope("accepted", None)
    total = sum(
        s.value for s in next(iter(metrics.ENVELOPES.collect())).samples if s.name.endswith("_total")
    )
    async with MicroRegistration(nc, "gateway"):
        (stats,) = await _collect(nc, f"$SRV.STATS.{service_name('gateway')}", 1)
    data = stats["endpoints"][0]["data"]
    assert data["counters"]["pgw_envelopes"] == total >= 1


async def test_drain_is_idempotent_and_deregisters(nc) -> None:
    """After drain() (twice) the service no longer answers $SRV.PING."""
    reg = await MicroRegistration(nc, "gateway").start()
    assert await _collect(nc, f"$SRV.PING.{service_name('gateway')}", 1)
    await reg.drain()
    await reg.drain()
    got: list[dict] = []
    with contextlib.suppress(TimeoutError):
        got = await _collect(nc, f"$SRV.PING.{service_name('gateway')}", 1, timeout=0.3)
    assert got == []


async def test_status_endpoint_answers(nc) -> None:
    """The per-role status endpoint answers a plain request with the service name and id."""
    async with MicroRegistration(nc, "signer", "pgw") as reg:
        msg = await nc.request("pgw.ops.signer.status", b"", timeout=2)
        reg_id = reg.id
    body = json.loads(msg.data)
    assert body["service"] == "pgw-signer"
    assert body["id"] == reg_id is not None


class HeldPart:
    """A gateway part whose start waits until the test lets it go (a start still under way)."""

    release: asyncio.Event | None = None
    entered: asyncio.Event | None = None

    def __init__(self, gw: object) -> None:
        self.gw = gw

    async def __aenter__(self) -> HeldPart:
        assert HeldPart.release is not None and HeldPart.entered is not None
        HeldPart.entered.set()
        await HeldPart.release.wait()
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def drain(self) -> None:
        pass


async def _pinged(nc, role: str, timeout: float = 0.3) -> list[dict]:
    """The services answering a ping within ``timeout`` (the first answer ends the wait): a short wait where
    none is expected, a long one where one is (a loaded machine answers late, not never)."""
    with contextlib.suppress(TimeoutError):
        return await _collect(nc, f"$SRV.PING.{service_name(role)}", 1, timeout=timeout)
    return []


async def test_a_gateway_is_found_only_once_it_serves(nats_server, nc, tmp_path, monkeypatch) -> None:
    """$SRV.PING finds a gateway once every part has started and its consumer is open, not while it starts
    (a gateway found while starting was counted as serving, and killed as such, by the cluster's chaos
    test: it then failed to start when a node went down). It is no longer found once it drains."""
    from gateway import app
    from tests.pipeline_helpers import running_gateway

    HeldPart.release, HeldPart.entered = asyncio.Event(), asyncio.Event()
    monkeypatch.setattr(app, "GATEWAY_PARTS", [*app.GATEWAY_PARTS, f"{__name__}:HeldPart"])
    started = asyncio.Event()
    stop = asyncio.Event()

    async def run() -> None:
        async with running_gateway(nats_server, str(tmp_path / "d")) as gw:
            started.set()
            await stop.wait()
            await gw.drain()
            assert await _pinged(nc, "gateway") == []  # drained: no longer found

    task = asyncio.create_task(run())
    try:
        await asyncio.wait_for(HeldPart.entered.wait(), 30)
        assert await _pinged(nc, "gateway") == []  # its parts before HeldPart have started, MetricsPart first
        HeldPart.release.set()
        await asyncio.wait_for(started.wait(), 30)
        assert [r["name"] for r in await _pinged(nc, "gateway", timeout=15)] == [service_name("gateway")]
        stop.set()
        await asyncio.wait_for(task, 30)
    finally:
        HeldPart.release.set()
        stop.set()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_pull_service_is_found_only_once_it_serves(nc) -> None:
    """The signer, registrar and notifier (``PullService``) likewise: found once ``start()`` has returned."""
    from pgwcore.config import Config
    from pgwcore.service import PullService

    release, entered = asyncio.Event(), asyncio.Event()

    class Probe(PullService):
        name = "signer"

        async def start(self) -> None:
            entered.set()
            await release.wait()

    svc = Probe(Config(), nc)
    task = asyncio.create_task(svc.__aenter__())
    try:
        await asyncio.wait_for(entered.wait(), 10)
        assert await _pinged(nc, "signer") == []
        release.set()
        await asyncio.wait_for(task, 10)
        assert [r["name"] for r in await _pinged(nc, "signer", timeout=15)] == [service_name("signer")]
    finally:
        release.set()
        await asyncio.gather(task, return_exceptions=True)
        await svc.drain()
    assert await _pinged(nc, "signer") == []
