"""Is this interaction request from Slack, and new? (docs/surfaces.md "Slack: security")

Slack signs every request it sends to the interactivity URL: ``X-Slack-Signature``
is ``v0=`` + HMAC-SHA256 of ``v0:{X-Slack-Request-Timestamp}:{body}`` under the
app's signing secret. slack-sdk's :class:`SignatureVerifier` checks the HMAC
(in constant time) and that the timestamp is within five minutes of our clock.
On top of that a signature seen once is refused for as long as its timestamp
is acceptable (a captured request replayed within the five minutes). The
memory of seen signatures is this process's; a restart forgets it, which a
replay can use only for an answer the gateway then refuses as
``already_resolved`` (first answer wins).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from slack_sdk.signature import SignatureVerifier

WINDOW_S = 300  # Slack: "more than five minutes" from local time is refused


class Refusal(Exception):
    """An interaction request refused before it is read: why, for the log."""

    def __init__(self, code: str, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"{code}: {reason}")


class RequestGuard:
    def __init__(self, signing_secret: str, *, now: Callable[[], float] = time.time) -> None:
        self._verifier = SignatureVerifier(signing_secret)
        self._now = now
        self._seen: dict[str, float] = {}  # signature -> until when it could still be replayed

    def check(self, body: bytes, timestamp: str | None, signature: str | None) -> None:
        """Raise :class:`Refusal` unless the request is signed by Slack, fresh and not seen before."""
        if not timestamp or not signature:
            raise Refusal("unsigned", "no X-Slack-Request-Timestamp or X-Slack-Signature header")
        try:
            ts = int(timestamp)
        except ValueError:
            raise Refusal("bad_timestamp", "X-Slack-Request-Timestamp is not a number") from None
        now = self._now()
        if abs(now - ts) > WINDOW_S:
            raise Refusal("stale", f"timestamp {ts} is more than {WINDOW_S} s from now")
        if not self._verifier.is_valid(body=body, timestamp=timestamp, signature=signature):
            raise Refusal("bad_signature", "X-Slack-Signature does not match the signing secret")
        for sig, until in list(self._seen.items()):
            if until < now:
                del self._seen[sig]
        if signature in self._seen:
            raise Refusal("replay", "this signed request was already received")
        self._seen[signature] = ts + WINDOW_S
