"""IDP kernel request-reply vs a bare request-reply responder: each one's ceiling (issues 4 and 18).

Both run as their own process against the same embedded nats-server
(JetStream ``sync_interval: always``) and are driven the same way: an
open-loop driver fires requests at a fixed offered rate for
``PGW_BENCH_IDP_S`` seconds (default 5) per step of a ladder
(``PGW_BENCH_IDP_RATES``, default ``250,500,750,1000,1500,2000,3000``/s).
A system's **ceiling** is the highest offered rate at which it kept up
(achieved >= 95 % of offered, no failures) with p99 <= 10 ms; its ladder
stops at the first rate it fails.

- **kernel**: ``agent.bench.idp`` served by ``pgw gateway``'s ``KernelService``:
  decode and validate the IDP (spec 003 §5.2), verify the EdDSA mandate, the
  session compare-and-set and the signed, chained ``IDP_SUBMITTED`` append,
  Cedar, the ``CEDAR_PERMIT_RECORDED`` append, the IDP index entry and the
  open-permit record (``PGW_KERNEL_OPEN``), then the reply. Every request
  carries a new idp_id and (``PGW_BENCH_IDP_STEPS``, default 1) a new session; the
  agent presents the same mandate.
- **bare** (baseline): a core-NATS responder on ``bench.echo`` that replies
  with the request body, no logic, no storage.
- **contract floor** (``_floor_main``): a responder on ``bench.idpfloor`` that
  does only the kernel's reads and synced writes for a PERMIT of a new session,
  in the kernel's rounds and through its primitives (``BatchReader``,
  ``publish_acked``): the batched read of the index entry, report key and
  session; then together the session compare-and-set, the ``IDP_SUBMITTED``
  append and the report key (spec 003 §5.2(f), §5.3); then together the index
  entry and the ``CEDAR_PERMIT_RECORDED`` append; then the reply. No
  validation, mandate, signature, hash chain or Cedar: what the kernel spends
  beyond it is its own code, what it spends beyond the bare responder is what
  spec 003 has stored before the answer. The record sizes are approximate
  (the request itself as ``IDP_SUBMITTED``, a few hundred bytes for the
  others); with five synced writes of under 2 KB together the cost is the
  writes' count, not their bytes.
- **log-index floor** (``PGW_BENCH_IDP_MIN=1``, with the next one; off by
  default to keep ``make bench`` under five minutes): what a kernel would
  still store if its idp_id index were the in-memory one spec 003 §8.4
  describes ("an in-memory index of committed idp_ids ..., rebuilt from the
  Event Log"), kept by following the log instead of by the two keys per
  request of ``PGW_KERNEL`` (index entry, report key): the session read, then
  together the session compare-and-set and ``IDP_SUBMITTED``, then the
  ``CEDAR_PERMIT_RECORDED`` append (the overdue sweep's record), then the
  reply.
- **minimal floor** (``PGW_BENCH_IDP_MIN=1``): the same responder storing only
  what spec 003 itself requires before a PERMIT, the session compare-and-set
  (§5.2(f)) and ``IDP_SUBMITTED`` (§5.3), together, then the reply: no read
  (a session revision known in memory) and no permit record. A lower bound,
  not a design.

Rows: each ceiling; p50/p99 at every step; the gateway's and the server's CPU
per request and the gateway connection's messages per request (at the
highest step the kernel passed). Run alone: ``.venv/bin/python -m benchmarks.bench_idp``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

from pgwcore import loop as pgw_loop

RATES = [int(x) for x in os.environ.get("PGW_BENCH_IDP_RATES", "250,500,750,1000,1500,2000,3000").split(",") if x]
SECONDS = float(os.environ.get("PGW_BENCH_IDP_S", "5"))
# Steps per session (default 1: every request a new session). With more, the
# sessions are interleaved so that each recurs about SECONDS / STEPS apart at 250/s.
STEPS = max(1, int(os.environ.get("PGW_BENCH_IDP_STEPS", "1")))
P99_MAX_MS = 10.0
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


FLOOR_BUCKET, FLOOR_LOG = "BENCH_IDPF_KERNEL", "BENCH_IDPF_LOG"


# The floors: module argument -> (subject and connection name suffix, what it stores); module docstring.
FLOORS = {"floor": "", "floor-log": "log", "floor-min": "min"}


async def _floor_main(url: str, variant: str = "floor") -> None:
    """One IDP floor (``FLOORS``), in its own process (module docstring)."""
    from nats.js.api import StorageType, StreamConfig

    from pgwcore.atomic import publish_acked
    from pgwcore.connect import connect
    from pgwcore.kvread import BatchReader, enable_direct
    from pgwcore.streams import ensure_kv, ensure_stream

    suffix = FLOORS[variant]
    name = f"bench.idpfloor{suffix}"
    nc = await connect(url, name=f"bench-idp-{variant}")
    js = nc.jetstream()
    await ensure_kv(js, FLOOR_BUCKET, replicas=1)
    await enable_direct(js, FLOOR_BUCKET)
    await ensure_stream(js, StreamConfig(name=FLOOR_LOG, subjects=["bench.idpf.log.*"], storage=StorageType.FILE,
                                         duplicate_window=3600.0))
    reader = BatchReader(nc, "$JS.API", FLOOR_BUCKET, 10.0)
    await reader.start()
    kv = f"$KV.{FLOOR_BUCKET}."
    permit_event = b"p" * 420  # about the size of a signed CEDAR_PERMIT_RECORDED
    stop_ev = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_ev.set)

    def put(key: str, value: bytes) -> Any:  # a create: the key must not exist (the kernel's _write, rev 0)
        return publish_acked(nc, kv + key, value, {"Nats-Expected-Last-Subject-Sequence": "0"}, 10.0)

    def log(event: str, body: bytes, idp_id: str) -> Any:
        return publish_acked(nc, f"bench.idpf.log.{event}", body, {"Nats-Msg-Id": f"{event}:{idp_id}"}, 10.0)

    async def serve(msg: Any) -> None:
        idp = msgspec.json.decode(msg.data)["idp"]
        idp_id, session = idp["idp_id"], idp["session_id"]
        if variant == "floor-min":
            await asyncio.gather(put(f"sess.{session}", b"s" * 200), log("IDP_SUBMITTED", msg.data, idp_id))
            await msg.respond(b'{"result":"PERMIT"}')
            return
        if variant == "floor-log":
            await reader.get_many([f"sess.{session}"])
            await asyncio.gather(put(f"sess.{session}", b"s" * 200), log("IDP_SUBMITTED", msg.data, idp_id))
            await log("CEDAR_PERMIT_RECORDED", permit_event, idp_id)
            await msg.respond(b'{"result":"PERMIT"}')
            return
        await reader.get_many([f"idp.{idp_id}", f"tr.{idp_id}", f"sess.{session}"])
        await asyncio.gather(put(f"sess.{session}", b"s" * 200), log("IDP_SUBMITTED", msg.data, idp_id),
                             put(f"tr.{idp_id}", b"t" * 36))
        await asyncio.gather(put(f"idp.{idp_id}", b"e" * 360), log("CEDAR_PERMIT_RECORDED", permit_event, idp_id))
        await msg.respond(b'{"result":"PERMIT"}')

    await nc.subscribe(name, cb=serve)
    await nc.flush()
    await nc.publish(f"{name}.ready", b"")
    await stop_ev.wait()
    await reader.close()
    await nc.drain()


async def _ladder(name: str, send: Any, meter: Any) -> tuple[int, list[dict], dict]:
    """Step up the offered rate until ``send`` fails a step; (ceiling, rows, CPU/messages at the ceiling)."""
    from benchmarks.harness import progress, row

    ceiling, rows, at_ceiling = 0, [], {}
    for rate in RATES:
        n = max(10, int(rate * SECONDS))
        for attempt in (1, 2):  # one retry: a single disk or scheduler stall must not set the ceiling
            progress(f"idp {name}: {rate}/s for {SECONDS:.0f} s" + (" (retry)" if attempt > 1 else ""))
            with meter() as m:
                lat, elapsed, fail = await _drive(send, n, rate)
            p50, p99 = _pct(lat, 0.5) * 1000, _pct(lat, 0.99) * 1000
            achieved = len(lat) / elapsed
            ok = not fail and achieved >= 0.95 * rate and p99 <= P99_MAX_MS
            verdict = "" if ok else " (failed the step)"
            rows.append(row(f"idp {name}: p99 / p50 @ {rate}/s offered, try {attempt}{verdict}", p99, p50,
                            f"ms (baseline column = p50; achieved {achieved:,.0f}/s, {fail} failed)", digits=2)
                        | {"ratio": None})
            if ok or not at_ceiling:
                at_ceiling = {k: v * 1000 / n for k, v in m.cpu.items()} | {f"msgs_{k}": v[0] / n for k, v in m.msgs.items()}
                at_ceiling["rate"] = rate
            if ok:
                break
        if not ok:
            break
        ceiling = rate
    return ceiling, rows, at_ceiling


async def _main() -> list[dict]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from nats.errors import NoRespondersError

    from benchmarks.harness import Meter, row, start_gateway, start_ready, stop, wait_gateway
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
    gw = echo_proc = floor_proc = None
    # The optional floors (PGW_BENCH_IDP_MIN=1): module argument -> (ladder name, ceiling row, what it writes).
    extra = {"floor-log": ("log-index floor", "session read; session + IDP_SUBMITTED; CEDAR_PERMIT_RECORDED",
                           "read, writes, reply"),
             "floor-min": ("minimal floor", "session + IDP_SUBMITTED only", "writes, reply")}
    if os.environ.get("PGW_BENCH_IDP_MIN", "") in ("", "0"):
        extra = {}
    extra_procs: dict[str, Any] = {}
    extra_results: dict[str, tuple[int, list[dict], dict]] = {}
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
        tag = uuid.uuid4().hex[:8]

        nsess = max(1, int(250 * SECONDS / STEPS))

        def body(i: int, prefix: str = "bench") -> bytes:
            session, step = (i, 1) if STEPS == 1 or prefix != "bench" else (i % nsess, i // nsess + 1)
            return msgspec.json.encode({"mandate": token, "idp": {
                "idp_id": str(uuid.uuid4()), "session_id": f"{prefix}-{tag}-{session}", "so_id": so, "mandate_id": "bench-m",
                "step_sequence": step, "requested_action": "CloseBooking",
                "declared_goal": {"goal_id": str(uuid.uuid4()), "description": "Close the booking after checkout"},
                "reasoning_basis": {"type": "RULE_BASED", "description": "Checkout recorded"},
                "confidence_level": 0.9, "hem_urgency": "NONE", "timestamp": now_rfc3339()}})

        # Both systems run as their own process, as they would in production; the
        # driver only sends and times.
        logs = tmp / "logs"
        echo_proc = await start_ready(driver, "bench.echo.ready", "benchmarks.bench_idp", "echo", server.client_url,
                                      log_path=logs / "echo.log")
        floor_proc = await start_ready(driver, "bench.idpfloor.ready", "benchmarks.bench_idp", "floor",
                                       server.client_url, log_path=logs / "floor.log")
        for variant in extra:
            extra_procs[variant] = await start_ready(
                driver, f"bench.idpfloor{FLOORS[variant]}.ready", "benchmarks.bench_idp", variant, server.client_url,
                log_path=logs / f"{variant}.log")
        gw = await start_gateway(server.client_url, tmp / "gw", extra_toml=kernel_toml)
        await wait_gateway(driver)
        counter = iter(range(10**9))
        payload = body(0)

        async def bare(_i: int) -> bool:
            await driver.request("bench.echo", payload, timeout=10)
            return True

        async def kernel(_i: int) -> bool:
            msg = await driver.request("pgw.agent.bench.idp", body(next(counter)), timeout=10)
            return isinstance(kernel_result_decoder.decode(msg.data), Permit)

        def floor_of(variant: str) -> Any:
            async def send(_i: int) -> bool:
                msg = await driver.request(f"bench.idpfloor{FLOORS[variant]}", body(next(counter)), timeout=10)
                return msg.data == b'{"result":"PERMIT"}'
            return send

        floor = floor_of("floor")

        for _ in range(3):
            await bare(0)
            await floor(0)
        deadline = time.monotonic() + 30
        while True:  # the gateway answers $SRV.PING before its kernel part has subscribed
            try:
                await driver.request("pgw.agent.bench.idp", body(0, "warm"), timeout=10)
                break
            except NoRespondersError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        for i in range(1, 50):  # warm-up: first KV/stream lookups, Cedar caches
            await driver.request("pgw.agent.bench.idp", body(i, "warm"), timeout=10)

        def meter_of(pid: int, conn: str) -> Any:
            return lambda: Meter({"service": pid, "server": server.pid or 0}, server.monitor_url, {"service": conn})

        b_ceiling, b_rows, b_at = await _ladder("bare responder", bare, meter_of(echo_proc.pid, "bench-echo"))
        f_ceiling, f_rows, f_at = await _ladder("contract floor", floor, meter_of(floor_proc.pid, "bench-idp-floor"))
        for variant, proc in extra_procs.items():
            extra_results[variant] = await _ladder(extra[variant][0], floor_of(variant),
                                                   meter_of(proc.pid, f"bench-idp-{variant}"))
        k_ceiling, k_rows, k_at = await _ladder("kernel", kernel, meter_of(gw.pid, "pgw-gateway"))
    finally:
        await stop(gw)
        await stop(echo_proc)
        await stop(floor_proc)
        for proc in extra_procs.values():
            await stop(proc)
        with contextlib.suppress(Exception):
            await driver.close()
        await server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [row(f"idp ceiling: highest offered rate with p99 <= {P99_MAX_MS:.0f} ms (kernel vs bare responder)",
                float(k_ceiling), float(b_ceiling), "req/s (target: kernel >= 1,000 on 2 cores)", digits=0),
            row("idp ceiling: the contract floor (the kernel's reads and writes, no logic) vs bare responder",
                float(f_ceiling), float(b_ceiling), "req/s", digits=0)]
    if k_at:
        rows += _cost_rows("idp kernel", k_at, b_at, "writes, reply")
    if f_at:
        rows += _cost_rows("idp contract floor", f_at, b_at, "writes, read, reply")
    extra_rows: list[dict] = []
    for variant, (ceiling, ladder_rows, at) in extra_results.items():
        name, stores, what = extra[variant]
        rows.append(row(f"idp ceiling: the {name} ({stores}) vs bare responder", float(ceiling), float(b_ceiling),
                        "req/s", digits=0))
        if at:
            rows += _cost_rows(f"idp {name}", at, b_at, what)
        extra_rows += ladder_rows
    return rows + k_rows + f_rows + extra_rows + b_rows


def _cost_rows(who: str, at: dict, bare: dict, what: str) -> list[dict]:
    """CPU of the service and of nats-server, and messages sent, per request at ``who``'s highest passed step."""
    from benchmarks.harness import row

    return [row(f"{who}: CPU per request @ {at['rate']}/s (vs bare responder)", at["service"], bare.get("service"),
                "ms CPU"),
            row(f"{who}: nats-server CPU per request @ {at['rate']}/s (vs bare responder's)", at["server"],
                bare.get("server"), "ms CPU"),
            row(f"{who}: messages sent to the server per request (vs bare responder)", at["msgs_service"],
                bare.get("msgs_service"), f"msgs ({what})", digits=2)]


def run() -> list[dict]:
    import structlog

    # The kernel logs one line per request; keep the benchmark's output to its table.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    return pgw_loop.run(_main())


if __name__ == "__main__":
    if len(sys.argv) >= 3 and (sys.argv[1] == "echo" or sys.argv[1] in FLOORS):
        pgw_loop.run(_echo_main(sys.argv[2]) if sys.argv[1] == "echo" else _floor_main(sys.argv[2], sys.argv[1]))
        sys.exit(0)
    for r in run():
        print(r)
