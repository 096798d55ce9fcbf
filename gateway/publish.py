"""Durable, idempotent publishing of everything the gateway emits.

Every publish goes to a JetStream stream, waits for the server's PubAck and
carries a deterministic ``Nats-Msg-Id``: a message redelivered after a crash
produces the same ids, and the stream drops the repeats. ``traceparent``
(W3C) rides along as a header on every message an input causes.
"""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext

from gateway import metrics
from subjects.names import Subjects
from subjects.wire import Outcome, SurfaceItem, Verdict

_enc = msgspec.json.Encoder()


class Publisher:
    def __init__(self, js: JetStreamContext, subjects: Subjects) -> None:
        self.js = js
        self.subjects = subjects

    async def _pub(self, subject: str, body: bytes, msg_id: str, traceparent: str | None) -> bool:
        """Publish durably; True if the stream stored it, False if it was a duplicate."""
        headers = {"Nats-Msg-Id": msg_id}
        if traceparent:
            headers["traceparent"] = traceparent
        ack = await self.js.publish(subject, body, headers=headers)
        return not ack.duplicate

    async def outcome(self, outcome: Outcome, msg_id: str) -> None:
        await self._pub(self.subjects.outcome(outcome.agent), _enc.encode(outcome), msg_id, outcome.traceparent)

    async def surface(self, item: SurfaceItem, msg_id: str) -> None:
        await self._pub(self.subjects.surface(item.principal), _enc.encode(item), msg_id, item.traceparent)

    async def verdict(self, verdict: Verdict) -> None:
        stored = await self._pub(
            self.subjects.verdict(verdict.verdict_class),
            _enc.encode(verdict),
            verdict.verdict_id,
            verdict.traceparent,
        )
        if stored:  # every verdict counted once, whoever publishes it; repeats are not
            metrics.count_verdict(verdict.verdict_class)
