"""IDP kernel request-reply latency vs a bare request-reply responder (issue 4).

Both run in this process against the same embedded nats-server (JetStream
``sync_interval: always``) and are driven the same way: an open-loop driver
fires requests at a fixed rate (``PGW_BENCH_IDP_RATE``, default 200/s) for
``PGW_BENCH_IDP_S`` seconds (default 10: 2,000 requests, so p99 is the
20th-worst request rather than the 6th of a 3 s run, which one disk stall
decides) and records each request's latency.

- **kernel**: ``agent.bench.idp`` served by the gateway's ``KernelService``:
  decode and validate the IDP (spec 003 §5.2), verify the EdDSA mandate,
  KV reads and a compare-and-set on the session, the signed and chained
  ``IDP_SUBMITTED`` append awaiting its PubAck (fsync) with the report-key
  write beside it, Cedar, then the ``CEDAR_PERMIT_RECORDED`` append and the
  KV index write (each fsync'd), then the reply. Every request carries a new
  idp_id and session; the agent presents the same mandate each time, as an
  agent does across its steps.
- **bare** (baseline): a core-NATS responder on ``bench.echo`` that replies
  with the request body, no logic, no storage.

Rows: p50 and p99 latency (ms) of each, ratio kernel/bare (lower is better),
and the achieved rate. Run alone: ``.venv/bin/python -m benchmarks.bench_idp``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

from pgwcore import loop as pgw_loop

RATE = float(os.environ.get("PGW_BENCH_IDP_RATE", "200"))
SECONDS = float(os.environ.get("PGW_BENCH_IDP_S", "10"))
REPO = str(Path(__file__).resolve().parent.parent)
POLICY = 'permit(principal, action == Action::"CloseBooking", resource)\n' \
         'when { context.idp.confidence_level.greaterThanOrEqual(decimal("0.8")) };\n'


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _drive(send: Any, n: int, rate: float) -> tuple[list[float], float, int]:
    """Fire ``n`` requests at ``rate``/s open-loop; return latencies (s), elapsed, failures."""
    lat: list[float] = []
    failures = 0

    async def one(i: int) -> None:
        nonlocal failures
        t0 = time.perf_counter()
        try:
            ok = await send(i)
        except Exception:  # noqa: BLE001 - counted, the run goes on
            ok = False
        if ok:
            lat.append(time.perf_counter() - t0)
        else:
            failures += 1

    start = time.perf_counter()
    tasks = []
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # pacing the open-loop driver, not waiting for an event
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return lat, time.perf_counter() - start, failures


async def _echo_main(url: str) -> None:
    """The bare responder, in its own process: reply with the request body."""
    from pgwcore.connect import connect

    nc = await connect(url, name="bench-echo")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def echo(msg: Any) -> None:
        await msg.respond(msg.data)

    await nc.subscribe("bench.echo", cb=echo)
    await nc.flush()
    await nc.publish("bench.echo.ready", b"")
    await stop.wait()
    await nc.drain()


async def _main() -> list[dict]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from nats.errors import NoRespondersError

    from benchmarks.bench_gateway import _start_gateway, _stop, _wait_gateway, _wait_message
    from gateway.kernel.mandate import issue_mandate
    from pgwcore.connect import connect
    from pgwcore.keys import kid_of
    from pgwcore.server import EmbeddedServer
    from subjects.idp import Permit, kernel_result_decoder
    from subjects.util import now_rfc3339

    tmp = Path(tempfile.mkdtemp(prefix="pgw-bench-idp-"))
    server = EmbeddedServer(tmp / "nats", port=-1, monitor_port=-1, websocket_port=-1)
    await server.start()
    driver = await connect(server.client_url, name="bench-driver")
    gw = echo_proc = None
    try:
        key = Ed25519PrivateKey.generate()
        kid = kid_of(key.public_key())
        pem = tmp / "issuer.pem"
        pem.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        (tmp / "policies").mkdir()
        (tmp / "policies" / "bench.cedar").write_text(POLICY)
        kernel_toml = f'[kernel]\npolicy_dir = "{tmp / "policies"}"\n[kernel.issuers]\n"{kid}" = "{pem}"\n'
        so = str(uuid.uuid4())
        token = issue_mandate(key, kid, agent="bench", so_id=so, principal="alice", actions=["CloseBooking"], jti="bench-m")
        n = max(1, int(RATE * SECONDS))
        bodies = [
            msgspec.json.encode({"mandate": token, "idp": {
                "idp_id": str(uuid.uuid4()), "session_id": f"bench-{i}", "so_id": so, "mandate_id": "bench-m",
                "step_sequence": 1, "requested_action": "CloseBooking",
                "declared_goal": {"goal_id": str(uuid.uuid4()), "description": "Close the booking after checkout"},
                "reasoning_basis": {"type": "RULE_BASED", "description": "Checkout recorded"},
                "confidence_level": 0.9, "hem_urgency": "NONE", "timestamp": now_rfc3339()}})
            for i in range(n)
        ]
        # Both systems run as their own process, as they would in production; the
        # driver only sends and times.
        echo_ready = asyncio.create_task(_wait_message(driver, "bench.echo.ready", 30))
        await driver.flush()
        echo_proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.bench_idp", "echo", server.client_url,
            start_new_session=True, cwd=REPO)
        gw = await _start_gateway(server.client_url, tmp / "gw", extra_toml=kernel_toml)
        await echo_ready
        await _wait_gateway(driver)

        async def bare(i: int) -> bool:
            await driver.request("bench.echo", bodies[i], timeout=10)
            return True

        async def kernel(i: int) -> bool:
            msg = await driver.request("pgw.agent.bench.idp", bodies[i], timeout=10)
            return isinstance(kernel_result_decoder.decode(msg.data), Permit)

        # Warm up both paths (first KV/stream lookups, Cedar parse caches).
        for i in range(3):
            await bare(i)
        warm = [msgspec.json.encode({**msgspec.json.decode(bodies[0]), "idp": {**msgspec.json.decode(bodies[0])["idp"], "idp_id": str(uuid.uuid4()), "session_id": f"warm-{i}"}}) for i in range(5)]
        deadline = time.monotonic() + 30
        while True:  # the gateway answers $SRV.PING before its kernel part has subscribed
            try:
                await driver.request("pgw.agent.bench.idp", warm[0], timeout=10)
                break
            except NoRespondersError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        for w in warm[1:]:
            await driver.request("pgw.agent.bench.idp", w, timeout=10)
        base_lat, base_t, base_fail = await _drive(bare, n, RATE)
        k_lat, k_t, k_fail = await _drive(kernel, n, RATE)
    finally:
        await _stop(gw)
        await _stop(echo_proc)
        with contextlib.suppress(Exception):
            await driver.close()
        await server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    rows: list[dict] = []
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        k, b = _pct(k_lat, q) * 1000, _pct(base_lat, q) * 1000
        rows.append({"name": f"idp request-reply latency {name} @ {RATE:.0f}/s (kernel vs bare)",
                     "value": k, "baseline": b, "ratio": k / b if b else None, "unit": "ms"})
    rows.append({"name": "idp achieved rate (kernel vs bare)", "value": len(k_lat) / k_t,
                 "baseline": len(base_lat) / base_t, "ratio": (len(k_lat) / k_t) / (len(base_lat) / base_t),
                 "unit": "req/s"})
    rows.append({"name": "idp failed or non-PERMIT replies (kernel vs bare)", "value": float(k_fail),
                 "baseline": float(base_fail), "ratio": None, "unit": "count"})
    rows.append({"name": "idp mean latency (kernel vs bare)", "value": statistics.fmean(k_lat) * 1000 if k_lat else float("nan"),
                 "baseline": statistics.fmean(base_lat) * 1000, "ratio": (statistics.fmean(k_lat) / statistics.fmean(base_lat)) if k_lat else None,
                 "unit": "ms"})
    return rows


def run() -> list[dict]:
    import structlog

    # The kernel logs one line per request; keep the benchmark's output to its table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    return pgw_loop.run(_main())


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "echo":
        pgw_loop.run(_echo_main(sys.argv[2]))
        sys.exit(0)
    for row in run():
        ratio = f"{row['ratio']:.2f}" if isinstance(row["ratio"], float) else "-"
        print(f"{row['name']:<62} {row['value']:>9.3f} {row['baseline']:>9.3f} {ratio:>6} {row['unit']}")
