"""structlog set-up: JSON when not a TTY, the console renderer when it is.

Context (envelope id, agent, principal, trace id) is bound per message with
contextvars; each message gets one summary line (STYLE.md "Logging").
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Literal

import structlog


class _CurrentStderr:
    """A file-like object that writes to whatever ``sys.stderr`` is now."""

    def write(self, s: str) -> int:
        try:
            return sys.stderr.write(s)
        except ValueError:  # closed stream: logging must never crash the caller
            return 0

    def flush(self) -> None:
        with contextlib.suppress(ValueError):
            sys.stderr.flush()


def connection_errors_in_one_line(
    _logger: object, _name: str, event: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    """A NATS connection-state error (the server gone, a request timed out while reconnecting) is
    logged as one ``error`` field, not a traceback: it is an operating condition, not a bug, and a
    stop after the server died must not fill the log with tracebacks (docs/operations.md)."""
    exc = event.get("exc_info")
    if exc is True:
        exc = sys.exc_info()[1]
    elif isinstance(exc, tuple):
        exc = exc[1]
    if isinstance(exc, BaseException) and _is_connection_error(exc):
        event.pop("exc_info", None)
        event.setdefault("error", f"{type(exc).__name__}: {exc}"[:300])
    return event


def _is_connection_error(exc: BaseException) -> bool:
    from nats.errors import Error as NatsError  # nats is imported by every process that logs this

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:  # a wrapped one counts too (raise ... from e)
        if isinstance(e, NatsError | ConnectionError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def configure_logging(fmt: Literal["auto", "json", "console"] = "auto", level: str = "INFO") -> None:
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    )
    _route_stdlib_logging(renderer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            connection_errors_in_one_line,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # Resolve sys.stderr at each write, not at configure time: a stream
        # captured or replaced later (tests, daemons) must not be kept open.
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=False,
    )


def _route_stdlib_logging(renderer: structlog.typing.Processor) -> None:
    """Lines of the standard library's loggers (asyncio's "Exception in callback" and "Task
    exception was never retrieved", nats-py's, aiohttp's) in the same format as ours: one JSON
    object per line, with ``logger`` and the traceback in ``exception``, not raw text lines in the
    middle of a JSON log. Warnings and above, as Python's last-resort handler wrote them."""
    handler = logging.StreamHandler(_CurrentStderr())
    handler.set_name(_STDLIB_HANDLER)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_logger_name,
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            connection_errors_in_one_line,
            structlog.processors.format_exc_info,
            renderer,
        ],
    ))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _STDLIB_HANDLER]:
        root.removeHandler(old)  # configured again (a second command in one process)
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)


_STDLIB_HANDLER = "pgw-structlog"


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)


def enabled(level: int) -> bool:
    """Whether a line at ``level`` (``logging.INFO``...) would be written under the configured
    filtering level, so a hot path can skip building the fields of a line that would be dropped
    (the gateway's per-envelope summary line costs a redaction of each field). A wrapper class
    that does not say its level is taken to write everything."""
    effective = getattr(structlog.get_config()["wrapper_class"], "get_effective_level", None)
    return effective is None or level >= effective(None)
