"""Small helpers shared by every party of the bus: clocks and stable ids."""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime

_second: list[tuple[int, str]] = [(-1, "")]  # [(the second, its text)]: swapped whole, read whole


def now_rfc3339() -> str:
    """Current time as RFC 3339 UTC with a ``Z`` suffix and millisecond precision.

    The same text as ``datetime.now(UTC).isoformat(timespec="milliseconds")`` with
    ``Z``, the date and time of day formatted once per second (the kernel stamps
    four per request).
    """
    sec, ns = divmod(time.time_ns(), 1_000_000_000)
    known, text = _second[0]
    if sec != known:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        _second[0] = (sec, text)
    return f"{text}.{ns // 1_000_000:03d}Z"


def to_rfc3339(ts: float) -> str:
    """A POSIX timestamp as RFC 3339 UTC ``Z``."""
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_rfc3339(value: str) -> datetime:
    """Parse an RFC 3339 timestamp; raise ValueError if it lacks a timezone."""
    dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        raise ValueError(f"timestamp {value!r} has no timezone")
    return dt


def stable_id(*parts: str, length: int = 32) -> str:
    """Deterministic lowercase-hex id of ``parts``.

    Redelivery of the same input yields the same id, which is what makes every
    JetStream publish idempotent through ``Nats-Msg-Id``.
    """
    h = hashlib.sha256()
    for p in parts:
        b = p.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(4, "big"))
        h.update(b)
    return h.hexdigest()[:length]
