"""Captured log events with the per-request context bound through contextvars (pgwcore.logs merges it).

``structlog.testing.capture_logs(processors=[merge_contextvars])`` does this from structlog 25.5 on;
pyproject.toml admits structlog 24.1 (``make test-lowest`` runs the suite there), so the same is
written out here the way ``capture_logs`` does it: the configured processor list is changed in
place, so loggers that cached it see the capture too, and put back afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import structlog


@contextmanager
def capture_logs_with_context() -> Iterator[list[MutableMapping[str, Any]]]:
    cap = structlog.testing.LogCapture()
    processors = structlog.get_config()["processors"]
    old = processors.copy()
    try:
        processors.clear()
        processors.extend([structlog.contextvars.merge_contextvars, cap])
        structlog.configure(processors=processors)
        yield cap.entries
    finally:
        processors.clear()
        processors.extend(old)
        structlog.configure(processors=processors)
