"""The binding-moment path vs a bare JetStream relay, measured side by side (issues 8 and 18).

Both systems run as their own process against the same nats-server, fed by
the same driver with the same envelope bytes:

- **gateway**: ``pgw gateway`` (shape, kind, payload, lints, redaction, trust,
  correlationId claim, the moment, surface item + ``hitl_dispatched`` verdict,
  outcome + claim settle, then the ack);
- **relay** (the bare baseline, ``benchmarks/relay.py``): the same pull
  consumer and fetch loop, one JetStream publish awaiting its PubAck, then the
  ack; and the same relay with its publish through the gateway's group commit;
- **contract floor** (``benchmarks/relay.py`` ``floor``): the relay's loop doing
  only the gateway's durable writes for a binding moment, through its writers,
  with no logic: what any gateway keeping these records pays, so gateway/floor
  is what the gateway's own code costs (throughput, CPU, messages, and
  ``PGW_BENCH_FLOOR_RUNS`` (1) latency windows at 500/s on both settings, and two
  floors sharing the work against one); the **minimal floor** (``floor-min``: a
  claim and the contract's three streams), the least DESIGN's streams can cost,
  measured only with ``PGW_BENCH_FLOOR_MIN=1`` (its figures are in the run log;
  left out by default to keep ``make bench`` under five minutes);
  and the contract floor **with the two watches** every instance keeps
  (``floor-watch``: the squat watch's subscription and the moment-record watch,
  no logic), reported beside the floor: what the gateway's received messages
  cost before its own code runs.

Each envelope the driver sends carries its own texts (every text slot of the moment carries
the envelope's number, ``benchmarks.harness.moment_of_kb``), as principals' moments do: one
moment sent again and again would find the gateway's per-text caches full.

Every ratio is against a baseline measured in the same run. Throughput is
counted until every input is **acked** (all it caused stored). CPU per
envelope of each process (gateway, relay, nats-server, driver) and the
messages each service's connection exchanged with the server per envelope
come from ``/proc`` and the server's ``/connz``: robust to a noisy machine.

Scenarios, on the embedded default (``sync_interval: always``) unless said:
throughput and CPU (1 KB moments, one agent); 16 and 120 KB moments; 1,000
distinct agents vs one; p99 publish -> surface at 500/s in
``PGW_BENCH_LAT_RUNS`` (5) consecutive windows of ``PGW_BENCH_RATE_S`` (10) s
each on the server's default sync interval, and under ``always`` in
``PGW_BENCH_LAT_RUNS_ALWAYS`` windows (default: as many as the contract
floor's, ``PGW_BENCH_FLOOR_RUNS``, 1), all reported; 1 vs 2 gateway instances (16 KB); throughput and CPU on
nats-server's default sync interval; the RSS soak (``PGW_SOAK_S``, 0 by
default; ``python -m benchmarks --soak`` = 600 s).

Sizes: ``PGW_BENCH_N`` (throughput envelopes per run, default 2000).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import harness
from benchmarks import relay as relay_mod
from benchmarks.harness import (
    PRINCIPAL,
    Driver,
    Meter,
    System,
    bench_server,
    env_int,
    progress,
    row,
    rss_mb,
    start_gateway,
    start_ready,
    stop,
    wait_gateway,
)
from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams

GW_CONN = "pgw-gateway"


def _systems() -> tuple[System, System, System, System, System, System]:
    gw = System("gateway", "pgw.agent", f"pgw.principal.{PRINCIPAL}.surface", "PGW_INBOUND", "pgw-gateway",
                done_subject="pgw.agent.*.outcome")
    rel = System("relay", "bench.agent", f"bench.out.{PRINCIPAL}", "BENCH_IN", relay_mod.durable("plain"))
    rgc = System("relay-gc", "bench.gcagent", f"bench.gcout.{PRINCIPAL}", "BENCH_GC_IN",
                 relay_mod.durable("group-commit"))
    floor = System("floor", "bench.flagent", f"bench.flsurface.{PRINCIPAL}", "BENCH_FL_IN", relay_mod.durable("floor"))
    fmin = System("floor-min", "bench.fmagent", f"bench.fmsurface.{PRINCIPAL}", "BENCH_FM_IN",
                  relay_mod.durable("floor-min"))
    fwatch = System("floor-watch", "bench.fwagent", f"bench.fwsurface.{PRINCIPAL}", "BENCH_FW_IN",
                    relay_mod.durable("floor-watch"))
    return gw, rel, rgc, floor, fmin, fwatch


class Bench:
    """One server, its systems, and the measurements on it."""

    def __init__(self, server: EmbeddedServer, root: Path, label: str, *, floor_min: bool | None = None) -> None:
        self.server = server
        self.root = root
        self.label = label
        # The minimal floor only on request (PGW_BENCH_FLOOR_MIN=1; module docstring).
        self.with_floor_min = env_int("PGW_BENCH_FLOOR_MIN", 0) > 0 if floor_min is None else floor_min
        self.gw, self.relay, self.relay_gc, self.floor, self.floor_min, self.floor_watch = _systems()
        self._variants = {self.relay.name: "plain", self.relay_gc.name: "group-commit", self.floor.name: "floor",
                          self.floor_min.name: "floor-min", self.floor_watch.name: "floor-watch"}

    async def start(self, *, group_commit_relay: bool = True) -> None:
        self.nc = await connect(self.server.client_url, name="bench-driver")
        await ensure_streams(self.nc.jetstream(), Config().subjects)
        await relay_mod.ensure_relay_streams(self.nc)
        self.drv = Driver(self.nc)
        relays = [self.relay, self.floor, self.floor_watch, *self.floors_min()] + ([self.relay_gc] if group_commit_relay else [])
        systems = [self.gw, *relays]
        for s in systems:
            await self.drv.watch(s)
        for s in relays:
            v = self._variants[s.name]
            s.procs.append(await start_ready(self.nc, f"bench.relay.ready.{v}", "benchmarks.relay",
                                             self.server.client_url, v, log_path=self.root / f"relay-{v}.log"))
        self.gw.procs.append(await start_gateway(self.server.client_url, self.root / "gw1"))
        await wait_gateway(self.nc)
        progress(f"{self.label}: warm-up")
        for s in systems:
            await self.drv.throughput(s, 200)

    def floors_min(self) -> list[System]:
        """The minimal floor, if this bench measures it."""
        return [self.floor_min] if self.with_floor_min else []

    async def close(self) -> None:
        for s in (self.gw, self.relay, self.relay_gc, self.floor, self.floor_min, self.floor_watch):
            for p in s.procs:
                await stop(p)
        with contextlib.suppress(Exception):
            await self.nc.close()

    def meter(self, *systems: System) -> Meter:
        pids = {"server": self.server.pid or 0, "driver": os.getpid()}
        names = {}
        for s in systems:
            for i, p in enumerate(s.procs):
                pids[f"{s.name}{i}"] = p.pid
            names[s.name] = GW_CONN if s is self.gw else relay_mod.CONN_NAME.format(variant=self._variants[s.name])
        return Meter(pids, self.server.monitor_url, names)

    async def run(self, s: System, n: int, **kw: object) -> dict:
        """One throughput run: env/s, and per envelope: CPU ms of each process, messages each way."""
        label = f"{self.label}: {s.name} {kw.get('kb', 1)} KB" + (f", {kw['agents']} agents" if kw.get("agents") else "")
        progress(f"{label}: {n:,} envelopes")
        with self.meter(s) as m:
            rate = await self.drv.throughput(s, n, label=label, **kw)  # type: ignore[arg-type]
        own = sum(v for k, v in m.cpu.items() if k.startswith(s.name)) * 1000 / n
        sent, received = m.msgs.get(s.name, (0, 0))
        return {"rate": rate, "cpu": own, "server": m.cpu["server"] * 1000 / n, "driver": m.cpu["driver"] * 1000 / n,
                "sent": sent / n, "received": received / n}

    async def best_of(self, systems: list[System], n: int, rounds: int = 2, **kw: object) -> dict[str, dict]:
        """Alternate the systems ``rounds`` times (noise hits all alike); keep each one's fastest
        rate and its mean CPU and messages per envelope."""
        got: dict[str, list[dict]] = {s.name: [] for s in systems}
        for _ in range(rounds):
            for s in systems:
                got[s.name].append(await self.run(s, n, **kw))
        out = {}
        for name, runs in got.items():
            out[name] = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
            out[name]["rate"] = max(r["rate"] for r in runs)
        return out


RELAY_WINDOW_S = float(os.environ.get("PGW_BENCH_RELAY_S", "5"))
# CPU at the rate users run (issue 48, target 4): the gateway and the contract floor each at a steady
# STEADY_RATE/s, open loop, for PGW_BENCH_STEADY_S seconds (0 leaves it out), under ``always``.
STEADY_RATE = float(os.environ.get("PGW_BENCH_STEADY_RATE", "150"))
STEADY_S = float(os.environ.get("PGW_BENCH_STEADY_S", "3"))
STEADY_ROW = "gateway CPU per envelope at a steady {rate:g}/s vs the contract floor at the same rate"


async def _steady_rows(b: Bench, tag: str) -> list[dict]:
    """CPU per envelope of the gateway and of the contract floor, each alone at a steady ``STEADY_RATE``/s
    (open loop, publish -> surface), from each process's CPU-time clock: what a gateway costs at the
    rates users run, where nothing is shared between envelopes (socket writes, wake-ups, fetches)."""
    if STEADY_S <= 0:
        return []
    n = max(10, int(STEADY_RATE * STEADY_S))
    cpu: dict[str, float] = {}
    server: dict[str, float] = {}
    for s in (b.floor, b.gw):
        progress(f"{b.label}: {s.name} at a steady {STEADY_RATE:g}/s for {STEADY_S:g} s")
        with b.meter(s) as m:
            await b.drv.latency(s, STEADY_RATE, STEADY_S, label=f"{b.label}: {s.name} steady")
        cpu[s.name] = sum(v for k, v in m.cpu.items() if k.startswith(s.name)) * 1000 / n
        server[s.name] = m.cpu["server"] * 1000 / n
    return [
        row(tag + STEADY_ROW.format(rate=STEADY_RATE), cpu["gateway"], cpu["floor"],
            f"ms CPU (ratio = gateway/floor, each alone at {STEADY_RATE:g}/s for {STEADY_S:g} s; target <= 2)"),
        row(f"{tag}nats-server CPU per envelope at a steady {STEADY_RATE:g}/s, gateway vs contract floor",
            server["gateway"], server["floor"], "ms CPU (gateway run vs floor run)"),
    ]


def _cpu_rows(tag: str, g: dict, r: dict) -> list[dict]:
    return [
        row(f"{tag}gateway CPU per envelope (service process)", g["cpu"], r["cpu"],
            "ms CPU (ratio = gateway/relay, target <= 2)"),
        row(f"{tag}nats-server CPU per envelope", g["server"], r["server"], "ms CPU (gateway run vs relay run)"),
        row(f"{tag}driver CPU per envelope", g["driver"], r["driver"], "ms CPU (gateway run vs relay run)"),
        row(f"{tag}messages sent to the server per envelope (writes, acks, fetches)", g["sent"], r["sent"],
            "msgs (gateway vs relay connection)", digits=2),
        row(f"{tag}messages received from the server per envelope (deliveries, PubAcks)", g["received"],
            r["received"], "msgs (gateway vs relay connection)", digits=2),
    ]


def _floor_rows(tag: str, g: dict, f: dict, r: dict, fmin: dict | None, fw: dict) -> list[dict]:
    """The contract floor (benchmarks/relay.py ``floor``) against the relay and the gateway against it;
    the minimal floor (``floor-min``: a claim and the contract's three streams) against the relay; the
    contract floor with the two watches every instance keeps (``floor-watch``) against the floor, and
    the gateway against it (reported: no target's floor). ``fmin`` None: not measured, no rows."""
    return [
        row(f"{tag}contract floor with the two required watches (squat, moment records): CPU per envelope",
            fw["cpu"], f["cpu"], "ms CPU (ratio = floor-watch/floor: what receiving the watches' messages costs)"),
        row(f"{tag}gateway CPU per envelope vs the contract floor with its two watches", g["cpu"], fw["cpu"],
            "ms CPU (ratio = gateway/floor-watch: the gateway's own code beyond every required message)"),
        row(f"{tag}contract floor with the two watches: messages received per envelope", fw["received"],
            f["received"], "msgs (floor-watch vs floor connection)", digits=2),
        *([] if fmin is None else [
            row(f"{tag}minimal floor (claim + surface, verdict, outcome; no logic): CPU per envelope", fmin["cpu"],
                r["cpu"], "ms CPU (ratio = minimal floor/relay: the least DESIGN's streams can cost)"),
            row(f"{tag}minimal floor: envelopes/s until acked", fmin["rate"], r["rate"],
                "env/s (ratio = minimal floor/relay)", digits=1)]),
        row(f"{tag}contract floor (the gateway's writes, no logic): envelopes/s until acked", f["rate"], r["rate"],
            "env/s (ratio = floor/relay)", digits=1),
        row(f"{tag}contract floor: CPU per envelope (service process)", f["cpu"], r["cpu"],
            "ms CPU (ratio = floor/relay: what the stored records cost)"),
        row(f"{tag}gateway CPU per envelope vs the contract floor", g["cpu"], f["cpu"],
            "ms CPU (ratio = gateway/floor: what the gateway's own code costs)"),
        row(f"{tag}contract floor: nats-server CPU per envelope", f["server"], r["server"],
            "ms CPU (floor run vs relay run)"),
        row(f"{tag}contract floor: messages sent / received per envelope", f["sent"], r["sent"],
            f"msgs sent (floor vs relay connection); received {f['received']:.2f} vs {r['received']:.2f}", digits=2),
    ]


async def _on_always(root: Path, n: int, lat_runs: int, rate_s: float, soak_s: float) -> list[dict]:
    rows: list[dict] = []
    async with bench_server(root / "nats", websocket_port=None) as server:
        b = Bench(server, root, "always")
        try:
            await b.start()
            gw, rel, rgc = b.gw, b.relay, b.relay_gc
            t = await b.best_of([rel, rgc, b.floor, *b.floors_min(), b.floor_watch, gw], n // 2)
            g, r = t["gateway"], t["relay"]
            rows.append(row("gateway: envelopes/s until acked (closed loop, 256 in flight)", g["rate"], r["rate"],
                            "env/s (ratio = gateway/relay, target >= 0.5)", digits=1))
            rows.append(row("gateway: the same, vs the relay with the gateway's group commit", g["rate"],
                            t["relay-gc"]["rate"], "env/s (ratio = gateway/relay-gc)", digits=1))
            rows += _cpu_rows("", g, r)
            rows += _floor_rows("", g, t["floor"], r, t.get("floor-min"), t["floor-watch"])
            rows += await _steady_rows(b, "")
            for kb in (16, 120):
                k = max(100, n // (4 if kb == 16 else 10))
                sz = await b.best_of([rel, b.floor, gw], k, rounds=1, kb=kb)
                rows.append(row(f"gateway: envelopes/s until acked, {kb} KB moments", sz["gateway"]["rate"],
                                sz["relay"]["rate"], "env/s (ratio = gateway/relay, same bytes)", digits=1))
                rows.append(row(f"gateway: CPU per envelope, {kb} KB moments", sz["gateway"]["cpu"],
                                sz["relay"]["cpu"], "ms CPU (ratio = gateway/relay, same bytes)"))
                rows.append(row(f"contract floor: CPU per envelope, {kb} KB moments", sz["floor"]["cpu"],
                                sz["relay"]["cpu"], "ms CPU (ratio = floor/relay: the moment written twice)"))
                rows.append(row(f"gateway CPU per envelope vs the contract floor, {kb} KB moments", sz["gateway"]["cpu"],
                                sz["floor"]["cpu"], "ms CPU (ratio = gateway/floor)"))
            try:
                many = await b.run(gw, n, agents=1000)
                single = await b.run(gw, n)
                rows.append(row("gateway: envelopes/s until acked, 1,000 distinct new agents vs one", many["rate"],
                                single["rate"], "env/s (ratio = 1,000 agents/one, target >= 0.8)", digits=1))
                rows.append(row("gateway: CPU per envelope, 1,000 distinct new agents vs one", many["cpu"],
                                single["cpu"], "ms CPU (ratio = 1,000 agents/one)"))
                rows.append(row("nats-server: CPU per envelope, 1,000 distinct new agents vs one", many["server"],
                                single["server"], "ms CPU (ratio = 1,000 agents/one)"))
            except Exception as e:  # noqa: BLE001 - reported as a row; the other scenarios still run
                rows.append({"name": f"gateway: 1,000 distinct new agents: FAILED ({e})"[:160]})
                await b.drv.throughput(gw, 100)  # let the redeliveries settle before the next scenario
            rows += await _latency_rows(b, "", lat_runs, rate_s)
            if soak_s > 0:
                rows += await _soak(b, soak_s)
            rows += await _instances(b, root, n)
        finally:
            await b.close()
    return rows


async def _instances(b: Bench, root: Path, n: int) -> list[dict]:
    """1 vs 2 instances at 16 KB, of the gateway and of the contract floor (what sharing one durable
    consumer costs with no per-instance watch), ``PGW_BENCH_INSTANCE_ROUNDS`` (1) times alternating.

    Each one-instance figure is taken right before the second instance starts (the machine's drift
    since the size runs must not count as the instance's cost), over ``n`` envelopes, not the size
    runs' n/4: two instances' CPU is split over two processes' clock ticks (10 ms each), so a short
    run cannot tell a few per cent from noise. The second instances stop between rounds."""
    rounds = env_int("PGW_BENCH_INSTANCE_ROUNDS", 1)
    url = b.server.client_url
    rows: list[dict] = []
    ratios: dict[str, list[float]] = {"gateway": [], "contract floor": []}
    for r in range(rounds):
        tag = f", round {r + 1}/{rounds}" if rounds > 1 else ""
        one = await b.run(b.gw, n, kb=16)
        progress(f"always: a second gateway instance{tag}")
        b.gw.procs.append(await start_gateway(url, root / f"gw2-{r}"))
        await wait_gateway(b.nc, count=2)
        # Warm the new instance (its first envelopes compile patterns and fill caches).
        await b.drv.throughput(b.gw, 600, kb=16)
        two = await b.run(b.gw, n, kb=16)
        rows.append(row(f"gateway: 2 instances vs 1, CPU per envelope (all instances), 16 KB{tag}", two["cpu"],
                        one["cpu"], "ms CPU (ratio = two/one, target <= 1)"))
        rows.append(row(f"gateway: 2 instances vs 1, envelopes/s until acked, 16 KB{tag}", two["rate"], one["rate"],
                        "env/s (ratio = two/one)", digits=1))
        progress(f"always: a second contract floor{tag}")
        f_one = await b.run(b.floor, n, kb=16)
        b.floor.procs.append(await start_ready(b.nc, "bench.relay.ready.floor", "benchmarks.relay", url, "floor",
                                               log_path=root / f"relay-floor-2-{r}.log"))
        await b.drv.throughput(b.floor, 600, kb=16)
        f_two = await b.run(b.floor, n, kb=16)
        rows.append(row(f"contract floor: 2 instances vs 1, CPU per envelope (all instances), 16 KB{tag}",
                        f_two["cpu"], f_one["cpu"], "ms CPU (ratio = two/one: sharing the work alone)"))
        ratios["gateway"].append(two["cpu"] / one["cpu"] if one["cpu"] else float("nan"))
        ratios["contract floor"].append(f_two["cpu"] / f_one["cpu"] if f_one["cpu"] else float("nan"))
        if r < rounds - 1:
            for s in (b.gw, b.floor):
                await stop(s.procs.pop())
    if rounds > 1:
        for what, rs in ratios.items():
            rows.append({"name": f"{what}: 2 instances vs 1, CPU ratio over {rounds} rounds (mean; min-max)",
                         "value": round(sum(rs) / len(rs), 3), "baseline": None,
                         "ratio": round(sum(rs) / len(rs), 3),
                         "unit": f"two/one ({min(rs):.3f}-{max(rs):.3f})"})
    return rows


async def _on_default_interval(root: Path, n: int, lat_runs: int, rate_s: float) -> list[dict]:
    async with bench_server(root / "nats-default", websocket_port=None, sync_interval=None) as server:
        b = Bench(server, root / "default", "default sync")
        try:
            await b.start(group_commit_relay=False)
            t = await b.best_of([b.relay, b.floor, *b.floors_min(), b.floor_watch, b.gw], n // 2)
            latency = await _latency_rows(b, "default sync interval: ", lat_runs, rate_s)
        finally:
            await b.close()
    g, r = t["gateway"], t["relay"]
    return [row("gateway, server's default sync interval: envelopes/s until acked", g["rate"], r["rate"],
                "env/s (ratio = gateway/relay, target >= 0.5)", digits=1),
            *_cpu_rows("default sync interval: ", g, r), *_floor_rows("default sync interval: ", g, t["floor"], r, t.get("floor-min"),
                                                                          t["floor-watch"]),
            *latency]


async def _latency_rows(b: Bench, tag: str, lat_runs: int, rate_s: float) -> list[dict]:
    """p99 and p50 publish -> surface at 500/s: one window of the relay, then ``lat_runs`` consecutive
    windows of the gateway, all reported; and how busy the machine and each process were meanwhile
    (on a small machine the tail at a steady rate is queueing for the CPU, so the reader needs both)."""
    rows: list[dict] = []
    # The bare relay's window is only the ratio column's baseline (no target rests on it): at most
    # RELAY_WINDOW_S, 2,500 samples at 500/s, which keeps make bench under five minutes.
    relay_s = min(rate_s, RELAY_WINDOW_S)
    progress(f"{b.label}: relay p99 at 500/s over {relay_s:g} s")
    with b.meter(b.relay) as mr:
        lr = await b.drv.latency(b.relay, 500, relay_s, label=f"{b.label}: relay latency")
    # The contract floor's windows (PGW_BENCH_FLOOR_RUNS, default 1) and the minimal floor's
    # (PGW_BENCH_FLOOR_MIN_RUNS, default 0: ten seconds each would take make bench past five minutes).
    for fs, what, runs in ((b.floor, "contract floor", env_int("PGW_BENCH_FLOOR_RUNS", 1)),
                           (b.floor_min, "minimal floor", env_int("PGW_BENCH_FLOOR_MIN_RUNS", 0) if b.with_floor_min else 0)):
        for i in range(runs):
            progress(f"{b.label}: {what} p99 at 500/s over {rate_s:g} s, run {i + 1}/{runs}")
            with b.meter(fs) as mf:
                lf = await b.drv.latency(fs, 500, rate_s, label=f"{b.label}: {what} latency")
            rows += [
                row(f"{tag}{what}: p99 publish->surface @ 500/s, {rate_s:g} s window, run {i + 1}/{runs}",
                    lf[1], lr[1], "ms (ratio = floor/relay)", digits=2),
                row(f"{tag}{what}: p50 publish->surface @ 500/s, run {i + 1}/{runs}", lf[0], lr[0],
                    "ms (ratio = floor/relay)", digits=2),
                row(f"{tag}{what}: machine CPU busy during its window, run {i + 1}/{runs}", mf.busy * 100,
                    mr.busy * 100, f"% of {os.cpu_count() or 1} cores (floor vs relay window)", digits=1),
            ]
    meters: list[Meter] = []
    for i in range(lat_runs):
        progress(f"{b.label}: gateway p99 at 500/s, run {i + 1}/{lat_runs} ({rate_s:g} s)")
        with b.meter(b.gw) as m:
            lg = await b.drv.latency(b.gw, 500, rate_s, label=f"{b.label}: gateway latency run {i + 1}")
        meters.append(m)
        sat = " (saturated)" if lg[2] < 450 else ""
        rows.append(row(f"{tag}gateway: p99 publish->surface @ 500/s, {rate_s:g} s window, run {i + 1}/{lat_runs}{sat}",
                        lg[1], lr[1], "ms (ratio = gateway/relay, target <= 20 ms)", digits=2))
        rows.append(row(f"{tag}gateway: p50 publish->surface @ 500/s, run {i + 1}/{lat_runs}", lg[0], lr[0],
                        "ms (ratio = gateway/relay)", digits=2))
    if meters:
        def mean(f: Callable[[Meter], float]) -> float:
            return sum(f(m) for m in meters) / len(meters) * 100

        cores = os.cpu_count() or 1
        rows += [
            row(f"{tag}machine CPU busy during the latency windows (all processes)", mean(lambda m: m.busy),
                mr.busy * 100, f"% of {cores} cores (gateway windows vs the relay's)", digits=1),
            row(f"{tag}service process CPU during the latency windows", mean(lambda m: m.core_share("gateway")),
                mr.core_share("relay") * 100, "% of one core (gateway vs relay)", digits=1),
            row(f"{tag}nats-server CPU during the latency windows", mean(lambda m: m.core_share("server")),
                mr.core_share("server") * 100, "% of one core (gateway windows vs the relay's)", digits=1),
            row(f"{tag}driver CPU during the latency windows", mean(lambda m: m.core_share("driver")),
                mr.core_share("driver") * 100, "% of one core (gateway windows vs the relay's)", digits=1),
        ]
    return rows


async def _soak(b: Bench, seconds: float, rate: float = 150.0) -> list[dict]:
    """RSS of the gateway and the relay under the same steady load (``rate``/s each) for ``seconds``."""
    samples: dict[str, list[tuple[float, float]]] = {"gateway": [], "relay": []}
    done = asyncio.Event()
    procs = {"gateway": b.gw.procs[0], "relay": b.relay.procs[0]}

    async def sampler() -> None:
        t0 = time.monotonic()
        while not done.is_set():
            for name, p in procs.items():
                samples[name].append((time.monotonic() - t0, rss_mb(p.pid)))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 1.0)

    progress(f"soak: {seconds:.0f} s at {rate:.0f}/s through both")
    task = asyncio.create_task(sampler())
    with b.meter(b.gw, b.relay) as m:
        lg, lr = await asyncio.gather(b.drv.latency(b.gw, rate, seconds, label="soak gateway"),
                                      b.drv.latency(b.relay, rate, seconds, label="soak relay"))
    done.set()
    await task
    warm = {k: [p for p in v if p[0] >= min(10.0, seconds / 4)] or v for k, v in samples.items()}
    g, r = warm["gateway"], warm["relay"]
    minutes = max((g[-1][0] - g[0][0]) / 60, 1e-9)
    n = rate * seconds
    return [
        row(f"soak {seconds:.0f} s @ {rate:.0f}/s: gateway RSS growth (start {g[0][1]:.1f} MB, "
            f"peak {max(p[1] for p in g):.1f} MB; ratio column = MB/min)", g[-1][1] - g[0][1], r[-1][1] - r[0][1],
            "MB (gateway vs relay)", digits=2) | {"ratio": round((g[-1][1] - g[0][1]) / minutes, 3)},
        row(f"soak {seconds:.0f} s: p99 publish->surface", lg[1], lr[1], "ms (ratio = gateway/relay)", digits=2),
        row(f"soak {seconds:.0f} s: gateway CPU per envelope", m.cpu["gateway0"] * 1000 / n,
            m.cpu["relay0"] * 1000 / n, "ms CPU (ratio = gateway/relay)"),
    ]


async def measure(*, n: int, lat_runs: int, rate_s: float, soak_s: float, lat_runs_always: int | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="pgw-bench-") as d:
        root = Path(d)
        rows = await _on_always(root, n, lat_runs if lat_runs_always is None else lat_runs_always, rate_s, soak_s)
        progress("server's default sync interval")
        rows += await _on_default_interval(root, n, lat_runs, rate_s)
    return rows


def run() -> list[dict]:
    """Rows for ``python -m benchmarks`` (starts its own servers and processes)."""
    return harness.run(measure(
        n=env_int("PGW_BENCH_N", 2000),
        lat_runs=env_int("PGW_BENCH_LAT_RUNS", 5),
        # Under ``always`` the p99 target is a ratio to the contract floor's window: as many gateway
        # windows as the floor's (PGW_BENCH_FLOOR_RUNS, default 1), worst against worst, like with like.
        lat_runs_always=env_int("PGW_BENCH_LAT_RUNS_ALWAYS", env_int("PGW_BENCH_FLOOR_RUNS", 1)),
        rate_s=float(os.environ.get("PGW_BENCH_RATE_S", "10")),
        soak_s=float(os.environ.get("PGW_SOAK_S", "0")),
    ))


if __name__ == "__main__":
    for r in run():
        print(r)
