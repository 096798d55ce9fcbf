"""The gated path: a permitted action through the kernel's gate vs the same action called directly.

**What "the same call made directly" is.** One executor process (the SDK of
``subjects/executor.py``, kind ``bench``, action ``Echo``: it answers its
arguments back) is called two ways, on one nats-server, in one run:

- **direct** (the baseline): the driver sends an ``ExecRequest`` straight to
  ``pgw.exec.bench.Echo`` with a new idempotency key, as the kernel would.
  That is the action with everything its executor does for it (the claim of
  the key in ``PGW_EXEC_BENCH`` and the stored result: two synced KV writes)
  and nothing of the gateway. On a deployed bus the server refuses this
  publish to an agent (only the gateway's identity may send on
  ``exec.>``); the benchmark's server has no accounts, so the driver can.
- **gated**: the driver is an agent and submits ``ActRequest`` on
  ``pgw.agent.bench.act`` to ``pgw gateway``'s kernel (its own process): the
  IDP validation and the EdDSA mandate (spec 003 §5.2), the session
  compare-and-set and the chained ``IDP_SUBMITTED`` append (§5.3), Cedar
  (PERMIT), the open-dispatch key in ``PGW_KERNEL_GATE`` and
  ``GATE_DISPATCHED``, the very same executor call, then
  ``STATE_TRANSITIONED`` (``gate_executed``, ``confirmed`` with the response
  digest, spec 004 §5.2), the commitment check, the ``executed`` verdict and
  the answer. Every call is a new IDP of a new session.

So the added latency is what the kernel's governance of one action costs,
on top of the action itself (its executor's storage included). The MCP
gate (``pgw mcp-gate``) puts the same kernel path between an MCP client and
an upstream tool: the MCP hops from host to upstream are there with or
without it, and what it adds is one agent-to-gateway request and this
kernel path, so this figure is its governance cost too (an MCP upstream is
not measured here: a real server's own time would dominate and vary).

**Measured**, on each sync setting of the embedded nats-server
(``sync_interval: always``, the project's default, and the server's own
default interval; ``PGW_BENCH_GATE_SYNC=always,default``):

- at 100 calls/s open loop for ``PGW_BENCH_GATE_S`` seconds (default 10),
  direct then gated: p50 and p99 of each, and the **added latency** gated
  minus direct (targets: p50 <= 5 ms, p99 <= 15 ms);
- the **ceiling**: the highest offered rate of a ladder
  (``PGW_BENCH_GATE_RATES``, default ``200,300,500,750,1000``/s, steps of
  ``PGW_BENCH_GATE_STEP_S`` seconds, default 2, one retry of a failed step)
  at which the call kept up (achieved >= 95 % of offered, nothing failed)
  with p99 <= 20 ms; the 100/s window counts as the ladder's first step;
  gated beside direct, each ladder stops at its first failed step; when
  100/s itself fails, the ladder goes down instead (50, 25, 10/s, one try
  each) to the first rate that passes (0: none did);
- where the added time goes: the same declaration for an action no
  executor serves, on ``agent.bench.idp`` (validation, session,
  ``IDP_SUBMITTED``, Cedar, the permit's records; no dispatch), at the same
  rate for ``PGW_BENCH_GATE_IDP_S`` seconds (default 3; 0 leaves it out),
  its p50 beside the gated call's: the difference is the gate's own
  dispatch records and the executor call;
- the noise-robust figures of the 100/s windows: CPU of the gateway, the
  executor and nats-server per call, and messages the gateway's connection
  sent per gated call.

Run alone: ``.venv/bin/python -m benchmarks.bench_gate`` (about 85 s with the
defaults on 2 cores). benchmarks/performance-changes.md, "The gated path (bench_gate)".
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

from benchmarks.harness import pct
from pgwcore import loop as pgw_loop

WINDOW_S = float(os.environ.get("PGW_BENCH_GATE_S", "10"))
STEP_S = float(os.environ.get("PGW_BENCH_GATE_STEP_S", "2"))
RATES = [int(x) for x in os.environ.get("PGW_BENCH_GATE_RATES", "200,300,500,750,1000").split(",") if x]
SYNCS = [s for s in os.environ.get("PGW_BENCH_GATE_SYNC", "always,default").split(",") if s]
# The issue's operating point: added latency at 100 calls/s (PGW_BENCH_GATE_RATE to look elsewhere;
# the row names then say the rate used).
RATE = float(os.environ.get("PGW_BENCH_GATE_RATE", "100"))
DOWN = [50, 25, 10]  # the ladder below RATE, tried only when RATE itself fails
P99_MAX_MS = 20.0
KIND, ACTION, AGENT = "bench", "Echo", "bench"
DECLARED = "EchoDeclared"  # the same declaration for an action no executor serves (the split row)
POLICY = f'permit(principal, action in [Action::"{ACTION}", Action::"{DECLARED}"], resource);\n'
# Seconds of the split window (the declaration alone, agent.{agent}.idp); 0 leaves it out.
SPLIT_S = float(os.environ.get("PGW_BENCH_GATE_IDP_S", "3"))
ARGS = {"path": "/notes/today.txt", "text": "Pick up the dry cleaning before six."}
WARM = 50  # sequential calls of each kind before the first window
READY = "bench.gate.executor.ready"
EXECUTOR_CONN = "bench-gate-executor"


async def _drive(send: Any, n: int, rate: float) -> tuple[list[float], float, int]:
    """Fire ``n`` calls at ``rate``/s open loop; (latencies in ms, elapsed s, failures)."""
    lat: list[float] = []
    failures = 0

    async def one() -> None:
        nonlocal failures
        t0 = time.perf_counter()
        try:
            ok = await send()
        except Exception:  # noqa: BLE001 - counted, the run goes on
            ok = False
        if ok:
            lat.append((time.perf_counter() - t0) * 1000)
        else:
            failures += 1

    start = time.perf_counter()
    tasks = []
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # pacing the open-loop driver, not waiting for an event
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return lat, time.perf_counter() - start, failures


def _passed(lat: list[float], elapsed: float, fail: int, rate: float) -> bool:
    return not fail and bool(lat) and len(lat) / elapsed >= 0.95 * rate and pct(lat, 0.99) <= P99_MAX_MS


async def _executor_main(url: str) -> None:
    """The bench executor, in its own process: ``Echo`` answers its arguments (the SDK stores each result)."""
    from pgwcore.connect import connect
    from subjects.executor import Executor

    nc = await connect(url, name=EXECUTOR_CONN)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Executor(nc, KIND) as ex:
        @ex.action(ACTION)
        async def echo(args: dict[str, Any]) -> Any:
            return {"echo": args}

        await nc.publish(READY, b"")
        await stop.wait()
    await nc.drain()


async def _one_setting(sync: str, root: Path) -> list[dict]:
    """Both measurements on one nats-server started with ``sync`` (``always`` or ``default``)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from nats.errors import NoRespondersError

    from benchmarks.harness import (
        Meter,
        progress,
        row,
        start_gateway,
        start_ready,
        stop,
        wait_gateway,
    )
    from gateway.kernel.mandate import issue_mandate
    from pgwcore.connect import connect
    from pgwcore.keys import kid_of
    from pgwcore.server import EmbeddedServer
    from subjects.executor import decode_response
    from subjects.gate import IDEMPOTENCY_HEADER, ActDone, ExecRequest, act_result_decoder
    from subjects.idp import Permit, kernel_result_decoder
    from subjects.util import now_rfc3339

    root.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - set-up, not a timed path
    tag = "always" if sync == "always" else "default sync"
    rows: list[dict] = []
    async with EmbeddedServer(root / "nats", port=-1, monitor_port=-1, websocket_port=None,
                              sync_interval="always" if sync == "always" else None) as server:
        driver = await connect(server.client_url, name="bench-gate-driver")
        gw = ex = None
        try:
            key = Ed25519PrivateKey.generate()
            kid = kid_of(key.public_key())
            pem = root / "issuer.pem"
            pem.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo))
            (root / "policies").mkdir(exist_ok=True)
            (root / "policies" / "bench.cedar").write_text(POLICY)
            kernel_toml = (f'[kernel]\npolicy_dir = "{root / "policies"}"\n[kernel.issuers]\n"{kid}" = "{pem}"\n'
                           f'[kernel.executors.{KIND}]\nactions = ["{ACTION}"]\ntimeout_s = 10.0\n')
            so = str(uuid.uuid4())
            token = issue_mandate(key, kid, agent=AGENT, so_id=so, principal="alice", actions=[ACTION, DECLARED],
                                  jti="bench-m")
            run_tag = uuid.uuid4().hex[:8]
            counter = iter(range(10**9))

            def idp_of(action: str) -> dict[str, Any]:
                return {"idp_id": str(uuid.uuid4()), "session_id": f"g-{run_tag}-{next(counter)}", "so_id": so,
                        "mandate_id": "bench-m", "step_sequence": 1, "requested_action": action,
                        "declared_goal": {"goal_id": str(uuid.uuid4()), "description": "Write today's note"},
                        "reasoning_basis": {"type": "RULE_BASED", "description": "The principal asked for a reminder"},
                        "confidence_level": 0.9, "hem_urgency": "NONE", "timestamp": now_rfc3339()}

            def act_body() -> bytes:
                return msgspec.json.encode({"mandate": token, "action": ACTION, "arguments": ARGS, "idp": idp_of(ACTION)})

            async def declared() -> bool:
                """The declaration alone: the same IDP path to PERMIT (an ungated action), no dispatch."""
                msg = await driver.request(f"pgw.agent.{AGENT}.idp", msgspec.json.encode(
                    {"mandate": token, "idp": idp_of(DECLARED)}), timeout=10)
                return isinstance(kernel_result_decoder.decode(msg.data), Permit)

            async def gated() -> bool:
                msg = await driver.request(f"pgw.agent.{AGENT}.act", act_body(), timeout=10)
                res = act_result_decoder.decode(msg.data)
                return isinstance(res, ActDone) and res.status == "confirmed"

            async def direct() -> bool:
                k = uuid.uuid4().hex
                req = ExecRequest(idempotency_key=k, action=ACTION, arguments=ARGS, idp_id=str(uuid.uuid4()),
                                  so_id=so, agent=AGENT, principal="alice")
                msg = await driver.request(f"pgw.exec.{KIND}.{ACTION}", msgspec.json.encode(req), timeout=10,
                                           headers={IDEMPOTENCY_HEADER: k})
                return decode_response(msg.data).status == "ok"

            progress(f"gate ({tag}): starting the executor and the gateway")
            # Both processes start at once (the gateway's start-up is the longer one).
            gw = await start_gateway(server.client_url, root / "gw", extra_toml=kernel_toml)
            ex = await start_ready(driver, READY, "benchmarks.bench_gate", "executor", server.client_url,
                                   log_path=root / "executor.log")
            await wait_gateway(driver)
            deadline = time.monotonic() + 30
            while True:  # the gateway answers $SRV.PING before its kernel part has subscribed
                try:
                    if await gated():
                        break
                except NoRespondersError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the gated call did not succeed within 30 s (see {root / 'gw'})")
                await asyncio.sleep(0.1)
            for _ in range(WARM):  # warm-up: first stream and KV lookups, Cedar's caches
                await direct()
                await gated()
                await declared()

            def meter() -> Meter:
                return Meter({"gateway": gw.pid, "executor": ex.pid, "server": server.pid or 0}, server.monitor_url,
                             {"gateway": "pgw-gateway", "executor": EXECUTOR_CONN})

            n = max(10, int(RATE * WINDOW_S))
            got: dict[str, tuple[list[float], float, int, Meter]] = {}
            for name, send in (("direct", direct), ("gated", gated)):
                progress(f"gate ({tag}): {name} at {RATE:.0f}/s for {WINDOW_S:g} s")
                with meter() as m:
                    lat, elapsed, fail = await _drive(send, n, RATE)
                got[name] = (lat, elapsed, fail, m)
            (dl, de, df, dm), (gl, ge, gf, gm) = got["direct"], got["gated"]
            if df or gf or not dl or not gl:
                raise RuntimeError(f"calls failed at {RATE:.0f}/s: direct {df}, gated {gf}")
            d50, d99, g50, g99 = (statistics.median(dl), pct(dl, 0.99), statistics.median(gl), pct(gl, 0.99))
            achieved = f"achieved {len(gl) / ge:,.0f}/s gated, {len(dl) / de:,.0f}/s direct"
            unit = f"ms (baseline = the direct call's {{}}; gated {{:.2f}} ms; target <= {{}} ms; {n} calls each, {achieved})"
            at = f"{RATE:g}/s"
            rows.append(row(f"gate: added latency p50 at {at} ({tag})", g50 - d50, d50,
                            unit.format("p50", g50, 5), digits=2) | {"ratio": round(g50 / d50, 3) if d50 else None})
            rows.append(row(f"gate: added latency p99 at {at} ({tag})", g99 - d99, d99,
                            unit.format("p99", g99, 15), digits=2) | {"ratio": round(g99 / d99, 3) if d99 else None})

            if SPLIT_S > 0:
                # Where the added time goes: the declaration alone (validation, session, IDP_SUBMITTED,
                # Cedar, the permit's records) at the same rate; the rest is the gate's dispatch records.
                k = max(10, int(RATE * SPLIT_S))
                progress(f"gate ({tag}): the declaration alone at {RATE:.0f}/s for {SPLIT_S:g} s")
                il, ie, inf = await _drive(declared, k, RATE)
                if inf or not il:
                    raise RuntimeError(f"declarations failed at {RATE:.0f}/s: {inf}")
                rows.append(row(f"gate: the declaration alone (agent.{{agent}}.idp PERMIT), p50 at {at} ({tag})",
                                statistics.median(il), g50,
                                f"ms (baseline = the gated call's p50; p99 {pct(il, 0.99):.2f} vs {g99:.2f} ms; "
                                f"{k} calls, achieved {len(il) / ie:,.0f}/s)", digits=2))

            # The ceiling: the 100/s window is the first step; then the ladder, each system on its own.
            ceilings: dict[str, int] = {}
            for name, send in (("gated", gated), ("direct", direct)):
                lat, elapsed, fail, _ = got[name]
                ceiling = int(RATE) if _passed(lat, elapsed, fail, RATE) else 0
                for rate in (r for r in DOWN if r < RATE and not ceiling):  # below the operating point: one try each
                    progress(f"gate ({tag}): {name} ladder down at {rate}/s")
                    if _passed(*await _drive(send, max(10, int(rate * STEP_S)), rate), rate):
                        ceiling = rate
                for rate in [r for r in RATES if r > RATE] if ceiling == int(RATE) else []:
                    for attempt in (1, 2):  # one retry: a single disk or scheduler stall must not set it
                        progress(f"gate ({tag}): {name} ladder at {rate}/s" + (" (retry)" if attempt > 1 else ""))
                        lat, elapsed, fail = await _drive(send, max(10, int(rate * STEP_S)), rate)
                        ok = _passed(lat, elapsed, fail, rate)
                        if ok:
                            break
                    if not ok:
                        break
                    ceiling = rate
                ceilings[name] = ceiling
            top = f"; ladder up to {max([int(RATE), *RATES])}/s" if ceilings["gated"] >= max([int(RATE), *RATES]) else ""
            rows.append(row(f"gate: ceiling p99<={P99_MAX_MS:.0f}ms ({tag})", float(ceilings["gated"]),
                            float(ceilings["direct"]), f"calls/s offered (baseline = the direct call's ceiling{top})",
                            digits=0))

            # What each call cost, from the 100/s windows (robust to the machine's other load).
            rows.append(row(f"gate: gateway CPU per gated call at {at} ({tag})", gm.cpu["gateway"] * 1000 / n,
                            dm.cpu["executor"] * 1000 / n,
                            "ms CPU (baseline = the executor's CPU per direct call)"))
            rows.append(row(f"gate: executor CPU per call at {at}, gated vs direct ({tag})",
                            gm.cpu["executor"] * 1000 / n, dm.cpu["executor"] * 1000 / n, "ms CPU"))
            rows.append(row(f"gate: nats-server CPU per call at {at}, gated vs direct ({tag})",
                            gm.cpu["server"] * 1000 / n, dm.cpu["server"] * 1000 / n, "ms CPU"))
            rows.append(row(f"gate: messages the gateway sent per gated call ({tag})", gm.msgs["gateway"][0] / n,
                            dm.msgs["executor"][0] / n,
                            "msgs (baseline = the executor's per direct call)", digits=2))
        finally:
            await asyncio.gather(stop(gw), stop(ex))
            with contextlib.suppress(Exception):
                await driver.close()
    return rows


async def _main() -> list[dict]:
    from benchmarks.harness import progress

    rows: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="pgw-bench-gate-"))
    try:
        for sync in SYNCS:
            if sync not in ("always", "default"):
                raise ValueError(f"PGW_BENCH_GATE_SYNC: {sync!r} is neither 'always' nor 'default'")
            progress(f"gate: sync {sync}")
            rows += await _one_setting(sync, tmp / sync)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def run() -> list[dict]:
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    return pgw_loop.run(_main())


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "executor":
        pgw_loop.run(_executor_main(sys.argv[2]))
        sys.exit(0)
    from benchmarks.__main__ import table

    print(table(run()))
