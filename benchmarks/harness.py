"""What every benchmark shares: processes, their CPU and messages, the driver, progress (issue 18).

Noise-robust figures first: on a shared machine wall-clock throughput moves
with other tenants' load; the CPU seconds a process spent per envelope (its
CPU-time clock, ``cpu_s``) move much less (contention for the physical cores
still shows as more CPU time for the same work), and the messages its
connection exchanged with the server per envelope (the server's ``/connz``)
do not move at all.

Throughput is counted when the inbound message is **acked** (everything it
caused is stored): the driver publishes, then waits until the consumer's ack
floor has passed the last envelope's stream sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import os
import signal
import statistics
import sys
import time
import traceback
import urllib.request
import uuid
from collections.abc import Awaitable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from nats.aio.client import Client

from pgwcore import loop as pgw_loop
from pgwcore.micro import count_instances
from pgwcore.server import EmbeddedServer, bound_to_parent
from subjects.client import BINDING_MOMENT_KIND, envelope

PGW = str(Path(sys.executable).parent / "pgw")
REPO = str(Path(__file__).resolve().parent.parent)
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
_T0 = time.monotonic()


def progress(msg: str) -> None:
    """One line on stderr, with the seconds since the harness started: a long module shows it is alive."""
    print(f"  [{time.monotonic() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


T = TypeVar("T")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


async def until_signal(main: Coroutine[Any, Any, T], *, grace: float = 15.0) -> T:
    """``await main``, stopped by SIGTERM or SIGHUP the way Ctrl-C stops it, then exit with 128 + the signal.

    The servers, gateways and relays a run starts are in sessions of their own (a Ctrl-C in the
    terminal reaches only the run, which stops them in order), so a run killed by ``timeout`` or a
    closed terminal left them running beside the next run's measure. Here the first signal cancels
    the run's task, whose ``finally`` blocks stop what it started; then every child that leads a
    session of its own and still runs (one whose stop the cancel cut short, a server started
    before its ``try``) has its group sent SIGTERM, and SIGKILL after ``grace`` seconds. Children in
    this process's session (a pool's forkserver, multiprocessing's resource tracker) are left to
    their owners. Later signals are only noted: ``timeout`` signals the process and then its group,
    and the second must not cut the cleanup short; so a cancel the run swallows (Python 3.11's
    ``wait_for`` can, as its inner future completes) leaves it to run to its end, and ``timeout -k``
    is the hard stop. A signal ignored when the run started (``nohup``) stays ignored; one that
    arrives after ``main`` has returned changes nothing."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    got: list[int] = []

    def on_signal(sig: int) -> None:
        got.append(sig)
        if len(got) == 1:
            task.cancel()
        with contextlib.suppress(OSError):  # a hung-up terminal fails the write (EIO)
            progress(f"{signal.Signals(sig).name}: " + ("stopping the servers and processes this run started"
                                                        if len(got) == 1 else "already stopping"))

    mine = [s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
    for s in mine:
        loop.add_signal_handler(s, on_signal, s)
    try:
        try:
            result = await main
        except (Exception, asyncio.CancelledError) as e:
            if not got:
                raise
            if not isinstance(e, asyncio.CancelledError):  # the cleanup itself failed: said, then the signal's exit
                with contextlib.suppress(OSError):
                    traceback.print_exc()
        else:
            if not got:
                return result
        await stop_children(grace)  # the cancel is spent: these awaits run to their end
        raise SystemExit(128 + got[0])
    finally:
        for s in mine:
            loop.remove_signal_handler(s)


def proc_stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields after the command's name (so ``[0]`` is field 3, the state; ``[1]`` the
    parent; ``[11]``, ``[12]`` the user and system ticks; ``[19]`` the start time); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def started_at(pid: int) -> int | None:
    """``pid``'s start time (clock ticks since boot) while it runs, not a zombie; None once it is gone: with it,
    a pid the kernel gave again to another process is not taken for the one seen before."""
    fields = proc_stat(pid)
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[19])


def children(pid: int) -> list[int]:
    """The running processes whose parent is ``pid`` (``/proc``; an exited one waiting to be reaped is not)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (fields := proc_stat(int(d.name))) and fields[1] == str(pid) \
                and fields[0] not in ("Z", "X"):
            out.append(int(d.name))
    return out


def _session_leaders() -> list[int]:
    """This process's running children that lead a session of their own (``start_new_session``)."""
    out = []
    for k in children(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            if os.getsid(k) == k:
                out.append(k)
    return out


async def stop_children(grace: float) -> None:
    """SIGTERM the group of every child still running that leads a session of its own (what the harness and
    ``EmbeddedServer`` start); SIGKILL the groups whose leader is alive after ``grace`` seconds."""
    kids = _session_leaders()
    for k in kids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(k, signal.SIGTERM)
    deadline = time.monotonic() + grace
    # No event announces the exit of a process we hold no handle to: polled, bounded by ``grace``.
    while (left := [k for k in children(os.getpid()) if k in kids]) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    for k in left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(k, signal.SIGKILL)


def run(main: Coroutine[Any, Any, T]) -> T:
    """A benchmark's run on the project's loop (``pgwcore.loop.run``), stopped cleanly by a signal (``until_signal``)."""
    return pgw_loop.run(until_signal(main))


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank); NaN for no samples."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def moment_of_kb(kb: int, case: int | None = None) -> dict:
    """The bench moment grown to about ``kb`` KB of JSON: findings, then recommendations, of 1,900
    characters each (the grammar's limits: 32 items of at most 2,000; so at most about 125 KB).

    With ``case``, every text slot of the moment carries that number (``#case``), so each envelope the
    driver sends carries its own texts, as principals' moments do: one text sent again and again
    would find the gateway's per-text caches full (the seen forms, ``gateway/security/seen.py``)
    on every envelope after the first, and the bench would not count the folds a real moment
    costs. Without it, the same moment every time."""
    base = MOMENT if case is None else _numbered(case)
    if kb <= 1:
        return base
    lists = {"findings": list(base["findings"]), "recommendations": list(base["recommendations"])}
    size = len(json.dumps(base))
    for name in ("findings", "recommendations"):
        while size < kb * 1024 and len(lists[name]) < 32:
            k = len(lists["findings"]) + len(lists["recommendations"])
            line = _LEDGER_LINE if case is None else (
                f"Ledger line {k} of #{case}: transfer to Harbor Accounting, invoice {4711 + k}, "
                "reviewed and matched. " * 21)[:1900]
            part = line[: max(1, min(len(line), kb * 1024 - size))]
            lists[name].append(part)
            size += len(part) + 4
    return {**base, **lists}


_LEDGER_LINE = ("Ledger line 2025-03-14: transfer to Harbor Accounting, invoice 4711, reviewed and matched. " * 21)[:1900]


def _numbered(case: int) -> dict:
    """The bench moment with ``#case`` in each of its texts (the grammar and the lints as clean)."""
    q = MOMENT["question"]
    tag = f"#{case}"
    return {
        "synopsis": MOMENT["synopsis"].replace("Harbor Accounting", f"Harbor Accounting {tag}"),
        "findings": [f"Harbor {tag} requested the full ledger for the 2025 filing.",
                     f"Their engagement letter {tag} covers the annual filing only."],
        "recommendations": [f"Send the 2025 tax summary PDF {tag} through the client portal."],
        "offer": f"Ask for detail on any item ({tag}).",
        "question": {
            **q,
            "stem": q["stem"].replace("Harbor Accounting", f"Harbor Accounting {tag}"),
            "options": [{"label": f"{o['label']} ({tag})", "reasoning": f"{o['reasoning'][:-1]} ({tag})."}
                        for o in q["options"]],
        },
    }


# -- processes ---------------------------------------------------------------


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _process_clock(pid: int) -> int | None:
    """The clock id of process ``pid``'s CPU time (clock_getcpuclockid(3)); None where libc has none."""
    libc = _libc()
    getter = getattr(libc, "clock_getcpuclockid", None) if libc is not None else None
    if getter is None:
        return None
    clock = ctypes.c_int()
    if getter(pid, ctypes.byref(clock)) != 0:
        return None  # no such process (ESRCH), or not allowed
    return clock.value


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, to the nanosecond where the OS has it.

    Read from the process's CPU-time clock (every thread, the exited ones included), not from
    ``/proc/<pid>/stat``, which counts in clock ticks of 10 ms: on a round of 1,000 envelopes at
    0.2 ms each, the two readings' truncation alone moved a CPU-per-envelope figure by up to
    10 % (issue 32). ``/proc`` is the fallback; 0.0 for a process that is gone.
    """
    clock = _process_clock(pid)
    if clock is not None:
        try:
            return time.clock_gettime_ns(clock) / 1e9
        except OSError:
            pass  # gone, or the clock unreadable: /proc says which
    fields = proc_stat(pid)
    if fields is None:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far, all CPUs (``/proc/stat``): busy is
    everything but idle and iowait, so steal and interrupt time count as busy."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def bench_server(data_dir: Path, **kw: Any) -> EmbeddedServer:
    """A benchmark's embedded nats-server: free ports, the monitor's too, and bound to the run
    (``EmbeddedServer.stop_with_parent``: a run killed by SIGKILL leaves it stopped)."""
    return EmbeddedServer(data_dir, port=-1, monitor_port=-1, stop_with_parent=True, **kw)


async def start_gateway(url: str, data: Path, extra_toml: str = "", *, tree: Path | None = None) -> asyncio.subprocess.Process:
    """``pgw gateway`` on ``url`` with its data in ``data``; ``tree``: from that directory's sources (first on
    ``PYTHONPATH``, run by this interpreter) instead of the installed project (benchmarks.side_by_side)."""
    data.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - process start-up, not a hot path
    cfg = data / "bench.toml"
    batch = env_int("PGW_BENCH_BATCH", 0)  # 0: the gateway's default (gateway.batch)
    cfg.write_text("[ops]\nlag_interval_s = 60.0\n" + (f"[gateway]\nbatch = {batch}\n" if batch else "")
                   + extra_toml)
    log = open(data / "gateway.log", "wb")  # noqa: SIM115, ASYNC230 - handed to the child
    # PGW_BENCH_GW_PROFILE=FILE: the gateway runs under cProfile and writes FILE at exit (SIGTERM).
    prof = os.environ.get("PGW_BENCH_GW_PROFILE")
    cmd = ([sys.executable, "-m", "pgwcli"] if tree is not None  # the tree's sources, not the installed pgw
           else [sys.executable, "-m", "cProfile", "-o", prof, "-m", "pgwcli"] if prof else [PGW])
    cmd += ["--server", url, "--data-dir", str(data), "--config", str(cfg), "--log-format", "json",
            "--log-level", "WARNING", "gateway"]
    proc = await asyncio.create_subprocess_exec(
        *bound_to_parent(cmd), stdout=log, stderr=log, start_new_session=True,
        cwd=tree, env=None if tree is None else {**os.environ, "PYTHONPATH": str(tree)})
    log.close()
    return proc


async def start_module(module: str, *args: str, log_path: Path) -> asyncio.subprocess.Process:
    """``python -m module args`` as its own process (a baseline: relay, echo responder)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")  # noqa: SIM115, ASYNC230 - handed to the child
    proc = await asyncio.create_subprocess_exec(
        *bound_to_parent([sys.executable, "-m", module, *args]), stdout=log, stderr=log, start_new_session=True,
        cwd=REPO)
    log.close()
    return proc


async def start_ready(nc: Client, ready_subject: str, module: str, *args: str, log_path: Path,
                      timeout: float = 60) -> asyncio.subprocess.Process:
    """``start_module``, then wait until the process publishes ``ready_subject`` (subscribed first)."""
    ready = asyncio.create_task(wait_message(nc, ready_subject, timeout))
    await nc.flush()
    proc = await start_module(module, *args, log_path=log_path)
    try:
        await ready
    except BaseException:
        await stop(proc)
        raise
    return proc


async def stop(proc: asyncio.subprocess.Process | None) -> None:
    if proc is not None and proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 15)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def wait_message(nc: Client, subject: str, timeout: float) -> None:
    fut = asyncio.get_running_loop().create_future()

    async def cb(_msg) -> None:
        if not fut.done():
            fut.set_result(None)

    sub = await nc.subscribe(subject, cb=cb)
    try:
        await asyncio.wait_for(fut, timeout)
    finally:
        await sub.unsubscribe()


async def wait_gateway(nc: Client, timeout: float = 30, count: int = 1) -> None:
    """Until ``count`` gateway instances answer ``$SRV.PING`` (``pgwcore.micro.count_instances``: the server's
    "no responders" status is no instance; counted as one, a gateway that never started was waited for as if
    it had, and the driver then waited on its envelopes for the throughput's 900 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await count_instances(nc, "pgw-gateway", 0.3, enough=count) >= count:
            return
    raise TimeoutError(f"{count} gateway instance(s) did not start")


# -- what the server saw ------------------------------------------------------


def connz(monitor_url: str, *, subs: bool = False) -> list[dict]:
    query = "limit=1024" + ("&subs=1" if subs else "")
    with urllib.request.urlopen(f"{monitor_url.rstrip('/')}/connz?{query}", timeout=5) as r:
        return json.loads(r.read()).get("connections") or []


def msgs_of(monitor_url: str, name: str) -> tuple[int, int]:
    """(messages sent to the server, messages received from it) by every connection named ``name``."""
    sent = received = 0
    for c in connz(monitor_url):
        if c.get("name") == name:
            sent += c.get("in_msgs", 0)
            received += c.get("out_msgs", 0)
    return sent, received


@dataclass
class Meter:
    """CPU seconds of some processes and messages of some connection names, between start() and stop()."""

    pids: dict[str, int]
    monitor_url: str = ""
    conn_names: dict[str, str] = field(default_factory=dict)  # label -> connection name
    cpu: dict[str, float] = field(default_factory=dict)
    msgs: dict[str, tuple[int, int]] = field(default_factory=dict)

    busy: float = 0.0  # share of the whole machine's CPU that was busy (0..1), any process
    wall: float = 0.0  # seconds between start and stop

    def _read(self) -> tuple[dict[str, float], dict[str, tuple[int, int]]]:
        cpu = {k: cpu_s(p) for k, p in self.pids.items()}
        msgs = {k: msgs_of(self.monitor_url, n) for k, n in self.conn_names.items()} if self.monitor_url else {}
        return cpu, msgs

    def __enter__(self) -> Meter:
        self._c0, self._m0 = self._read()
        self._t0, self._w0 = machine_ticks(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        c1, m1 = self._read()
        (b1, t1), (b0, t0) = machine_ticks(), self._t0
        self.wall = time.perf_counter() - self._w0
        self.busy = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
        self.cpu = {k: c1[k] - self._c0[k] for k in c1}
        self.msgs = {k: (m1[k][0] - self._m0[k][0], m1[k][1] - self._m0[k][1]) for k in m1}

    def core_share(self, prefix: str) -> float:
        """CPU of the processes whose label starts with ``prefix``, as a share of one core."""
        return sum(v for k, v in self.cpu.items() if k.startswith(prefix)) / self.wall if self.wall else 0.0


# -- the driver ---------------------------------------------------------------


@dataclass
class System:
    """One system under test: where to publish, where its result appears (the latency end), where
    its last write appears (the closed loop's end: the agent's outcome), which consumer acks the input."""

    name: str
    publish_prefix: str  # + ".{agent}.envelope"
    receive_subject: str
    stream: str
    durable: str
    done_subject: str = ""  # "" = receive_subject
    procs: list[asyncio.subprocess.Process] = field(default_factory=list)
    received: dict[str, float] = field(default_factory=dict)
    waiters: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)  # outcome code -> count (must stay empty)

    @staticmethod
    def _id(data: bytes) -> tuple[str | None, dict]:
        try:
            body = json.loads(data)
        except ValueError:
            return None, {}
        return body.get("envelope_id") or body.get("envelopeId"), body

    def on_receive(self, data: bytes) -> None:
        t = time.perf_counter()
        eid, _ = self._id(data)
        if eid and eid not in self.received:
            self.received[eid] = t
            if not self.done_subject:
                self._done(eid)

    def on_done(self, data: bytes) -> None:
        eid, body = self._id(data)
        if eid is None:
            return
        if body.get("status") not in (None, "accepted"):
            code = str(body.get("code") or body.get("status"))
            self.refused[code] = self.refused.get(code, 0) + 1
        self._done(eid)

    def _done(self, eid: str) -> None:
        fut = self.waiters.pop(eid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def check(self) -> None:
        if self.refused:
            refused, self.refused = self.refused, {}
            raise RuntimeError(f"{self.name} refused bench envelopes: {refused}")


class Driver:
    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=30)
        self.tag = uuid.uuid4().hex[:8]
        self.seq = 0

    async def watch(self, system: System) -> None:
        async def cb(msg, s=system) -> None:
            s.on_receive(msg.data)

        await self.nc.subscribe(system.receive_subject, cb=cb)
        if system.done_subject:
            async def done(msg, s=system) -> None:
                s.on_done(msg.data)

            await self.nc.subscribe(system.done_subject, cb=done)

    def body(self, kb: int) -> tuple[str, bytes]:
        self.seq += 1
        eid = f"b{self.tag}-{self.seq}"
        moment = moment_of_kb(kb, self.seq)  # each envelope its own texts (moment_of_kb)
        env = envelope(BINDING_MOMENT_KIND, {"principal": PRINCIPAL, "binding_moment": moment}, envelope_id=eid)
        return eid, json.dumps(env).encode()

    async def send(self, system: System, agent: str = "bench", kb: int = 1) -> tuple[str, float, asyncio.Future[None], int]:
        """Publish one envelope; the future resolves when its result is received; the int is its stream seq."""
        eid, body = self.body(kb)
        fut = system.waiters[eid] = asyncio.get_running_loop().create_future()
        t0 = time.perf_counter()
        ack = await self.js.publish(f"{system.publish_prefix}.{agent}.envelope", body,
                                    headers={"Nats-Msg-Id": f"{agent}:{eid}"})
        return eid, t0, fut, ack.seq

    async def acked_through(self, system: System, seq: int, timeout: float = 600) -> None:
        """Until the system's consumer has acked every message up to stream sequence ``seq``."""
        deadline = time.monotonic() + timeout
        while True:
            info = await self.js.consumer_info(system.stream, system.durable)
            if info.ack_floor.stream_seq >= seq and not info.num_ack_pending:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{system.name}: not acked through {seq} (ack floor {info.ack_floor.stream_seq})")
            await asyncio.sleep(0.005)

    async def throughput(self, system: System, n: int, *, window: int = 256, agents: int = 1, kb: int = 1,
                         label: str = "") -> float:
        """Envelopes/s from the first publish until every input is acked (closed loop, ``window`` in flight)."""
        sem = asyncio.Semaphore(window)
        last = [0]
        names = [f"a{self.tag}x{i}" for i in range(agents)] if agents > 1 else ["bench"]
        done = [0]

        async def one(i: int) -> None:
            async with sem:
                _, _, fut, seq = await self.send(system, names[i % len(names)], kb)
                last[0] = max(last[0], seq)
                await fut
            done[0] += 1

        async def report() -> None:
            while True:
                await asyncio.sleep(5)
                progress(f"{label or system.name}: {done[0]:,}/{n:,} envelopes")

        reporter = asyncio.create_task(report())
        try:
            t0 = time.perf_counter()
            await asyncio.wait_for(_gathered(one(i) for i in range(n)), 900)
            await self.acked_through(system, last[0])
            system.check()
            return n / (time.perf_counter() - t0)
        finally:
            reporter.cancel()

    async def latency(self, system: System, rate: float, seconds: float, label: str = "") -> tuple[float, float, float]:
        """(p50 ms, p99 ms, achieved/s) publish -> surface receipt at an open-loop offered ``rate`` for ``seconds``."""
        n = max(10, int(rate * seconds))
        sent: dict[str, float] = {}
        t_start = time.perf_counter()
        tasks = []
        next_report = t_start + 5
        for i in range(n):
            delay = t_start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing the open-loop driver, not waiting for an event
            if time.perf_counter() >= next_report:
                next_report += 5
                progress(f"{label or system.name}: {i:,}/{n:,} sent at {rate:.0f}/s")
            tasks.append(asyncio.create_task(self._timed(system, sent)))
        await asyncio.wait_for(_gathered(tasks), 900)
        system.check()
        lat = sorted((system.received[e] - t0) * 1000 for e, t0 in sent.items())
        span = max(system.received[e] for e in sent) - t_start
        return statistics.median(lat), lat[min(len(lat) - 1, int(len(lat) * 0.99))], n / span

    async def _timed(self, system: System, sent: dict[str, float]) -> None:
        eid, t0, fut, _ = await self.send(system)
        await fut
        for _ in range(500):  # the result is stored before the outcome; its delivery may trail
            if eid in system.received:
                break
            await asyncio.sleep(0.01)
        sent[eid] = t0


def _gathered(aws: Iterable[Awaitable[Any]]) -> asyncio.Future[list[Any]]:
    """``asyncio.gather`` whose failure is marked retrieved: cancelled inside ``wait_for`` (a run stopped by a
    signal, ``until_signal``), Python 3.11's gathering future ends holding a ``CancelledError`` nobody reads,
    and the loop prints it as "never retrieved" for every driver that was running."""
    gathered = asyncio.gather(*aws)
    gathered.add_done_callback(pgw_loop.retrieve)
    return gathered


def row(name: str, value: float, baseline: float | None, unit: str, *, digits: int = 3) -> dict:
    ratio = round(value / baseline, 3) if baseline else None
    return {"name": name, "value": round(value, digits), "baseline": None if baseline is None else round(baseline, digits),
            "ratio": ratio, "unit": unit}


async def serve_each(nc: Any, subject: str, serve: Any, ready: str, stop: asyncio.Event) -> None:
    """Serve each request on ``subject`` in a task of its own, handed over as the read loop parses it (as the
    kernel serves, gateway.kernel.service); say ``ready``; once ``stop`` is set, wait (10 s at most) for those
    still in flight. The floors of bench_idp and bench_gate."""
    from pgwcore.delivery import subscribe_inline

    inflight: set[asyncio.Task[None]] = set()

    def spawn(msg: Any) -> None:
        task = asyncio.create_task(serve(msg))
        inflight.add(task)
        task.add_done_callback(inflight.discard)

    await subscribe_inline(nc, subject, spawn)
    await nc.flush()
    await nc.publish(ready, b"")
    await stop.wait()
    if inflight:
        await asyncio.wait(inflight, timeout=10)
