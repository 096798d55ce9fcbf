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


def configure_logging(fmt: Literal["auto", "json", "console"] = "auto", level: str = "INFO") -> None:
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        # Resolve sys.stderr at each write, not at configure time: a stream
        # captured or replaced later (tests, daemons) must not be kept open.
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
