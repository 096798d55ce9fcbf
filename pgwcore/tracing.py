"""OpenTelemetry spans from the W3C ``traceparent`` every message already carries (off by default).

An agent (or a surface) may send a ``traceparent`` header; the gateway keeps it
on the envelope's turn, its verdicts carry it to the signer, and the signer's
registration statement carries it to the registrar (docs/contract.md §6). With
tracing on, each of those steps becomes a span, child of the sender's span, so
one trace shows the gateway's turn, the signing and the registration:

- ``pgw.gateway.turn`` (gateway): one inbound message through the pipeline;
- ``pgw.signer.capsule`` (signer): a verdict signed and queued for registration;
- ``pgw.registrar.register`` (registrar): one statement registered.

Tracing is configured by the standard OpenTelemetry variables and is off
unless one of them asks for it: ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (OTLP over HTTP/protobuf), or
``OTEL_TRACES_EXPORTER=otlp``; ``OTEL_SDK_DISABLED=true`` turns it off again.
``OTEL_SERVICE_NAME`` names the process (default ``pgw-{command}``); the
batch processor's ``OTEL_BSP_*`` settings apply. It needs the ``otel`` extra
(``pip install 'principal-gateway[otel]'``); asked for without it, the process
stops at start with that hint. Off, ``span()`` costs one ``None`` check.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

from subjects.errors import ConfigError


class _State:
    tracer: Any = None
    provider: Any = None


_state = _State()


# W3C Trace Context §3.2: version "00", a 16-byte trace-id and an 8-byte parent-id (lowercase hex,
# neither all zeros) and the flags. A value of another form is not carried on (§3.2.2: "the vendor
# MUST ... restart the trace"), so text an agent puts in the header never reaches a log or a store.
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


def accepted(value: str | None, redactor: Any = None) -> str | None:
    """``value`` when it is a well-formed W3C ``traceparent`` holding no secret (``redactor.holding``:
    a configured secret may have the shape of a trace id), else None: the message starts no trace."""
    if value is None or not _TRACEPARENT.fullmatch(value):
        return None
    if redactor is not None and redactor.holding(value):
        return None
    return value


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether the standard OTEL_* variables ask for trace export."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return exporter == "otlp" or bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure(service: str, env: Mapping[str, str] | None = None) -> bool:
    """Start exporting spans when the environment asks for it (at the command-line edge); True if on."""
    if not wanted(env):
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ConfigError("OTEL_EXPORTER_OTLP_ENDPOINT",
                          "trace export needs the otel extra: pip install 'principal-gateway[otel]'") from e
    name = (env or os.environ).get("OTEL_SERVICE_NAME") or service
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # endpoint etc. from OTEL_*
    _state.provider, _state.tracer = provider, provider.get_tracer("principal-gateway")
    return True


def shutdown() -> None:
    """Flush and stop the exporter (idempotent)."""
    provider, _state.provider, _state.tracer = _state.provider, None, None
    if provider is not None:
        with contextlib.suppress(Exception):
            provider.shutdown()


_OFF: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()  # reusable: enters as None


def span(name: str, traceparent: str | None, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A span named ``name``, child of ``traceparent`` (W3C) when given; nothing (``None``) when
    tracing is off, then without building a generator per call (the gateway opens one per turn)."""
    if _state.tracer is None:
        return _OFF
    return _span(name, traceparent, **attributes)


@contextlib.contextmanager
def _span(name: str, traceparent: str | None, **attributes: Any) -> Iterator[Any]:
    tracer = _state.tracer
    if tracer is None:  # turned off in between
        yield None
        return
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract({"traceparent": traceparent}) if traceparent else None
    attrs = {k: v for k, v in attributes.items() if isinstance(v, str | int | float | bool)}
    with tracer.start_as_current_span(name, context=ctx, attributes=attrs) as s:
        yield s


def record(name: str, traceparent: str | None, start_ns: int, **attributes: Any) -> None:
    """A finished span from ``start_ns`` (``time.time_ns()``) to now, for work done in batches."""
    tracer = _state.tracer
    if tracer is None:
        return
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract({"traceparent": traceparent}) if traceparent else None
    attrs = {k: v for k, v in attributes.items() if isinstance(v, str | int | float | bool)}
    tracer.start_span(name, context=ctx, attributes=attrs, start_time=start_ns).end()
