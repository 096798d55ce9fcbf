"""The envelope pipeline and its JetStream worker (DESIGN §3.2).

A durable pull consumer on ``PGW_INBOUND`` (``agent.*.envelope``). Each
message is a turn; each envelope in it runs the stages in spec 002 order and
ends in exactly one outcome to the agent and, for every decision, a verdict.
The message is acked only after all of that is durably published; every
publish has a deterministic ``Nats-Msg-Id``, so a worker killed mid-way
redelivers and the result is the same, once.

A processed turn that held a secret does not stay in ``PGW_INBOUND`` as sent
(spec 002 SR-1; docs/security.md "Data at rest"): its redacted form is kept in
the bucket ``PGW_INBOUND_REDACTED`` (what ``pgw replay`` re-drives in its
place), then the raw message is deleted with erase, then acked
(gateway/at_rest.py, which settles a dead-lettered turn and a transition
report the same way). A crash in between redelivers the turn, which is
answered from its dedup record and settled again. A turn that redaction leaves
unchanged stays as sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gateway.at_rest import ensure_copies, settle_raw
from gateway.stages import contract, dedup, kind, limits, payload, redaction, route, shape, trust
from gateway.stages.base import INBOUND_DURABLE, Ctx, Refuse, Turn
from gateway.stages.state import StageStateCell, StateHost
from pgwcore import tracing
from pgwcore.atomic import stored_by_reply
from pgwcore.logs import enabled, get_logger
from pgwcore.loop import together
from pgwcore.service import delivery
from subjects.errors import SubjectError
from subjects.util import now_rfc3339, stable_id
from subjects.wire import EnvelopeOutcome, NoticeItem, Outcome, Verdict

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from subjects.names import Subjects


class PipelineHost(StateHost):
    """What the pipeline reads from the gateway it runs in (``gateway.app.Gateway``, which imports this module)."""

    subjects: Subjects
    stage_state: StageStateCell
    outcome_hooks: list[Callable[[Ctx, Outcome], Awaitable[None]]]
    failure_hooks: list[Callable[[Any, Msg], Awaitable[bool]]]
    timing_hooks: list[Callable[[str, float], None]]


log = get_logger("pgw.pipeline")

Stage = Callable[[Ctx], Awaitable[None]]

# spec 002 "Production flow": shape -> kind -> payload -> contract -> limits
# -> redaction -> trust -> dedup -> route. Stages are inserted here in order.
STAGES: list[Stage] = [
    shape.run,
    kind.run,
    payload.run,
    contract.run,
    limits.run,
    redaction.run,
    trust.run,
    dedup.run,
]

DURABLE = INBOUND_DURABLE


class Pipeline:
    """Runs turns through the stages and publishes their results."""

    def __init__(self, gw: PipelineHost) -> None:
        self.gw = gw
        self.stages = list(STAGES)

    async def process_turn(self, turn: Turn) -> list[Outcome]:
        state = await self.gw.stage_state.get()
        try:
            values = shape.decode_body(turn.body, self.gw.config.limits)
        except Refuse as r:
            ctx = Ctx(self.gw, turn, 0, None, state)
            hint = getattr(r, "hint", None)  # ids read back where they can be (DESIGN §3.2)
            ctx.envelope_id = shape.readable_id(hint, "envelopeId")
            ctx.correlation_id = shape.readable_id(hint, "correlationId")
            ctx.anonymous = ctx.envelope_id is None  # an empty body sent twice is two inputs (Ctx.envelope_key)
            return [await self._finish(ctx, await self._refuse(ctx, r))]
        outcomes = []
        # spec 002 "Wire serialization": processed in array order, each envelope to
        # exactly one outcome; those past envelopesPerTurn are cap.breached (the
        # limits stage). A turn too long to answer envelope by envelope (more than
        # limits.max_turn_envelopes) was refused whole by decode_body.
        for i, raw in enumerate(values):
            ctx = Ctx(self.gw, turn, i, raw, state)
            ctx.anonymous = shape.readable_id(raw, "envelopeId") is None
            ctx.extra["turn_size"] = len(values)
            outcomes.append(await self.process_envelope(ctx))
        return outcomes

    async def process_envelope(self, ctx: Ctx) -> Outcome:
        refused = False
        try:
            for stage in self.stages:
                await stage(ctx)
            assert ctx.kind is not None
            if "cached_outcome" in ctx.extra:  # set by the dedup stage: replay short-circuit
                return await self._finish(ctx, ctx.extra["cached_outcome"])
            outcome: Outcome = await route.HANDLERS[ctx.kind.handler](ctx)
        except Refuse as r:
            # A clarification / schema.request round counted, then refused: not a round.
            await limits.uncount(ctx)
            # spec 002: validation refusals count against schemaRounds; past it, cap.breached.
            if limits.counts_against_rounds(ctx, r):
                # The dedup record before the count (limits module docstring).
                await dedup.mark_refused(ctx, ctx.state.kv, ctx.correlation_id or "")
                r = await limits.count_refusal(ctx, r)
            outcome = await self._refuse(ctx, r)
            refused = True
        return await self._finish(ctx, outcome, refused=refused)

    async def _finish(self, ctx: Ctx, outcome: Outcome, *, refused: bool = False) -> Outcome:
        red = ctx.state.redactor
        # SR-1: no secret in any downstream byte, whatever stage produced the text.
        outcome, body = red.scrub_json(outcome)  # encoded once: for the publish and the settle
        msg_id = self.outcome_msg_id(ctx)
        # The outcome and the correlationId record are stored together: a crash
        # between them leaves a record whose redelivery republishes the cached
        # outcome under the same Nats-Msg-Id, or no record, and the turn runs again.
        # The id names the envelope (ctx.envelope_key), not the stream position:
        # the same envelope stored twice has one outcome (DESIGN §7, issue 19).
        await together(self.gw.publisher.outcome(outcome, msg_id, body),
                       dedup.settle(ctx, outcome, msg_id, refused, body))
        for hook in self.gw.outcome_hooks:
            await hook(ctx, outcome)
        if not enabled(logging.INFO):
            return outcome  # the summary line below would be dropped: its redacted fields are not built
        status = getattr(outcome, "status", outcome.__struct_config__.tag)
        code = getattr(outcome, "code", None)
        log.info(
            "envelope",
            envelope_id=red.text(ctx.envelope_id) if ctx.envelope_id else None,
            agent=ctx.agent,
            principal=ctx.principal,
            type=red.text(ctx.env.type[:128]) if ctx.env else None,
            status=status,
            code=red.text(code) if code else None,
            moment_id=getattr(outcome, "moment_id", None),
            replayed=getattr(outcome, "replayed", False) or None,
            seq=ctx.turn.stream_seq,
        )
        return outcome

    @staticmethod
    def outcome_msg_id(ctx: Ctx) -> str:
        return f"outcome:{ctx.agent}:{ctx.envelope_key}"

    async def _refuse(self, ctx: Ctx, r: Refuse) -> EnvelopeOutcome:
        """Every refusal: an outcome to the agent with its code, and a verdict (DESIGN §3.2)."""
        seq, idx = str(ctx.turn.stream_seq), str(ctx.index)
        key = ctx.envelope_key  # the same envelope stored twice: one verdict, one notice
        ts = now_rfc3339()
        etype = ctx.env.type if ctx.env else None
        action_id = ctx.envelope_id or f"seq-{seq}-{idx}"
        verdict = Verdict(
            verdict_id=stable_id("refused", ctx.agent, key),
            verdict_class=r.verdict_class,
            decision="reject",
            approver="policy",
            human_disposed=False,
            ts=ts,
            agent=ctx.agent,
            principal=ctx.principal,
            action_type=f"pgw.envelope:{etype}" if etype else "pgw.envelope",
            action_id=action_id,
            envelope_id=ctx.envelope_id,
            correlation_id=ctx.correlation_id,
            reason=r.refusal,
            untrusted=ctx.untrusted,
            traceparent=ctx.turn.traceparent,
            node_id=ctx.node_id,
        )
        red = ctx.state.redactor
        pubs = [self.gw.publisher.verdict(verdict)]  # SR-1 scrubs it there (Publisher.scrub_verdict), once
        bound = self.gw.config.bound_principals(ctx.agent)
        # spec 000 §8.4: a notice goes only to a principal the agent may address.
        if r.notice is not None and ctx.principal and (bound is None or ctx.principal in bound):
            # spec 000 §9.3 / §12.5: the principal sees the conventional payload
            # and a diagnostic, never a partial decision.
            notice = NoticeItem(
                agent=ctx.agent,
                principal=ctx.principal,
                created_at=ts,
                untrusted=ctx.untrusted,
                traceparent=ctx.turn.traceparent,
                node_id=ctx.node_id,
                item_id=stable_id("notice", ctx.agent, key),
                envelope_id=action_id,
                diagnostic=f"The agent's binding moment was discarded as malformed: {r.reason}",
                conventional=r.notice,
            )
            pubs.append(self.gw.publisher.surface(red.scrub_struct(notice), f"notice:{ctx.agent}:{key}"))
        await asyncio.gather(*pubs)
        return EnvelopeOutcome(
            agent=ctx.agent,
            ts=ts,
            untrusted=ctx.untrusted,
            traceparent=ctx.turn.traceparent,
            node_id=ctx.node_id,
            status=r.status,
            envelope_id=ctx.envelope_id,
            correlation_id=ctx.correlation_id,
            type=etype,
            code=r.code,
            reason=r.reason,
            details=r.details,
            warnings=list(ctx.warnings),
            cap_kind=r.cap_kind,
            refused_type=r.refused_type,
            accepted_types=r.accepted_types,
        )


class EnvelopeWorker:
    """Pulls ``agent.*.envelope`` from PGW_INBOUND and runs the pipeline."""

    def __init__(self, gw: PipelineHost) -> None:
        self.gw = gw
        self.pipeline = Pipeline(gw)
        self._sub = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        cfg = self.gw.config.gateway
        await ensure_copies(self.gw.js)
        self._sub = await self.gw.js.pull_subscribe(
            self.gw.subjects.all_agents("envelope"),
            durable=DURABLE,
            stream="PGW_INBOUND",
            config=ConsumerConfig(
                durable_name=DURABLE,
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=cfg.ack_wait_s,
                max_deliver=cfg.max_deliver,
                max_ack_pending=cfg.batch * 16,
            ),
        )
        self._task = asyncio.create_task(self._loop(), name="envelope-worker")

    async def _loop(self) -> None:
        batch = self.gw.config.gateway.batch
        assert self._sub is not None
        # Up to four batches in flight, fetching again as soon as there is
        # room: waiting for a whole batch before the next fetch made every
        # batch as slow as its slowest turn (issue 8 profile: +20-40 % env/s).
        limit = batch * 4
        inflight: set[asyncio.Task[None]] = set()
        try:
            while not self._stopping:
                free = limit - len(inflight)
                if free <= 0:
                    await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    msgs = await self._sub.fetch(min(batch, free), timeout=0.5)
                except (NatsTimeout, TimeoutError):
                    continue
                except Exception:
                    if self._stopping:
                        return
                    log.exception("fetch failed; retrying")
                    await asyncio.sleep(0.5)
                    continue
                for m in msgs:
                    # Each turn in a context of its own, empty: nothing bound for the log (its agent, its seq)
                    # or a trace is inherited from another turn, with no clearing to pay for per turn.
                    task = asyncio.create_task(self.handle(m), context=contextvars.Context())
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
        finally:
            # drain(): the turns in hand finish (and are acked) before we return.
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)

    async def handle(self, msg: Msg) -> None:
        stream_seq, num_delivered = delivery(msg)
        try:
            parsed = self.gw.subjects.parse(msg.subject)  # remembered per subject (Subjects.parse)
        except SubjectError as e:
            # Not even the agent id can be read: drop with a logged reason.
            log.warning("dropped message on an invalid subject", subject=msg.subject[:200], reason=str(e))
            await msg.term()
            return
        if stored_by_reply(msg):
            log.warning("passed over the server's publish acknowledgement stored on an agent's subject",
                        subject=msg.subject[:200], seq=stream_seq)
            with contextlib.suppress(Exception):
                await msg.term()
            return
        headers = msg.headers or {}
        tp = await self.gw.traceparent(headers) if "traceparent" in headers else None
        turn = Turn(
            agent=parsed.token or "",
            subject=msg.subject,
            stream_seq=stream_seq,
            body=msg.data,
            msg_id=headers.get("Nats-Msg-Id"),
            traceparent=tp,
            num_delivered=num_delivered,
            principal=headers.get("Pgw-Principal"),
            headers=headers,
        )
        structlog.contextvars.bind_contextvars(agent=turn.agent, seq=turn.stream_seq, traceparent=turn.traceparent)
        t0 = time.perf_counter()
        try:
            with tracing.span("pgw.gateway.turn", turn.traceparent, agent=turn.agent, stream_seq=turn.stream_seq):
                await self.pipeline.process_turn(turn)
        except Exception:
            log.exception("turn failed; will be redelivered", delivered=turn.num_delivered)
            for hook in self.gw.failure_hooks:
                with contextlib.suppress(Exception):
                    if await hook(turn, msg):
                        return
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return
        try:
            await settle_raw(self.gw.js, (await self.gw.stage_state.get()).redactor, turn)
        except Exception:  # the turn is answered; the next delivery (answered from dedup) settles it again
            log.exception("redacted copy or erase of a processed turn failed; redelivered", delivered=turn.num_delivered)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return
        with contextlib.suppress(Exception):  # erased already: nothing left to redeliver
            await msg.ack()
        for hook in self.gw.timing_hooks:
            hook("turn", time.perf_counter() - t0)

    async def drain(self) -> None:
        """Stop fetching; let the in-flight batch finish. Idempotent."""
        self._stopping = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
