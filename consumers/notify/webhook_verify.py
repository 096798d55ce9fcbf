"""Verify a notifier webhook (docs/notifications.md "Signed webhook"). Standard library only: copy it.

Every webhook POST carries::

    Pgw-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + raw body)>
    Pgw-Notification-Id: <32 hex digits, the same on a repeat of the same notification>

A receiver checks the HMAC over the exact bytes received (before parsing the
JSON), refuses a timestamp older or newer than ``tolerance_s`` (a captured
request cannot be replayed later), and refuses an id it has already taken
within that window (a captured request cannot be replayed now either):
answer 401 to :class:`WebhookSignatureError`, 409 to :class:`WebhookReplay`
(the notifier counts a 409 as delivered, so a repeat of the same notification
after a notifier crash is shown once).
Several ``v1=`` entries may be present while a secret is being rotated; any
one that matches is enough.
"""

from __future__ import annotations

import hashlib
import hmac
import time

SIGNATURE_HEADER = "Pgw-Signature"
ID_HEADER = "Pgw-Notification-Id"
DEFAULT_TOLERANCE_S = 300


class WebhookSignatureError(ValueError):
    """The request is not a valid, fresh notifier webhook: answer 401 and do nothing."""


class WebhookReplay(WebhookSignatureError):
    """Signed and fresh, but this notification id was already taken: answer 409 and do nothing.

    The notifier takes 409 as "delivered" (a repeat after a crash carries the
    same id), so a receiver that dedupes this way shows each notification once.
    """


def sign(secret: bytes, body: bytes, timestamp: int) -> str:
    """The ``Pgw-Signature`` header value for ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(secret: bytes, header: str | None, body: bytes, *, notification_id: str | None = None,
           seen: dict[str, float] | None = None, tolerance_s: float = DEFAULT_TOLERANCE_S,
           now: float | None = None) -> int:
    """Check one webhook; return its timestamp, or raise WebhookSignatureError.

    ``seen`` (id -> time taken), if given, is the receiver's replay memory: an id
    in it is refused, a fresh one is added, entries older than ``tolerance_s`` are
    forgotten (the timestamp check refuses those requests anyway).
    """
    now = time.time() if now is None else now
    if not header:
        raise WebhookSignatureError(f"no {SIGNATURE_HEADER} header")
    ts: int | None = None
    macs: list[str] = []
    for part in header.split(","):
        k, _, v = part.strip().partition("=")
        if k == "t" and v.isdigit():
            ts = int(v)
        elif k == "v1":
            macs.append(v)
    if ts is None or not macs:
        raise WebhookSignatureError(f"malformed {SIGNATURE_HEADER}: want t=<unix>,v1=<hex>")
    expected = hmac.new(secret, str(ts).encode() + b"." + body, hashlib.sha256).hexdigest()
    if not any(hmac.compare_digest(expected, m) for m in macs):
        raise WebhookSignatureError("signature does not match the body")
    if abs(now - ts) > tolerance_s:
        raise WebhookSignatureError(f"timestamp {ts} is more than {tolerance_s:.0f} s from now (replay?)")
    if seen is not None:
        for k in [k for k, t in seen.items() if now - t > tolerance_s]:
            del seen[k]
        key = notification_id or expected
        if key in seen:
            raise WebhookReplay(f"notification {key} was already received (replay)")
        seen[key] = now
    return ts
