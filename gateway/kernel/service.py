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
* HEM (§4.4, §5.5.2, §6.3): the session enters HEM_PENDING, the mandate's
  principal gets a binding moment through the moment desk, and the answer
  (``on_hem_decision``) settles the session; an approval lets exactly that
  idp_id transition once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
import rfc8785
import structlog
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig
from prometheus_client import Counter

from gateway.kernel.audit import AuditService
from gateway.kernel.checkpoint import Checkpointer
from gateway.kernel.eventlog import STREAM, EventLog
from gateway.kernel.hem import hem_moment
from gateway.kernel.mandate import Mandate, MandateError, MandateVerifier
from gateway.kernel.overdue import OverdueReports
from gateway.kernel.policy import PolicyEngine, entity_uid, idp_context
from gateway.kernel.received import commit_received, commit_refused
from gateway.kernel.revocation import Revocations
from gateway.kernel.state import ConflictError, IdpEntry, KernelState, SessionEntry, bump_step
from pgwcore.keys import load_or_create
from pgwcore.logs import get_logger
from pgwcore.metrics import LATENCY, REGISTRY
from subjects import jcs
from subjects.errors import SubjectError
from subjects.idp import (
    REASONING_BASIS_TYPES,
    EnrichedDeny,
    HemPending,
    Idp,
    IdpThin,
    KernelResult,
    MismatchDetail,
    Permit,
    Reject,
    SuggestedPath,
    TransitionReport,
    b64url,
    decode_idp,
    json_digest,
    pii_markers,
    profile_of,
)
from subjects.util import now_rfc3339, stable_id
from subjects.wire import Detail, Refusal, ReportedEffect, Verdict

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
COMMITMENT_GAPS = Counter(
    "pgw_idp_commitment_gaps_total",
    "IDP_COMMITMENT_GAP findings: CRITICAL audit alerts (spec 003 §5.5.2)",
    ["agent"],
    registry=REGISTRY,
)

_DENY_REASONS = {
    "POLICY_DENY": "The governing policy does not permit {action} on this object in the declared context.",
    "MANDATE_SCOPE": "{action} is outside the scope of the presented mandate.",
    "HEM_PENDING": "The session awaits a human decision; no transition proceeds until it is resolved.",
    "IDP_MISSION_REF_MISMATCH": "The IDP mission_ref does not match the mission bound to the mandate; see mismatch_detail.",
}
_ERRORED = {"failed", "error", "errored", "failure"}
_TYPED_FIELDS = frozenset(
    {"idp_id", "session_id", "so_id", "mandate_id", "step_sequence", "requested_action", "timestamp",
     "declared_goal", "reasoning_basis", "confidence_level", "hem_urgency", "profile", "audit_accessible",
     "mission_ref", "context_refs"}
)


class _RefusalError(Exception):
    def __init__(self, result: KernelResult) -> None:
        self.result = result


class _RaceError(Exception):
    pass


def recorded_status(reported: str, response_digest: str | None) -> tuple[str, str | None]:
    """(the effect status the log and the capsule record, the reported one where it differs).

    Spec 004 §5.2: "confirmed" is an observed result bound by the digest of the
    response, never without it; a report that says confirmed and carries no
    response is recorded as ``dispatched``, the status it does support, with
    the reported status beside it. Recorded, not refused: the agent says the
    transition happened, and spec 003 §5.3/§5.5 require STATE_TRANSITIONED and
    its commitment check for it (a refusal would hide an executed action).
    STATE_TRANSITIONED and the capsule then state the same effect status.
    """
    if reported == "confirmed" and response_digest is None:
        return "dispatched", reported
    return reported, None


def _uuid_from(*parts: str) -> str:
    return str(uuid.UUID(hex=stable_id(*parts), version=4))


class KernelService:
    """The governing kernel of spec 003 on the bus; a gateway part (``GATEWAY_PARTS``)."""

    name = "kernel"

    def __init__(self, gateway: Any) -> None:
        self.gw = gateway
        self.config = gateway.config
        self.cfg = gateway.config.kernel
        self.nc = gateway.nc
        self.js = gateway.js
        self.subjects = gateway.subjects
        self.publisher = gateway.publisher
        self.desk = gateway.desk
        self.key = load_or_create(self.config.data_path, "kernel")
        self.mandates = MandateVerifier(self.cfg, self.config.data_path)
        # A bad policy file fails start-up here, with its name and line.
        self.policy = PolicyEngine(self.cfg.policy_dir)
        self.eventlog = EventLog(self.nc, self.subjects, self.key)
        self.state = KernelState(self.js)
        self.overdue = OverdueReports(self, self.cfg.report_deadline_s)
        self.revocations = Revocations(self)
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
        await self.state.open()
        await self.overdue.start()
        await self.revocations.start(QUEUE)
        await self.audit.start(QUEUE)
        await self.state.rebuild(self.js, STREAM)
        if not self.policy.files:
            log.warning("no Cedar policies configured (kernel.policy_dir): every action is denied")
        self.desk.on_hem_decision(self._on_hem_decision)
        self._sub = await self.nc.subscribe(self.subjects.all_agents("idp"), queue=QUEUE, cb=self._on_idp)
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
        await self.revocations.close()
        await self.audit.close()
        if self._loop_task is not None:
            if not self._busy:
                # Idle in fetch(): nothing in flight, so stop waiting for new reports.
                self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._loop_task, timeout=30)
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        if self._psub is not None:
            with contextlib.suppress(Exception):
                await self._psub.unsubscribe()
        await self.overdue.close()
        if self.cfg.enabled and not self.nc.is_closed:
            await self.checkpoints.close()  # the head at shutdown, anchored

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()

    # -- transition requests ----------------------------------------------------
    async def _on_idp(self, msg: Msg) -> None:
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
            tp = (msg.headers or {}).get("traceparent")
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
            LATENCY.labels(stage="idp").observe(time.perf_counter() - t0)
            code = getattr(result, "error_code", None) or getattr(result, "deny_code", None) or "none"
            IDP_RESULTS.labels(result=type(result).__name__, code=code).inc()
            log.info(
                "idp",
                agent=agent,
                result=type(result).__name__,
                code=code,
                idp_id=getattr(result, "idp_id", None),
            )
            if msg.reply:
                with contextlib.suppress(Exception):
                    await msg.respond(msgspec.json.encode(result))

    async def handle_request(self, agent: str, data: bytes, *, traceparent: str | None = None) -> KernelResult:
        """One kernel.transition() call (spec 003 §5.1 step 4) -> its result."""
        receipt = now_rfc3339()
        try:
            return await self._handle(agent, data, receipt, traceparent)
        except _RefusalError as r:
            return r.result

    def _reject(
        self, code: str, reason: str, *, idp_id: str | None = None, details: list[Detail] | None = None
    ) -> _RefusalError:
        return _RefusalError(
            Reject(timestamp=now_rfc3339(), error_code=code, reason=reason, details=details or [], idp_id=idp_id)  # type: ignore[arg-type]
        )

    async def _handle(self, agent: str, data: bytes, receipt: str, tp: str | None) -> KernelResult:
        digest = stable_id("request", agent, data.decode("utf-8", "replace"))
        try:
            raw = msgspec.json.decode(data)
        except Exception:  # noqa: BLE001 - not JSON, not UTF-8, too deep: all a refusal
            raw = None
        if not isinstance(raw, dict):
            await self._deny_verdict(agent, None, digest, "REQUEST_MALFORMED", "the request is not a JSON object", None, tp)
            raise self._reject("REQUEST_MALFORMED", "the request body must be a JSON object {mandate, action, resource?, idp}")
        try:
            idp, mandate, resource, pii, read = await self._validate(agent, raw)
        except _RefusalError as r:
            res = r.result
            assert isinstance(res, Reject)
            # A well-formed IDP refused by (c)-(f) is still committed first (received.py).
            await commit_refused(self, agent, raw.get("idp"), receipt, res.error_code, tp)
            await self._deny_verdict(agent, res.idp_id, digest, res.error_code, res.reason, None, tp)
            raise
        return await self._decide(agent, raw, idp, mandate, resource, pii, read, receipt, tp)

    # spec 003 §5.2, in order ---------------------------------------------------
    async def _validate(
        self, agent: str, raw: dict[str, Any]
    ) -> tuple[Idp, Mandate, dict[str, str], list[str], tuple[SessionEntry, int | None]]:
        # (a) an IDP is present
        idp_raw = raw.get("idp")
        if idp_raw is None:
            raise self._reject("IDP_MISSING", "the transition request carries no IDP (spec 003 §5.2(a))")
        raw_id = idp_raw.get("idp_id") if isinstance(idp_raw, dict) else None
        raw_id = raw_id if isinstance(raw_id, str) and len(raw_id) <= 64 else None
        # (b) every field rule of §4.1-§4.2 (and §7 for IDP_THIN)
        try:
            idp = decode_idp(idp_raw)
        except msgspec.ValidationError as e:
            msg = str(e)
            path = msg.rsplit("at `", 1)[-1].rstrip("`") if "at `" in msg else None
            raise self._reject(
                "IDP_MALFORMED", "the IDP does not conform to spec 003 §4", idp_id=raw_id,
                details=[Detail(message=msg[:500], path=path)],
            ) from None
        try:
            # Only open members can hold numbers JCS cannot serialize; the rest are typed.
            # The log's serializer: it fails exactly where rfc8785 does.
            jcs.dumps({k: v for k, v in idp_raw.items() if k not in _TYPED_FIELDS})
        except Exception:  # noqa: BLE001 - e.g. integers beyond 2^53 cannot be canonicalized
            raise self._reject(
                "IDP_MALFORMED", "the IDP cannot be canonicalized (RFC 8785): numbers must fit IEEE 754 doubles",
                idp_id=idp.idp_id, details=[Detail(message="not canonicalizable", path="$.metadata")],
            ) from None
        action = raw.get("action")
        if action is not None and action != idp.requested_action:
            raise self._reject(
                "IDP_MALFORMED", "requested_action must be the Cedar action submitted for evaluation (spec 003 §4.2)",
                idp_id=idp.idp_id, details=[Detail(message="differs from the request's action", path="$.requested_action")],
            )
        res_raw = raw.get("resource")
        if res_raw is None:
            resource = {"type": "GovernedObject", "id": idp.so_id}
        else:
            uid = entity_uid(res_raw) if isinstance(res_raw, str) else None
            if uid is None:
                raise self._reject("REQUEST_MALFORMED", 'resource must be a Cedar entity id like Type::"id"', idp_id=idp.idp_id)
            resource = uid
        pii: list[str] = []
        for path, text in (
            ("$.declared_goal.description", idp.declared_goal.description if idp.declared_goal else ""),
            ("$.reasoning_basis.description", idp.reasoning_basis.description if idp.reasoning_basis else ""),
        ):
            pii += [f"{kind}@{path}" for kind in pii_markers(text)]
        if pii and self.cfg.pii == "reject":
            raise self._reject(
                "IDP_MALFORMED", "goal and reasoning descriptions must not contain personal data (spec 003 §9)",
                idp_id=idp.idp_id, details=[Detail(message=f"{p.split('@')[0]} marker", path=p.split("@")[1], rule="pii") for p in pii],
            )
        # §4.3: an INSTRUCTION basis MUST name the instruction's source by
        # mandate_id or session_id, so the instruction stays traceable.
        rb = idp.reasoning_basis
        if rb is not None and rb.type == "INSTRUCTION" and idp.mandate_id not in rb.description and idp.session_id not in rb.description:
            raise self._reject(
                "IDP_MALFORMED",
                "an INSTRUCTION reasoning basis must name its source by mandate_id or session_id (spec 003 §4.3)",
                idp_id=idp.idp_id,
                details=[Detail(message="source of the instruction not named", path="$.reasoning_basis.description", rule="instruction_source")],
            )
        # (c) idp_id unique for the governed object (and for this agent's reports).
        # The session entry for (f) is read in the same round trip; only the
        # reads overlap, the checks below still run in the order of §5.2.
        known, reported, read = await asyncio.gather(
            self.state.idp(idp.so_id, idp.idp_id), self.state.so_of(agent, idp.idp_id),
            self.state.session(agent, idp.session_id),
        )
        if known is not None or reported:
            raise self._reject("IDP_DUPLICATE", "this idp_id was already submitted (spec 003 §5.2(c), §8.4)", idp_id=idp.idp_id)
        # mandate: signature, revocation, expiry (DESIGN §5.2)
        try:
            mandate = self.mandates.verify(raw.get("mandate"), agent=agent)
        except MandateError as e:
            raise self._reject(e.code, e.reason, idp_id=idp.idp_id) from None
        # (d) so_id bound to the mandate
        if idp.so_id.lower() != mandate.so_id.lower():
            raise self._reject("IDP_SO_MISMATCH", "the IDP so_id is not the governed object bound to the mandate", idp_id=idp.idp_id)
        # (e) mandate_id is the JWT's jti
        if idp.mandate_id != mandate.jti:
            raise self._reject("IDP_MANDATE_MISMATCH", "the IDP mandate_id is not the jti of the presented mandate", idp_id=idp.idp_id)
        # (f) step_sequence strictly increasing per session
        sess, rev = await self._session(agent, idp.session_id, read)
        if sess.state == "TERMINATED":
            await commit_received(
                self, self._submitted_body(agent, idp_raw, idp, mandate, resource, pii, now_rfc3339()),
                session_state=sess.state, code="SESSION_TERMINATED", moment_id=sess.hem_moment_id, tp=None,
            )
            raise self._reject("SESSION_TERMINATED", "this session was ended by its principal after a human escalation", idp_id=idp.idp_id)
        if idp.step_sequence <= sess.last_step:
            raise self._reject(
                "IDP_STEP_SEQUENCE",
                f"step_sequence must be greater than {sess.last_step}, the last committed step of this session (spec 003 §5.2(f))",
                idp_id=idp.idp_id,
            )
        # §7: IDP_THIN where the configuration does not accept it
        if isinstance(idp, IdpThin) and (not self.cfg.thin_accepted or idp.requested_action in self.cfg.thin_refused_actions):
            raise self._reject("IDP_THIN_NOT_ACCEPTED", f"{idp.requested_action} requires an IDP_STANDARD declaration (spec 003 §7)", idp_id=idp.idp_id)
        return idp, mandate, resource, pii, (sess, rev)

    async def _session(
        self, agent: str, session_id: str, read: tuple[SessionEntry, int] | None = None
    ) -> tuple[SessionEntry, int | None]:
        """The session, settling a HEM decision the desk holds; revision None if settled here."""
        sess, rev = read or await self.state.session(agent, session_id)
        if sess.state == "HEM_PENDING" and sess.hem_moment_id and sess.hem_principal:
            # The desk may have resolved the moment before our callback ran.
            found = await self.desk.get(sess.hem_principal, sess.hem_moment_id)
            if found and found[0].status in ("resolved", "expired"):
                from gateway.moments import hem_decision_of

                rec = found[0]
                decision = hem_decision_of(rec.resolution) if rec.status == "resolved" else "expired"
                sess = await self._apply_hem(agent, session_id, sess.hem_idp_id or "", rec.moment_id, decision)
                return sess, None
        return sess, rev

    # after validation: commit, then Cedar ------------------------------------
    async def _decide(
        self, agent: str, raw: dict[str, Any], idp: Idp, m: Mandate, resource: dict[str, str],
        pii: list[str], read: tuple[SessionEntry, int | None], receipt: str, tp: str | None,
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
        body = self._submitted_body(agent, raw["idp"], idp, m, resource, pii, receipt)
        round1 = asyncio.gather(
            self._reserve_step(agent, idp, (sess, rev)),
            self.eventlog.append(
                "IDP_SUBMITTED", body, msg_id=stable_id("IDP_SUBMITTED", idp.so_id.lower(), idp.idp_id.lower()),
                traceparent=tp,
            ),
            return_exceptions=True,
        )
        tr = asyncio.ensure_future(self.state.put_tr(agent, idp.idp_id, idp.so_id))
        try:
            return await self._commit(agent, raw, idp, m, resource, pii, round1, tp, hem_available)
        finally:
            await tr

    async def _commit(
        self, agent: str, raw: dict[str, Any], idp: Idp, m: Mandate, resource: dict[str, str],
        pii: list[str], round1: asyncio.Future[list[Any]], tp: str | None, hem_available: bool,
    ) -> KernelResult:
        reserved, sub = await round1
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
        ctx = self._context(agent, idp, m)
        action = idp.requested_action
        in_scope = action in m.actions
        allowed = in_scope and self.policy.evaluate(
            action, agent=agent, principal=m.principal, resource=resource, so_id=idp.so_id, context=ctx
        ).allowed
        deny_code = "POLICY_DENY" if in_scope else "MANDATE_SCOPE"
        warnings = [Detail(message=f"possible personal data ({p.split('@')[0]})", path=p.split("@")[1], rule="pii") for p in pii]

        if idp.hem_urgency == "REQUIRED" and self.cfg.hem_enabled:
            # spec 003 §4.4: HEM regardless of the Cedar outcome; §6.3 a resubmission after DENY.
            entry.status = "hem_pending"
            entry.moment_id = self._moment_id("HEM_URGENCY_REQUIRED", idp)
            await self._put_entry(entry)
            moment_id, _seq = await self._escalate(
                agent=agent, principal=m.principal, idp=idp, trigger="HEM_URGENCY_REQUIRED",
                cedar="PERMIT" if allowed else "DENY", tp=tp,
            )
            return HemPending(
                timestamp=now_rfc3339(), idp_id=idp.idp_id, session_id=idp.session_id,
                moment_id=moment_id, trigger="HEM_URGENCY_REQUIRED", event_seq=sub.seq,
            )
        if idp.hem_urgency == "REQUIRED":
            # The agent asked for a human and none can be asked: fail closed.
            allowed = False
        if allowed:
            entry.status = "permitted"
            jobs = [self._put_entry(entry), self.overdue.opened(entry)]
            if self.cfg.log_permits:
                jobs.append(
                    self.eventlog.append(
                        "CEDAR_PERMIT_RECORDED",
                        {"idp_id": idp.idp_id, "so_id": idp.so_id, "session_id": idp.session_id, "agent": agent,
                         "requested_action": action, "idp_submitted_seq": sub.seq},
                        msg_id=stable_id("CEDAR_PERMIT_RECORDED", idp.so_id.lower(), idp.idp_id.lower()),
                        traceparent=tp,
                    )
                )
            await asyncio.gather(*jobs)
            return Permit(
                timestamp=now_rfc3339(), idp_id=idp.idp_id, session_id=idp.session_id,
                step_sequence=idp.step_sequence, event_seq=sub.seq, warnings=warnings,
            )
        available = self._available(agent, idp, m, resource, ctx)
        entry.status = "denied"
        await self._put_entry(entry)
        return await self._deny(
            agent, idp, m, deny_code, raw["idp"], available=available, hem_available=hem_available,
            tp=tp, submitted_seq=sub.seq, log_event=True,
        )

    def _moment_id(self, trigger: str, idp: Idp) -> str:
        return stable_id("hem", trigger, idp.so_id.lower(), idp.idp_id.lower())

    async def _put_entry(self, entry: IdpEntry) -> None:
        try:
            await self.state.put_idp(entry, 0)
        except ConflictError:
            # Rebuilt by another instance from the log meanwhile: move it forward.
            await self.state.advance_idp(entry.so_id, entry.idp_id, entry.status, moment_id=entry.moment_id)

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

    def _context(self, agent: str, idp: Idp, m: Mandate) -> dict[str, Any]:
        ctx: dict[str, Any] = {"idp": idp_context(idp), "agent": agent, "principal": m.principal,
                               "mandate": {"jti": m.jti, "so_id": m.so_id}}
        if m.mission_ref is not None:
            ctx["mandate"]["mission_ref"] = m.mission_ref
        return ctx

    def _available(self, agent: str, idp: Idp, m: Mandate, resource: dict[str, str], ctx: dict[str, Any]) -> list[str]:
        """spec 003 §6.2: the mandate's actions that Cedar would permit now (never more)."""
        actions = list(dict.fromkeys(m.actions))
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

    async def _deny(
        self, agent: str, idp: Idp, m: Mandate, code: str, idp_raw: Any, *, available: list[str],
        hem_available: bool, tp: str | None, submitted_seq: int | None = None, log_event: bool = False,
        mismatch: MismatchDetail | None = None,
    ) -> EnrichedDeny:
        reason = _DENY_REASONS.get(code, "The transition is not permitted now.").format(action=idp.requested_action)
        res = EnrichedDeny(
            timestamp=now_rfc3339(), deny_code=code, deny_reason=reason, idp_received=idp_raw,  # type: ignore[arg-type]
            available_actions=available, hem_available=hem_available,
            suggested_paths=self._paths(idp.requested_action, available) if code in ("POLICY_DENY", "MANDATE_SCOPE") else None,
            mismatch_detail=mismatch, idp_id=idp.idp_id, event_seq=submitted_seq,
        )
        if log_event:
            await self.eventlog.append(
                "CEDAR_DENY_RECORDED",
                {"idp_id": idp.idp_id, "so_id": idp.so_id, "session_id": idp.session_id, "agent": agent,
                 "requested_action": idp.requested_action, "deny_code": code, "available_actions": available,
                 "hem_available": hem_available, "idp_submitted_seq": submitted_seq},
                msg_id=stable_id("CEDAR_DENY_RECORDED", idp.so_id.lower(), idp.idp_id.lower()),
                traceparent=tp,
            )
        await self._deny_verdict(agent, idp.idp_id, idp.idp_id, code, reason, m.principal, tp, result="DENY")
        return res

    async def _mission_mismatch(self, agent: str, idp: Idp, m: Mandate, idp_raw: Any, tp: str | None) -> KernelResult:
        assert idp.mission_ref is not None and m.mission_ref is not None
        detail = MismatchDetail(expected_mission_ref=m.mission_ref, submitted_mission_ref=idp.mission_ref)
        # spec 003 §5.2(g): "MUST log IDP_MISSION_REF_MISMATCH_REJECTED".
        body = {"idp_id": idp.idp_id, "so_id": idp.so_id, "session_id": idp.session_id, "agent": agent,
                "principal": m.principal, "mismatch_detail": msgspec.to_builtins(detail), "idp": idp_raw}
        ev = await self.eventlog.append(
            "IDP_MISSION_REF_MISMATCH_REJECTED", body,
            msg_id=stable_id("IDP_MISSION_REF_MISMATCH_REJECTED", idp.so_id.lower(), idp.idp_id.lower()), traceparent=tp,
        )
        await self.state.apply("IDP_MISSION_REF_MISMATCH_REJECTED", body, ev.seq)
        sess, _ = await self.state.session(agent, idp.session_id)
        threshold = self.cfg.mismatch_hem_threshold
        escalate = bool(threshold) and self.cfg.hem_enabled and len(sess.mismatches) >= threshold and sess.state == "ACTIVE"
        res = await self._deny(
            agent, idp, m, "IDP_MISSION_REF_MISMATCH", idp_raw, available=[],
            hem_available=self.cfg.hem_enabled and not escalate and sess.state == "ACTIVE", tp=tp, mismatch=detail,
        )
        if escalate:
            # spec 003 §5.2(g): HEM_AGENT_ESCALATED after the configured number of mismatches.
            await self._escalate(agent=agent, principal=m.principal, idp=idp, trigger="MISSION_REF_MISMATCH_THRESHOLD", tp=tp)
        return res

    async def _escalate(
        self, *, agent: str, principal: str, idp: Idp, trigger: str, cedar: str | None = None,
        verification: dict[str, Any] | None = None, tp: str | None = None,
    ) -> tuple[str, int]:
        from gateway.moments import HemContext

        moment_id = self._moment_id(trigger, idp)
        body = {"idp_id": idp.idp_id, "so_id": idp.so_id if trigger != "MISSION_REF_MISMATCH_THRESHOLD" else None,
                "session_id": idp.session_id, "agent": agent, "principal": principal, "trigger": trigger,
                "moment_id": moment_id, "cedar": cedar, "requested_action": idp.requested_action}
        if verification:
            body["verification"] = verification
        # §5.5.2 "the session enters HEM_PENDING immediately": the session moves together
        # with the event's append, not after its ack, so once the escalation is decided no
        # later step reservation goes through (a request that reserved its step first was
        # first). If the event cannot be logged the session is put back; the IDP's own
        # entry (HEM_URGENCY_REQUIRED) was written hem_pending by the caller.
        ev, prior = await asyncio.gather(
            self.eventlog.append("HEM_ESCALATED", body, msg_id=stable_id("HEM_ESCALATED", moment_id), traceparent=tp),
            self.state.escalate(body),
            return_exceptions=True,
        )
        if isinstance(ev, BaseException):
            if isinstance(prior, SessionEntry):
                with contextlib.suppress(Exception):
                    await self.state.unescalate(body, prior)
            raise ev
        if isinstance(prior, BaseException):
            raise prior
        sess, _ = await self.state.session(agent, idp.session_id)
        moment = hem_moment(agent=agent, idp=idp, trigger=trigger, cedar=cedar, verification=verification)
        await self.desk.dispatch(
            agent=agent, principal=principal, binding_moment=moment, envelope_id=idp.idp_id,
            correlation_id=idp.session_id, expires_in_s=self.cfg.hem_expires_in_s, traceparent=tp,
            hem=HemContext(idp.idp_id, idp.session_id, idp.requested_action), moment_id=moment_id,
        )
        log.info("hem escalated", agent=agent, idp_id=idp.idp_id, trigger=trigger, moment_id=moment_id,
                 session_state=sess.state)
        return moment_id, ev.seq

    # -- HEM decisions --------------------------------------------------------
    async def _on_hem_decision(self, record: Any, decision: str, resolution: Any) -> None:
        hem = record.hem
        if hem is None:
            return
        try:
            await self._apply_hem(record.agent, hem.session_id, hem.idp_id, record.moment_id, decision)
        except Exception:
            log.exception("could not apply HEM decision", moment_id=record.moment_id)

    async def _apply_hem(self, agent: str, session_id: str, idp_id: str, moment_id: str, decision: str) -> SessionEntry:
        sess, _ = await self.state.session(agent, session_id)
        if sess.hem_moment_id != moment_id or sess.state != "HEM_PENDING":
            return sess
        so_id = await self.state.so_of(agent, idp_id) if sess.hem_trigger != "MISSION_REF_MISMATCH_THRESHOLD" else None
        body = {"agent": agent, "session_id": session_id, "idp_id": idp_id, "so_id": so_id, "moment_id": moment_id,
                "decision": decision, "trigger": sess.hem_trigger, "principal": sess.hem_principal}
        await self.eventlog.append("HEM_RESOLVED", body, msg_id=stable_id("HEM_RESOLVED", moment_id))
        settled = await self.state.resolve_hem(body)
        if decision == "approve" and so_id and sess.hem_trigger == "HEM_URGENCY_REQUIRED":
            got = await self.state.idp(so_id, idp_id)
            if got is not None:
                await self.overdue.opened(got[0], moment_id=moment_id)  # a human's permit awaits its report too
        return settled

    # -- verdicts ---------------------------------------------------------------
    async def _deny_verdict(
        self, agent: str, idp_id: str | None, key: str, code: str, reason: str, principal: str | None,
        tp: str | None, result: str = "REJECT",
    ) -> None:
        """DESIGN §6: IDP REJECT and Cedar DENY -> ``denied`` (approver policy)."""
        v = Verdict(
            verdict_id=stable_id("idp-denied", agent, key, code),
            verdict_class="denied", decision="reject", approver="policy", human_disposed=False,
            ts=now_rfc3339(), agent=agent, principal=principal, action_type="idp.transition",
            action_id=idp_id or key, idp_id=idp_id, reason=Refusal(code=code, reason=reason),
            traceparent=tp, details={"result": result},
        )
        await self.publisher.verdict(v)

    async def _verdict_failure(self, agent: str, data: bytes, tp: str | None) -> None:
        key = stable_id("request", agent, data.decode("utf-8", "replace"))
        await self.publisher.verdict(
            Verdict(
                verdict_id=stable_id("idp-engine-failure", agent, key), verdict_class="engine_failure",
                decision="reject", approver="policy", human_disposed=False, ts=now_rfc3339(), agent=agent,
                action_type="idp.transition", action_id=key, traceparent=tp,
                reason=Refusal(code="KERNEL_UNAVAILABLE", reason="the kernel could not evaluate the request"),
            )
        )

    # -- transition reports (spec 003 §5.5) -------------------------------------------
    async def _transition_loop(self) -> None:
        while not self._stopping:
            if self.nc.is_closed:
                # The owner closed the connection without draining us (e.g. a failed start).
                return
            try:
                msgs = await self._psub.fetch(batch=self.config.gateway.batch, timeout=1)
            except (NatsTimeout, TimeoutError):
                continue
            except asyncio.CancelledError:
                return
            except Exception:
                if self._stopping or self.nc.is_closed:
                    return
                log.exception("fetching transition reports failed")
                await asyncio.sleep(0.5)
                continue
            self._busy = True
            try:
                await self._process_batch(msgs)
            finally:
                self._busy = False

    async def _process_batch(self, msgs: list[Any]) -> None:
        for msg in msgs:
            structlog.contextvars.clear_contextvars()
            try:
                agent = self.subjects.parse(msg.subject).token or ""
                tp = (msg.headers or {}).get("traceparent")
                structlog.contextvars.bind_contextvars(agent=agent, traceparent=tp)
                await self.handle_transition(agent, msg.data, msg.metadata.sequence.stream, traceparent=tp)
                await msg.ack()
            except SubjectError:
                await msg.term()
            except Exception:
                log.exception("transition report failed; will be redelivered", subject=msg.subject)
                with contextlib.suppress(Exception):
                    await msg.nak(delay=1)

    async def handle_transition(self, agent: str, data: bytes, msg_seq: int, *, traceparent: str | None = None) -> str:
        """Process one report; return what happened (``verified``, ``gap`` or ``refused:...``)."""
        tp = traceparent
        try:
            rep = msgspec.json.decode(data, type=TransitionReport)
        except Exception as e:  # noqa: BLE001 - any malformed report is refused and logged
            return await self._refuse_transition(agent, None, f"malformed report: {str(e)[:200]}", msg_seq, tp)
        so_id = await self.state.so_of(agent, rep.idp_id)
        got = await self.state.idp(so_id, rep.idp_id) if so_id else None
        if got is None:
            # spec 003 §5.3: no STATE_TRANSITIONED without a preceding IDP_SUBMITTED.
            return await self._refuse_transition(agent, rep, "no IDP_SUBMITTED for this step", msg_seq, tp)
        entry = got[0]
        if entry.status == "hem_pending":
            await self._session(agent, entry.session_id)
            entry = (await self.state.idp(entry.so_id, entry.idp_id) or got)[0]
        if entry.status not in ("permitted", "hem_approved", "transitioned"):
            return await self._refuse_transition(agent, rep, f"the IDP was not permitted (status {entry.status})", msg_seq, tp)
        report_digest = json_digest(msgspec.to_builtins(rep))
        eff = rep.effect
        resp_digest = json_digest(eff.response) if eff.response is not None else None
        status, reported = recorded_status(eff.status, resp_digest)
        st_body = {
            "idp_id": entry.idp_id, "so_id": entry.so_id, "session_id": entry.session_id, "agent": agent,
            "principal": entry.principal, "step_sequence": entry.step_sequence,
            "executed_action": rep.executed_action, "idp_submitted_seq": entry.submitted_seq,
            "effect": {"type": eff.type, "status": status, "external_ref": eff.external_ref,
                       "irreversibility_class": eff.irreversibility_class,
                       "request_digest": json_digest(eff.request) if eff.request is not None else None,
                       "response_digest": resp_digest},
            "effect_attestation": "runtime_claimed",
            "report_digest": report_digest,
        }
        if reported is not None:
            st_body["effect"]["status_reported"] = reported
        st_id = stable_id("STATE_TRANSITIONED", entry.so_id.lower(), entry.idp_id.lower())
        st = await self.eventlog.append("STATE_TRANSITIONED", st_body, msg_id=st_id, traceparent=tp)
        if st.duplicate and st.event.body.get("report_digest") != report_digest:
            return await self._refuse_transition(agent, rep, "a transition was already reported for this IDP", msg_seq, tp)
        if entry.status == "transitioned" and not st.duplicate and entry.transition_seq not in (None, st.seq):
            return await self._refuse_transition(agent, rep, "a transition was already reported for this IDP", msg_seq, tp)
        matched = rep.executed_action == entry.requested_action  # spec 003 §5.5.3: string-exact
        record: dict[str, Any] = {
            "idp_id": entry.idp_id,
            "state_transition_id": st.event.event_id,
            "state_transition_seq": st.seq,
            "verified_at": now_rfc3339(),
            "match_result": "MATCHED" if matched else "IDP_COMMITMENT_GAP",
            "requested_action": entry.requested_action,
            "executed_action": rep.executed_action,
            "kid": self.key.kid,
        }
        # spec 003 §5.5.1: Ed25519 over the canonical serialization of all other fields.
        record["kernel_signature"] = b64url(self.key.sign(rfc8785.dumps(record)))
        etype = "IDP_COMMITMENT_VERIFIED" if matched else "IDP_COMMITMENT_GAP"
        vbody: dict[str, Any] = {"record": record, "so_id": entry.so_id, "session_id": entry.session_id, "agent": agent}
        if not matched:
            vbody["alert"] = {"severity": "CRITICAL", "alert_trigger": "IDP_COMMITMENT_GAP"}
        vev = await self.eventlog.append(etype, vbody, msg_id=stable_id(etype, entry.so_id.lower(), entry.idp_id.lower()), traceparent=tp)
        record = vev.event.body["record"]
        await self.state.advance_idp(entry.so_id, entry.idp_id, "transitioned", transition_seq=st.seq)
        await self.overdue.closed(entry.so_id, entry.idp_id)
        if not matched:
            COMMITMENT_GAPS.labels(agent=agent).inc()
            log.critical("IDP_COMMITMENT_GAP", agent=agent, idp_id=entry.idp_id, requested=entry.requested_action,
                         executed=rep.executed_action[:200], alert_trigger="IDP_COMMITMENT_GAP")
            sub_ev = await self.eventlog.get(entry.submitted_seq)
            idp = decode_idp(sub_ev.body["idp"])
            await self._escalate(agent=agent, principal=entry.principal, idp=idp, trigger="IDP_COMMITMENT_GAP",
                                 verification=record, tp=tp)
        await self._transition_verdict(agent, entry, rep, resp_digest, record, tp)
        return "verified" if matched else "gap"

    async def _transition_verdict(
        self, agent: str, entry: IdpEntry, rep: TransitionReport, resp_digest: str | None,
        record: dict[str, Any], tp: str | None,
    ) -> None:
        eff = rep.effect
        status, reported = recorded_status(eff.status, resp_digest)
        details: dict[str, Any] = {"effect_attestation": "runtime_claimed", "match_result": record["match_result"],
                                   "executed_action": rep.executed_action, "requested_action": entry.requested_action}
        if resp_digest:
            details["response_digest"] = resp_digest
        if reported is not None:
            details["effect_status_reported"] = reported
        errored = eff.status.lower() in _ERRORED
        human = entry.status == "hem_approved" or entry.moment_id is not None
        v = Verdict(
            verdict_id=stable_id("idp-transition", entry.so_id.lower(), entry.idp_id.lower()),
            verdict_class="errored" if errored else "executed",
            decision="accept",
            approver="human" if human else "policy",
            # The principal approved this very step through HEM (DESIGN §6 "as happened").
            human_disposed=human,
            ts=now_rfc3339(), agent=agent, principal=entry.principal, action_type=entry.requested_action,
            action_id=entry.idp_id, idp_id=entry.idp_id, moment_id=entry.moment_id,
            supersedes=stable_id("resolved", entry.moment_id) if entry.moment_id else None,
            traceparent=tp,
            effect=ReportedEffect(type=eff.type, status=status, request=eff.request, response=eff.response,
                                  external_ref=eff.external_ref, irreversibility_class=eff.irreversibility_class),
            details=details,
        )
        await self.publisher.verdict(v)

    async def _refuse_transition(
        self, agent: str, rep: TransitionReport | None, why: str, msg_seq: int, tp: str | None
    ) -> str:
        key = stable_id("TRANSITION_REFUSED", agent, str(msg_seq))
        body = {"agent": agent, "reason": why, "inbound_seq": msg_seq,
                "idp_id": rep.idp_id if rep else None, "executed_action": rep.executed_action if rep else None}
        await self.eventlog.append("TRANSITION_REFUSED", body, msg_id=key, traceparent=tp)
        log.warning("transition refused", agent=agent, reason=why, idp_id=body["idp_id"])
        await self.publisher.verdict(
            Verdict(
                verdict_id=stable_id("idp-transition-refused", key), verdict_class="denied", decision="reject",
                approver="policy", human_disposed=False, ts=now_rfc3339(), agent=agent,
                action_type=(rep.executed_action if rep else "idp.transition"), action_id=(rep.idp_id if rep else key),
                idp_id=rep.idp_id if rep else None, traceparent=tp,
                reason=Refusal(code="TRANSITION_REFUSED", reason=why),
            )
        )
        return f"refused:{why}"
