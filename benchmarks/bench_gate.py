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
  (``PGW_BENCH_GATE_RATES``, default ``200,300,400,500,750``/s, steps of
  ``PGW_BENCH_GATE_STEP_S`` seconds, default 1.5, one retry of a failed step)
  at which the call kept up (achieved >= 95 % of offered, nothing failed)
  with p99 <= 20 ms; the 100/s window counts as the ladder's first step;
  the gate and the gate floor each climb their own ladder, which stops at
  its first failed step; when 100/s itself fails, the ladder goes down
  instead (50, 25, 10/s, one try each) to the first rate that passes (0:
  none did). The ladder's steps are 25-50 % apart, so the target's own
  threshold (0.9x the gate floor's ceiling) falls between two of them: when
  the gate stopped below the floor and has not failed at or below that
  threshold, it is tried at the threshold itself, rounded up, one retry
  (``threshold_step``), and its ceiling is that rate if it keeps up there;
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
import math
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

from benchmarks import harness
from benchmarks.harness import pct, serve_each
from pgwcore import loop as pgw_loop

WINDOW_S = float(os.environ.get("PGW_BENCH_GATE_S", "10"))
STEP_S = float(os.environ.get("PGW_BENCH_GATE_STEP_S", "1.5"))
# The direct call's window at the operating point: only the baseline of "added" (issue 48 halved it, with
# the steps above, to make room for the gate floor within make bench's five minutes).
DIRECT_S = float(os.environ.get("PGW_BENCH_GATE_DIRECT_S", "5"))
RATES = [int(x) for x in os.environ.get("PGW_BENCH_GATE_RATES", "200,300,400,500,750").split(",") if x]
SYNCS = [s for s in os.environ.get("PGW_BENCH_GATE_SYNC", "always,default").split(",") if s]
# The issue's operating point: added latency at 100 calls/s (PGW_BENCH_GATE_RATE to look elsewhere;
# the row names then say the rate used).
RATE = float(os.environ.get("PGW_BENCH_GATE_RATE", "100"))
DOWN = [50, 25, 10]  # the ladder below RATE, tried only when RATE itself fails
P99_MAX_MS = 20.0
CEILING_RATIO = 0.9  # issue 48, target 1: the gate's ceiling >= 0.9x the gate floor's (targets.gate_ceiling)
KIND, ACTION, AGENT = "bench", "Echo", "bench"
DECLARED = "EchoDeclared"  # the same declaration for an action no executor serves (the split row)
POLICY = f'permit(principal, action in [Action::"{ACTION}", Action::"{DECLARED}"], resource);\n'
# Seconds of the split window (the declaration alone, agent.{agent}.idp); 0 leaves it out.
SPLIT_S = float(os.environ.get("PGW_BENCH_GATE_IDP_S", "3"))
# The direct call's own ladder (the baseline of "gate: ceiling"): off by default since issue 48 (the gate
# is judged against its floor and the declaration; make bench stays under five minutes).
DIRECT_LADDER = os.environ.get("PGW_BENCH_GATE_DIRECT", "") not in ("", "0")
# The declaration's own ladder (the IDP kernel's ceiling on this ladder and server): off by default, the
# report reads bench_idp's kernel ceiling instead (PGW_BENCH_GATE_DECL=1 adds it, on both settings).
DECL_LADDER = os.environ.get("PGW_BENCH_GATE_DECL", "") not in ("", "0")
# One agent: steps of one session, one after the other, gated and through the gate floor.
SEQ_N = int(os.environ.get("PGW_BENCH_GATE_SEQ", "150"))
ARGS = {"path": "/notes/today.txt", "text": "Pick up the dry cleaning before six."}
WARM = 50  # sequential calls of each kind before the first window
READY = "bench.gate.executor.ready"
EXECUTOR_CONN = "bench-gate-executor"


async def _timed(send: Any, lat: list[float]) -> bool:
    """One call: its latency in ms appended to ``lat`` when it succeeded; whether it did."""
    t0 = time.perf_counter()
    try:
        ok = await send()
    except Exception:  # noqa: BLE001 - counted, the run goes on
        ok = False
    if ok:
        lat.append((time.perf_counter() - t0) * 1000)
    return bool(ok)


async def _drive(send: Any, n: int, rate: float) -> tuple[list[float], float, int]:
    """Fire ``n`` calls at ``rate``/s open loop; (latencies in ms, elapsed s, failures)."""
    lat: list[float] = []
    failures = 0

    async def one() -> None:
        nonlocal failures
        failures += not await _timed(send, lat)

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


def threshold_step(gated: int, floor: int, failed: int | None, limit: float = CEILING_RATIO) -> int | None:
    """The rate at which the gate is tried once more after both ladders (module docstring): ``limit`` x the
    gate floor's ceiling ``floor``, rounded up, when the gate's ceiling ``gated`` is below it and the gate has
    not already failed at or below it (``failed``: the rate of its first failed step, None if none failed).
    None when there is nothing to try: the floor passed no step, the gate reached the threshold, or the
    ladder already answered the question."""
    if floor <= 0 or gated >= floor:
        return None
    rate = math.ceil(limit * floor)
    if rate <= gated or (failed is not None and rate >= failed):
        return None
    return rate


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


# -- the gate floor ------------------------------------------------------------------------------
# What a gated call must store, in the gate's rounds ("/"; the writes of a round go together, "+";
# "read:" one batched read; "reply": the answer leaves; what follows it is the tail), no logic: no
# validation, mandate, signature, hash chain, Cedar or redaction. Its records are the ones spec 003
# and the gate's crash recovery require (docs/gate.md "The path of a gated action"):
#   read:idp,tr,sess          the validation's batched read (spec 003 §5.2 (c), (f))
#   sess+submitted+tr         the step reserved by compare-and-set, IDP_SUBMITTED, the report key (§5.2(f), §5.3)
#   idp+permit+gate           after Cedar (§5.3: IDP_SUBMITTED < Cedar): the index entry, CEDAR_PERMIT_RECORDED
#                             and the open dispatch (PGW_KERNEL_GATE), all stored before the executor is asked
#   exec+dispatched           the very executor call (its own two synced writes), GATE_DISPATCHED meanwhile
#   st+verified               STATE_TRANSITIONED and its IDP_COMMITMENT_VERIFIED (§5.3, §5.5), one round
#   reply                     the agent's answer (DONE)
#   verdict+transitioned      the executed verdict (spec 004's capsule) and the index entry
#   del                       the open dispatch's key deleted, last
# ``GATE_SHAPES[name]``: the floor is a shape, as bench_idp's floors are; "before" is the gate's shape
# until issue 48 (the dispatch's index entry, the record after the answer, a round more in the tail).
GATE_SHAPES = {
    "floor": "read:idp,tr,sess / sess+submitted+tr / idp+permit+gate / exec+dispatched / st+verified / reply"
             " / verdict+transitioned / del",
    "before": "read:idp,tr,sess / sess+submitted+tr / idp+permit+gate / exec+dispatched+idpdispatched / st"
              " / reply / verified+verdict / transitioned / del",
}
FLOOR_SUBJECT, FLOOR_READY, FLOOR_CONN = "bench.gatefloor", "bench.gatefloor.ready", "bench-gate-floor"
_GF_KV, _GF_GATE, _GF_LOG, _GF_VERDICTS = "BENCH_GATEF_KERNEL", "BENCH_GATEF_GATE", "BENCH_GATEF_LOG", "BENCH_GATEF_VERDICTS"
# About the gateway's record sizes (bytes): KV values, log events, the verdict.
_GF_SIZES = {"sess": 200, "tr": 36, "idp": 380, "gate": 700, "permit": 420, "dispatched": 600, "st": 900,
             "verified": 900, "verdict": 1500}
_GF_ITEMS = {"sess", "submitted", "tr", "idp", "permit", "gate", "exec", "dispatched", "idpdispatched", "st",
             "verified", "verdict", "transitioned", "del"}


def parse_gate_shape(shape: str) -> list[tuple[str, list[str]]]:
    """``GATE_SHAPES``' notation -> [("read" | "write" | "reply", items) per round]; ValueError if malformed."""
    rounds: list[tuple[str, list[str]]] = []
    for part in (p.strip() for p in shape.split("/")):
        if part == "reply":
            rounds.append(("reply", []))
            continue
        if part.startswith("read:"):
            items = [k.strip() for k in part[5:].split(",") if k.strip()]
            bad = [k for k in items if k not in ("idp", "tr", "sess")]
            kind = "read"
        else:
            items = [w.strip() for w in part.split("+") if w.strip()]
            bad = [w for w in items if w not in _GF_ITEMS]
            kind = "write"
        if not items or bad:
            raise ValueError(f"round {part!r} of {shape!r}: unknown {bad or 'empty round'}")
        rounds.append((kind, items))
    if [k for k, _ in rounds].count("reply") != 1:
        raise ValueError(f"{shape!r}: exactly one reply round")
    return rounds


async def _floor_main(url: str, shape: str = "floor") -> None:
    """The gate floor (``GATE_SHAPES[shape]``), in its own process: each request handed over as it is
    read and served by a task of its own, at most 256 at once, as the kernel serves ``agent.*.act``;
    the writes through the kernel's primitives (``AckInbox``, ``BatchReader``)."""
    from nats.js.api import StorageType, StreamConfig

    from pgwcore.atomic import AckInbox
    from pgwcore.connect import connect
    from pgwcore.kvread import BatchReader, enable_direct
    from pgwcore.streams import ensure_kv, ensure_stream
    from subjects.gate import IDEMPOTENCY_HEADER, ExecRequest

    rounds = parse_gate_shape(GATE_SHAPES.get(shape, shape))
    nc = await connect(url, name=FLOOR_CONN)
    js = nc.jetstream()
    for bucket in (_GF_KV, _GF_GATE):
        await ensure_kv(js, bucket, replicas=1)
    await enable_direct(js, _GF_KV)
    await ensure_stream(js, StreamConfig(name=_GF_LOG, subjects=["bench.gatef.log.*"], storage=StorageType.FILE,
                                         duplicate_window=3600.0))
    await ensure_stream(js, StreamConfig(name=_GF_VERDICTS, subjects=["bench.gatef.verdict.*"],
                                         storage=StorageType.FILE, duplicate_window=3600.0))
    reader = BatchReader(nc, "$JS.API", _GF_KV, 10.0)
    await reader.start()
    acks = AckInbox(nc)
    await acks.start()
    stop_ev = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_ev.set)
    sessions: dict[str, int] = {}  # session -> the revision of its last write (the kernel caches it too)
    pad = {k: k[0].encode() * n for k, n in _GF_SIZES.items()}

    async def kv_put(bucket: str, key: str, value: bytes, last: int | None) -> int:
        headers = {} if last is None else {"Nats-Expected-Last-Subject-Sequence": str(last)}
        return (await acks.publish(f"$KV.{bucket}.{key}", value, headers, 10.0)).seq

    async def log(event: str, body: bytes, idp_id: str) -> None:
        await acks.publish(f"bench.gatef.log.{event}", body, {"Nats-Msg-Id": f"{event}:{idp_id}"}, 10.0)

    async def one(what: str, data: bytes, idp: dict[str, Any], revs: dict[str, int]) -> None:
        idp_id, session = idp["idp_id"], idp["session_id"]
        if what == "sess":
            sessions[session] = await kv_put(_GF_KV, f"sess.{session}", pad["sess"], sessions.get(session, 0))
        elif what in ("tr", "idp"):
            revs[what] = await kv_put(_GF_KV, f"{what}.{idp_id}", pad[what], 0)
        elif what in ("idpdispatched", "transitioned"):
            revs["idp"] = await kv_put(_GF_KV, f"idp.{idp_id}", pad["idp"], revs["idp"])
        elif what == "gate":
            await kv_put(_GF_GATE, idp_id, pad["gate"], None)
        elif what == "del":
            await acks.publish(f"$KV.{_GF_GATE}.{idp_id}", b"", {"KV-Operation": "DEL"}, 10.0)
        elif what == "submitted":
            await log("IDP_SUBMITTED", data, idp_id)
        elif what == "verdict":
            await acks.publish("bench.gatef.verdict.executed", pad["verdict"], {"Nats-Msg-Id": f"v:{idp_id}"}, 10.0)
        elif what == "exec":
            key = uuid.uuid4().hex
            req = ExecRequest(idempotency_key=key, action=ACTION, arguments=ARGS, idp_id=idp_id, so_id="floor",
                              agent=AGENT, principal="alice")
            await nc.request(f"pgw.exec.{KIND}.{ACTION}", msgspec.json.encode(req), timeout=10,
                             headers={IDEMPOTENCY_HEADER: key})
        else:  # permit, dispatched, st, verified: log events
            await log(what.upper(), pad[what], idp_id)

    sem = asyncio.Semaphore(256)

    async def serve(msg: Any) -> None:
        async with sem:
            idp = msgspec.json.decode(msg.data)["idp"]
            revs: dict[str, int] = {}
            replied = False
            try:
                for kind, items in rounds:
                    if kind == "read":
                        await reader.get_many([f"{k}.{idp['idp_id'] if k != 'sess' else idp['session_id']}"
                                               for k in items])
                    elif kind == "reply":
                        await msg.respond(b'{"result":"DONE"}')
                        replied = True
                    else:
                        await asyncio.gather(*(one(w, msg.data, idp, revs) for w in items))
            except Exception:  # a failed write: no answer (the driver counts it failed)
                if replied:
                    raise
                return

    await serve_each(nc, FLOOR_SUBJECT, serve, FLOOR_READY, stop_ev)
    await reader.close()
    await acks.close()
    await nc.drain()


async def _in_sequence(send: Any, n: int) -> tuple[list[float], float, int]:
    """One agent: ``n`` calls one after another, each sent once the one before is answered (spec 003 §5.1
    (6), §5.2 (f): a session's next step is taken after the result of its last one); (latencies ms, s, failures)."""
    lat: list[float] = []
    failures = 0
    start = time.perf_counter()
    for _ in range(n):
        failures += not await _timed(send, lat)
    return lat, time.perf_counter() - start, failures


async def _one_setting(sync: str, root: Path) -> list[dict]:
    """Every measurement on one nats-server started with ``sync`` (``always`` or ``default``)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from nats.errors import NoRespondersError

    from benchmarks.harness import (
        Meter,
        bench_server,
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
    from subjects.executor import decode_response
    from subjects.gate import IDEMPOTENCY_HEADER, ActDone, ExecRequest, act_result_decoder
    from subjects.idp import Permit, kernel_result_decoder
    from subjects.util import now_rfc3339

    root.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - set-up, not a timed path
    tag = "always" if sync == "always" else "default sync"
    rows: list[dict] = []
    async with bench_server(root / "nats", websocket_port=None,
                            sync_interval="always" if sync == "always" else None) as server:
        driver = await connect(server.client_url, name="bench-gate-driver")
        gw = ex = fl = None
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

            def idp_of(action: str, session: str | None = None, step: int = 1) -> dict[str, Any]:
                return {"idp_id": str(uuid.uuid4()), "session_id": session or f"g-{run_tag}-{next(counter)}",
                        "so_id": so, "mandate_id": "bench-m", "step_sequence": step, "requested_action": action,
                        "declared_goal": {"goal_id": str(uuid.uuid4()), "description": "Write today's note"},
                        "reasoning_basis": {"type": "RULE_BASED", "description": "The principal asked for a reminder"},
                        "confidence_level": 0.9, "hem_urgency": "NONE", "timestamp": now_rfc3339()}

            def act_body(session: str | None = None, step: int = 1) -> bytes:
                return msgspec.json.encode({"mandate": token, "action": ACTION, "arguments": ARGS,
                                            "idp": idp_of(ACTION, session, step)})

            async def declared() -> bool:
                """The declaration alone: the same IDP path to PERMIT (an ungated action), no dispatch."""
                msg = await driver.request(f"pgw.agent.{AGENT}.idp", msgspec.json.encode(
                    {"mandate": token, "idp": idp_of(DECLARED)}), timeout=10)
                return isinstance(kernel_result_decoder.decode(msg.data), Permit)

            async def gated(session: str | None = None, step: int = 1) -> bool:
                msg = await driver.request(f"pgw.agent.{AGENT}.act", act_body(session, step), timeout=10)
                res = act_result_decoder.decode(msg.data)
                return isinstance(res, ActDone) and res.status == "confirmed"

            async def floor(session: str | None = None, step: int = 1) -> bool:
                msg = await driver.request(FLOOR_SUBJECT, act_body(session, step), timeout=10)
                return msg.data == b'{"result":"DONE"}'

            async def direct() -> bool:
                k = uuid.uuid4().hex
                req = ExecRequest(idempotency_key=k, action=ACTION, arguments=ARGS, idp_id=str(uuid.uuid4()),
                                  so_id=so, agent=AGENT, principal="alice")
                msg = await driver.request(f"pgw.exec.{KIND}.{ACTION}", msgspec.json.encode(req), timeout=10,
                                           headers={IDEMPOTENCY_HEADER: k})
                return decode_response(msg.data).status == "ok"

            def one_agent(send: Any) -> Any:
                """One session's steps in sequence (a fresh session, steps 1, 2, 3, ...)."""
                session, steps = f"one-{run_tag}-{next(counter)}", iter(range(1, 10**9))
                return lambda: send(session, next(steps))

            progress(f"gate ({tag}): starting the executor, the gate floor and the gateway")
            # The processes start at once (the gateway's start-up is the longer one).
            gw = await start_gateway(server.client_url, root / "gw", extra_toml=kernel_toml)
            ex = await start_ready(driver, READY, "benchmarks.bench_gate", "executor", server.client_url,
                                   log_path=root / "executor.log")
            fl = await start_ready(driver, FLOOR_READY, "benchmarks.bench_gate", "floor", server.client_url,
                                   log_path=root / "floor.log")
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
                await floor()

            def meter() -> Meter:
                return Meter({"gateway": gw.pid, "executor": ex.pid, "floor": fl.pid, "server": server.pid or 0},
                             server.monitor_url, {"gateway": "pgw-gateway", "executor": EXECUTOR_CONN,
                                                  "floor": FLOOR_CONN})

            n = max(10, int(RATE * WINDOW_S))
            nd = max(10, int(RATE * DIRECT_S))
            got: dict[str, tuple[list[float], float, int, Meter]] = {}
            for name, send, k_calls in (("direct", direct, nd), ("gated", gated, n)):
                progress(f"gate ({tag}): {name} at {RATE:.0f}/s for {k_calls / RATE:g} s")
                with meter() as m:
                    lat, elapsed, fail = await _drive(send, k_calls, RATE)
                got[name] = (lat, elapsed, fail, m)
            (dl, de, df, dm), (gl, ge, gf, gm) = got["direct"], got["gated"]
            if df or gf or not dl or not gl:
                raise RuntimeError(f"calls failed at {RATE:.0f}/s: direct {df}, gated {gf}")
            d50, d99, g50, g99 = (statistics.median(dl), pct(dl, 0.99), statistics.median(gl), pct(gl, 0.99))
            achieved = f"achieved {len(gl) / ge:,.0f}/s gated, {len(dl) / de:,.0f}/s direct"
            unit = (f"ms (baseline = the direct call's {{}}; gated {{:.2f}} ms; target <= {{}} ms; {n} gated calls, "
                    f"{nd} direct, {achieved})")
            at = f"{RATE:g}/s"
            rows.append(row(f"gate: added latency p50 at {at} ({tag})", g50 - d50, d50,
                            unit.format("p50", g50, 5), digits=2) | {"ratio": round(g50 / d50, 3) if d50 else None})
            rows.append(row(f"gate: added latency p99 at {at} ({tag})", g99 - d99, d99,
                            unit.format("p99", g99, 15), digits=2) | {"ratio": round(g99 / d99, 3) if d99 else None})

            k = max(10, int(RATE * SPLIT_S))
            split: tuple[list[float], float, int] | None = None
            if SPLIT_S > 0:
                # Where the added time goes: the declaration alone (validation, session, IDP_SUBMITTED,
                # Cedar, the permit's records) at the same rate; the rest is the gate's dispatch records.
                progress(f"gate ({tag}): the declaration alone at {RATE:.0f}/s for {SPLIT_S:g} s")
                split = il, ie, inf = await _drive(declared, k, RATE)
                if inf or not il:
                    raise RuntimeError(f"declarations failed at {RATE:.0f}/s: {inf}")
                i99 = pct(il, 0.99)
                rows.append(row(f"gate: the declaration alone (agent.{{agent}}.idp PERMIT), p50 at {at} ({tag})",
                                statistics.median(il), g50,
                                f"ms (baseline = the gated call's p50; p99 {i99:.2f} vs {g99:.2f} ms; "
                                f"{k} calls, achieved {len(il) / ie:,.0f}/s)", digits=2))
                # issue 48: what the gate adds to the direct call, against what the declaration alone takes.
                rows.append(row(f"gate: added p99 at {at} vs the declaration's own p99 ({tag})", g99 - d99, i99,
                                f"ms (baseline = the declaration's p99 at {at}; target ratio <= 2)", digits=2))

            # The gate floor at the same rate: its messages and CPU per call (what a gated call must send).
            progress(f"gate ({tag}): the gate floor at {RATE:.0f}/s for {max(SPLIT_S, 1):g} s")
            kf = max(10, int(RATE * max(SPLIT_S, 1)))
            with meter() as fm:
                floor_first = await _drive(floor, kf, RATE)
            if floor_first[2] or not floor_first[0]:
                raise RuntimeError(f"the gate floor failed at {RATE:.0f}/s: {floor_first[2]}")

            async def step(name: str, send: Any, rate: int, label: str = "ladder at") -> bool:
                """One step of a ladder, one retry: a single disk or scheduler stall must not set a ceiling."""
                for attempt in (1, 2):
                    progress(f"gate ({tag}): {name} {label} {rate}/s" + (" (retry)" if attempt > 1 else ""))
                    if _passed(*await _drive(send, max(10, int(rate * STEP_S)), rate), rate):
                        return True
                return False

            async def ceiling(name: str, send: Any,
                              first: tuple[list[float], float, int] | None) -> tuple[int, int | None]:
                """The highest rate of the ladder ``send`` keeps up with at p99 <= 20 ms (module docstring),
                and the rate of its first failed step (None: none failed)."""
                if first is None:
                    progress(f"gate ({tag}): {name} at {RATE:.0f}/s for {STEP_S:g} s")
                    first = await _drive(send, max(10, int(RATE * STEP_S)), RATE)
                if not _passed(*first, RATE):
                    top, failed = 0, int(RATE)
                    for rate in (r for r in DOWN if r < RATE):  # below the operating point: one try each
                        progress(f"gate ({tag}): {name} ladder down at {rate}/s")
                        if _passed(*await _drive(send, max(10, int(rate * STEP_S)), rate), rate):
                            return rate, failed
                        failed = rate  # the lowest rate that failed (threshold_step tries nothing above it)
                    return top, failed
                top = int(RATE)
                for rate in (r for r in RATES if r > RATE):
                    if not await step(name, send, rate):
                        return top, rate
                    top = rate
                return top, None

            # The ceilings: each system's ladder on its own, the 100/s windows as their first steps.
            gated_top, gated_failed = await ceiling("gated", gated, got["gated"][:3])
            ceilings = {"gated": gated_top, "floor": (await ceiling("gate floor", floor, floor_first))[0]}
            # The target's own threshold, when the ladder stepped over it (threshold_step).
            threshold = threshold_step(gated_top, ceilings["floor"], gated_failed)
            threshold_note = ""
            if threshold is not None:
                kept = await step("gated", gated, threshold,
                                  f"at the target's threshold ({CEILING_RATIO:g}x the floor's)")
                ceilings["gated"] = threshold if kept else gated_top
                threshold_note = f"; also tried at the threshold {threshold}/s: {'kept up' if kept else 'did not'}"
            if DECL_LADDER:
                ceilings["declared"] = (await ceiling("declaration", declared, split if split else None))[0]
            if DIRECT_LADDER:
                ceilings["direct"] = (await ceiling("direct", direct, got["direct"][:3]))[0]
            top = max([int(RATE), *RATES])
            capped = "; ladder up to {top}/s" if ceilings["gated"] >= top else ""
            rows.append(row(f"gate: ceiling p99<={P99_MAX_MS:.0f}ms ({tag})", float(ceilings["gated"]),
                            float(ceilings["direct"]) if "direct" in ceilings else None,
                            "calls/s offered (baseline = the direct call's ceiling" +
                            ("" if "direct" in ceilings else ", not measured: PGW_BENCH_GATE_DIRECT=1") +
                            f"{capped.format(top=top)})", digits=0))
            rows.append(row(f"gate: ceiling p99<={P99_MAX_MS:.0f}ms vs the gate floor's ({tag})",
                            float(ceilings["gated"]), float(ceilings["floor"]),
                            f"calls/s offered (baseline = the gate floor's ceiling on the same ladder; target ratio "
                            f">= {CEILING_RATIO:g}{capped.format(top=top)}{threshold_note})", digits=0))
            if "declared" in ceilings:
                rows.append(row(f"gate: ceiling p99<={P99_MAX_MS:.0f}ms vs the declaration's ({tag})",
                                float(ceilings["gated"]), float(ceilings["declared"]),
                                "calls/s offered (baseline = the IDP kernel's declaration, agent.{agent}.idp PERMIT, "
                                f"on the same ladder and server; asked: ratio >= 0.8{capped.format(top=top)})", digits=0))

            # One agent: one session's steps in sequence, gated and through the floor.
            seq: dict[str, tuple[list[float], float, int]] = {}
            for name, send in (("gated", gated), ("floor", floor)):
                progress(f"gate ({tag}): one agent, {SEQ_N} steps of one session in sequence ({name})")
                seq[name] = await _in_sequence(one_agent(send), SEQ_N)
                if seq[name][2]:
                    raise RuntimeError(f"one agent's steps failed ({name}): {seq[name][2]}")
            (sl, se, _), (fl_lat, fe, _) = seq["gated"], seq["floor"]
            rows.append(row(f"gate: one agent, steps/s of one session in sequence ({tag})", len(sl) / se,
                            len(fl_lat) / fe,
                            f"steps/s (baseline = the gate floor's; p50 {statistics.median(sl):.2f} vs "
                            f"{statistics.median(fl_lat):.2f} ms, p99 {pct(sl, 0.99):.2f} vs {pct(fl_lat, 0.99):.2f} "
                            f"ms a step; bound by spec 003 §5.1 (6) and §5.2 (f): one step after the other)",
                            digits=1))

            # What each call cost, from the 100/s windows (robust to the machine's other load).
            rows.append(row(f"gate: gateway CPU per gated call at {at} ({tag})", gm.cpu["gateway"] * 1000 / n,
                            dm.cpu["executor"] * 1000 / nd,
                            "ms CPU (baseline = the executor's CPU per direct call)"))
            rows.append(row(f"gate: gateway CPU per gated call vs the gate floor's at {at} ({tag})",
                            gm.cpu["gateway"] * 1000 / n, fm.cpu["floor"] * 1000 / kf,
                            "ms CPU (baseline = the gate floor process's CPU per call)"))
            rows.append(row(f"gate: executor CPU per call at {at}, gated vs direct ({tag})",
                            gm.cpu["executor"] * 1000 / n, dm.cpu["executor"] * 1000 / nd, "ms CPU"))
            rows.append(row(f"gate: nats-server CPU per call at {at}, gated vs direct ({tag})",
                            gm.cpu["server"] * 1000 / n, dm.cpu["server"] * 1000 / nd, "ms CPU"))
            rows.append(row(f"gate: messages the gateway sent per gated call ({tag})", gm.msgs["gateway"][0] / n,
                            dm.msgs["executor"][0] / nd,
                            "msgs (baseline = the executor's per direct call)", digits=2))
            rows.append(row(f"gate: messages per gated call vs the gate floor's ({tag})", gm.msgs["gateway"][0] / n,
                            fm.msgs["floor"][0] / kf,
                            "msgs sent (baseline = the gate floor's: the records a gated call needs, the "
                            "executor call and the answer)", digits=2))
        finally:
            await asyncio.gather(stop(gw), stop(ex), stop(fl))
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
    return harness.run(_main())


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "executor":
        pgw_loop.run(_executor_main(sys.argv[2]))
        sys.exit(0)
    if len(sys.argv) >= 3 and sys.argv[1] == "floor":  # the gate floor; a shape of GATE_SHAPES or its notation
        pgw_loop.run(_floor_main(sys.argv[2], *sys.argv[3:4]))
        sys.exit(0)
    from benchmarks.__main__ import table

    print(table(run()))
