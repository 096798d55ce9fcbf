"""Small helpers shared by every party of the bus: clocks and stable ids."""

from __future__ import annotations

import hashlib
import math
import re
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
    return f"{_second_text(sec)}.{ns // 1_000_000:03d}Z"


_LAST_SECOND = 253402300799  # 9999-12-31T23:59:59Z: beyond it (and before 1970) datetime formats it


def _second_text(sec: int) -> str:
    known, text = _second[0]
    if sec != known:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        _second[0] = (sec, text)
    return text


def to_rfc3339(ts: float) -> str:
    """A POSIX timestamp as RFC 3339 UTC ``Z``, to the millisecond.

    The same text as ``datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")``
    with ``Z``, which rounds the fraction half-even to microseconds and then truncates it to
    milliseconds; done here as datetime does it (``math.modf``, ``round``, a carry) with the
    date and time of day formatted once per second, at a third of its cost."""
    frac, whole = math.modf(ts)
    us = round(frac * 1e6)
    if us >= 1_000_000:
        us -= 1_000_000
        whole += 1.0
    elif us < 0:
        us += 1_000_000
        whole -= 1.0
    if not 0.0 <= whole <= _LAST_SECOND:  # also NaN and the infinities: datetime says what it says
        return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return f"{_second_text(int(whole))}.{us // 1000:03d}Z"


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


# Every character ``str.splitlines`` breaks a line at (CR, LF, VT, FF, the file/group/record separators, NEL,
# the line and paragraph separators). A text meant for one line holds none: a terminal draws a CR as a
# return to the line's start, over what was drawn before it.
LINE_BREAKS = re.compile("[\r\n\v\f\x1c-\x1e\x85\u2028\u2029]")


def one_line(text: str) -> str:
    """``text`` with each line break (:data:`LINE_BREAKS`) shown as a space."""
    return LINE_BREAKS.sub(" ", text) if LINE_BREAKS.search(text) else text
