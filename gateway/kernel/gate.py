"""The gate: governed actions that transit the kernel (spec 003 §5.1, §8.7; spec 004 §5.2; docs/gate.md).

An agent submits the transition and the action's arguments in one call on
``{prefix}.agent.*.act`` (``subjects.gate.ActRequest``; request-reply, queue
group ``pgw-gateway``). The request runs the same path as one on
``agent.*.idp`` (validation in the order of §5.2, ``IDP_SUBMITTED`` committed
before Cedar, §5.3); on PERMIT, or on a human's approval through HEM, the
kernel itself carries the action out by sending it to the executor of its
kind (``exec.{kind}.{action}``, which only the gateway's identity may
publish on). What is written when:

1. ``PGW_KERNEL_GATE`` key ``{idempotency_key}`` (``OpenDispatch``: the
   arguments, the executor, the state) with the permit, and the index entry
   stored ``dispatched`` in the same round: the record a crash is recovered
   from; ``GATE_DISPATCHED`` in the event log (request digest, executor, key),
   written while the executor works and stored before its answer is recorded;
   for a HEM step the key is written ``awaiting_approval`` before the
   principal is asked, and becomes ``dispatched`` on the approval;
2. the executor's answer, within ``kernel.executors.{kind}.timeout_s``:
   ``STATE_TRANSITIONED`` with ``executed_action`` = the action the kernel
   dispatched, ``executed_action_source: kernel_dispatched``,
   ``effect_attestation: gate_executed`` and the effect status
   (``confirmed`` bound to the JSON-DIGEST of the response the kernel
   received, or ``failed``), and with it, in the same round,
   ``IDP_COMMITMENT_VERIFIED`` (declared vs dispatched, computed by the
   kernel alone: §8.7; spec 003 §5.3, §5.5); once both are stored, the
   ``ActDone`` answer. Then, after the answer (the tail): the ``executed``
   verdict (so the capsule), the open permit's close and the index entry
   ``transitioned``, together; the key deleted, last. Nothing of the tail is
   read by the session's next step, which does not wait for it; a gap (never
   on this path: the kernel dispatches the declared action) keeps the tail
   before the answer;
3. no answer in time: a ``timeout`` verdict (spec 004 §5.4.2: a timeout
   after dispatch, ``dispatched_unconfirmed``), the ``ActDispatched``
   answer; the key stays, and the sweep below finishes it.

The sweep (at start, then every few seconds) finishes every dispatch whose
answer the kernel did not record, from its key: it asks the executor's
``_result`` endpoint for the key; a stored result is recorded as in 2 (and
supersedes the timeout verdict), ``unknown`` (the executor never claimed
the key, so never ran it) is dispatched again with the same key, and
``running`` or no executor is asked again until ``follow_up_s`` has passed,
when the step is recorded ``dispatched`` (``STATE_TRANSITIONED`` with that
status) and left unconfirmed. Every write has a deterministic id, so a
sweep on two gateways, or a restart in the middle, doubles nothing.
docs/gate.md says what each crash leaves and what holds for an executor
that is not idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import structlog
from msgspec import Struct, field
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from gateway.kernel import gate_args
from gateway.kernel.eventlog import Appended
from gateway.kernel.mandate import LAPSED_HOW
from gateway.kernel.scopes import ApprovalScope, ScopeOffer, scope_detail
from gateway.kernel.state import ConflictError, IdpEntry
from pgwcore.kvread import listing, sweep_markers
from pgwcore.logs import get_logger
from pgwcore.metrics import LATENCY
from pgwcore.publish import DELETE_MARKER
from pgwcore.streams import ensure_kv
from subjects import jcs
from subjects.errors import SubjectError
from subjects.executor import decode_response
from subjects.gate import (
    IDEMPOTENCY_HEADER,
    ActDispatched,
    ActDone,
    ActRequest,
    ActResult,
    ExecRequest,
    ExecResponse,
    ResultQuery,
    idempotency_key,
)
from subjects.idp import Permit, Reject
from subjects.util import now_rfc3339, stable_id
from subjects.wire import ActionResult, Refusal, ReportedEffect, Verdict

if TYPE_CHECKING:
    from nats.aio.msg import Msg

log = get_logger("pgw.kernel.gate")

BUCKET = "PGW_KERNEL_GATE"
EXECUTED_ACTION_SOURCE = "kernel_dispatched"
ATTESTATION = "gate_executed"
# What Cedar sees of a request on agent.{agent}.act (context.execution): the action will
# transit the gate, so a policy may require it: forbid(...) unless { context.execution.gated };
GATE_CONTEXT = {"gated": True, "executed_action_source": EXECUTED_ACTION_SOURCE}
_enc = msgspec.json.Encoder()
# Why a HEM step did not run, by the principal's answer (gateway.moment_record.hem_decision_of), in the
# ``action_result`` the agent gets. Her own words are not copied here: they travel in the moment's
# ``hem_decision`` outcome (``text``), which is forgotten on schedule (spec 000 §13); the MCP gate hands
# them to the model with this refusal (docs/gate.md "What the principal sees").
NOT_RUN = {
    "deny": "the principal denied this call: nothing ran",
    "free_text": "the principal answered in her own words instead of approving: nothing ran; "
                 "her words are the text of this moment's hem_decision outcome",
    "dialogue": "the principal rejected the question as asked: nothing ran; "
                "her objection, if she wrote one, is the text of this moment's hem_decision outcome",
    "expired": "nobody answered before the approval expired: nothing ran (an expiry is never a consent)",
    "unknown": "the principal did not approve: nothing ran",
}
_STANDS = "(an approval permits a step only under a mandate that still stands)"
NOT_RUN.update({f"void:{code}": f"the principal approved after the mandate {how}: nothing ran {_STANDS}"
                for code, how in LAPSED_HOW.items()})
# The sweep's case: approved while the mandate stood, which lapsed before the call was sent (a crash between).
NOT_SENT = "the mandate {how} after the principal approved and before the call was sent: nothing ran " + _STANDS
# The tail task _finish left running in this act's task (awaited by _serve_act after it answered).
_TAIL: contextvars.ContextVar[asyncio.Task[None] | None] = contextvars.ContextVar("pgw_gate_tail", default=None)


class GateCall:
    """What ``agent.{agent}.act`` carries beyond a transition request; filled in on the way."""

    def __init__(self, kind: str, arguments: dict[str, Any], resource: str | None = None) -> None:
        self.kind = kind
        self.arguments = arguments
        self.resource = resource  # as declared (validated with the request): handed to the executor
        self.entry: IdpEntry | None = None
        # The revision the permit's batch stored the index entry at (None: unknown, read it).
        self.entry_rev: int | None = None
        self.d: OpenDispatch | None = None
        self.traceparent: str | None = None
        # Standing approvals (gateway/kernel/scopes.py): what its approval moment offers to allow
        # standing, or the standing approval that permits it without asking.
        self.scope_offer: ScopeOffer | None = None
        self.scope: ApprovalScope | None = None


class OpenDispatch(Struct, kw_only=True, omit_defaults=True):
    """A gated action the kernel has accepted and not yet recorded the end of (``PGW_KERNEL_GATE``)."""

    idempotency_key: str
    state: Literal["awaiting_approval", "dispatched"]
    kind: str
    action: str
    arguments: dict[str, Any] = field(default_factory=dict)
    idp_id: str
    so_id: str
    agent: str
    principal: str
    session_id: str
    step_sequence: int
    submitted_seq: int
    moment_id: str | None = None
    dispatched_at: float | None = None
    dispatched_seq: int | None = None
    timed_out: bool = False
    traceparent: str | None = None
    # gateway/kernel/scopes.py: the standing approval its moment offers (awaiting_approval), or the
    # one that permitted it without asking (``scope_id``, ``kind``, ``grant_seq``, ``moment_id``, ...).
    scope_offer: ScopeOffer | None = None
    scope: dict[str, Any] | None = None
    # gateway/kernel/gate_args.py: arguments that hold a secret are stored apart (erasable), and this
    # record holds them redacted; the sequence of the message holding them as sent.
    arguments_seq: int | None = None
    # The Cedar resource the call was judged against, as declared (None: none declared); sent to the executor,
    # which checks it names what the arguments act on (subjects.gate.ExecRequest.resource).
    resource: str | None = None

    def request(self) -> ExecRequest:
        return ExecRequest(idempotency_key=self.idempotency_key, action=self.action, arguments=self.arguments,
                           idp_id=self.idp_id, so_id=self.so_id, agent=self.agent, principal=self.principal,
                           resource=self.resource)


_od_dec = msgspec.json.Decoder(OpenDispatch)


def observed(resp: ExecResponse) -> tuple[Literal["confirmed", "failed"], Any]:
    """The effect status and the response the kernel records for an executor's answer.

    ``ok``: ``confirmed`` with the executor's result (a null result is recorded as ``{}``,
    so that a confirmed effect always has a response to bind, spec 004 §5.2); ``error``:
    ``failed`` with the error object (spec 004 §5.2 ``failed``: attempted, failure reported).
    """
    if resp.status == "ok":
        return "confirmed", _as_recorded({} if resp.result is None else resp.result)
    err = msgspec.to_builtins(resp.error) if resp.error is not None else {"code": "EXECUTOR_ERROR"}
    return "failed", _as_recorded(err)


def _as_recorded(response: Any) -> Any:
    """``response`` as the kernel can record it: the tool ran, so a result with an integer beyond +-(2**53 - 1)
    (a database id, a nanosecond time) is recorded with it as a decimal string (``jcs.recordable_form``), and
    the agent gets it so. Before, its digest failed, the agent got KERNEL_UNAVAILABLE, and every gate sweep
    failed on the step for good (found by a review)."""
    if not jcs.unrecordable(response):
        return response
    log.warning("an executor's result holds what RFC 8785 cannot write; recorded with it as strings")
    return jcs.recordable_form(response)


def _request_record(request: ExecRequest) -> tuple[Any, str]:
    """The executor request as builtins (what the verdict carries) and its JSON-DIGEST (spec 004)."""
    req = msgspec.to_builtins(request)
    return req, jcs.json_digest(req)


class Gate:
    """The gate methods of :class:`gateway.kernel.service.KernelService` (state lives on the service)."""

    gw: Any
    nc: Any
    js: Any
    cfg: Any
    subjects: Any
    state: Any
    eventlog: Any
    overdue: Any
    publisher: Any
    key: Any
    scopes: Any
    _inflight: set[asyncio.Task[Any]]
    _sem: asyncio.Semaphore
    _stopping: bool

    gate_kv: Any = None
    _gate_sub: Any = None
    _gate_task: asyncio.Task[None] | None = None
    _gate_busy: set[str]

    # -- life cycle -------------------------------------------------------------
    async def _gate_start(self, queue: str) -> None:
        self._gate_busy = set()
        self.gate_kv = await ensure_kv(self.js, BUCKET)
        self._gate_sub = await self.gw.rnc.subscribe(self.subjects.all_agents("act"), queue=queue, cb=self._on_act)
        if self.cfg.executors:
            self._gate_task = asyncio.create_task(self._gate_loop(), name="kernel-gate-sweep")

    async def _gate_drain(self) -> None:
        if self._gate_sub is not None:
            with contextlib.suppress(Exception):
                await self._gate_sub.drain()
            self._gate_sub = None
        if self._gate_task is not None:
            self._gate_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._gate_task
            self._gate_task = None

    def gated(self, action: str) -> bool:
        """spec 003 §8.7: an action that must transit the gate (served by an executor, or listed)."""
        return action in self.cfg.gated_actions or self.cfg.executor_of(action) is not None

    # -- agent.{agent}.act ----------------------------------------------------------
    async def _on_act(self, msg: Msg) -> None:
        if not self.responder.admits(msg):  # the reply rule, before any work (docs/security.md "Replies")
            return
        task = asyncio.create_task(self._serve_act(msg))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _serve_act(self, msg: Msg) -> None:
        async with self._sem:
            structlog.contextvars.clear_contextvars()
            t0 = time.perf_counter()
            try:
                agent = self.subjects.parse(msg.subject).token or ""
            except SubjectError:
                return
            tp = await self.gw.traceparent(msg.headers)
            structlog.contextvars.bind_contextvars(agent=agent, traceparent=tp)
            try:
                result = await self.handle_act(agent, msg.data, traceparent=tp)
            except Exception:
                log.exception("gated action failed", agent=agent)
                result = Reject(timestamp=now_rfc3339(), error_code="KERNEL_UNAVAILABLE",
                                reason="the kernel could not complete this request; see the event log for what it recorded")
            LATENCY.labels(stage="act").observe(time.perf_counter() - t0)
            log.info("act", agent=agent, result=type(result).__name__, idp_id=getattr(result, "idp_id", None))
            await self.responder.answer(msg, _enc.encode(result))
        # The tail written after the answer (_finish): this task, which drain() waits for, ends with it.
        tail = _TAIL.get()
        if tail is not None:
            await asyncio.wait({tail})

    async def handle_act(self, agent: str, data: bytes, *, traceparent: str | None = None) -> ActResult:
        """One gated action: the transition (spec 003 §5.1) and, when permitted, its dispatch."""
        tp = traceparent
        receipt = now_rfc3339()
        try:
            req = msgspec.json.decode(data, type=ActRequest)
        except Exception as e:  # noqa: BLE001 - not JSON or not an ActRequest: a refusal with the path
            await self._malformed_verdict(agent, data, "the act request is malformed", tp)  # type: ignore[attr-defined]
            return Reject(timestamp=now_rfc3339(), error_code="REQUEST_MALFORMED",
                          reason="the body must be an ActRequest {mandate, action, idp, arguments?, resource?}",
                          details=[_detail(str(e))])
        if jcs.maybe_unrecordable(data) and not jcs.recordable(req.arguments):
            # The arguments are digested into GATE_DISPATCHED and the verdict (spec 004 JSON-DIGEST, RFC 8785),
            # which an integer beyond +-(2**53 - 1) cannot be: refused before anything is committed. Before, the
            # permit stored its open dispatch and then failed, and every gate sweep failed on the key for good
            # (found by an attack from the docs: 3,000 such calls in 6 s, 15 MB of log a minute after a restart).
            why = ("the arguments cannot be recorded: the kernel digests them as RFC 8785 JSON, which holds integers "
                   "within +-(2**53 - 1) only (send a larger number as a string)")
            await self._malformed_verdict(agent, data, why, tp)  # type: ignore[attr-defined]
            return Reject(timestamp=now_rfc3339(), error_code="REQUEST_MALFORMED", reason=why,
                          details=[_detail("not canonicalizable at `$.arguments`")])
        kind = self.cfg.executor_of(req.action)
        if kind is None:
            # A refusal has its verdict, as every other (docs/kernel.md); before, this one had none (a review).
            why = f"no executor serves {req.action[:128]} here: declare it on agent.{{agent}}.idp and report it"
            await self._malformed_verdict(agent, data, why, tp)  # type: ignore[attr-defined]
            return Reject(timestamp=now_rfc3339(), error_code="REQUEST_MALFORMED", reason=why)
        # spec 003 §5.1 (6) "processes result before next ACT", §5.5: the previous step's
        # commitment record was stored before its answer (_finish), so this session's next
        # step waits for nothing of the previous one's tail.
        raw: dict[str, Any] = {"mandate": req.mandate, "action": req.action, "idp": req.idp}
        if req.resource is not None:
            raw["resource"] = req.resource
        gate = GateCall(kind, req.arguments, req.resource)
        gate.traceparent = tp
        res = await self.handle_raw(agent, raw, data, receipt, tp, gate=gate)  # type: ignore[attr-defined]
        if not isinstance(res, Permit):
            return res
        assert gate.d is not None
        known = None
        if gate.entry is not None and gate.entry_rev is not None:
            known = msgspec.structs.replace(gate.entry), gate.entry_rev
        return await self._dispatch(gate.d, reply=True, stored=True, known=known)

    def _open(self, entry: IdpEntry, gate: GateCall, *, state: Literal["awaiting_approval", "dispatched"],
              moment_id: str | None = None) -> OpenDispatch:
        return OpenDispatch(
            idempotency_key=idempotency_key(entry.so_id, entry.idp_id), state=state, kind=gate.kind,
            action=entry.requested_action, arguments=gate.arguments, idp_id=entry.idp_id, so_id=entry.so_id,
            agent=entry.agent, principal=entry.principal, session_id=entry.session_id,
            step_sequence=entry.step_sequence, submitted_seq=entry.submitted_seq, moment_id=moment_id,
            traceparent=gate.traceparent, scope_offer=gate.scope_offer if state == "awaiting_approval" else None,
            scope=scope_detail(gate.scope) if gate.scope is not None else None, resource=gate.resource,
        )

    async def _gate_open(self, entry: IdpEntry, gate: GateCall) -> None:
        """A permitted gated step: its open dispatch is stored before the permit is answered."""
        d = self._open(entry, gate, state="dispatched")
        d.dispatched_at = time.time()
        gate.d = d
        # kv.put through the kernel's own PubAck inbox, as the permit's other writes of this round
        # (pgwcore.atomic.AckInbox): the same stored value, no request future of the KV client.
        await self.state.acks.publish(f"$KV.{BUCKET}.{d.idempotency_key}", await self._od_bytes(d), {},
                                      self.js._timeout)

    async def _od_bytes(self, d: OpenDispatch) -> bytes:
        """``d`` as ``PGW_KERNEL_GATE`` holds it: arguments that hold a secret apart (gate_args.py)."""
        return await gate_args.stored(self.js, (await self.gw.stage_state.get()).redactor, d)

    async def _read_open(self, key: str, value: bytes) -> OpenDispatch | None:
        """An open dispatch read back, with its arguments as sent; None (logged) when they are gone, or when
        ``key``'s value is no open dispatch of the kernel's: the server's acknowledgement a party aimed at it
        (docs/security.md "Replies"), which is deleted (before, every gate sweep logged an error for it)."""
        try:
            d = _od_dec.decode(value)
        except msgspec.DecodeError:
            log.warning("an open dispatch's key holds no record of the kernel's; deleted", key=key[:200])
            with contextlib.suppress(KeyNotFoundError):
                await self.gate_kv.delete(key)
            return None
        try:
            return await gate_args.restored(self.js, d)
        except gate_args.ArgumentsGone as e:
            # Never dispatched with its redacted arguments: left for the operator (docs/gate.md).
            log.error("an open dispatch's arguments are gone; it is not dispatched", idp_id=d.idp_id,
                      key=d.idempotency_key, error=str(e))
            return None

    async def _gate_hold(self, entry: IdpEntry, gate: GateCall, moment_id: str) -> None:
        """A HEM step of the gate: its arguments are stored before the principal is asked."""
        d = self._open(entry, gate, state="awaiting_approval", moment_id=moment_id)
        with contextlib.suppress(KeyWrongLastSequenceError):
            await self.gate_kv.create(d.idempotency_key, await self._od_bytes(d))

    # -- dispatch -------------------------------------------------------------------
    async def _dispatch(self, d: OpenDispatch, *, reply: bool, rev: int | None = None, stored: bool = False,
                        known: tuple[IdpEntry, int] | None = None) -> ActResult:
        """Record the dispatch (key + GATE_DISPATCHED), send it, and record what came back.

        ``stored``: the key is written already (with the permit); ``rev``: the key is taken
        from ``awaiting_approval`` by compare-and-set (one gateway dispatches an approval);
        ``known``: the index entry as the permit stored it, and its revision."""
        if not stored:
            d.state, d.dispatched_at = "dispatched", time.time()
            if rev is None:
                await self.gate_kv.put(d.idempotency_key, await self._od_bytes(d))
            else:
                await self.gate_kv.update(d.idempotency_key, await self._od_bytes(d), last=rev)
        # The open dispatch (the key, state ``dispatched``) is the record a crash is recovered
        # from, and it is stored before this point. GATE_DISPATCHED and the index entry
        # ``dispatched`` are written while the executor works, and both are stored before
        # anything the executor answered is recorded (STATE_TRANSITIONED follows this gather),
        # so the log always reads GATE_DISPATCHED before STATE_TRANSITIONED; after a crash the
        # sweep logs GATE_DISPATCHED (its fixed id: never twice) before it records a result
        # (_sweep_one). Meanwhile a report for this step is refused all the same (its action is
        # gated: transitions.py), and the sweep moves the entry on from the key, so nothing
        # reads ``permitted`` for a dispatched step.
        request = d.request()
        sent = _request_record(request)  # its builtins and digest, for GATE_DISPATCHED and the record
        resp, entry, _ = await asyncio.gather(
            self._ask(self.subjects.exec(d.kind, d.action), _enc.encode(request), d),
            self._index_dispatched(d, known),
            self._log_dispatch(d, sent),
        )
        if resp is None or resp.status in ("running", "unknown"):
            return await self._timed_out(d, reply=reply)
        return await self._finish(d, resp, entry=entry, early=reply, sent=sent)

    async def _index_dispatched(self, d: OpenDispatch, known: tuple[IdpEntry, int] | None = None
                                ) -> tuple[IdpEntry, int] | None:
        """The index entry moved to ``dispatched`` (never backwards); the entry and its revision,
        so that the tail's ``transitioned`` is one compare-and-set without a read.

        ``known``: the entry as the permit's batch stored it, and that revision: the move is one
        compare-and-set on it, with no read first; if anything wrote the entry since (a sweep on
        another gateway), the compare-and-set fails and the entry is read and moved as before.
        A gated permit's entry is stored ``dispatched`` by the permit's own round (service.py),
        with the open dispatch: then there is nothing to write here."""
        if known is not None and known[0].status == "dispatched":
            return known
        if known is not None and known[0].status == "permitted":
            e = msgspec.structs.replace(known[0], status="dispatched")
            try:
                return e, await self.state.put_idp(e, known[1])
            except ConflictError:
                pass
        for _ in range(20):
            got = await self.state.idp(d.so_id, d.idp_id)
            if got is None:
                return None
            e, rev = got
            if e.status in ("dispatched", "transitioned"):
                return e, rev
            e.status = "dispatched"
            try:
                return e, await self.state.put_idp(e, rev)
            except ConflictError:
                continue
        raise ConflictError(f"the index entry of {d.idp_id}")

    async def _index_transitioned(self, d: OpenDispatch, known: tuple[IdpEntry, int] | None, st_seq: int,
                                  v_seq: int) -> None:
        if known is not None and known[0].status == "dispatched":
            e = msgspec.structs.replace(known[0], status="transitioned", transition_seq=st_seq, verification_seq=v_seq)
            try:
                await self.state.put_idp(e, known[1])
                return
            except ConflictError:
                pass  # written meanwhile (another gateway's sweep): read and move it forward
        await self.state.advance_idp(d.so_id, d.idp_id, "transitioned", transition_seq=st_seq, verification_seq=v_seq)

    async def _log_dispatch(self, d: OpenDispatch, sent: tuple[Any, str] | None = None) -> None:
        _req, req_digest = sent or _request_record(d.request())
        body = {"idp_id": d.idp_id, "so_id": d.so_id, "session_id": d.session_id, "agent": d.agent,
                "principal": d.principal, "action": d.action, "executor": d.kind,
                "idempotency_key": d.idempotency_key, "request_digest": req_digest,
                "idp_submitted_seq": d.submitted_seq, "moment_id": d.moment_id}
        await self.eventlog.append("GATE_DISPATCHED", body,
                                   msg_id=stable_id("GATE_DISPATCHED", d.so_id.lower(), d.idp_id.lower()),
                                   traceparent=d.traceparent)

    async def _ask(self, subject: str, data: bytes, d: OpenDispatch) -> ExecResponse | None:
        timeout = self.cfg.executors[d.kind].timeout_s
        try:
            msg = await self.nc.request(subject, data, timeout=timeout, headers={IDEMPOTENCY_HEADER: d.idempotency_key})
        except (NatsTimeout, TimeoutError, NoRespondersError):
            return None
        try:
            return decode_response(msg.data)
        except msgspec.ValidationError:
            log.error("an executor answered with something that is not an ExecResponse", executor=d.kind,
                      idp_id=d.idp_id)
            return None

    async def _timed_out(self, d: OpenDispatch, *, reply: bool) -> ActResult:
        """No answer in time: spec 004 §5.4.2 ``timeout`` after dispatch (dispatched_unconfirmed)."""
        timeout = self.cfg.executors[d.kind].timeout_s
        why = (f"the executor {d.kind} did not answer within {timeout:g} s; the action may have run "
               "(dispatched_unconfirmed); its result follows as an action_result outcome")
        d.timed_out = True
        with contextlib.suppress(KeyNotFoundError):
            await self.gate_kv.put(d.idempotency_key, await self._od_bytes(d))
        vid = stable_id("gate-timeout", d.so_id.lower(), d.idp_id.lower())
        await self.publisher.verdict(Verdict(
            verdict_id=vid, verdict_class="timeout", decision="accept",
            approver="human" if d.moment_id or d.scope else "policy", human_disposed=bool(d.moment_id),
            ts=now_rfc3339(), agent=d.agent, principal=d.principal, action_type=d.action, action_id=d.idp_id,
            idp_id=d.idp_id, moment_id=d.moment_id,
            supersedes=stable_id("dispatch", d.moment_id) if d.moment_id else None,
            reason=Refusal(code="EXECUTOR_TIMEOUT", reason=why), traceparent=d.traceparent,
            effect=ReportedEffect(type=d.action, status="dispatched", request=msgspec.to_builtins(d.request())),
            details={"effect_attestation": ATTESTATION, "executed_action_source": EXECUTED_ACTION_SOURCE,
                     "executor": d.kind, **({"approval_scope": d.scope} if d.scope else {})},
        ))
        log.warning("executor timeout", executor=d.kind, idp_id=d.idp_id, replied=reply)
        return ActDispatched(timestamp=now_rfc3339(), idp_id=d.idp_id, reason=why, verdict_id=vid)

    # -- the record of what the kernel observed -----------------------------------------
    async def _finish(self, d: OpenDispatch, resp: ExecResponse | None, *, entry: tuple[IdpEntry, int] | None = None,
                      early: bool = False, sent: tuple[Any, str] | None = None) -> ActDone | ActDispatched:
        """STATE_TRANSITIONED (gate_executed), the commitment check, the verdict; idempotent.

        ``resp`` None: the kernel gave up waiting (``follow_up_s``): recorded ``dispatched``.
        ``entry``: the index entry as the dispatch left it (saves reading it again). ``early``:
        the agent is waiting on ``act``: it is answered once STATE_TRANSITIONED is durable, and
        the rest (the tail, :meth:`_gate_tail`) is written after the answer. ``sent``: the
        request's builtins and digest, as the dispatch computed them."""
        if resp is None:
            status: str = "dispatched"
            response: Any = None
        else:
            status, response = observed(resp)
        resp_digest = jcs.json_digest(response) if response is not None else None
        req, req_digest = sent or _request_record(d.request())
        known = entry if entry is not None else await self.state.idp(d.so_id, d.idp_id)
        if known is None:
            raise RuntimeError(f"no index entry for dispatched IDP {d.idp_id}")
        entry = known[0]
        st_body = {
            "idp_id": d.idp_id, "so_id": d.so_id, "session_id": d.session_id, "agent": d.agent,
            "principal": d.principal, "step_sequence": d.step_sequence,
            "executed_action": d.action, "executed_action_source": EXECUTED_ACTION_SOURCE,
            "idp_submitted_seq": d.submitted_seq, "executor": d.kind, "idempotency_key": d.idempotency_key,
            "effect": {"type": d.action, "status": status, "request_digest": req_digest,
                       "response_digest": resp_digest},
            "effect_attestation": ATTESTATION,
        }
        # spec 003 §5.5, §8.7: declared vs the action the kernel itself dispatched.
        matched = d.action == entry.requested_action
        # One STATE_TRANSITIONED per IDP (spec 003 §5.3): a second finish (a sweep on another
        # gateway, a restart) finds the first (in the index, or as the duplicate its Nats-Msg-Id
        # makes it) and writes nothing new.
        ver: Appended | None = None
        if entry.status == "transitioned" and entry.transition_seq is not None:
            st = Appended(entry.transition_seq, await self.eventlog.get(entry.transition_seq), True)
        else:
            # spec 003 §5.3: "Following every STATE_TRANSITIONED event, the kernel MUST generate an
            # IDP_COMMITMENT_VERIFIED or IDP_COMMITMENT_GAP event" (§5.5): the record cites the
            # event's sequence, which the chain fixes before the server answers, so both are sent
            # in one round (EventLog.append_chained) and both are stored before the answer: the
            # log shows the commitment record before any next step of the session (§5.1 (6)),
            # on whichever gateway it arrives, and the answer waits one synced round, not two.
            st, ver = await self.eventlog.append_chained(
                "STATE_TRANSITIONED", st_body,
                lambda seq, ev: self._verification(d, entry, seq, ev.event_id, matched),
                msg_id=stable_id("STATE_TRANSITIONED", d.so_id.lower(), d.idp_id.lower()), traceparent=d.traceparent)
        first = st.event.body
        if first.get("effect", {}).get("status") != status or first.get("effect", {}).get("response_digest") != resp_digest:
            # What the log recorded first stands (e.g. a give-up raced a late result).
            status = first.get("effect", {}).get("status", status)
            resp_digest = first.get("effect", {}).get("response_digest")
            if resp_digest is None:
                response = None
        vid = stable_id("idp-transition", d.so_id.lower(), d.idp_id.lower())
        tail = self._gate_tail(d, known, st, ver, status, req, response, resp_digest, vid, matched)
        if early and matched and status != "dispatched":
            # The agent is answered now: STATE_TRANSITIONED and its commitment record are durable,
            # and everything after them has a deterministic id (Nats-Msg-Id / key) and is
            # rewritten by the sweep from the open dispatch's key, which is deleted last, if this
            # process dies before the tail is done. Nothing of the tail is read by the session's
            # next step (a MATCHED record does not change the session; only IDP_COMMITMENT_GAP
            # does, spec 003 §5.5.2, and a gap keeps the whole tail before the answer, below).
            self._spawn_tail(d, tail)
        else:
            await tail
        log.info("gated action recorded", executor=d.kind, idp_id=d.idp_id, status=status, replied_first=early)
        if status == "dispatched":
            return ActDispatched(timestamp=now_rfc3339(), idp_id=d.idp_id, reason="no result was observed",
                                 verdict_id=stable_id("gate-timeout", d.so_id.lower(), d.idp_id.lower()))
        return ActDone(timestamp=now_rfc3339(), idp_id=d.idp_id, status=status,  # type: ignore[arg-type]
                       response=response, response_digest=resp_digest, event_seq=st.seq, verdict_id=vid)

    def _verification(self, d: OpenDispatch, entry: IdpEntry, st_seq: int, st_id: str,
                      matched: bool) -> tuple[str, dict[str, Any], str]:
        """The commitment record of the step's STATE_TRANSITIONED at ``st_seq`` (spec 003 §5.5),
        kernel-signed: (event type, body, Nats-Msg-Id)."""
        record: dict[str, Any] = {
            "idp_id": d.idp_id, "state_transition_id": st_id, "state_transition_seq": st_seq,
            "verified_at": now_rfc3339(), "match_result": "MATCHED" if matched else "IDP_COMMITMENT_GAP",
            "requested_action": entry.requested_action, "executed_action": d.action,
            "executed_action_source": EXECUTED_ACTION_SOURCE, "kid": self.key.kid,
        }
        record["kernel_signature"] = self.eventlog.sign_record(record)
        etype = "IDP_COMMITMENT_VERIFIED" if matched else "IDP_COMMITMENT_GAP"
        vbody = {"record": record, "so_id": d.so_id, "session_id": d.session_id, "agent": d.agent,
                 "executed_action_source": EXECUTED_ACTION_SOURCE}
        return etype, vbody, stable_id(etype, d.so_id.lower(), d.idp_id.lower())

    def _spawn_tail(self, d: OpenDispatch, tail: Any) -> None:
        busy = d.idempotency_key

        async def run() -> None:
            try:
                await tail
            except Exception:
                log.exception("writing the gate's tail failed; the sweep finishes it", idp_id=d.idp_id)
            finally:
                self._gate_busy.discard(busy)

        self._gate_busy.add(busy)  # this process's sweep leaves the key alone meanwhile
        task = asyncio.create_task(run(), name=f"gate-tail-{d.idp_id}")
        _TAIL.set(task)
        self._inflight.add(task)  # drain() waits for it
        task.add_done_callback(self._inflight.discard)

    async def _gate_tail(
        self, d: OpenDispatch, known: tuple[IdpEntry, int], st: Appended, ver: Appended | None, status: str,
        req: Any, response: Any, resp_digest: str | None, vid: str, matched: bool,
    ) -> None:
        """What follows STATE_TRANSITIONED and its commitment record, in order: the verdict, the
        outcome, the open-permit close and the index entry ``transitioned`` (independent, sent
        together), then the key's delete (last: while the key stands, the sweep finishes whatever
        is missing). ``ver``: the commitment record, when _finish stored it with the event; else
        (a finish that found STATE_TRANSITIONED logged already) it is found or written first."""
        entry = known[0]
        if ver is None:
            if entry.verification_seq is not None:
                ver = await self._logged(entry.verification_seq)
            else:
                etype, vbody, vmsg = self._verification(d, entry, st.seq, st.event.event_id, matched)
                ver = await self.eventlog.append(etype, vbody, msg_id=vmsg, traceparent=d.traceparent)
        # The open permit has a key only for a HEM approval or with log_permits off (as for a report,
        # transitions.py); else its CEDAR_PERMIT_RECORDED registered it and the index closes it.
        keyed = d.moment_id is not None or d.scope is not None or not self.cfg.log_permits
        jobs: list[Any] = [self._index_transitioned(d, known, st.seq, ver.seq),
                           self.overdue.closed(d.so_id, d.idp_id, keyed=keyed)]
        if status != "dispatched":
            # The verdict carries only match_result of the record, which is the same in any
            # record of this step (the comparison is deterministic, §5.5.3).
            jobs.append(self._gate_verdict(d, entry, status, req, response, resp_digest,
                                           "MATCHED" if matched else "IDP_COMMITMENT_GAP", vid))
        if d.timed_out or d.moment_id or status == "dispatched":
            # The agent's act reply did not carry this: it comes on its outcome stream.
            jobs.append(self.publisher.outcome(ActionResult(
                agent=d.agent, ts=now_rfc3339(), idp_id=d.idp_id,
                status="dispatched_unconfirmed" if status == "dispatched" else status,  # type: ignore[arg-type]
                response=response, response_digest=resp_digest, moment_id=d.moment_id,
                verdict_id=vid if status != "dispatched" else stable_id("gate-timeout", d.so_id.lower(), d.idp_id.lower()),
                traceparent=d.traceparent,
            ), stable_id("action_result", d.so_id.lower(), d.idp_id.lower())))
        await asyncio.gather(*jobs)
        # The key's delete marker (what kv.delete writes), through the kernel's PubAck inbox.
        await self.state.acks.publish(f"$KV.{BUCKET}.{d.idempotency_key}", b"", DELETE_MARKER, self.js._timeout)
        await gate_args.erase(self.js, d)  # after the key: a crash between leaves the message, never a key without it

    async def _logged(self, seq: int) -> Appended:
        return Appended(seq, await self.eventlog.get(seq), True)

    async def _gate_verdict(
        self, d: OpenDispatch, entry: IdpEntry, status: str, req: Any, response: Any, resp_digest: str | None,
        match_result: str, vid: str,
    ) -> None:
        human = d.moment_id is not None
        if d.timed_out:
            supersedes: str | None = stable_id("gate-timeout", d.so_id.lower(), d.idp_id.lower())
        elif entry.overdue_seq is not None:
            supersedes = stable_id("idp-report-overdue", d.so_id.lower(), d.idp_id.lower())
        elif d.moment_id:
            supersedes = stable_id("dispatch", d.moment_id)
        else:
            supersedes = None
        details: dict[str, Any] = {
            "effect_attestation": ATTESTATION, "match_result": match_result,
            "executed_action": d.action, "requested_action": entry.requested_action,
            "executed_action_source": EXECUTED_ACTION_SOURCE, "executor": d.kind,
        }
        if resp_digest:
            details["response_digest"] = resp_digest
        if d.scope is not None:
            # Permitted by her standing approval (gateway/kernel/scopes.py): a human's decision, made in
            # advance; nobody looked at this call, so not human-disposed (spec 004 §5.4).
            details["approval_scope"] = d.scope
        await self.publisher.verdict(Verdict(
            verdict_id=vid, verdict_class="executed", decision="accept",
            approver="human" if human or d.scope is not None else "policy", human_disposed=human,
            ts=now_rfc3339(), agent=d.agent, principal=d.principal, action_type=entry.requested_action,
            action_id=d.idp_id, idp_id=d.idp_id, moment_id=d.moment_id, supersedes=supersedes,
            traceparent=d.traceparent,
            effect=ReportedEffect(type=d.action, status=status, request=req, response=response),
            details=details,
        ))

    # -- HEM answers (spec 003 §4.4) ---------------------------------------------------
    async def _gate_after_hem(self, so_id: str, idp_id: str, decision: str, option: int | None = None) -> None:
        """A human answered a gated step's escalation: dispatch it on approval, else it never runs.

        ``option``: the index she chose; 2 or 3 also grant the standing approval its moment offered
        (gateway/kernel/scopes.py), logged before the step is dispatched."""
        key = idempotency_key(so_id, idp_id)
        try:
            e = await self.gate_kv.get(key)
        except KeyNotFoundError:
            return
        if not e.value:
            return
        d = await self._read_open(key, e.value)
        if d is None or d.state != "awaiting_approval":
            return
        if decision == "approve":
            if option is not None and d.scope_offer is not None:
                try:
                    await self.scopes.grant(d, option, d.traceparent)
                except Exception:
                    # The asked call still runs (she approved it); the standing approval is lost, so the
                    # next call asks her again: the safe side.
                    log.exception("granting a standing approval failed", idp_id=d.idp_id, moment_id=d.moment_id)
            task = asyncio.create_task(self._approved(d, e.revision))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
            return
        await self._not_run(d, NOT_RUN.get(decision, NOT_RUN["deny"]))

    async def _approved(self, d: OpenDispatch, rev: int) -> None:
        try:
            await self._dispatch(d, reply=False, rev=rev)
        except KeyWrongLastSequenceError:
            return  # another gateway took it
        except Exception:
            log.exception("dispatch after approval failed; the sweep retries", idp_id=d.idp_id)

    async def _not_run(self, d: OpenDispatch, why: str) -> None:
        await self.publisher.outcome(ActionResult(
            agent=d.agent, ts=now_rfc3339(), idp_id=d.idp_id, status="not_run", reason=why, moment_id=d.moment_id,
            traceparent=d.traceparent,
        ), stable_id("action_result", d.so_id.lower(), d.idp_id.lower()))
        with contextlib.suppress(KeyNotFoundError):
            await self.gate_kv.delete(d.idempotency_key)
        await gate_args.erase(self.js, d)

    # -- the sweep: crash recovery and late results ------------------------------------------
    async def _gate_loop(self) -> None:
        every = self.cfg.gate_sweep_s
        if every is None:
            every = min(5.0, max(0.2, min(ex.timeout_s for ex in self.cfg.executors.values()) / 2))
        # Not `while True`: drain() sets _stopping before it cancels this task, and on Python 3.11 a
        # cancel that meets a request's own timeout is turned into TimeoutError by asyncio.wait_for
        # (caught below as a failed sweep): the loop would go on and drain() would wait for ever.
        while not self._stopping:
            try:
                await self.gate_sweep()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the gate sweep failed")
            if not every:
                return  # at start only (kernel.gate_sweep_s = 0)
            await asyncio.sleep(every)

    async def gate_sweep(self, now: float | None = None) -> int:
        """Finish every open dispatch older than its executor's timeout; how many were finished."""
        now = time.time() if now is None else now
        keys, markers = await listing(self.js, self.gate_kv, BUCKET)
        done = 0
        jobs = []
        for key in keys:
            if key in self._gate_busy:
                continue
            jobs.append(self._sweep_one(key, now))
        for r in await asyncio.gather(*jobs, return_exceptions=True):
            if isinstance(r, BaseException):
                log.error("finishing an open dispatch failed", error=repr(r))
            elif r:
                done += 1
        await sweep_markers(self.js, BUCKET, markers, now)  # the finished dispatches' markers, read by every sweep
        return done

    async def _sweep_one(self, key: str, now: float) -> bool:
        self._gate_busy.add(key)
        try:
            try:
                e = await self.gate_kv.get(key)
            except KeyNotFoundError:
                return False
            if not e.value:
                return False
            d = await self._read_open(key, e.value)
            if d is None:
                return False
            if jcs.unrecordable(d.arguments):
                # Stored before the act refused such arguments (handle_act): never dispatched, and never to be,
                # as its dispatch cannot be recorded. Ended once, not failed at every sweep.
                log.warning("an open dispatch whose arguments cannot be recorded is ended; nothing ran",
                            agent=d.agent, idp_id=d.idp_id)
                await self._not_run(d, "its arguments cannot be recorded (an integer beyond +-(2**53 - 1)): nothing ran")
                with contextlib.suppress(KeyNotFoundError, KeyWrongLastSequenceError):
                    await self.gate_kv.delete(key)
                return True
            got = await self.state.idp(d.so_id, d.idp_id)
            if d.state == "dispatched" and got is not None and got[0].status in ("permitted", "hem_approved"):
                # A crash between the request and its index entry (_dispatch): the step was sent.
                got = await self._index_dispatched(d)
            ex = self.cfg.executors.get(d.kind)
            if ex is None:
                return False  # an executor no longer configured: left for the operator (docs/gate.md)
            if d.state == "awaiting_approval":
                if got is not None and got[0].status == "hem_approved":
                    void = await self.approval_void(d.agent, d.so_id, got[0].mandate_id, None)  # type: ignore[attr-defined]
                    if void is not None:
                        # Approved, then its mandate revoked or ended before this dispatch (a crash between): never run.
                        await self._not_run(d, NOT_SENT.format(how=LAPSED_HOW[void]))
                        return True
                    with contextlib.suppress(KeyWrongLastSequenceError):  # else another gateway took it
                        await self._dispatch(d, reply=False, rev=e.revision)
                    return True
                if got is not None and got[0].status == "hem_denied":
                    await self._not_run(d, NOT_RUN["unknown"])
                    return True
                return False
            if (d.dispatched_at or 0) + ex.timeout_s > now:
                return False  # in flight on some gateway
            q = _enc.encode(ResultQuery(idempotency_key=d.idempotency_key))
            if not d.timed_out:
                # The request may have left with its GATE_DISPATCHED still unstored (_dispatch
                # writes it while the executor works): logged before any result is recorded, so
                # the log reads it before STATE_TRANSITIONED. Its fixed id logs it once.
                # (A timed-out step's GATE_DISPATCHED was stored before its timeout was.)
                await self._log_dispatch(d)
            resp = await self._ask(self.subjects.exec_result(d.kind), q, d)
            if resp is not None and resp.status == "unknown":
                # The executor never claimed the key, so it never ran it: send it again, same key.
                await self._index_dispatched(d)
                resp = await self._ask(self.subjects.exec(d.kind, d.action), _enc.encode(d.request()), d)
            if resp is not None and resp.status in ("ok", "error"):
                await self._finish(d, resp)
                return True
            # STATE_TRANSITIONED is logged already (a crash after it): the rest waits for the response
            # (the verdict binds it), asked again on the next sweep, up to follow_up_s.
            recorded = got is not None and got[0].status == "transitioned"
            if (d.dispatched_at or 0) + ex.follow_up_s <= now:
                if not d.timed_out and not recorded:
                    await self._timed_out(d, reply=False)
                await self._finish(d, None)
                return True
            if not d.timed_out and not recorded:
                await self._timed_out(d, reply=False)
            return False
        finally:
            self._gate_busy.discard(key)


def _detail(message: str) -> Any:
    from subjects.wire import Detail

    msg = message[:500]
    path = msg.rsplit("at `", 1)[-1].rstrip("`") if "at `" in msg else None
    return Detail(message=msg, path=path)
