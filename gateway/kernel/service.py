"""``KernelService``: the IDP kernel as a gateway part (DESIGN §5, spec 003).

* Transition requests on ``{prefix}.agent.*.idp``: request-reply, queue group
  ``pgw-gateway``. The agent is the subject token (the authenticated
  identity); the mandate's ``sub`` must name it. Validation runs in the
  order of spec 003 §5.2 (``_validate``); then the session's step is
  reserved by compare-and-set, ``IDP_SUBMITTED`` is signed, chained and
  acknowledged by the server, and only then does Cedar run (§5.3, §8.2).
* Transition reports on ``{prefix}.agent.*.transition`` (``PGW_INBOUND``):
  durable pull consumer ``pgw-kernel``; each report becomes
  ``STATE_TRANSITIONED`` then ``IDP_COMMITMENT_VERIFIED`` or
  ``IDP_COMMITMENT_GAP`` (§5.5), and a verdict; the message is acked only
  after all of them are durably published. Every publish has a
  deterministic ``Nats-Msg-Id``, so a redelivery doubles nothing.
* HEM (§4.4, §5.5.2, §6.3): the session enters HEM_PENDING, and so does
  every other session of the agent on the governed object (the object's
  hold, ``state.HoldEntry``); the mandate's principal gets a binding moment
  through the moment desk, escalations queue, and each answer
  (``on_hem_decision``) is logged and settles its moment; an approval lets
  exactly that idp_id transition once.

This module is the service and the request path (serve, validate, reserve
the step, decide, commit); the other three ideas live beside it as mixins of
``KernelService``: request validation (``validation.py``), denials and HEM
(``denials.py``) and transition reports (``transitions.py``). At about 500
lines it stays one idea: one request, from the subject to the signed entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from nats.js.api import AckPolicy, ConsumerConfig
from prometheus_client import Counter

from gateway.at_rest import ensure_copies
from gateway.kernel.audit import AuditService
from gateway.kernel.checkpoint import Checkpointer
from gateway.kernel.denials import Denials, request_key
from gateway.kernel.eventlog import EventLog
from gateway.kernel.gate import GATE_CONTEXT, Gate, GateCall
from gateway.kernel.mandate import Mandate, MandateVerifier
from gateway.kernel.overdue import OverdueReports
from gateway.kernel.policy import PolicyEngine, idp_context
from gateway.kernel.received import commit_received, commit_refused
from gateway.kernel.repairs import StepRepairs
from gateway.kernel.revocation import Revocations
from gateway.kernel.scopes import Scopes, offer_for, with_options
from gateway.kernel.state import (
    ConflictError,
    HoldEntry,
    IdpEntry,
    KernelState,
    SessionEntry,
    bump_step,
)
from gateway.kernel.transitions import EXECUTION_CONTEXT, TransitionReports
from gateway.kernel.validation import RefusalError, RequestValidation
from pgwcore import logs
from pgwcore.delivery import subscribe_inline
from pgwcore.keys import load_or_create, public_keys
from pgwcore.logs import get_logger
from pgwcore.loop import gather_inline
from pgwcore.metrics import LATENCY, REGISTRY
from pgwcore.respond import Responder
from subjects.errors import SubjectError
from subjects.idp import (
    REASONING_BASIS_TYPES,
    EnrichedDeny,
    HemPending,
    Idp,
    IdpThin,
    KernelResult,
    Permit,
    Reject,
    SuggestedPath,
    profile_of,
)
from subjects.util import now_rfc3339, stable_id
from subjects.wire import Detail

if TYPE_CHECKING:
    from nats.aio.msg import Msg

log = get_logger("pgw.kernel")

QUEUE = "pgw-gateway"
DURABLE = "pgw-kernel"
INBOUND = "PGW_INBOUND"

IDP_RESULTS = Counter(
    "pgw_idp_results_total",
    "Kernel results of transition requests, by result and code (spec 003 §5.2, §6)",
    ["result", "code"],
    registry=REGISTRY,
)
_IDP_LATENCY = LATENCY.labels(stage="idp")
_RESULT_CHILDREN: dict[tuple[str, str], Any] = {}


def _count_result(result: str, code: str) -> None:
    """``IDP_RESULTS.labels(result, code).inc()``, the labelled child looked up once per pair."""
    child = _RESULT_CHILDREN.get((result, code))
    if child is None:
        child = _RESULT_CHILDREN[(result, code)] = IDP_RESULTS.labels(result=result, code=code)
    child.inc()


class _RaceError(Exception):
    pass


def _uuid_from(*parts: str) -> str:
    return str(uuid.UUID(hex=stable_id(*parts), version=4))


class KernelService(RequestValidation, Denials, TransitionReports, Gate):
    """The governing kernel of spec 003 on the bus; a gateway part (``GATEWAY_PARTS``)."""

    name = "kernel"

    def __init__(self, gateway: Any) -> None:
        self.gw = gateway
        self.config = gateway.config
        self.cfg = gateway.config.kernel
        self.nc = gateway.nc
        self.js = gateway.js
        # The kernel's answers: the gateway's reply rule, each written by the hot path's publish_soon.
        self.responder = Responder(gateway.config.prefix, "gateway", soon=True)
        self.subjects = gateway.subjects
        self.publisher = gateway.publisher
        self.desk = gateway.desk
        self.key = load_or_create(self.config.data_path, "kernel", create=self.config.keys.create,
                                  keys_dir=self.config.keys_path)
        self.mandates = MandateVerifier(self.cfg, self.config.data_path, keys_dir=self.config.keys_path)
        # A bad policy file fails start-up here, with its name and line.
        self.policy = PolicyEngine(self.cfg.policy_dir)
        # Records signed by any kernel key of the data folder (active and retired) are the kernel's own.
        kernel_keys = {k.kid: k.public for k in public_keys(self.config.data_path, "kernel", keys_dir=self.config.keys_path)}
        self.eventlog = EventLog(self.nc, self.subjects, self.key, keys=kernel_keys)
        self.state = KernelState(self.js, self.eventlog.acks)  # one inbox of the kernel's own for both writers' PubAcks
        self.overdue = OverdueReports(self, self.cfg.report_deadline_s)
        # Reports whose step's records are foreign wait for a shared walk of the log there (repairs.py).
        self.repairs = StepRepairs(self.state, self.eventlog, lambda msg: self._one_report(msg, held=True),
                                   beat_s=max(0.5, self.config.gateway.ack_wait_s / 3))
        self.revocations = Revocations(self)
        self.scopes = Scopes(self)  # standing approvals (scopes.py)
        self.audit = AuditService(self)
        self.checkpoints = Checkpointer(
            self.eventlog, self.key, self.subjects.prefix, self.config.data_path, self.cfg.checkpoint_interval_s
        )
        self._sub: Any = None
        self._psub: Any = None
        self._loop_task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._sem = asyncio.Semaphore(256)
        self._stopping = False
        self._busy = False
        self._drained = False

    # -- life cycle -----------------------------------------------------------
    async def __aenter__(self) -> KernelService:
        if not self.cfg.enabled:
            log.info("kernel disabled by configuration")
            return self
        await self.eventlog.acks.start()  # the kernel's PubAcks handed over in the read loop (pgwcore.atomic)
        await self.state.open()
        # The foreign records an operator has quarantined (eventlog.py), before anything walks the log.
        await self.eventlog.load_quarantine()
        await self.overdue.start()
        await self.revocations.start(QUEUE)  # the revocations of the log, then the bucket (revocation.py)
        await self.audit.start(QUEUE)
        await self.scopes.start(QUEUE)  # kernel.approvals.{principal}: list and revoke
        await self.state.rebuild(self.eventlog)
        self.overdue.log_ready = True  # the index now knows every permit the log closed
        if not self.policy.files:
            log.warning("no Cedar policies configured (kernel.policy_dir): every action is denied")
        self.desk.on_hem_decision(self._on_hem_decision)
        self.desk.judge_approval(self._judge_approval)
        # Each request's task started as it is read (pgwcore.delivery).
        self._sub = await subscribe_inline(self.gw.rnc, self.subjects.all_agents("idp"), self._spawn, queue=QUEUE)
        await self._gate_start(QUEUE)  # agent.*.act and the sweep of open dispatches (gate.py)
        await ensure_copies(self.js)  # where a recorded report that held a secret is kept redacted (transitions.py)
        self._psub = await self.js.pull_subscribe(
            self.subjects.all_agents("transition"),
            durable=DURABLE,
            stream=INBOUND,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=self.config.gateway.ack_wait_s,
                max_deliver=self.config.gateway.max_deliver,
                filter_subject=self.subjects.all_agents("transition"),
            ),
        )
        self._loop_task = asyncio.create_task(self._transition_loop(), name="kernel-transitions")
        await self.checkpoints.start()
        await self.nc.flush()
        log.info("kernel started", policies=self.policy.files, kid=self.key.kid)
        return self

    async def drain(self) -> None:
        """Stop taking requests and reports; finish those in flight. Idempotent."""
        if self._drained:
            return
        self._drained = True
        self._stopping = True
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.drain()
        await self._gate_drain()
        await self.revocations.close()
        await self.audit.close()
        await self.scopes.close()
        if self._loop_task is not None:
            if not self._busy:
                # Idle in fetch(): nothing in flight, so stop waiting for new reports.
                self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._loop_task, timeout=30)
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        await self.repairs.close()  # a report still held there is redelivered (repairs.py)
        if self._psub is not None:
            with contextlib.suppress(Exception):
                await self._psub.unsubscribe()
        await self.overdue.close()
        await self.state.close()
        if self.cfg.enabled and not self.nc.is_closed:
            await self.checkpoints.close()  # the head at shutdown, anchored
        await self.eventlog.acks.close()  # nothing of the kernel is in flight any more

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()

    # -- transition requests ----------------------------------------------------
    def _spawn(self, msg: Msg) -> None:
        if not self.responder.admits(msg):  # the reply rule, before any work (docs/security.md "Replies")
            return
        # One task per request so a slow fsync does not serialize every agent.
        task = asyncio.create_task(self._serve(msg))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _serve(self, msg: Msg) -> None:
        async with self._sem:
            structlog.contextvars.clear_contextvars()
            t0 = time.perf_counter()
            try:
                agent = self.subjects.parse(msg.subject).token or ""
            except SubjectError:
                return
            tp = await self.gw.traceparent(msg.headers)
            structlog.contextvars.bind_contextvars(agent=agent, traceparent=tp)  # every log line of this request
            try:
                result = await self.handle_request(agent, msg.data, traceparent=tp)
            except Exception:
                log.exception("kernel request failed", agent=agent)
                result = Reject(
                    timestamp=now_rfc3339(),
                    error_code="KERNEL_UNAVAILABLE",
                    reason="the kernel could not evaluate this request; nothing was permitted",
                )
                with contextlib.suppress(Exception):
                    await self._verdict_failure(agent, msg.data, tp)
            _IDP_LATENCY.observe(time.perf_counter() - t0)
            code = getattr(result, "error_code", None) or getattr(result, "deny_code", None) or "none"
            _count_result(type(result).__name__, code)
            if logs.enabled(logging.INFO):  # the summary line's fields are not built for a dropped line
                log.info(
                    "idp",
                    agent=agent,
                    result=type(result).__name__,
                    code=code,
                    idp_id=getattr(result, "idp_id", None),
                )
            await self.responder.answer(msg, msgspec.json.encode(result))

    async def handle_request(self, agent: str, data: bytes, *, traceparent: str | None = None) -> KernelResult:
        """One kernel.transition() call (spec 003 §5.1 step 4) -> its result."""
        receipt = now_rfc3339()
        try:
            return await self._handle(agent, data, receipt, traceparent)
        except RefusalError as r:
            return r.result

    async def _handle(self, agent: str, data: bytes, receipt: str, tp: str | None) -> KernelResult:
        try:
            raw = msgspec.json.decode(data)
        except Exception:  # noqa: BLE001 - not JSON, not UTF-8, too deep: all a refusal
            raw = None
        if not isinstance(raw, dict):
            await self._malformed_verdict(agent, data, "the request is not a JSON object", tp)
            raise self._reject("REQUEST_MALFORMED", "the request body must be a JSON object {mandate, action, resource?, idp}")
        return await self._handle_raw(agent, raw, data, receipt, tp)

    async def handle_raw(
        self, agent: str, raw: dict[str, Any], data: bytes, receipt: str, tp: str | None, *, gate: GateCall | None = None
    ) -> KernelResult:
        """A decoded transition request (``agent.{agent}.idp``, or the transition of a gated
        action on ``agent.{agent}.act`` when ``gate`` is given) -> its result."""
        try:
            return await self._handle_raw(agent, raw, data, receipt, tp, gate)
        except RefusalError as r:
            return r.result

    async def _handle_raw(
        self, agent: str, raw: dict[str, Any], data: bytes, receipt: str, tp: str | None, gate: GateCall | None = None
    ) -> KernelResult:
        try:
            idp, mandate, resource, pii, read = await self._validate(agent, raw)
        except RefusalError as r:
            res = r.result
            # A well-formed IDP refused by (c)-(f) is still committed first (received.py).
            if isinstance(res, EnrichedDeny):  # MANDATE_REVOKED, a deny code (spec 003 §6.2)
                res.event_seq = await commit_refused(self, agent, raw.get("idp"), receipt, res.deny_code, tp)
                await self._deny_verdict(agent, res.idp_id, request_key(agent, data), res.deny_code, res.deny_reason, None, tp, result="DENY")
                raise
            assert isinstance(res, Reject)
            await commit_refused(self, agent, raw.get("idp"), receipt, res.error_code, tp)
            await self._deny_verdict(agent, res.idp_id, request_key(agent, data), res.error_code, res.reason, None, tp)
            raise
        return await self._decide(agent, raw, idp, mandate, resource, pii, read, receipt, tp, gate)

    async def _session(
        self, agent: str, session_id: str, read: tuple[SessionEntry, int] | None = None
    ) -> tuple[SessionEntry, int | None]:
        """The session, settling the HEM decisions the desk holds for its queue; revision None if settled here."""
        sess, rev = read or await self.state.session(agent, session_id)
        # The desk may have resolved a moment before our callback ran.
        if sess.hem_queue and await self._settle_decided(agent, list(sess.hem_queue)):
            sess, _ = await self.state.session(agent, session_id)
            return sess, None
        return sess, rev

    async def _hold(self, agent: str, so_id: str, read: tuple[HoldEntry, int]) -> HoldEntry:
        """The hold of the agent's governed object (spec 003 §4.4, §5.5.2), settling decided moments."""
        hold = read[0]
        if hold.pending and await self._settle_decided(agent, list(hold.pending)):
            hold, _ = await self.state.hold(agent, so_id)
        return hold

    # after validation: commit, then Cedar ------------------------------------
    async def _decide(
        self, agent: str, raw: dict[str, Any], idp: Idp, m: Mandate, resource: dict[str, str],
        pii: list[str], read: tuple[SessionEntry, int | None], receipt: str, tp: str | None,
        gate: GateCall | None = None,
    ) -> KernelResult:
        sess, rev = read
        hem_available = self.cfg.hem_enabled and sess.state == "ACTIVE"
        # No transition of a session in HEM_PENDING proceeds (spec 003 §6.2 HEM_PENDING).
        if sess.state == "HEM_PENDING":
            # Still committed first (spec 003 §5.3): gateway/kernel/received.py.
            seq = await commit_received(
                self, self._submitted_body(agent, raw["idp"], idp, m, resource, pii, receipt),
                session_state=sess.state, code="HEM_PENDING", moment_id=sess.hem_moment_id, tp=tp,
            )
            return await self._deny(agent, idp, m, "HEM_PENDING", raw["idp"], available=[], hem_available=False,
                                    tp=tp, submitted_seq=seq)
        # (g) mission_ref against the mandate's mission_ref: Enriched DENY
        if idp.mission_ref is not None and m.mission_ref is not None and idp.mission_ref != m.mission_ref:
            return await self._mission_mismatch(agent, idp, m, raw["idp"], tp)

        # spec 003 §5.3: commit IDP_SUBMITTED, signed, and wait for the server's
        # ack before Cedar runs. Alongside it, in the same round trip (so the
        # reply waits for one synced write here, not two in a row), the step
        # reservation (§5.2(f)): a compare-and-set on the revision validation
        # read, so two instances cannot both take one step. Whichever of two
        # racing submissions loses it has its IDP_SUBMITTED followed by
        # IDP_SUBMISSION_VOIDED (``_void``): the log keeps the declared intent
        # (§5.3) and says why nothing followed it.
        # The report key (agent, idp_id) -> so_id is written meanwhile too, and
        # waited for before any answer: a report names only the idp_id, and the
        # key also makes the idp_id taken for this agent (§5.2(c)). Concurrent
        # creates of one key are settled by the create itself, so it need not
        # hold up Cedar; it is sent after the session write, so the bucket's
        # stream (one synced write after another) stores that one first.
        # The reservation runs in this request's own task and the other two beside it
        # (one task each, no gathering future: ``pgwcore.loop.gather_inline``); the reservation is
        # started first, so its write is still the first one sent, and the other
        # two follow in the order they did under ``gather`` (held by
        # tests/test_kernel_log.py::test_a_permits_writes_leave_in_their_order).
        body = self._submitted_body(agent, raw["idp"], idp, m, resource, pii, receipt)
        submitted = asyncio.ensure_future(self.eventlog.append(
            "IDP_SUBMITTED", body, msg_id=stable_id("IDP_SUBMITTED", idp.so_id.lower(), idp.idp_id.lower()),
            traceparent=tp,
        ))
        tr = asyncio.ensure_future(self.state.put_tr(agent, idp.idp_id, idp.so_id))
        try:
            round1 = await gather_inline(self._reserve_step(agent, idp, (sess, rev)), submitted, return_exceptions=True)
            return await self._commit(agent, raw, idp, m, resource, pii, round1, tp, hem_available, gate)
        finally:
            await tr

    async def _commit(
        self, agent: str, raw: dict[str, Any], idp: Idp, m: Mandate, resource: dict[str, str],
        pii: list[str], round1: list[Any], tp: str | None, hem_available: bool,
        gate: GateCall | None = None,
    ) -> KernelResult:
        reserved, sub = round1
        for r in (sub, reserved):
            if isinstance(r, BaseException):
                raise r
        assert not isinstance(sub, BaseException)
        if reserved is not None:
            # The step was taken meanwhile, or the session went to HEM_PENDING.
            if not sub.duplicate:
                await self._void(agent, idp, m, sub.seq, "HEM_PENDING" if reserved == "HEM_PENDING" else "IDP_STEP_SEQUENCE", tp)
            if reserved == "HEM_PENDING":
                return await self._deny(agent, idp, m, "HEM_PENDING", raw["idp"], available=[], hem_available=False, tp=tp)
            rej = Reject(timestamp=now_rfc3339(), error_code="IDP_STEP_SEQUENCE", reason="step_sequence was taken by a concurrent submission", idp_id=idp.idp_id)
            await self._deny_verdict(agent, idp.idp_id, idp.idp_id, rej.error_code, rej.reason, m.principal, tp)
            return rej
        if sub.duplicate:
            rej = Reject(timestamp=now_rfc3339(), error_code="IDP_DUPLICATE", reason="this idp_id was already submitted (spec 003 §5.2(c))", idp_id=idp.idp_id)
            await self._deny_verdict(agent, idp.idp_id, idp.idp_id, rej.error_code, rej.reason, m.principal, tp)
            return rej
        entry = IdpEntry(
            idp_id=idp.idp_id, so_id=idp.so_id, agent=agent, principal=m.principal, session_id=idp.session_id,
            step_sequence=idp.step_sequence, requested_action=idp.requested_action, mandate_id=m.jti,
            profile=profile_of(idp), submitted_seq=sub.seq,
        )

        # Only now: policy (spec 003 §5.3 ordering IDP_SUBMITTED < Cedar evaluation).
        ctx = self._context(agent, idp, m, gated=gate is not None)
        action = idp.requested_action
        in_scope = action in m.actions
        decision = self.policy.evaluate(
            action, agent=agent, principal=m.principal, resource=resource, so_id=idp.so_id, context=ctx
        ) if in_scope else None
        allowed = decision is not None and decision.allowed
        forbidden = decision is not None and decision.forbidden
        deny_code = "POLICY_DENY" if in_scope else "MANDATE_SCOPE"
        final = forbidden or not in_scope
        if final:
            # A forbid policy applied: the deployment says nobody may allow this action, so HEM is not
            # configured for it (spec 003 §6.2 hem_available "false ... if HEM is not configured"), and
            # neither a resubmission with hem_urgency REQUIRED (§4.4, §6.3) nor a standing approval puts
            # it to the principal, who would be asked to override the policy unawares (docs/kernel.md).
            # Likewise an action the mandate does not grant (MANDATE_SCOPE): §6.3 routes a POLICY_DENY to a
            # human, and an approval cannot widen the mandate its issuer signed. Before, a REQUIRED
            # declaration of such an action went to the principal, and Cedar was not even run for it, so an
            # agent whose mandate was narrower escaped a forbid, and could name its action in free text
            # (found by an attack from the docs).
            hem_available = False
        warnings = [Detail(message=f"possible personal data ({p.split('@')[0]})", path=p.split("@")[1], rule="pii") for p in pii]

        if gate is not None:
            gate.entry = entry
        if in_scope and gate is None and self.gated(action):
            # spec 003 §8.7: the comparison of declared and executed action must happen
            # entirely within the kernel, i.e. the action must transit the kernel's gate
            # (agent.{agent}.act, gateway/kernel/gate.py). Declared here, on the report
            # path, it is never permitted, nor sent to a human who could only approve what
            # the agent would then report itself. An action in kernel.gated_actions that
            # no executor serves has no gate at all: it is denied either way.
            entry.status = "denied"
            await self._put_entry(entry)
            return await self._deny(
                agent, idp, m, "GATE_REQUIRED", raw["idp"], available=self._available(agent, idp, m, resource, ctx),
                hem_available=False, tp=tp, submitted_seq=sub.seq, log_event=True,
            )
        if idp.hem_urgency == "REQUIRED" and self.cfg.hem_enabled and not final:
            # spec 003 §4.4: HEM regardless of the Cedar outcome; §6.3 a resubmission after DENY. Not for an
            # action a forbid policy denies or the mandate does not grant (above): those end with the
            # Enriched DENY below.
            entry.status = "hem_pending"
            entry.moment_id = self._moment_id("HEM_URGENCY_REQUIRED", idp)
            await self._put_entry(entry)
            offer = None
            if gate is not None:
                # Besides Approve and Deny, a standing approval where one could ever apply: an action of
                # the mandate, a call that names a clean path (scopes.py).
                offer = gate.scope_offer = offer_for(
                    action=action, executor=gate.kind, arguments=gate.arguments, mandate=m,
                    redactor=(await self.gw.stage_state.get()).redactor)
                # The arguments (and the offer) are stored before the principal can answer (gate.py).
                await self._gate_hold(entry, gate, entry.moment_id)
            moment_id, _seq = await self._escalate(
                agent=agent, principal=m.principal, idp=idp, trigger="HEM_URGENCY_REQUIRED", mandate_id=m.jti,
                mandate_exp=m.exp,
                cedar="PERMIT" if allowed else "DENY", tp=tp, arguments=gate.arguments if gate is not None else None,
                retell=(lambda moment: with_options(moment, offer, agent)) if offer is not None else None,
                extra={"approval_scope_offered": msgspec.to_builtins(offer)} if offer is not None else None,
            )
            return HemPending(
                timestamp=now_rfc3339(), idp_id=idp.idp_id, session_id=idp.session_id,
                moment_id=moment_id, trigger="HEM_URGENCY_REQUIRED", event_seq=sub.seq,
            )
        if idp.hem_urgency == "REQUIRED" and not final:
            # The agent asked for a human and none can be asked: fail closed, with a
            # code of its own (policy may well permit; the missing human is the reason).
            allowed, deny_code, hem_available = False, "HEM_UNAVAILABLE", False
        if not allowed and in_scope and gate is not None and hem_available and self.cfg.hem_enabled:
            # Cedar denied a gated call the agent did not itself ask a human about (REQUIRED returned
            # above): her standing approval answers it as she chose to, without asking (scopes.py).
            scope = await self.scopes.covering(agent=agent, mandate=m, idp=idp, executor=gate.kind,
                                               arguments=gate.arguments)
            if scope is not None:
                gate.scope = scope
                allowed = True
        if allowed:
            # A gated step's entry is stored ``dispatched`` at once: its open dispatch (the record
            # the gate's sweep recovers from, gate.py) is stored in this same round, and nothing
            # else may act on it meanwhile (a report of it is refused either way): one
            # compare-and-set less per gated call than ``permitted`` then ``dispatched``.
            entry.status = "permitted" if gate is None else "dispatched"
            # The permit is registered open (overdue.py) by its CEDAR_PERMIT_RECORDED
            # when that is logged, else by a PGW_KERNEL_OPEN key; either is stored
            # before the answer leaves.
            # With a gate, the entry's revision is kept on it by the write that stored it
            # (``_put_entry``), whatever the place of that write in this round: the gate
            # moves the entry to ``dispatched`` by one compare-and-set on it, with no read
            # (gate.py, _index_dispatched).
            jobs = [self._put_entry(entry, gate)]
            scoped = gate is not None and gate.scope is not None
            if not self.cfg.log_permits or scoped:  # else its log event registers it: opened() would do nothing
                jobs.append(self.overdue.opened(entry))
            if scoped:
                assert gate is not None and gate.scope is not None
                # Not a Cedar permit: the log says which standing approval answered Cedar's DENY.
                jobs.append(self.scopes.applied(gate.scope, entry, "DENY", tp))
            if gate is not None:
                # The open dispatch, with its arguments, is stored with the permit: a crash from
                # here on leaves it to the gate sweep, which finishes it (gateway/kernel/gate.py).
                jobs.append(self._gate_open(entry, gate))
            if self.cfg.log_permits and not scoped:
                jobs.append(
                    self.eventlog.append(
                        "CEDAR_PERMIT_RECORDED",
                        {"idp_id": idp.idp_id, "so_id": idp.so_id, "session_id": idp.session_id, "agent": agent,
                         "requested_action": action, "idp_submitted_seq": sub.seq},
                        msg_id=stable_id("CEDAR_PERMIT_RECORDED", idp.so_id.lower(), idp.idp_id.lower()),
                        traceparent=tp,
                    )
                )
            await gather_inline(*jobs)
            return Permit(
                timestamp=now_rfc3339(), idp_id=idp.idp_id, session_id=idp.session_id,
                step_sequence=idp.step_sequence, event_seq=sub.seq, warnings=warnings,
            )
        available = self._available(agent, idp, m, resource, ctx)
        entry.status = "denied"
        await self._put_entry(entry)
        return await self._deny(
            agent, idp, m, deny_code, raw["idp"], available=available, hem_available=hem_available,
            tp=tp, submitted_seq=sub.seq, log_event=True, forbidden=forbidden,
        )

    def _moment_id(self, trigger: str, idp: Idp) -> str:
        return stable_id("hem", trigger, idp.so_id.lower(), idp.idp_id.lower())

    async def _put_entry(self, entry: IdpEntry, gate: GateCall | None = None) -> int | None:
        """The new index entry stored; its revision, or None if it was there already and moved
        forward. With ``gate``, that revision is also kept as ``gate.entry_rev``."""
        try:
            rev: int | None = await self.state.put_idp(entry, 0)
        except ConflictError:
            # Rebuilt by another instance from the log meanwhile: move it forward.
            await self.state.advance_idp(entry.so_id, entry.idp_id, entry.status, moment_id=entry.moment_id)
            rev = None
        if gate is not None:
            gate.entry_rev = rev
        return rev

    async def _reserve_step(self, agent: str, idp: Idp, read: tuple[SessionEntry, int | None]) -> str | None:
        """Take ``idp.step_sequence`` for the session (spec 003 §5.2(f)); None if it is taken
        for this IDP, else the session state that refused it ("ACTIVE" when a higher
        step got there first)."""

        def advance(s: SessionEntry) -> bool:
            if s.state == "ACTIVE" and s.last_step == idp.step_sequence and s.last_idp == idp.idp_id:
                # The same IDP sent to two instances at once took the step through
                # the other one; which of them goes on is decided by the log append
                # (the other's is a duplicate and answers IDP_DUPLICATE).
                return False
            if s.state != "ACTIVE" or s.last_step >= idp.step_sequence:
                raise _RaceError(s.state)
            s.last_step = idp.step_sequence
            s.last_idp = idp.idp_id
            return True

        sess, rev = read
        try:
            # The CAS is on the revision validation read, so no second read is
            # needed; a write in between fails it and update_session re-reads.
            await self.state.update_session(
                agent, idp.session_id, advance, known=(sess, rev) if rev is not None else None
            )
        except _RaceError as r:
            return str(r)
        return None

    async def _void(self, agent: str, idp: Idp, m: Mandate, submitted_seq: int, code: str, tp: str | None) -> None:
        """Close an IDP_SUBMITTED whose step reservation lost a race: logged, its entry
        ``denied`` (a report for it is refused), and the step counted as committed,
        as the log's rebuild counts it (``bump_step``)."""
        body = {"idp_id": idp.idp_id, "so_id": idp.so_id, "session_id": idp.session_id, "agent": agent,
                "requested_action": idp.requested_action, "code": code, "idp_submitted_seq": submitted_seq}
        entry = IdpEntry(
            idp_id=idp.idp_id, so_id=idp.so_id, agent=agent, principal=m.principal, session_id=idp.session_id,
            step_sequence=idp.step_sequence, requested_action=idp.requested_action, mandate_id=m.jti,
            profile=profile_of(idp), submitted_seq=submitted_seq, status="denied",
        )
        await asyncio.gather(
            self.eventlog.append(
                "IDP_SUBMISSION_VOIDED", body,
                msg_id=stable_id("IDP_SUBMISSION_VOIDED", idp.so_id.lower(), idp.idp_id.lower()), traceparent=tp,
            ),
            self._put_entry(entry),
            self.state.update_session(agent, idp.session_id, bump_step(idp.step_sequence, idp.idp_id)),
        )

    def _context(self, agent: str, idp: Idp, m: Mandate, *, gated: bool = False) -> dict[str, Any]:
        ctx: dict[str, Any] = {"idp": idp_context(idp), "agent": agent, "principal": m.principal,
                               "mandate": {"jti": m.jti, "so_id": m.so_id},
                               # spec 003 §8.7: how the executed action will be known: dispatched
                               # by the kernel's gate (agent.{agent}.act), or reported by the agent.
                               # A policy requiring the gate: forbid(...) unless { context.execution.gated };
                               "execution": GATE_CONTEXT if gated else EXECUTION_CONTEXT}
        if m.mission_ref is not None:
            ctx["mandate"]["mission_ref"] = m.mission_ref
        return ctx

    def _available(self, agent: str, idp: Idp, m: Mandate, resource: dict[str, str], ctx: dict[str, Any]) -> list[str]:
        """spec 003 §6.2: the mandate's actions that Cedar would permit now (never more; no gated action)."""
        actions = [a for a in dict.fromkeys(m.actions) if not self.gated(a)]
        decisions = self.policy.evaluate_many(
            actions, agent=agent, principal=m.principal, resource=resource, so_id=idp.so_id, context=ctx
        )
        return [a for a, d in zip(actions, decisions, strict=True) if d.allowed]

    def _paths(self, action: str, available: list[str]) -> list[SuggestedPath] | None:
        """Configured paths whose first step is available now (spec 003 §6.2, §8.3)."""
        out = []
        for steps in self.cfg.suggested_paths.get(action, []):
            if steps and steps[0] in available:
                out.append(SuggestedPath(path_id=_uuid_from("path", action, *steps), steps=list(steps), requires_elevation=False))
        return out or None

    def _submitted_body(
        self, agent: str, idp_raw: Any, idp: Idp, m: Mandate, resource: dict[str, str], pii: list[str], receipt: str
    ) -> dict[str, Any]:
        recorded = msgspec.to_builtins(idp)
        if isinstance(idp, IdpThin):
            # spec 003 §7: stub values keep the log schema consistent.
            recorded.setdefault("declared_goal", {"goal_id": _uuid_from("goal", idp.idp_id), "description": "UNSPECIFIED (IDP_THIN stub)"})
            recorded.setdefault("reasoning_basis", {"type": "UNSPECIFIED", "description": "UNSPECIFIED"})
            recorded.setdefault("confidence_level", 0.5)
            recorded.setdefault("hem_urgency", "NONE")
            recorded.setdefault("mission_ref", None)
        rb_type = idp.reasoning_basis.type if idp.reasoning_basis else None
        return {
            "idp": idp_raw,
            "idp_recorded": recorded,
            "profile": profile_of(idp),
            "kernel_receipt_ts": receipt,
            "agent_ts": idp.timestamp,
            "idp_id": idp.idp_id,
            "so_id": idp.so_id,
            "session_id": idp.session_id,
            "mandate_id": idp.mandate_id,
            "step_sequence": idp.step_sequence,
            "requested_action": idp.requested_action,
            "audit_accessible": idp.audit_accessible,
            "agent": agent,
            "principal": m.principal,
            "mandate_issuer_kid": m.issuer_kid,
            "resource": resource,
            # spec 003 §4.3: unrecognized types are recorded, not rejected.
            "reasoning_basis_type_registered": (rb_type in REASONING_BASIS_TYPES) if rb_type else None,
            "pii_markers": pii,
        }

