"""Validation of a transition request, in the order of spec 003 §5.2.

Split from ``gateway.kernel.service`` (issue 18): everything that can refuse
an IDP before its step is reserved (decoding, profile and thin-IDP rules, the
mandate and its binding to the agent, revocation, the mission reference).
The methods run on :class:`gateway.kernel.service.KernelService`, whose state
they share.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from gateway.kernel.mandate import Mandate, MandateError
from gateway.kernel.policy import entity_uid
from gateway.kernel.received import commit_received
from gateway.kernel.state import KernelState, SessionEntry
from gateway.security.seen import seen_latin
from pgwcore.logs import get_logger
from subjects import jcs
from subjects.idp import (
    EnrichedDeny,
    Idp,
    IdpThin,
    KernelResult,
    Reject,
    canonical_id,
    decode_idp,
    pii_markers,
)
from subjects.util import now_rfc3339
from subjects.wire import Detail

log = get_logger("pgw.kernel")

_TYPED_FIELDS = frozenset(
    {"idp_id", "session_id", "so_id", "mandate_id", "step_sequence", "requested_action", "timestamp",
     "declared_goal", "reasoning_basis", "confidence_level", "hem_urgency", "profile", "audit_accessible",
     "mission_ref", "context_refs"}
)


# Punctuation that may wrap an id in prose: "(session s-1)", "mandate 'j-7'.", "[s-1]:".
_WRAP = "()[]{}<>\"'`‘’“”,;:.!?"


def names_source(description: str, *ids: str) -> bool:
    """spec 003 §4.3 INSTRUCTION: does ``description`` name one of ``ids`` as a word of its own?

    A substring test would let a one-character session_id be "named" by any
    word holding that letter; here an id must be a whole whitespace-separated
    token (wrapping punctuation stripped, or the token's ``key=``/``key:`` value).
    """
    wanted = {i for i in ids if i}
    for token in description.split():
        word = token.strip(_WRAP)
        if word in wanted or any(word.partition(sep)[2].strip(_WRAP) in wanted for sep in ("=", ":")):
            return True
    return False


@functools.lru_cache(maxsize=4096)
def _pii_kinds(text: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """``pii_markers(text, names)`` (spec 003 §9) of the text as sent and as a person reads it
    (``seen_latin``: full-width or mathematical letters, a Cyrillic a (U+0430), a zero-width space inside a name,
    a full-width at sign (U+FF20); found by an attack from the docs, each logged for good), remembered: a pure function
    of its arguments, and agents repeat their goal and reasoning descriptions from one step to the next."""
    found = pii_markers(text, names)
    read = seen_latin(text)
    if read != text:
        found += [k for k in pii_markers(read, names) if k not in found]
    return tuple(found)


class RefusalError(Exception):
    def __init__(self, result: KernelResult) -> None:
        self.result = result


class RequestValidation:
    """The request-validation methods of :class:`gateway.kernel.service.KernelService` (state lives on the service)."""

    cfg: Any
    gw: Any  # the Gateway: its stage state holds the redactor (SR-1)
    state: KernelState
    mandates: Any

    def _reject(
        self, code: str, reason: str, *, idp_id: str | None = None, details: list[Detail] | None = None
    ) -> RefusalError:
        return RefusalError(
            Reject(timestamp=now_rfc3339(), error_code=code, reason=reason, details=details or [], idp_id=idp_id)  # type: ignore[arg-type]
        )

    def _revoked(self, idp: Idp, idp_raw: Any) -> EnrichedDeny:
        """spec 003 §6.2 MANDATE_REVOKED: a deny code, so an Enriched DENY; nothing is available."""
        return EnrichedDeny(
            timestamp=now_rfc3339(), deny_code="MANDATE_REVOKED", idp_received=idp_raw, available_actions=[],
            deny_reason="The presented mandate has been revoked; no action is available under it.",
            hem_available=False, idp_id=idp.idp_id,
        )

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
        # spec 003 §4.2: the idp_id is a UUID, whose hex digits are case-insensitive. Canonicalised once,
        # here where it enters (as a transition report's is): the index, every event, the audit walk and
        # the Session Audit Record's restrictions name one id. IDP_SUBMITTED.idp keeps the IDP as sent.
        idp = msgspec.structs.replace(idp, idp_id=canonical_id(idp.idp_id))
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
            if uid == {"type": "Agent", "id": agent}:
                # The request's principal is this entity already (gateway/kernel/policy.py): Cedar would be
                # handed it twice and fail after IDP_SUBMITTED was committed (a KERNEL_UNAVAILABLE).
                raise self._reject("REQUEST_MALFORMED", "resource must not be the agent itself: Cedar's principal is "
                                   f'Agent::"{agent}" already', idp_id=idp.idp_id)
            resource = uid
        pii: list[str] = []
        for path, text in (
            ("$.declared_goal.description", idp.declared_goal.description if idp.declared_goal else ""),
            ("$.reasoning_basis.description", idp.reasoning_basis.description if idp.reasoning_basis else ""),
        ):
            pii += [f"{kind}@{path}" for kind in _pii_kinds(text, tuple(self.cfg.pii_names))]
        if pii and self.cfg.pii == "reject":
            raise self._reject(
                "IDP_MALFORMED", "goal and reasoning descriptions must not contain personal data (spec 003 §9)",
                idp_id=idp.idp_id, details=[Detail(message=f"{p.split('@')[0]} marker", path=p.split("@")[1], rule="pii") for p in pii],
            )
        # spec 003 §5.3: IDP_SUBMITTED holds "the full IDP object as submitted", signed (§8.2) in a log
        # that is never deleted, so a secret in an IDP would stay readable at rest for good (spec 002
        # SR-1; docs/security.md "Data at rest"). As personal data (§9), it is refused before anything is
        # committed: the agent restates the step without it. The resource is recorded beside the IDP.
        red = (await self.gw.stage_state.get()).redactor
        held = red.holding(idp_raw)
        if held:
            raise self._reject(
                "IDP_MALFORMED",
                "the IDP holds a secret (a configured secret or a secret: token); the event log keeps an IDP as "
                "submitted and for good, so restate it without the secret (spec 002 SR-1, spec 003 §5.3)",
                idp_id=idp.idp_id, details=[Detail(message="holds a secret", path=p, rule="secret") for p in held],
            )
        if isinstance(res_raw, str) and red.holding(res_raw):
            raise self._reject(
                "REQUEST_MALFORMED", "the resource holds a secret; the event log keeps it with the IDP (spec 002 SR-1)",
                idp_id=idp.idp_id, details=[Detail(message="holds a secret", path="resource", rule="secret")],
            )
        # §4.3: an INSTRUCTION basis MUST name the instruction's source by
        # mandate_id or session_id, so the instruction stays traceable.
        rb = idp.reasoning_basis
        if rb is not None and rb.type == "INSTRUCTION" and not names_source(rb.description, idp.mandate_id, idp.session_id):
            raise self._reject(
                "IDP_MALFORMED",
                "an INSTRUCTION reasoning basis must name its source by mandate_id or session_id (spec 003 §4.3)",
                idp_id=idp.idp_id,
                details=[Detail(message="source of the instruction not named", path="$.reasoning_basis.description", rule="instruction_source")],
            )
        # mandate: signature, revocation, expiry (DESIGN §5.2). Before (c): an agent
        # without a valid mandate learns nothing of the index, not even whether an
        # idp_id exists. A revoked mandate is the Enriched DENY of §6.2.
        try:
            mandate = self.mandates.verify(raw.get("mandate"), agent=agent)
        except MandateError as e:
            if e.code == "MANDATE_REVOKED":
                raise RefusalError(self._revoked(idp, idp_raw)) from None
            raise self._reject(e.code, e.reason, idp_id=idp.idp_id) from None
        # (c) idp_id unique for the governed object (and for this agent's reports).
        # The session entry for (f) is read in the same round trip; only the
        # reads overlap, the checks below still run in the order of §5.2.
        # A session this instance holds at its last revision, ACTIVE and below this
        # step, is not read again (KernelState.cached_session: the step's CAS
        # re-checks it); any other is read fresh, so every refusal below is
        # decided on the session as stored.
        cached = self.state.cached_session(agent, idp.session_id, idp.step_sequence)
        # The hold of the governed object (spec 003 §4.4, §5.5.2: a HEM block or a
        # termination holds every session of the agent on it) is read in the same request.
        known, reported, fresh, hold_read = await self.state.validation_reads(
            agent, idp.so_id, idp.idp_id, idp.session_id if cached is None else None
        )
        read = fresh if fresh is not None else cached
        assert read is not None
        if known is not None or reported:
            raise self._reject("IDP_DUPLICATE", "this idp_id was already submitted (spec 003 §5.2(c), §8.4)", idp_id=idp.idp_id)
        # (d) so_id bound to the mandate
        if idp.so_id.lower() != mandate.so_id.lower():
            raise self._reject("IDP_SO_MISMATCH", "the IDP so_id is not the governed object bound to the mandate", idp_id=idp.idp_id)
        # (e) mandate_id is the JWT's jti
        if idp.mandate_id != mandate.jti:
            raise self._reject("IDP_MANDATE_MISMATCH", "the IDP mandate_id is not the jti of the presented mandate", idp_id=idp.idp_id)
        if cached is not None and idp.mission_ref is not None and mandate.mission_ref is not None \
                and idp.mission_ref != mandate.mission_ref:
            # (g) denies without taking the step, so no CAS would catch a stale
            # session there: it is decided on the session as stored.
            read = await self.state.session(agent, idp.session_id)
        # (f) step_sequence strictly increasing per session
        sess, rev = await self._session(agent, idp.session_id, read)
        hold = await self._hold(agent, idp.so_id, hold_read)
        # A termination ends the session and its mandate: every other session under
        # that mandate is refused too, not only the one that was escalated.
        if sess.state == "TERMINATED" or mandate.jti in hold.terminated:
            await commit_received(
                self, self._submitted_body(agent, idp_raw, idp, mandate, resource, pii, now_rfc3339()),
                session_state="TERMINATED", code="SESSION_TERMINATED", moment_id=sess.hem_moment_id, tp=None,
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
        if hold.pending and sess.state == "ACTIVE":
            # A moment of another session of this agent on this governed object awaits a
            # human: this session is held as if it were its own (spec 003 §4.4, §5.5.2). The
            # view is only read (HEM_PENDING takes no step); it is never written.
            h = hold.pending[0]
            sess = msgspec.structs.replace(sess, state="HEM_PENDING", hem_moment_id=h.moment_id, hem_idp_id=h.idp_id,
                                           hem_trigger=h.trigger, hem_principal=h.principal)
        return idp, mandate, resource, pii, (sess, rev)

