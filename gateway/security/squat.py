"""No agent can make the server drop another agent's envelope (DESIGN §7, issue 19).

JetStream drops a message whose ``Nats-Msg-Id`` the stream saw within its
duplicate window, and the publisher chooses the header. Two layers close
this for every client (nats CLI, Go, TypeScript, raw nats-py), not only for
``subjects.client.Agent``:

1. ``PGW_INBOUND`` keeps the smallest duplicate window nats-server accepts
   (``pgwcore.streams.INBOUND_DUPLICATE_WINDOW_S``, 100 ms) and the gateway
   does its own exactly-once, keyed by the subject's agent and the envelope
   (``Ctx.envelope_key``), on streams only the services write to. A squatter
   must therefore publish the victim's id at most a few hundred milliseconds
   before the victim does.
2. ``SquatWatch`` closes those milliseconds. Every gateway instance sees every
   envelope publish on core NATS (a plain subscription, not a queue group, so
   each instance sees both halves of a collision). When one ``Nats-Msg-Id``
   arrives on the subjects of two *different* agents within ``HOLD_S``, the
   server may have dropped either one: the watch re-publishes both to their
   own subjects under an id nobody can predict (``rescue-`` + an HMAC of the
   body under this process's random key). The copy that was already stored
   and its rescue are the same envelope to the pipeline (same agent, same
   bytes), so the agent still gets exactly one outcome.

Identity comes from the subject, which the server authenticated
(``agent.{agent}.envelope`` is publishable only by that agent, DESIGN §7).
What remains: a squat while *no* gateway instance is connected is not seen.

What the watch holds is bounded by count and by bytes, and let go on time even
when no message comes (a sweep every ``HOLD_S``): an agent sending the largest
messages the server takes made it hold every body it saw, 300 MB after 300
bodies of 1 MB, until the next message came. Past ``MAX_HELD_BYTES`` the oldest
bodies are let go and their ids kept: a collision with an id whose body was let
go still re-publishes the later message, the one the server drops when the ids
arrive in the order the watch saw them (only the earlier publish's own copy,
needed if the server had stored them in the other order, is lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from gateway.security import msgid
from pgwcore.logs import get_logger
from subjects.errors import SubjectError

if TYPE_CHECKING:
    from gateway.app import Gateway

log = get_logger("pgw.security")
# Longer than the duplicate window (100 ms) plus nats-server's purge timer (up to one more window),
# with margin for delivery jitter between the stream and this subscription.
HOLD_S = 2.0
RESCUE_PREFIX = "rescue-"
MAX_HELD = 200_000
# Bodies and header values held at most (bytes): beyond it the oldest bodies are let go, their ids kept.
MAX_HELD_BYTES = 64 * 1024 * 1024


class SquatWatch:
    """Re-publishes envelopes whose ``Nats-Msg-Id`` another agent also used, so none is dropped."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._key = os.urandom(32)
        # msg id -> (monotonic time, subject, body, headers) of the first publish seen with it; body and
        # headers None once let go (MAX_HELD_BYTES)
        self._seen: OrderedDict[str, tuple[float, str, bytes | None, dict[str, str] | None]] = OrderedDict()
        self._bodies: OrderedDict[str, int] = OrderedDict()  # msg id -> bytes held for it, oldest first
        self.held_bytes = 0
        self._rescued: dict[str, set[str]] = {}  # msg id -> agents whose publish was re-published
        self._sub: Any = None
        self._sweep: asyncio.Task[None] | None = None
        self.rescues = 0

    def rescue_id(self, subject: str, body: bytes) -> str:
        mac = hmac.new(self._key, subject.encode() + b"\x00" + body, hashlib.sha256).hexdigest()[:40]
        return RESCUE_PREFIX + mac

    async def start(self) -> None:
        self._sub = await self.gw.nc.subscribe(self.gw.subjects.all_agents("envelope"), cb=self._on_msg)
        self._sweep = asyncio.create_task(self._sweeping(), name="squat-watch-sweep")

    async def _sweeping(self) -> None:
        """Lets go of what is past ``HOLD_S`` when no message comes to do it."""
        while True:
            await asyncio.sleep(HOLD_S)
            self._expire(time.monotonic())

    async def drain(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweep
            self._sweep = None
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # closing anyway
                log.debug("squat watch unsubscribe failed", exc_info=True)
            self._sub = None

    def _expire(self, now: float) -> None:
        seen = self._seen
        while seen and (now - next(iter(seen.values()))[0] > HOLD_S or len(seen) > MAX_HELD):
            mid, _ = seen.popitem(last=False)
            self._rescued.pop(mid, None)
            size = self._bodies.pop(mid, None)
            if size is not None:
                self.held_bytes -= size

    def _hold(self, mid: str, now: float, subject: str, body: bytes, headers: dict[str, str]) -> None:
        """Remembers the first publish of ``mid``, its body and headers within ``MAX_HELD_BYTES``."""
        size = len(body)
        for k, v in headers.items():
            size += len(k) + len(v)
        if size > MAX_HELD_BYTES:
            self._seen[mid] = (now, subject, None, None)
            return
        self._seen[mid] = (now, subject, body, headers)
        self._bodies[mid] = size
        self.held_bytes += size
        bodies, seen = self._bodies, self._seen
        while self.held_bytes > MAX_HELD_BYTES:
            old, old_size = bodies.popitem(last=False)
            self.held_bytes -= old_size
            t, sub, _, _ = seen[old]
            seen[old] = (t, sub, None, None)  # the id stays, in its place: a collision is still seen

    async def _on_msg(self, msg: Any) -> None:
        # Every instance runs this for every envelope published (issue 18): the
        # common case (an id not seen yet) costs a dict lookup and an insert, and
        # keeps references only (the body and the header dict nats-py built for
        # this message); the subject is parsed only when two publishes collide.
        headers = msg.headers
        mid = headers.get("Nats-Msg-Id") if headers else None
        if not mid:
            return
        subject = msg.subject
        if mid.startswith(RESCUE_PREFIX) and mid == self.rescue_id(subject, msg.data):
            return  # our own copy
        now = time.monotonic()
        self._expire(now)
        first = self._seen.get(mid)
        if first is None:
            self._hold(mid, now, subject, msg.data, headers)
            return
        if first[1] == subject:
            return  # the same agent re-using its own id: JetStream's ordinary dedup, its own business
        # Two agents, one id: whichever the stream stored, the other was dropped. Re-publish
        # both (the stored one and its copy are one envelope to the pipeline's exactly-once);
        # a side whose subject names no agent is one the pipeline would drop anyway. A first
        # publish whose body was let go (MAX_HELD_BYTES) cannot be: the later one still is.
        sides = [(subject, msg.data, headers)]
        if first[2] is not None and first[3] is not None:
            sides.insert(0, (first[1], first[2], first[3]))
        else:
            log.warning("Nats-Msg-Id used by two agents; the first publish's body was no longer held",
                        msg_id=mid[:128])
        for sub, body, hdrs in sides:
            try:
                agent = self.gw.subjects.parse(sub).token or ""
            except SubjectError:
                continue
            await self._rescue(mid, agent, sub, body, dict(hdrs))

    async def _rescue(self, mid: str, agent: str, subject: str, body: bytes, headers: dict[str, str]) -> None:
        if msgid.check(agent, mid, None, first=False) is not None:
            return  # it claims another agent's identity: refused anyway, nobody loses it
        done = self._rescued.setdefault(mid, set())
        if agent in done:
            return
        done.add(agent)
        hdrs = {k: v for k, v in headers.items() if not k.startswith("Nats-")}
        hdrs["Nats-Msg-Id"] = self.rescue_id(subject, body)
        try:
            await self.gw.js.publish(subject, body, headers=hdrs)
        except Exception:  # logged; the squatter's own refusal is still recorded
            log.exception("could not re-publish an envelope whose Nats-Msg-Id another agent used", agent=agent)
            return
        self.rescues += 1
        log.warning("Nats-Msg-Id used by two agents; envelope re-published under a fresh id",
                    agent=agent, msg_id=mid[:128])
