"""Fault-injection harness: real processes, real kill -9, real nats-server (issue 8 "Faults").

- ``ServiceProc`` runs a service the way an operator does (``pgw gateway``,
  ``pgw signer``, ...) as a child process in its own session, and kills it
  with SIGKILL: no drain, no flush, no goodbye.
- ``Load`` publishes envelopes through JetStream with bounded concurrency and
  remembers exactly which ones the server *acknowledged* (PubAck); only those
  are promised, so only those are checked. A publish that fails (server gone)
  is retried with the same ``Nats-Msg-Id``, as a careful agent would, until
  acknowledged or the run ends.
- ``wait_drained`` waits until the gateway's durable consumer has nothing
  pending or unacknowledged, i.e. the system has caught up.

Sizes come from the environment (each test module names its own); the
defaults are what CI runs: the gateway's kill -9 rounds at the issue's
10,000 envelopes in flight per round (``PGW_CHAOS_KILL_ENVELOPES``), the
signers and registrar at 1,000 verdicts per round
(``PGW_CHAOS_SIGNER_ENVELOPES``), 5 rounds each (``PGW_CHAOS_ROUNDS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nats.aio.client import Client
from nats.js import JetStreamContext

from pgwcore.micro import count_instances
from subjects.client import BINDING_MOMENT_KIND, envelope
from tests.moments import good_moment
from tests.polling import until
from tests.ports import free_port  # noqa: F401 - re-exported: tests import it from here

PGW = str(Path(sys.executable).parent / "pgw")


def env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass(eq=False)
class ServiceProc:
    """``pgw ROLE`` as a child process against ``url``."""

    role: str  # "gateway", "signer", "registrar"
    url: str
    data_dir: Path
    config: Path | None = None
    proc: asyncio.subprocess.Process | None = None
    log: Path | None = None
    starts: int = 0
    creds: Path | None = None  # the service's own NATS credentials (operator mode: a JWT .creds file)

    async def start(self) -> ServiceProc:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self.log = self.data_dir / f"{self.role}-{self.starts}.log"
        args = [PGW, "--server", self.url, "--data-dir", str(self.data_dir), "--log-format", "json",
                "--log-level", "WARNING"]
        if self.config is not None:
            args += ["--config", str(self.config)]
        if self.creds is not None:
            args += ["--creds", str(self.creds)]
        args.append(self.role)
        with open(self.log, "wb") as out:  # noqa: ASYNC230 - process start-up, not a hot path
            self.proc = await asyncio.create_subprocess_exec(
                *args, stdout=out, stderr=out, start_new_session=True)
        return self

    def kill9(self) -> None:
        """SIGKILL: the process dies mid-whatever, nothing is drained."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)

    async def wait_dead(self) -> None:
        if self.proc is not None:
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.kill9()
                await self.proc.wait()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def log_tail(self, n: int = 3000) -> str:
        """The log's last ``n`` characters, for a failing test's message, and before them the service's
        last few errors in full wherever they are in the log (a traceback is one JSON line, longer than
        the tail: cut, only its last lines showed), each up to ``ERROR_CHARS``."""
        if self.log is None:
            return ""
        with contextlib.suppress(OSError):
            return log_excerpt(self.log.read_text(errors="replace"), n)
        return ""


ERROR_CHARS = 12_000  # one error's record in a log excerpt: a traceback's JSON line, whole in practice
ERRORS_KEPT = 3


def log_excerpt(text: str, n: int = 3000) -> str:
    """``text``'s last ``n`` characters, preceded by its last ``ERRORS_KEPT`` lines that record an error
    (a ``Traceback`` or a JSON record with an ``exception``) that the tail does not hold whole."""
    tail = text[-n:]
    errors = [line for line in text.splitlines() if "Traceback" in line or '"exception"' in line]
    earlier = [line[:ERROR_CHARS] for line in errors[-ERRORS_KEPT:] if line not in tail]
    if not earlier:
        return tail
    return "[the last errors, in full]\n" + "\n".join(earlier) + "\n[the log's tail]\n" + tail


async def wait_services(nc: Client, name: str, n: int, procs: list[ServiceProc], timeout: float = 30) -> None:
    """Wait until ``n`` instances of ``name`` are registered: each has then started and serves (a service
    registers only once its start is done: ``PullService.__aenter__``, ``MetricsPart.ready``)."""
    deadline = time.monotonic() + timeout
    while await count_instances(nc, name, enough=n) < n:
        for p in procs:
            if p.proc is not None and not p.alive:
                raise RuntimeError(f"{p.role} exited early:\n{p.log_tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} x {name} not registered in {timeout}s")


async def consumer_backlog(js: JetStreamContext, stream: str, durable: str) -> int | None:
    try:
        info = await js.consumer_info(stream, durable)
    except Exception:  # noqa: BLE001 - not created yet / node down
        return None
    return (info.num_pending or 0) + (info.num_ack_pending or 0)


async def wait_drained(js: JetStreamContext, stream: str = "PGW_INBOUND", durable: str = "pgw-gateway",
                       *, timeout: float = 120.0, poll: float = 0.2) -> None:
    """Wait until the consumer has caught up (nothing pending, nothing unacknowledged); a consumer
    not there yet or a node down is waited out too."""

    async def caught_up() -> bool:
        return await consumer_backlog(js, stream, durable) == 0

    await until(caught_up, timeout=timeout, interval=poll, what=f"{durable} on {stream} drained")


async def unsettled(js: JetStreamContext) -> list[str]:
    """What of the account's JetStream has not settled: each stream and consumer whose group has no
    leader, or a replica offline or behind. Empty once every group has a leader and all its replicas
    are current. A node that comes back catches up and groups elect again after the node itself
    answers, and a request meanwhile can meet a group with no leader (a kernel request then fails
    closed): a test that goes on after a restart waits for this first."""

    def group(name: str, cluster) -> list[str]:
        if cluster is None:  # not clustered
            return []
        if not cluster.leader:
            return [f"{name}: no leader"]
        return [f"{name}: replica {p.name} {'offline' if p.offline else 'behind'}"
                for p in cluster.replicas or [] if p.offline or not p.current]

    try:
        found = []
        for s in await js.streams_info():
            found += group(s.config.name, s.cluster)
            for c in await js.consumers_info(s.config.name):
                found += group(f"{s.config.name} consumer {c.name}", c.cluster)
        return found
    except Exception as e:  # noqa: BLE001 - JetStream not answering is not settled either
        return [f"JetStream did not answer: {e!r}"]


async def wait_settled(js: JetStreamContext, *, timeout: float = 120.0) -> None:
    """Wait until :func:`unsettled` finds nothing (server state no event announces: polled)."""
    last: list[str] = []

    async def settled() -> bool:
        last[:] = await unsettled(js)
        return not last

    await until(settled, timeout=timeout, interval=0.25, what=lambda: "cluster settled: " + "; ".join(last))


def make_envelope(i: int, tag: str, *, principal: str = "alice") -> tuple[dict, str]:
    """Envelope number ``i``: 4 in 5 are binding moments, 1 in 5 malformed (refused)."""
    eid = f"{tag}-{i:06d}"
    if i % 5 == 4:
        payload = {"principal": principal, "binding_moment": {"synopsis": "x"}}  # malformed
        return envelope(BINDING_MOMENT_KIND, payload, envelope_id=eid), "refused"
    payload = {"principal": principal, "binding_moment": good_moment()}
    return envelope(BINDING_MOMENT_KIND, payload, envelope_id=eid), "moment"


@dataclass
class Load:
    """Publishes envelopes, keeping the set the server acknowledged."""

    nc: Client
    agent: str = "chaos"
    concurrency: int = 64
    acked: dict[str, str] = field(default_factory=dict)
    sent: int = 0
    failures: int = 0

    async def send(self, n: int, tag: str, *, stop: asyncio.Event | None = None,
                   retry_for: float = 60.0, rate: float | None = None,
                   make: Callable[[int, str], tuple[dict, str]] | None = None) -> None:
        """Send ``n`` envelopes (``make(i, tag)``: envelope ``i`` and its kind, default
        ``make_envelope``); unacknowledged ones are retried (same msg id) up to ``retry_for`` s."""
        make = make or make_envelope
        stop = stop if stop is not None else asyncio.Event()  # never set: retry until retry_for
        js = self.nc.jetstream(timeout=2.0)
        subject = f"pgw.agent.{self.agent}.envelope"
        sem = asyncio.Semaphore(self.concurrency)

        async def one(i: int) -> None:
            env, kind = make(i, tag)
            body = json.dumps(env).encode()
            msg_id = f"{self.agent}:{env['envelopeId']}"
            deadline = time.monotonic() + retry_for
            async with sem:
                self.sent += 1
                while True:
                    try:
                        await js.publish(subject, body, headers={"Nats-Msg-Id": msg_id})
                        self.acked[env["envelopeId"]] = kind
                        return
                    except Exception:  # noqa: BLE001 - server down / no responders: retry
                        self.failures += 1
                        if time.monotonic() > deadline or stop.is_set():
                            return
                        # Back off 0.1-0.3 s (nothing announces the stream is back), or less if stopped meanwhile.
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), 0.1 + random.random() * 0.2)

        if not rate:
            await asyncio.gather(*(one(i) for i in range(n)))
            return
        # Open-loop pacing: envelope i is started by the loop's timer at start + i/rate, and the
        # send is done once the last one has been started and every one finished.
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks: list[asyncio.Task[None]] = []
        all_started = loop.create_future()

        def launch(i: int) -> None:
            tasks.append(loop.create_task(one(i)))
            if len(tasks) == n:
                all_started.set_result(None)

        timers = [loop.call_at(start + i / rate, launch, i) for i in range(n)]
        try:
            if n:
                await all_started
            await asyncio.gather(*tasks)
        finally:
            for t in timers:
                t.cancel()


def chaos_config(path: Path, *, extra: str = "", **gateway: object) -> Path:
    """A TOML config for the child services: short ack_wait so a killed worker's turns return fast."""
    gw = {"ack_wait_s": 2.0, "batch": 64, **gateway}
    lines = ["[gateway]"] + [f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"' for k, v in gw.items()]
    lines += ["", "[ops]", "lag_interval_s = 60.0", "", extra]
    path.write_text("\n".join(lines) + "\n")
    return path
