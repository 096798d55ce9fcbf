"""Prometheus metrics of the gateway and its consumers (issue 8 "Ops", spec 000 §12.3).

All metrics live in one dedicated ``CollectorRegistry`` (``REGISTRY``) so that
tests and embedded processes never collide with the process-wide default
registry. ``start_metrics_server(port)`` serves it for ``--metrics-port``.

Labels never carry principal ids (issue 8: "no principal ids as labels"): a
principal handle is personal data and an unbounded label set. Agent tokens are
configured, bounded, and are what spec 000 §3.3 asks to monitor per agent.
``safe_label`` caps free-form label values (outcome codes, decision classes)
so that a hostile agent cannot blow up the series count.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:
    from nats.js import JetStreamContext

REGISTRY = CollectorRegistry(auto_describe=True)


class _Tally:
    """The counts the hot path takes once per envelope or verdict (``count_envelope``, ``count_verdict``,
    ``count_moment``), kept as plain integers and added to their counters whenever one is read (issue 48,
    target 3: the Prometheus client's layers and its lock on every increment were a few per cent of the
    gateway's CPU). Only the main thread, where every pgw process runs its event loop, counts here; another
    thread increments the counter itself. The counts only grow, and a read adds what each grew by since the
    last read (under a lock, as two scrapes may read at once), so nothing is counted twice or lost: the main
    thread is the only writer of ``counts``, and a reader copies it in one C call."""

    def __init__(self) -> None:
        self.counts: dict[tuple[Any, tuple[str, ...]], int] = {}
        self._added: dict[tuple[Any, tuple[str, ...]], int] = {}
        self._lock = threading.Lock()
        self._thread = threading.main_thread().ident

    def add(self, metric: Any, labels: tuple[str, ...]) -> None:
        if threading.get_ident() != self._thread:
            child(metric, *labels).inc()
            return
        key = (metric, labels)
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1

    def flush(self) -> None:
        with self._lock:
            for key, n in self.counts.copy().items():  # one C copy: the main thread may add a key meanwhile
                grew = n - self._added.get(key, 0)
                if grew:
                    child(key[0], *key[1]).inc(grew)
                    self._added[key] = n


_TALLY = _Tally()


class _TalliedCounter(Counter):
    """A counter the hot path counts into through ``_TALLY``, which takes the tally in whenever it is read
    (the registry's exposition and ``get_sample_value``, or its own ``collect``)."""

    def collect(self) -> Any:
        _TALLY.flush()
        return super().collect()

# Sub-millisecond to tens of seconds: the binding-moment path is ~1-10 ms on
# the embedded default, a human resolution is seconds to hours (capped bucket).
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

ENVELOPES = _TalliedCounter(
    "pgw_envelopes_total",
    "Envelopes processed, by outcome status (accepted/gated/invalid/breached) and code",
    ["outcome", "code"],
    registry=REGISTRY,
)
VERDICTS = _TalliedCounter(
    "pgw_verdicts_total",
    "Verdicts published, by verdict_class (DESIGN §6)",
    ["verdict_class"],
    registry=REGISTRY,
)
LATENCY = Histogram(
    "pgw_latency_seconds",
    "Latency of a processing stage (e.g. envelope = receive to outcome acked)",
    ["stage"],
    buckets=_BUCKETS,
    registry=REGISTRY,
)
DIALOGUE_HATCH = Counter(
    "pgw_dialogue_hatch_total",
    "Resolutions by hatch, per agent and decision_class (spec 000 §12.3 dialogue-hatch rate)",
    ["agent", "decision_class"],
    registry=REGISTRY,
)
RESOLUTIONS = Counter(
    "pgw_resolutions_total",
    "All resolutions per agent and decision_class: the denominator of the dialogue-hatch rate",
    ["agent", "decision_class"],
    registry=REGISTRY,
)
CALIBRATION_NOTES = Counter(
    "pgw_calibration_notes_total",
    "Binding moments carrying meta.calibration_note, per agent (spec 000 §12.3)",
    ["agent"],
    registry=REGISTRY,
)
MOMENTS = _TalliedCounter(
    "pgw_binding_moments_total",
    "Binding moments delivered, per agent: the denominator of the calibration_note rate",
    ["agent"],
    registry=REGISTRY,
)
HATCH_SUPPRESSIONS = Counter(
    "pgw_hatch_suppressions_total",
    "Binding moments delivered with a hatch set to false, per agent and hatch (spec 000 §12.3)",
    ["agent", "hatch"],
    registry=REGISTRY,
)
CONSUMER_LAG = Gauge(
    "pgw_consumer_lag",
    "Messages not yet delivered to a durable consumer (num_pending + ack pending)",
    ["stream", "consumer"],
    registry=REGISTRY,
)
REPLAYS = Counter(
    "pgw_replays_total",
    "Envelopes answered from the correlationId cache (spec 002 replay short-circuit)",
    ["agent"],
    registry=REGISTRY,
)
DEAD_LETTERS = Counter(
    "pgw_dead_letters_total",
    "Messages given up after max_deliver and recorded as dead letters",
    ["stream"],
    registry=REGISTRY,
)

REPLIES_REFUSED = Counter(
    "pgw_replies_refused_total",
    "Requests left unanswered because their reply subject is no inbox of the party that may send them "
    "(docs/security.md \"Replies\"), by service and request kind",
    ["service", "request"],
    registry=REGISTRY,
)

_LABEL_OK = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


@functools.lru_cache(maxsize=4096)
def child(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)``, looked up once per label set (it costs a lock and a
    few dict operations on every envelope otherwise). The registry keeps every
    child anyway, so this holds nothing it does not."""
    return metric.labels(*values)


_SAFE: dict[str, str] = {}  # a string's label, once judged (the hot path labels the same few per envelope)
_SAFE_KEPT = 4096


def safe_label(value: object, *, default: str = "none") -> str:
    """A bounded label value: a short token as it is, anything else ``other``."""
    if value is None or value == "":
        return default
    if type(value) is str:
        label = _SAFE.get(value)
        if label is None:
            label = value if _LABEL_OK.match(value) else "other"
            if len(_SAFE) < _SAFE_KEPT:
                _SAFE[value] = label
        return label
    s = str(value)
    return s if _LABEL_OK.match(s) else "other"


@contextmanager
def timed(stage: str) -> Iterator[None]:
    """Observe the wall time of the ``with`` body in ``LATENCY{stage}``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        child(LATENCY, stage).observe(time.perf_counter() - t0)


def count_envelope(status: str, code: str | None) -> None:
    _TALLY.add(ENVELOPES, (safe_label(status), safe_label(code)))


def count_verdict(verdict_class: str) -> None:
    _TALLY.add(VERDICTS, (safe_label(verdict_class),))


def count_moment(agent: str, binding_moment: object) -> None:
    """Record the spec 000 §12.3 rates for one delivered binding moment.

    ``binding_moment`` is a ``subjects.wire.BindingMoment`` (duck-typed so that
    this module does not import the wire types).
    """
    a = safe_label(agent)
    _TALLY.add(MOMENTS, (a,))
    meta = getattr(binding_moment, "meta", None)
    if meta is not None and getattr(meta, "calibration_note", None):
        CALIBRATION_NOTES.labels(agent=a).inc()
    hatches = getattr(getattr(binding_moment, "question", None), "hatches", None)
    if hatches is not None:
        for hatch in ("free_text", "dialogue"):
            if getattr(hatches, hatch, True) is False:
                HATCH_SUPPRESSIONS.labels(agent=a, hatch=hatch).inc()


def count_resolution(agent: str, decision_class: str | None, resolution_kind: str) -> None:
    """One principal answer; ``dialogue`` answers also count towards the dialogue-hatch rate."""
    labels = {"agent": safe_label(agent), "decision_class": safe_label(decision_class)}
    RESOLUTIONS.labels(**labels).inc()
    if resolution_kind == "dialogue":
        DIALOGUE_HATCH.labels(**labels).inc()


def render() -> bytes:
    """The registry in the Prometheus text exposition format."""
    return generate_latest(REGISTRY)


def start_metrics_server(port: int, addr: str = "127.0.0.1") -> Callable[[], None]:
    """Serve ``REGISTRY`` on ``http://addr:port/metrics`` and the process's readiness on
    ``/healthz`` (``pgwcore.health``); return a function that stops it.

    Port 0 picks a free port; the chosen one is on the returned function's
    ``port`` attribute.
    """
    from pgwcore.health import HEALTH

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, ctype, code = generate_latest(REGISTRY), CONTENT_TYPE_LATEST, 200
            elif path in ("/healthz", "/readyz"):
                ok, checks = HEALTH.run()
                body = json.dumps({"status": "ok" if ok else "unhealthy", "checks": checks}).encode()
                ctype, code = "application/json", 200 if ok else 503
            else:
                body, ctype, code = b"not found: /metrics or /healthz\n", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="pgw-metrics", daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    stop.port = server.server_address[1]  # type: ignore[attr-defined]
    return stop


async def poll_consumer_lag(
    js: JetStreamContext,
    consumers: list[tuple[str, str]],
    *,
    interval_s: float = 5.0,
    stop: asyncio.Event | None = None,
) -> None:
    """Refresh ``CONSUMER_LAG`` for ``(stream, consumer)`` pairs until ``stop`` is set."""
    stop = stop or asyncio.Event()
    while not stop.is_set():
        await update_consumer_lag(js, consumers)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


async def update_consumer_lag(js: JetStreamContext, consumers: list[tuple[str, str]]) -> None:
    """One refresh of ``CONSUMER_LAG``; a consumer that does not exist (yet) is skipped."""
    for stream, consumer in consumers:
        try:
            info = await js.consumer_info(stream, consumer)
        except Exception:  # noqa: BLE001 - a missing consumer is not an error for a gauge
            continue
        CONSUMER_LAG.labels(stream=stream, consumer=consumer).set(
            (info.num_pending or 0) + (info.num_ack_pending or 0)
        )


# ---------------------------------------------------------------------------
# Consumer lag, refreshed by the gateway's metrics part (``gateway.metrics_part``)
# ---------------------------------------------------------------------------

# Consumers whose names are safe labels. PGW_SURFACE / PGW_OUTBOUND hold one
# durable per principal / agent, so their lag is summed into one series per
# stream rather than a label per principal.
_LAG_STREAMS_PER_CONSUMER = ("PGW_INBOUND", "PGW_VERDICTS", "PGW_REGISTRATION", "PGW_CAPSULES", "PGW_CHECKPOINTS")
_LAG_STREAMS_SUMMED = ("PGW_OUTBOUND", "PGW_SURFACE")

_server_refs: dict[tuple[str, int], tuple[Callable[[], None], int]] = {}


def acquire_server(addr: str, port: int) -> Callable[[], None]:
    """One /metrics server per (addr, port) in a process, however many parts ask for it."""
    key = (addr, port)
    if key in _server_refs:
        stop, n = _server_refs[key]
        _server_refs[key] = (stop, n + 1)
    else:
        _server_refs[key] = (start_metrics_server(port, addr), 1)

    def release() -> None:
        stop, n = _server_refs[key]
        if n <= 1:
            del _server_refs[key]
            stop()
        else:
            _server_refs[key] = (stop, n - 1)

    release.port = _server_refs[key][0].port  # type: ignore[attr-defined]
    return release


async def refresh_all_lag(js: JetStreamContext) -> None:
    """Set ``CONSUMER_LAG`` for every consumer of the contract's streams; never raises."""
    for stream in _LAG_STREAMS_PER_CONSUMER + _LAG_STREAMS_SUMMED:
        try:
            infos = await js.consumers_info(stream)
        except Exception:  # noqa: BLE001 - a missing stream is not an error for a gauge
            continue
        summed = stream in _LAG_STREAMS_SUMMED
        total = 0
        for info in infos:
            lag = (info.num_pending or 0) + (info.num_ack_pending or 0)
            name = info.name or ""
            if summed or not _LABEL_OK.match(name) or name.startswith(("outcome-", "surface-")):
                total += lag
            else:
                CONSUMER_LAG.labels(stream=stream, consumer=name).set(lag)
        if summed or total:
            CONSUMER_LAG.labels(stream=stream, consumer="(all)").set(total)
