"""Poison messages: a dead-letter record instead of an endless redelivery loop (issue 8).

The envelope worker's durable consumer has ``max_deliver`` (config
``gateway.max_deliver``). A turn that cannot be processed reaches it in one of
two ways, and both end here, once:

- the pipeline raised on every delivery: the worker's failure hook sees the
  last delivery (``num_delivered >= max_deliver``), records the dead letter
  and terminates the message (``AckTerm``);
- the worker never answered (crashed, hung past ``ack_wait``): the server
  emits ``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.PGW_INBOUND.pgw-gateway``
  and the listener (queue group, so one gateway instance acts) records it.

A transition report the kernel cannot record (durable ``pgw-kernel``, the same
``max_deliver``) ends here the same two ways: the kernel's last delivery
(``on_report_failure``) or the advisory of ``pgw-kernel``; and a report past its agent's share of the
reports the kernel holds for a walk of its log is dead-lettered at once (``give_up_report``,
gateway/kernel/repairs.py). Its dead letter is the
record (``consumer`` ``pgw-kernel``, the report's ``idp_id`` redacted) and the
``engine_failure`` verdict; a report has no outcome, so none is sent.

A dead letter is three messages, each with a deterministic ``Nats-Msg-Id`` so
that both paths together, or a crash half-way, still yield each exactly once:

- the record on ``{prefix}.deadletter.PGW_INBOUND`` in stream ``PGW_DEADLETTER``
  (stream sequence, subject, agent, deliveries, reason, the ids redacted;
  never the body, which stays in PGW_INBOUND at that sequence for ``pgw replay``);
- an ``engine_failure`` verdict (DESIGN §6: "the gateway could not evaluate"),
  so a capsule;
- an ``envelope_outcome`` with code ``engine_failure`` to the agent.

Then the turn is settled like an answered one (gateway/at_rest.py; spec 002
SR-1, docs/security.md "Data at rest"): one that held a secret leaves
``PGW_INBOUND`` with erase, its redacted form kept in ``PGW_INBOUND_REDACTED``
at its sequence, which is what ``pgw replay`` re-drives. A crash between the
record and the erase leaves the turn as sent until the advisory (or a redelivery)
records it again, which settles it.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import TYPE_CHECKING, Any

import msgspec
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from gateway.at_rest import ensure_copies, settle_raw
from gateway.stages.base import INBOUND_DURABLE, Turn
from pgwcore import metrics
from pgwcore.logs import get_logger
from pgwcore.streams import ensure_stream
from subjects.util import now_rfc3339, stable_id
from subjects.wire import EnvelopeOutcome, Refusal, Verdict

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from gateway.app import Gateway

log = get_logger("pgw.deadletter")

STREAM = "PGW_DEADLETTER"
SOURCE_STREAM = "PGW_INBOUND"
DURABLE = INBOUND_DURABLE
KERNEL_DURABLE = "pgw-kernel"  # gateway/kernel/service.py's durable for transition reports
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_enc = msgspec.json.Encoder()


class DeadLetter(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One message given up after ``max_deliver`` deliveries."""

    stream: str
    consumer: str
    stream_seq: int
    subject: str
    deliveries: int
    reason: str
    ts: str
    agent: str | None = None
    msg_id: str | None = None
    envelope_id: str | None = None
    correlation_id: str | None = None
    idp_id: str | None = None  # a transition report's (consumer pgw-kernel)
    traceparent: str | None = None
    verdict_id: str | None = None


def deadletter_subject(prefix: str, stream: str = SOURCE_STREAM) -> str:
    return f"{prefix}.deadletter.{stream}"


def _ids(body: bytes, keys: tuple[str, ...] = ("envelopeId", "correlationId")) -> tuple[str | None, ...]:
    """The first envelope's ``keys`` (a report's ``idp_id``), each if it is a plain id; never raises."""
    try:
        value = json.loads(body)
    except Exception:  # noqa: BLE001 - a poison body may be anything
        return (None,) * len(keys)
    if isinstance(value, list):
        value = value[0] if value else None
    if not isinstance(value, dict):
        return (None,) * len(keys)
    out = []
    for k in keys:
        v = value.get(k)
        out.append(v if isinstance(v, str) and _SAFE_ID.match(v) else None)
    return tuple(out)


class DeadLetters:
    """A gateway part (``GATEWAY_PARTS``): the failure hook plus the advisory listener."""

    name = "deadletter"

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._subs: list[Any] = []
        self._enabled = gw.config.ops.dead_letter
        self.prefix = gw.subjects.prefix

    async def __aenter__(self) -> DeadLetters:
        if not self._enabled:
            return self
        await self._ensure_stream()
        await ensure_copies(self.gw.js)
        self.gw.failure_hooks.append(self.on_failure)
        self.gw.dead_letters = self  # the kernel's reports (gateway/kernel/transitions.py)
        advisory = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{SOURCE_STREAM}"
        self._subs = [await self.gw.nc.subscribe(f"{advisory}.{durable}", queue="pgw-gateway", cb=self._on_advisory)
                      for durable in (DURABLE, KERNEL_DURABLE)]
        return self

    async def _ensure_stream(self) -> None:
        # Replicas as PGW_INBOUND's (the deployment's count); made once by whichever instance is first.
        await ensure_stream(self.gw.js, StreamConfig(
            name=STREAM,
            subjects=[f"{self.prefix}.deadletter.>"],
            storage=StorageType.FILE,
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            max_age=90 * 86400.0,
            duplicate_window=self.gw.config.gateway.duplicate_window_s,
        ))

    async def drain(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        with contextlib.suppress(ValueError):
            self.gw.failure_hooks.remove(self.on_failure)

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()

    # -- the two ways in -----------------------------------------------------
    async def on_failure(self, turn: Turn, msg: Msg) -> bool:
        """Worker failure hook: on the last allowed delivery, dead-letter and terminate."""
        if turn.num_delivered < self.gw.config.gateway.max_deliver:
            return False
        await self.record(
            stream_seq=turn.stream_seq,
            subject=turn.subject,
            agent=turn.agent,
            deliveries=turn.num_delivered,
            body=turn.body,
            msg_id=turn.msg_id,
            traceparent=turn.traceparent,
            reason=f"processing failed on each of {turn.num_delivered} deliveries (max_deliver)",
        )
        await self._settle(turn)
        with contextlib.suppress(Exception):  # erased already: nothing left to redeliver
            await msg.term()
        return True

    async def on_report_failure(self, report: Turn, msg: Msg) -> bool:
        """The kernel's failure hook for a transition report: on the last allowed delivery, dead-letter
        it, settle it (a report that held a secret leaves PGW_INBOUND) and terminate it."""
        if report.num_delivered < self.gw.config.gateway.max_deliver:
            return False
        await self.give_up_report(
            report, msg, f"the kernel could not record this report on each of {report.num_delivered} deliveries (max_deliver)")
        return True

    async def give_up_report(self, report: Turn, msg: Msg, reason: str) -> None:
        """Dead-letter a transition report now, settle it and terminate it (``reason``: why it is given up).

        Once the dead letter is recorded the message is terminated, whether or not the settle succeeds:
        redelivered, the report could be judged too, and have a dead letter and a verdict of its own."""
        await self.record(
            stream_seq=report.stream_seq, subject=report.subject, agent=report.agent,
            deliveries=report.num_delivered, body=report.body, msg_id=report.msg_id,
            traceparent=report.traceparent, consumer=KERNEL_DURABLE, reason=reason,
        )
        try:
            await self._settle(report)
        finally:
            with contextlib.suppress(Exception):
                await msg.term()

    async def _settle(self, turn: Turn) -> None:
        """The dead letter is recorded: a turn that held a secret leaves PGW_INBOUND (gateway/at_rest.py)."""
        await settle_raw(self.gw.js, (await self.gw.stage_state.get()).redactor, turn)

    async def _on_advisory(self, msg: Msg) -> None:
        try:
            adv = json.loads(msg.data)
            seq = int(adv["stream_seq"])
            deliveries = int(adv.get("deliveries") or 0)
            consumer = KERNEL_DURABLE if adv.get("consumer") == KERNEL_DURABLE else DURABLE
        except Exception:  # noqa: BLE001
            log.warning("unreadable max-deliveries advisory", data=msg.data[:200])
            return
        try:
            raw = await self.gw.js.get_msg(SOURCE_STREAM, seq)
        except Exception:  # noqa: BLE001 - purged or aged out: record what we know
            raw = None
        headers = (raw.headers or {}) if raw is not None else {}
        subject = raw.subject if raw is not None else "?"
        agent = None
        with contextlib.suppress(Exception):
            agent = self.gw.subjects.parse(subject).token
        body = (raw.data or b"") if raw is not None else b""
        tp = await self.gw.traceparent(headers)
        try:
            await self.record(
                stream_seq=seq,
                subject=subject,
                agent=agent,
                deliveries=deliveries,
                body=body,
                msg_id=headers.get("Nats-Msg-Id"),
                traceparent=tp,
                reason=f"not acknowledged after {deliveries} deliveries (worker crash or ack_wait exceeded)",
                consumer=consumer,
            )
            if raw is not None and agent:
                await self._settle(Turn(agent=agent, subject=subject, stream_seq=seq, body=body,
                                        msg_id=headers.get("Nats-Msg-Id"), traceparent=tp, headers=headers,
                                        num_delivered=deliveries, principal=headers.get("Pgw-Principal")))
        except Exception:
            log.exception("dead-letter recording failed", stream_seq=seq)

    # -- the record ------------------------------------------------------------
    async def record(
        self,
        *,
        stream_seq: int,
        subject: str,
        agent: str | None,
        deliveries: int,
        body: bytes,
        msg_id: str | None,
        traceparent: str | None,
        reason: str,
        consumer: str = DURABLE,
    ) -> DeadLetter:
        # SR-1: the record and the outcome are not scrubbed on the way out (the verdict is), so the ids a
        # poison turn carries are redacted here; a redacted id is still the agent's to match.
        red = (await self.gw.stage_state.get()).redactor
        report = consumer == KERNEL_DURABLE
        envelope_id, correlation_id = (None, None) if report else (red.text(i) if i else None for i in _ids(body))
        idp_id = next((red.text(i) for i in _ids(body, ("idp_id",)) if i), None) if report else None
        msg_id = red.text(msg_id) if msg_id else None
        seq = str(stream_seq)
        verdict_id = stable_id("engine_failure", SOURCE_STREAM, seq)
        ts = now_rfc3339()
        dl = DeadLetter(
            stream=SOURCE_STREAM, consumer=consumer, stream_seq=stream_seq, subject=subject,
            deliveries=deliveries, reason=reason, ts=ts, agent=agent, msg_id=msg_id,
            envelope_id=envelope_id, correlation_id=correlation_id, idp_id=idp_id, traceparent=traceparent,
            verdict_id=verdict_id if agent else None,
        )
        headers = {"Nats-Msg-Id": f"deadletter:{SOURCE_STREAM}:{seq}"}
        if traceparent:
            headers["traceparent"] = traceparent
        await self.gw.js.publish(deadletter_subject(self.prefix), _enc.encode(dl), headers=headers)
        refusal = Refusal(code="engine_failure", reason="the gateway could not evaluate this message")
        if agent:
            # Verdict first: if we die between the two, a redelivered advisory or
            # hook republishes both with the same ids.
            await self.gw.publisher.verdict(Verdict(
                verdict_id=verdict_id, verdict_class="engine_failure", decision="reject",
                approver="policy", human_disposed=False, ts=ts, agent=agent,
                action_type="idp.transition" if report else "pgw.envelope",
                action_id=(idp_id if report else envelope_id) or f"seq-{seq}", idp_id=idp_id,
                envelope_id=envelope_id, correlation_id=correlation_id, reason=refusal,
                traceparent=traceparent, details={"stream": SOURCE_STREAM, "stream_seq": stream_seq},
            ))
        if agent and not report:  # a transition report has no outcome
            await self.gw.publisher.outcome(
                EnvelopeOutcome(
                    agent=agent, ts=ts, traceparent=traceparent, status="invalid",
                    envelope_id=envelope_id, correlation_id=correlation_id,
                    code="engine_failure", reason=refusal.reason,
                ),
                f"engine_failure:{agent}:{seq}",
            )
        metrics.DEAD_LETTERS.labels(stream=SOURCE_STREAM).inc()
        log.error("dead letter", stream=SOURCE_STREAM, stream_seq=stream_seq, agent=agent,
                  deliveries=deliveries, reason=reason, traceparent=traceparent)
        return dl
