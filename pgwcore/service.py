"""The life cycle every long-lived part shares (STYLE.md "Lifecycles").

A service is an async context manager: entering starts it, ``drain()`` stops
taking new work and finishes in-flight work (idempotent), exiting releases
everything. ``run_services`` wires several with an AsyncExitStack, waits for
a stop event, drains them in reverse order and logs-and-continues past a
drain step that fails.

The parts every service wrote for itself live here once:

- ``PullService``: the base of a service of its own (signer, registrar,
  notifier): the services-API registration, the stop signal its loops watch,
  the loops, the pull subscription, started and released in one order;
  ``fetch_batch`` is the fetch every such loop makes.
- ``stop_event``: the signal-driven stop (SIGINT, SIGTERM) of a process.
- ``serve_alone``: one service as its own process (``pgw gateway``, ``pgw
  signer``, ``pgw registrar``, ``pgw notifier``): connect, streams, run, drain.

The platform names no service: the list ``pgw up`` runs (``UP_SERVICES``, name ->
factory ``(config, nc) -> Service``) is the command line's, in ``pgwcli/commands/up.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

from nats.errors import TimeoutError as NatsTimeoutError

from pgwcore import health, micro
from pgwcore.logs import get_logger
from pgwcore.metrics import acquire_server

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from structlog.typing import FilteringBoundLogger

    from pgwcore.config import Config

log = get_logger("pgw.service")


def delivery(msg: Msg) -> tuple[int, int]:
    """(stream sequence, times delivered) of a JetStream message. The usual reply subject,
    ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>``,
    is read here at a fifth of the cost of nats' full ``metadata`` (which builds a
    datetime per message); any other form (domains, ADR-15's v2) goes through ``metadata``."""
    t = (msg.reply or "").split(".")
    if len(t) == 9 and t[0] == "$JS" and t[1] == "ACK":
        return int(t[5]), int(t[4])
    meta = msg.metadata
    return meta.sequence.stream, meta.num_delivered


class Service(Protocol):
    name: str

    async def __aenter__(self) -> Any: ...
    async def __aexit__(self, *exc: object) -> None: ...
    async def drain(self) -> None: ...


ServiceFactory = Callable[["Config", "Client"], Service]


# Container allocations between two collections of the youngest generation (CPython's default:
# 700), and the two older generations' steps (default 10, 10). A binding moment allocates a
# hundred or so (dicts, Structs, futures, tasks) that nearly all die with its turn; at the default
# the collector ran every seven envelopes and promoted the turns in flight to the older
# generations, about 5 % of the gateway's CPU at 1,000 envelopes/s (benchmarks/performance-changes.md,
# "Gateway CPU per envelope"); a signer's batch or a kernel request is alike. At 20,000 it still ran
# every few hundred envelopes under a closed loop of 256, each time over the turns in flight (7 ms a
# collection, about 20 us an envelope: "The collector's threshold", same file); the turns in flight of
# a full gateway (``gateway.batch`` x 4) stay below 100,000, so a collection comes only when what is
# left over adds up to that. Cycles are still collected, only in larger steps; what dies without a
# cycle is freed at once, as always.
GC_THRESHOLDS = (100_000, 20, 20)


def freeze_startup_heap() -> None:
    """Collect once, then move everything alive after start-up (modules, compiled patterns,
    Cedar policies, clients) out of the cyclic collector's reach (``gc.freeze``), and collect
    what comes after in larger steps (:data:`GC_THRESHOLDS`).

    Issue 18: the gateway holds about 63,000 tracked objects after start-up; every collection
    of the oldest generation re-scanned all of them with the event loop stopped (a pause that
    lands on every envelope in flight, i.e. on p99). What is created afterwards is collected
    as before, every GC_THRESHOLDS[0] allocations instead of 700."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def run_services(services: list[Service], stop: asyncio.Event, *, on_started: Callable[[], None] | None = None) -> None:
    """Start ``services`` in order, wait for ``stop``, drain in reverse, close."""
    async with contextlib.AsyncExitStack() as stack:
        for svc in services:
            await stack.enter_async_context(svc)
            log.info("service started", service=svc.name)
        freeze_startup_heap()
        if on_started:
            on_started()
        await stop.wait()
        for svc in reversed(services):
            try:
                await svc.drain()
                log.info("service drained", service=svc.name)
            except Exception:
                log.exception("drain failed; continuing", service=svc.name)


async def stop_pull_loop(stopping: asyncio.Event, tasks: Iterable[asyncio.Task[Any] | None], sub: Any) -> None:
    """Stop consumer loops: signal them, let each finish what it holds, release their subscription."""
    stopping.set()
    for task in tasks:
        if task is None:
            continue
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if sub is not None:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def hand_back(msgs: Iterable[Msg], delay: float = 1.0) -> None:
    """Nak each of ``msgs`` for redelivery after ``delay`` seconds: what a loop that must outlive a
    failed message (or batch) does with it. One already settled (acked, handed back, terminated)
    refuses a second settle; that refusal, or a connection gone meanwhile, is ignored: the
    message comes back after ``ack_wait`` all the same."""
    for m in msgs:
        with contextlib.suppress(Exception):
            await m.nak(delay=delay)


async def fetch_batch(
    fetch: Callable[[], Awaitable[list[Msg]]], stopping: asyncio.Event, nc: Client, log: FilteringBoundLogger,
    *, what: str = "fetch",
) -> list[Msg] | None:
    """One fetch of a consumer loop: the messages; ``[]`` when none came in time; ``None`` when
    the loop should end (it is stopping, or the connection is closed). Any other failure is
    logged and answered with ``[]`` after half a second, so the loop keeps the stream alive."""
    try:
        return await fetch()
    except (TimeoutError, NatsTimeoutError):
        return []
    except Exception:
        if stopping.is_set() or nc.is_closed:
            return None
        log.exception(f"{what} failed; retrying")
        await asyncio.sleep(0.5)
        return []


class PullService:
    """The life cycle of a service of its own that reads a stream (signer, registrar, notifier).

    A subclass sets ``name`` (its services-API role), opens what it
    needs in ``start()``, keeps its pull subscription in ``self._sub`` and hands
    its loops to ``spawn()``; each loop runs ``while not self.stopping.is_set()``.

    - ``__aenter__``: registers with the services API (``pgwcore.micro``, so
      ``nats micro ls`` lists it), then ``start()``. A start that fails is drained
      before its error goes on, so no loop or registration outlives it.
    - ``drain()`` (idempotent): unregisters; ``stop_inputs()`` (a second input
      or responders the subclass runs); sets ``stopping``; waits for every loop
      to finish what it holds; releases the subscription; ``close()`` (HTTP
      clients and what else is the subclass's own).
    - ``__aexit__``: drains.
    """

    name: ClassVar[str]

    def __init__(self, config: Config, nc: Client) -> None:
        self.config = config
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = config.subjects
        self.stopping = asyncio.Event()
        self._sub: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._micro: micro.MicroRegistration | None = None
        self._health = health.Registered()
        self._release_http: Callable[[], None] | None = None

    async def start(self) -> None:
        """Open what the service needs and spawn its loops."""
        raise NotImplementedError

    async def stop_inputs(self) -> None:
        """Stop what feeds the loops besides the subscription (nothing by default)."""

    async def close(self) -> None:
        """Release what the service holds once its loops have ended (nothing by default)."""

    def ops_stats(self) -> dict[str, Any]:
        """The service's own data in the services API's STATS reply (none by default)."""
        return {}

    def spawn(self, loop: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run ``loop`` as one of the service's loops: ``drain()`` waits for it."""
        task = asyncio.create_task(loop, name=name)
        task.add_done_callback(self._loop_ended)
        self._tasks.append(task)
        return task

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """A loop that ends by an error while the service is not stopping leaves it registered and
        connected but doing nothing: say so loudly (its own error goes with it)."""
        if task.cancelled() or self.stopping.is_set():
            return
        err = task.exception()
        if err is not None:
            log.error("a service loop ended by an error; this service no longer takes work: restart it",
                       service=self.name, loop=task.get_name(), error=repr(err), exc_info=err)

    async def fetch(self, fetch: Callable[[], Awaitable[list[Msg]]], log: FilteringBoundLogger,
                    *, what: str = "fetch") -> list[Msg] | None:
        """``fetch_batch`` with this service's stop signal and connection."""
        return await fetch_batch(fetch, self.stopping, self.nc, log, what=what)

    async def __aenter__(self) -> Self:
        try:
            await self.start()
            self._serve_ops()
            # nats micro ls: registered once it takes work, so an instance $SRV.PING finds is one that
            # serves (a start that fails, as when a cluster node goes down meanwhile, was never counted).
            self._micro = await micro.register(self.nc, self.name, self.config, stats=self.ops_stats)
        except BaseException:
            await self.drain()
            raise
        return self

    def _serve_ops(self) -> None:
        """/metrics and /healthz on ``ops.metrics_port`` (docs/operations.md "Health and metrics"):
        connected, and the service's own durable consumer not stalled."""
        ops = self.config.ops
        if ops.metrics_port is None:
            return
        self._release_http = acquire_server(ops.metrics_addr, ops.metrics_port)
        self._health.add(f"{self.name}:connected", health.connected(self.nc))
        if self._sub is not None:
            self._health.add(f"{self.name}:consumer", health.consumer_progress(self._sub.consumer_info,
                                                                              ops.stall_after_s))

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()

    async def drain(self) -> None:
        """Stop taking work, let each loop finish what it holds, release everything. Idempotent."""
        reg, self._micro = self._micro, None
        await micro.unregister(reg)
        await self.stop_inputs()
        tasks, self._tasks = self._tasks, []
        sub, self._sub = self._sub, None
        await stop_pull_loop(self.stopping, tasks, sub)
        await self.close()
        self._health.remove()
        release, self._release_http = self._release_http, None
        if release is not None:
            release()


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (the second Ctrl-C is left to Python). Where signals
    cannot be handled (not the main thread, no signal support) the event is only set by hand."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop


async def serve_alone(config: Config, factory: ServiceFactory, name: str, *, streams: bool = True) -> int:
    """Run one service as a process of its own until SIGINT/SIGTERM: connect as ``pgw-{name}``,
    create the streams (``streams``; the gateway makes its own), build the service (a bad
    configuration fails here, before anything runs), run it, drain it, drain the connection."""
    from pgwcore.connect import close_quietly, connect
    from pgwcore.durability import check_durability
    from pgwcore.streams import ensure_streams, stream_plans

    nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name=f"pgw-{name}")
    try:
        if streams:
            await ensure_streams(nc.jetstream(), config.subjects,
                                 duplicate_window_s=config.gateway.duplicate_window_s)
        # Are the contract's streams crash-durable on this server (R3, or fsync on every write)?
        await check_durability(nc.jetstream(), [p.name for p in stream_plans(config.subjects)],
                               monitor_url=config.ops.nats_monitor_url, policy=config.ops.durability, service=name)
        stop = stop_event()
        await run_services([factory(config, nc)], stop,
                           on_started=lambda: log.info(f"{name} ready", server=config.nats_url))
    finally:
        await close_quietly(nc)
    return 0
