"""The binding-moment path vs a bare JetStream relay, measured side by side (issue 8).

Both systems run as their own process against the same embedded nats-server
(JetStream ``sync_interval: always``), fed by the same driver with the same
envelope bytes, and observed the same way (a core subscription on the
principal's subject, matched by envelope id):

- **gateway**: ``pgw gateway`` — shape, kind, payload, lints, redaction,
  trust, correlationId dedup (KV CAS), the moment (KV create), then three
  JetStream publishes (surface item, ``hitl_dispatched`` verdict, outcome),
  each awaiting its PubAck, the dedup settle (KV CAS), then the ack. Writes
  to one stream issued while another is in flight go out together as one
  atomic batch (``pgwcore.publish.GroupCommit``); each still awaits its own
  storage before the envelope moves on.
- **relay** (baseline): ``python -m benchmarks.bench_gateway relay URL`` — the
  same durable pull consumer with explicit ack on a copy of PGW_INBOUND, the
  same pipelined fetch loop (four batches of 64 in flight), one JetStream
  publish of the body to ``bench.out.{principal}`` awaiting the PubAck (with
  ``Nats-Msg-Id``), then the ack. Same ack semantics, no logic, no group
  commit (one plain publish per envelope). The target row is against this.
- **relay with group commit** (``relay URL group-commit``): the same relay,
  its publish through the same ``GroupCommit`` the gateway uses, on streams
  with ``allow_atomic``; throughput only. The ratio against it shows what
  the gateway's path costs beyond the batching technique both then share.

Rows: throughput (envelopes/s through each, ratio gateway/relay; target
>= 0.5); latency p50/p99 (publish -> surface receive) at fixed open-loop
offered rates, ratio gateway/relay (lower is better); RSS of the gateway
process over a soak (``PGW_SOAK_S`` seconds, default 20; 600 for the
10-minute soak) vs the relay's under the same load.

Sizes: ``PGW_BENCH_N`` (throughput envelopes, default 2000),
``PGW_BENCH_RATE_S`` (seconds per offered rate, default 2),
``PGW_BENCH_RATES`` (default ``100,500,2000``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

from pgwcore import loop as pgw_loop
from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.publish import GroupCommit
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams
from subjects.client import BINDING_MOMENT_KIND, envelope

PGW = str(Path(sys.executable).parent / "pgw")
PRINCIPAL = "alice"
MOMENT = {
    "synopsis": "Share only your 2025 tax summary with Harbor Accounting, not the full ledger.",
    "findings": ["Harbor requested the full ledger for the 2025 filing.",
                 "Their engagement letter covers the annual filing only."],
    "recommendations": ["Send the 2025 tax summary PDF through the client portal."],
    "offer": "Ask for detail on any item.",
    "question": {
        "stem": "Which records should Harbor Accounting receive for the 2025 filing?",
        "options": [
            {"label": "Send the 2025 tax summary only", "reasoning": "Covers the filing and keeps the ledger private."},
            {"label": "Send the full ledger", "reasoning": "Matches their request if they need line items later."},
        ],
        "recommended_idx": 0,
        "hatches": {"free_text": True, "dialogue": True},
    },
}


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


# ---------------------------------------------------------------------------
# The baseline relay (runs as its own process)
# ---------------------------------------------------------------------------

RELAY_STREAM_IN = "BENCH_IN"
RELAY_STREAM_OUT = "BENCH_OUT"
# The second relay: the same loop, its publishes through the gateway's group commit.
GC_IN, GC_OUT = "BENCH_GC_IN", "BENCH_GC_OUT"
RELAYS = {  # variant: (input stream, input subjects, output stream, output prefix)
    "plain": (RELAY_STREAM_IN, "bench.agent.*.envelope", RELAY_STREAM_OUT, "bench.out"),
    "group-commit": (GC_IN, "bench.gcagent.*.envelope", GC_OUT, "bench.gcout"),
}


async def ensure_relay_streams(nc: Client) -> None:
    js = nc.jetstream()
    for variant, (sin, subj_in, sout, out) in RELAYS.items():
        for name, subj in ((sin, subj_in), (sout, f"{out}.*")):
            with contextlib.suppress(Exception):
                await js.add_stream(StreamConfig(name=name, subjects=[subj], storage=StorageType.FILE,
                                                 duplicate_window=3600.0,
                                                 allow_atomic=True if variant == "group-commit" else None))


async def relay_main(url: str, variant: str = "plain") -> None:
    """Pull, publish-with-PubAck, ack: the bare minimum with the gateway's ack semantics.

    ``group-commit``: the publishes go through :class:`pgwcore.publish.GroupCommit`
    (what the gateway's own writes use), so the ratio against it shows what the
    gateway costs beyond the batching both then share.
    """
    sin, subj_in, sout, out = RELAYS[variant]
    nc = await connect(url, name=f"bench-relay-{variant}")
    js = nc.jetstream()
    await ensure_relay_streams(nc)
    psub = await js.pull_subscribe(
        subj_in, durable=f"bench-relay-{variant}", stream=sin,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_ack_pending=64 * 16))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    gc = GroupCommit(js, sout) if variant == "group-commit" else None
    await nc.publish(f"bench.relay.ready.{variant}", b"")

    async def plain(subject: str, data: bytes, headers: dict[str, str]) -> object:
        return await js.publish(subject, data, headers=headers)

    async def one(m) -> None:
        seq = m.metadata.sequence.stream
        subject, headers = f"{out}.{PRINCIPAL}", {"Nats-Msg-Id": f"relay:{seq}"}
        if gc is None:
            await plain(subject, m.data, headers)
        else:
            await gc.write(subject, m.data, headers, lambda: plain(subject, m.data, headers), lambda seq: seq)
        await m.ack()

    # The same pipelined loop as the gateway's worker (gateway/pipeline.py):
    # up to four batches of 64 in flight, fetching again as soon as there is room.
    inflight: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        free = 256 - len(inflight)
        if free <= 0:
            await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            continue
        try:
            msgs = await psub.fetch(min(64, free), timeout=0.5)
        except Exception:  # noqa: BLE001 - timeouts between bursts
            continue
        for m in msgs:
            task = asyncio.create_task(one(m))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
    if inflight:
        await asyncio.gather(*inflight, return_exceptions=True)
    await nc.drain()


# ---------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------


@dataclass
class System:
    """One system under test: where to publish, where results appear, how to read the id."""

    name: str
    publish_subject: str
    receive_subject: str
    proc: asyncio.subprocess.Process | None = None
    received: dict[str, float] = field(default_factory=dict)
    waiters: dict[str, asyncio.Future[None]] = field(default_factory=dict)

    def on_receive(self, data: bytes) -> None:
        t = time.perf_counter()
        try:
            body = json.loads(data)
        except ValueError:
            return
        eid = body.get("envelope_id") or body.get("envelopeId")
        if eid and eid not in self.received:
            self.received[eid] = t
            fut = self.waiters.pop(eid, None)
            if fut is not None and not fut.done():
                fut.set_result(None)


async def _start_gateway(url: str, data: Path, extra_toml: str = "") -> asyncio.subprocess.Process:
    data.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - process start-up, not a hot path
    cfg = data / "bench.toml"
    batch = _env_int("PGW_BENCH_BATCH", 0)  # 0: the gateway's default (gateway.batch)
    cfg.write_text("[ops]\nlag_interval_s = 60.0\n" + (f"[gateway]\nbatch = {batch}\n" if batch else "")
                   + extra_toml)
    log = open(data / "gateway.log", "wb")  # noqa: SIM115, ASYNC230 - handed to the child
    proc = await asyncio.create_subprocess_exec(
        PGW, "--server", url, "--data-dir", str(data), "--config", str(cfg), "--log-format", "json",
        "--log-level", "WARNING", "gateway", stdout=log, stderr=log, start_new_session=True)
    log.close()
    return proc


async def _start_relay(url: str, data: Path, variant: str = "plain") -> asyncio.subprocess.Process:
    data.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - process start-up, not a hot path
    log = open(data / f"relay-{variant}.log", "wb")  # noqa: SIM115, ASYNC230
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.bench_gateway", "relay", url, variant, stdout=log, stderr=log,
        start_new_session=True, cwd=str(Path(__file__).resolve().parent.parent))  # noqa: ASYNC240 - process start-up, not a hot path
    log.close()
    return proc


async def _stop(proc: asyncio.subprocess.Process | None) -> None:
    if proc is not None and proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Driver:
    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=10)
        self.tag = uuid.uuid4().hex[:8]
        self.seq = 0

    def body(self, system: System) -> tuple[str, bytes, str]:
        self.seq += 1
        eid = f"b{self.tag}-{self.seq}"
        env = envelope(BINDING_MOMENT_KIND, {"principal": PRINCIPAL, "binding_moment": MOMENT}, envelope_id=eid)
        return eid, json.dumps(env).encode(), f"bench:{eid}"

    async def send(self, system: System) -> tuple[str, float, asyncio.Future[None]]:
        """Publish one envelope; the future resolves when its result is received."""
        eid, body, msg_id = self.body(system)
        fut = system.waiters[eid] = asyncio.get_running_loop().create_future()
        t0 = time.perf_counter()
        await self.js.publish(system.publish_subject, body, headers={"Nats-Msg-Id": msg_id})
        return eid, t0, fut

    async def throughput(self, system: System, n: int, window: int = 256) -> float:
        """Envelopes/s from the first publish to the last surface receipt (closed loop, ``window`` in flight)."""
        sem = asyncio.Semaphore(window)
        done = asyncio.Event()
        remaining = [n]

        async def one() -> None:
            async with sem:
                _, _, fut = await self.send(system)
                await fut
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one()) for _ in range(n)]
        await asyncio.wait_for(done.wait(), 600)
        await asyncio.gather(*tasks)
        return n / (time.perf_counter() - t0)

    async def latency(self, system: System, rate: float, seconds: float) -> tuple[float, float, float]:
        """(p50 ms, p99 ms, achieved/s) at an open-loop offered ``rate`` for ``seconds``."""
        n = max(10, int(rate * seconds))
        sent: dict[str, float] = {}
        t_start = time.perf_counter()

        async def one(i: int) -> None:
            delay = t_start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            eid, t0, fut = await self.send(system)
            sent[eid] = t0
            await fut

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 900)
        lat = sorted((system.received[e] - t0) * 1000 for e, t0 in sent.items())
        span = max(system.received[e] for e in sent) - t_start
        return statistics.median(lat), lat[min(len(lat) - 1, int(len(lat) * 0.99))], n / span


async def _wait_message(nc: Client, subject: str, timeout: float) -> None:
    fut = asyncio.get_running_loop().create_future()

    async def cb(_msg) -> None:
        if not fut.done():
            fut.set_result(None)

    sub = await nc.subscribe(subject, cb=cb)
    try:
        await asyncio.wait_for(fut, timeout)
    finally:
        await sub.unsubscribe()


async def _wait_gateway(nc: Client, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            await nc.request("$SRV.PING.pgw-gateway", b"", timeout=0.5)
            return
        except Exception:  # noqa: BLE001 - not registered yet
            continue
    raise TimeoutError("gateway did not start")


async def measure(*, n: int, rates: list[int], rate_s: float, soak_s: float, profile: bool = False) -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="pgw-bench-") as d:
        root = Path(d)
        async with EmbeddedServer(root / "nats", port=-1, monitor_port=-1, websocket_port=None) as server:
            nc = await connect(server.client_url, name="bench-driver")
            await ensure_streams(nc.jetstream(), Config().subjects)
            await ensure_relay_streams(nc)
            gw = System("gateway", "pgw.agent.bench.envelope", f"pgw.principal.{PRINCIPAL}.surface")
            relay = System("relay", "bench.agent.bench.envelope", f"bench.out.{PRINCIPAL}")
            relay_gc = System("relay-gc", "bench.gcagent.bench.envelope", f"bench.gcout.{PRINCIPAL}")
            for s in (gw, relay, relay_gc):
                async def cb(msg, s=s) -> None:
                    s.on_receive(msg.data)
                await nc.subscribe(s.receive_subject, cb=cb)
            ready = [asyncio.create_task(_wait_message(nc, f"bench.relay.ready.{v}", 30)) for v in RELAYS]
            await nc.flush()
            try:
                relay.proc = await _start_relay(server.client_url, root / "relay")
                relay_gc.proc = await _start_relay(server.client_url, root / "relay", "group-commit")
                gw.proc = await _start_gateway(server.client_url, root / "gw")
                await asyncio.gather(*ready)
                await _wait_gateway(nc)
                drv = Driver(nc)
                # Warm-up: connections, consumers, KV buckets, code paths.
                for s in (gw, relay, relay_gc):
                    await drv.throughput(s, 200)
                # Throughput: alternate them so that background noise hits all alike.
                tput: dict[str, list[float]] = {"gateway": [], "relay": [], "relay-gc": []}
                cpu: dict[str, float] = {"gateway": 0.0, "relay": 0.0, "relay-gc": 0.0}
                for _ in range(2):
                    for s in (relay, relay_gc, gw):
                        c0 = _cpu_s(s.proc.pid)
                        tput[s.name].append(await drv.throughput(s, n // 2))
                        cpu[s.name] += _cpu_s(s.proc.pid) - c0
                g, r, rgc = max(tput["gateway"]), max(tput["relay"]), max(tput["relay-gc"])
                rows.append({"name": "gateway: binding-moment path, envelopes/s (closed loop, 256 in flight)",
                             "value": round(g, 1), "baseline": round(r, 1), "ratio": round(g / r, 3),
                             "unit": "env/s (ratio = gateway/relay, target >= 0.5)"})
                rows.append({"name": "gateway: the same, vs a relay whose publishes use the same group commit",
                             "value": round(g, 1), "baseline": round(rgc, 1), "ratio": round(g / rgc, 3),
                             "unit": "env/s (ratio = gateway/relay with group commit)"})
                per = {k: v * 1000 / (2 * (n // 2)) for k, v in cpu.items()}
                rows.append({"name": "gateway: CPU per envelope in the service process",
                             "value": round(per["gateway"], 3), "baseline": round(per["relay"], 3),
                             "ratio": round(per["gateway"] / per["relay"], 2),
                             "unit": "ms CPU (ratio = gateway/relay)"})
                for rate in rates:
                    lg = await drv.latency(gw, rate, rate_s)
                    lr = await drv.latency(relay, rate, rate_s)
                    sat = " (saturated)" if lg[2] < rate * 0.9 else ""
                    rows.append({"name": f"gateway: p50 latency @ {rate}/s offered{sat}", "value": round(lg[0], 2),
                                 "baseline": round(lr[0], 2), "ratio": round(lg[0] / lr[0], 2),
                                 "unit": "ms (ratio = gateway/relay, lower is better)"})
                    rows.append({"name": f"gateway: p99 latency @ {rate}/s offered{sat}", "value": round(lg[1], 2),
                                 "baseline": round(lr[1], 2), "ratio": round(lg[1] / lr[1], 2),
                                 "unit": "ms (ratio = gateway/relay, lower is better)"})
                if soak_s > 0:
                    rows += await _soak(drv, gw, relay, soak_s)
            finally:  # never leave a service running, whatever failed
                await _stop(gw.proc)
                await _stop(relay.proc)
                await _stop(relay_gc.proc)
                await nc.close()
    return rows


async def _soak(drv: Driver, gw: System, relay: System, seconds: float, rate: float = 150.0) -> list[dict]:
    """RSS of both processes under the same steady load (``rate``/s each) for ``seconds``."""
    assert gw.proc is not None and relay.proc is not None
    samples: dict[str, list[tuple[float, float]]] = {"gateway": [], "relay": []}
    stop = asyncio.Event()

    async def sampler() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            for s in (gw, relay):
                samples[s.name].append((time.monotonic() - t0, _rss_mb(s.proc.pid)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    task = asyncio.create_task(sampler())
    await asyncio.gather(drv.latency(gw, rate, seconds), drv.latency(relay, rate, seconds))
    stop.set()
    await task
    out = []
    for name in ("gateway", "relay"):
        pts = samples[name]
        warm = [p for p in pts if p[0] >= min(10.0, seconds / 4)] or pts
        samples[name] = warm
    g, r = samples["gateway"], samples["relay"]
    g_growth, r_growth = g[-1][1] - g[0][1], r[-1][1] - r[0][1]
    minutes = max((g[-1][0] - g[0][0]) / 60, 1e-9)
    out.append({"name": f"gateway: RSS growth over a {seconds:.0f} s soak at {rate:.0f}/s "
                        f"(start {g[0][1]:.1f} MB, peak {max(p[1] for p in g):.1f} MB)",
                "value": round(g_growth, 2), "baseline": round(r_growth, 2),
                "ratio": round(g_growth / minutes, 2), "unit": "MB (ratio column = gateway MB/min)"})
    return out


def run() -> list[dict]:
    """Rows for ``python -m benchmarks`` (starts its own server and processes)."""
    rates = [int(x) for x in os.environ.get("PGW_BENCH_RATES", "100,500,2000").split(",") if x.strip()]
    return pgw_loop.run(measure(
        n=_env_int("PGW_BENCH_N", 2000),
        rates=rates,
        rate_s=float(os.environ.get("PGW_BENCH_RATE_S", "2")),
        soak_s=float(os.environ.get("PGW_SOAK_S", "20")),
    ))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "relay":
        pgw_loop.run(relay_main(sys.argv[2], *sys.argv[3:4]))
    else:
        for row in run():
            print(row)
