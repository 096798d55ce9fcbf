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
