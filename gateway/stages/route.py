"""Stage 9, route: each kind's handler (spec 002 "Production flow", DESIGN §3.1).

A handler returns the envelope's outcome; the pipeline publishes it, and the
handler's own messages (surface item, verdict) are published before that.

- ``vendor.pgw.binding_moment``: single-surface check (spec 000 §8.4), no
  untrusted content (spec 002 "Trust boundary", :func:`untrusted_moment`), dual
  veto (§7.2), hatch suppression recorded (§12.3), dispatched to the desk;
- ``clarification.request``: lifted to a clarification item on the
  principal's surface; the answers come back like a resolution;
- ``schema.request``: answered with the kind's JSON Schema (a ``schema`` outcome);
- ``schema.response``, configured vendor kinds: recorded;
- ``error``: recorded at level error; a successful turn (spec 002);
- ``vendor.pgw.authorization``: spec 001 (``gateway.stages.authorization``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from gateway.stages import authorization as authz
from gateway.stages import dualveto
from gateway.stages.base import Ctx, Refuse
from pgwcore.logs import get_logger
from subjects.client import PRINCIPAL_HEADER
from subjects.names import principal_unhandled
from subjects.util import now_rfc3339, stable_id
from subjects.wire import (
    AuthorizationItem,
    AuthorizationPayload,
    BindingMomentPayload,
    ClarificationRequestPayload,
    Detail,
    EnvelopeOutcome,
    ErrorEnvelopePayload,
    SchemaOutcome,
    SchemaRequestPayload,
    WithdrawnItem,
)

if TYPE_CHECKING:
    from subjects.wire import Outcome

log = get_logger("pgw.route")


def accepted(ctx: Ctx, **kw: object) -> EnvelopeOutcome:
    assert ctx.env is not None
    return EnvelopeOutcome(
        agent=ctx.agent,
        ts=now_rfc3339(),
        untrusted=ctx.untrusted,
        traceparent=ctx.turn.traceparent,
        node_id=ctx.node_id,
        status="accepted",
        envelope_id=ctx.envelope_id,
        correlation_id=ctx.correlation_id,
        type=ctx.env.type,
        warnings=list(ctx.warnings),
        **kw,  # type: ignore[arg-type]
    )


def check_bound(ctx: Ctx, principal: str) -> None:
    """Single-surface delivery (spec 000 §8.4): only principals bound to the agent.

    With no bindings configured at all the gateway runs open (said loudly at start).
    """
    bound = ctx.gw.config.bound_principals(ctx.agent)
    if bound is not None and principal not in bound:
        raise Refuse(
            "principal_not_bound",
            "this agent is not bound to that principal",
            details=[Detail(message="the agent may address only the principals configured for it", path="$.payload.principal", rule="binding")],
            status="gated",
            verdict_class="denied",
        )




def addressed_principal(ctx: Ctx) -> str | None:
    """The principal :func:`resolve_principal` will find for a universal kind, without judging it
    (no warning, no refusal; None when it will refuse): for the limits stage, which runs first and
    counts clarifications per principal (gateway/stages/limits.py)."""
    assert ctx.env is not None and ctx.env.meta is not None
    # As resolve_principal reads it: ``~alice`` is ``alice`` (one count, not two; found by an attack from the docs).
    if ctx.turn.principal is not None:
        return principal_unhandled(ctx.turn.principal)
    legacy = ctx.env.meta.pgw.get("principal") if isinstance(ctx.env.meta.pgw, dict) else None
    if isinstance(legacy, str):
        return principal_unhandled(legacy)
    bound = ctx.gw.config.bound_principals(ctx.agent) or []
    return bound[0] if len(bound) == 1 else None


def resolve_principal(ctx: Ctx, explicit: Any = None, path: str = "$.meta.pgw.principal") -> str:
    """The addressed principal (issue 15 point 1).

    In order: ``explicit`` (a vendor kind's own payload member), the turn's
    ``Pgw-Principal`` NATS header, the deprecated ``meta.pgw.principal``
    (accepted with a warning: the official ``EnvelopeMeta`` is closed, so an
    envelope carrying it fails official validation), else the agent's only
    bound principal, else ``principal_required``.
    """
    from subjects.names import principal_token

    assert ctx.env is not None and ctx.env.meta is not None
    if explicit is None:
        legacy = ctx.env.meta.pgw.get("principal") if isinstance(ctx.env.meta.pgw, dict) else None
        header = ctx.turn.principal
        if legacy is not None:
            ctx.warn("meta.pgw.principal is deprecated (the official EnvelopeMeta is closed): "
                     f"send the {PRINCIPAL_HEADER} header instead", "deprecated", "$.meta.pgw.principal")
        if header is not None:
            if legacy is not None and legacy != header:
                raise Refuse("envelope_invalid", f"meta.pgw.principal and the {PRINCIPAL_HEADER} header name different principals",
                             details=[Detail(message="name one principal", path=f"header:{PRINCIPAL_HEADER}", rule="principal")])
            explicit, path = header, f"header:{PRINCIPAL_HEADER}"
        else:
            explicit = legacy
    if explicit is not None:
        try:
            principal = principal_token(explicit)
        except (ValueError, TypeError) as e:
            raise Refuse("envelope_invalid", "the principal is not a valid handle",
                         details=[Detail(message=str(e)[:200], path=path, rule="principal")]) from None
    else:
        bound = ctx.gw.config.bound_principals(ctx.agent) or []
        if len(bound) != 1:
            raise Refuse(
                "principal_required",
                f"name the principal in the {PRINCIPAL_HEADER} header: this agent is not bound to exactly one principal",
                details=[Detail(message=f"set the {PRINCIPAL_HEADER} NATS header", path=f"header:{PRINCIPAL_HEADER}", rule="principal")],
            )
        principal = bound[0]
    ctx.principal = principal
    check_bound(ctx, principal)
    return principal


def untrusted_moment() -> Refuse:
    """An untrusted binding moment is not delivered (spec 002 "Trust boundary"; docs/pipeline.md
    "Untrusted content").

    Spec 002: "Hosts MUST NOT advance HITL approval gates ... on the basis of an envelope whose
    meta.contentTrust = 'untrusted'", and a surface built from untrusted content is blocked
    from advancing an approval (its A2UI rule 5), even though a person submits it. Every
    binding moment is such a gate: its options are courses of action and the principal's
    choice binds the agent to one (spec 000 §1, "a binding moment is consensual"), whatever
    its labels say, so no reading of the labels could tell a safe one apart. The moment is
    refused before anything reaches the principal; untrusted content may still ask in the
    principal's own words (``clarification.request``) or inform (a narrative), neither of
    which is an approval.
    """
    return Refuse(
        "untrusted_content_blocks_approval",
        "a binding moment built from untrusted content cannot ask the principal to approve or choose an action; "
        "ask in their own words with clarification.request, or send the moment once trusted content carries it",
        details=[Detail(message="meta.contentTrust is untrusted", path="$.meta.contentTrust", rule="trust_boundary")],
        status="gated",
        verdict_class="denied",
    )


async def binding_moment(ctx: Ctx) -> Outcome:
    p: BindingMomentPayload = ctx.payload
    assert ctx.principal is not None and ctx.envelope_id and ctx.correlation_id
    check_bound(ctx, ctx.principal)
    if ctx.untrusted:
        raise untrusted_moment()
    st = ctx.state
    await dualveto.check(ctx, st, ctx.principal, p.binding_moment)
    bm = p.binding_moment
    details: dict[str, Any] = {}
    suppressed = [h for h in ("free_text", "dialogue") if getattr(bm.question.hatches, h) is False]
    if suppressed:
        # spec 000 §12.3: delivered, but recorded so systematic suppression is auditable.
        details["hatch_suppressed"] = suppressed
        ctx.warn(f"hatch suppressed: {', '.join(suppressed)} (recorded, spec 000 §12.3)", "hatch_suppression",
                 "$.payload.binding_moment.question.hatches")
        for h in suppressed:
            st.stats.hatch_suppressions[(ctx.agent, h)] += 1
        log.info("hatch suppression", agent=ctx.agent, hatches=suppressed, envelope_id=ctx.envelope_id)
    st.stats.moments[ctx.agent] += 1
    if bm.meta is not None and bm.meta.calibration_note:
        st.stats.calibration_notes[ctx.agent] += 1
        details["calibration_note"] = True
    if bm.meta is not None and bm.meta.decision_class:
        details["decision_class"] = bm.meta.decision_class
    moment_id = await ctx.gw.desk.dispatch(
        agent=ctx.agent,
        principal=ctx.principal,
        binding_moment=bm,
        envelope_id=ctx.envelope_id,
        correlation_id=ctx.correlation_id,
        untrusted=ctx.untrusted,
        expires_in_s=p.expires_in_s,
        traceparent=ctx.turn.traceparent,
        node_id=ctx.node_id,
        details=details or None,
        conventional=p.conventional,  # spec 000 §9.3: the surface's own fallback
    )
    return accepted(ctx, moment_id=moment_id)


async def clarification(ctx: Ctx) -> Outcome:
    """spec 002: lift to a clarification item; the answers come back as a resolution."""
    p: ClarificationRequestPayload = ctx.payload
    assert ctx.envelope_id and ctx.correlation_id
    principal = resolve_principal(ctx)
    moment_id = await ctx.gw.desk.dispatch(
        agent=ctx.agent,
        principal=principal,
        questions=p.questions,
        context_type=p.contextType,
        envelope_id=ctx.envelope_id,
        correlation_id=ctx.correlation_id,
        untrusted=ctx.untrusted,
        expires_in_s=ctx.gw.config.pipeline.clarification_expires_in_s,
        traceparent=ctx.turn.traceparent,
        node_id=ctx.node_id,
        action_type="pgw.clarification",
    )
    return accepted(ctx, moment_id=moment_id)


async def schema_request(ctx: Ctx) -> Outcome:
    """spec 002: the kind's JSON Schema, on the agent's outcome subject."""
    p: SchemaRequestPayload = ctx.payload
    assert ctx.envelope_id and ctx.correlation_id
    spec = ctx.gw.kinds.get(p.envelopeType)
    if spec is None:
        # spec 002 is silent on an unknown envelopeType: schema.request is a universal kind
        # ("always allowed") and its response "SHOULD include" the schema, which does not exist.
        # Default: accepted, with the supported kinds (the official conformance scenario);
        # configurable to the official schema description's unknown_envelope_kind.
        why = Detail(message=f"no schema for {p.envelopeType[:128]!r}: not a kind this host supports; "
                             f"supported kinds: {', '.join(sorted(ctx.gw.kinds))}",
                     path="$.payload.envelopeType", rule="kind")
        if ctx.gw.config.pipeline.schema_request_unknown_kind == "refuse":
            raise Refuse("unknown_envelope_kind", why.message, details=[why])
        ctx.warnings.append(why)
        return accepted(ctx)
    return SchemaOutcome(
        agent=ctx.agent,
        ts=now_rfc3339(),
        untrusted=ctx.untrusted,
        traceparent=ctx.turn.traceparent,
        envelope_id=ctx.envelope_id,
        correlation_id=ctx.correlation_id,
        node_id=ctx.node_id,
        envelope_type=spec.name,
        schema_version=spec.schema_version,
        schema=spec.schema(),
    )


def _event_id(ctx: Ctx) -> str:
    return stable_id("record", ctx.agent, ctx.envelope_id or "", ctx.correlation_id or "")


async def record(ctx: Ctx) -> Outcome:
    """schema.response and configured vendor kinds: recorded (spec 002: log.appended, debug)."""
    assert ctx.env is not None
    log.debug("envelope recorded", type=ctx.env.type, envelope_id=ctx.envelope_id, agent=ctx.agent)
    return accepted(ctx, recorded_event_ids=[_event_id(ctx)])


async def error(ctx: Ctx) -> Outcome:
    """The LLM's own error report: recorded at level error, a successful turn (spec 002)."""
    p: ErrorEnvelopePayload = ctx.payload
    log.error("agent reported an error", code=p.code[:128], message=p.message[:500], envelope_id=ctx.envelope_id, agent=ctx.agent)
    return accepted(ctx, recorded_event_ids=[_event_id(ctx)])


async def authorization(ctx: Ctx) -> Outcome:
    """spec 001: enforce, then deliver as an ``authorization`` item (DESIGN §3.4).

    ``enforcement_mode`` (spec 001 Binding Rules, docs/pipeline.md) decides
    when an authoritative variant's oracle verification runs: ``INLINE``
    before the item is published, ``ASYNC`` after, withdrawing the item when
    it fails.
    """
    p: AuthorizationPayload = ctx.payload
    assert ctx.envelope_id
    principal = resolve_principal(ctx, p.principal, "$.payload.principal")
    item_id = stable_id("authorization", ctx.agent, ctx.envelope_id)
    cfg = ctx.gw.config.pipeline
    workflow = cfg.workflows.get(p.workflow_id)
    refusal: authz.PolicyRefusal | None = None
    deferred: authz.AuthorizationEnvelope | None = None
    try:
        if workflow is None:
            raise authz.PolicyRefusal(
                "unknown_workflow",
                f"workflow {p.workflow_id[:128]!r} is not declared; declare it in [pipeline.workflows] (spec 001)",
                "$.payload.workflow_id",
                user_code="BLOCKED",
            )
        env = authz.enforce(authz.decode(p.envelope), workflow, cfg.narrative, untrusted=ctx.untrusted)
        if isinstance(env, authz.Refusal):
            # spec 001 RefusalReason: the agent's own refusal, screened like the gateway's.
            names = [o for w in cfg.workflows.values() for o in w.oracles]
            env, warnings = authz.shown_refusal(env, item_id, names)
            ctx.warnings.extend(warnings)
        if isinstance(env, authz.Measurement | authz.Classification | authz.Action):
            if workflow.enforcement_mode == "ASYNC":
                deferred = env
            else:
                authz.verify_oracles(env, workflow)
            await _claim_envelope_id(ctx, p.workflow_id, env.provenance.envelope_id)
        shown: dict[str, Any] = msgspec.to_builtins(env)
    except authz.PolicyRefusal as pr:
        refusal = pr
        # The principal sees a fail-closed refusal without control-plane detail.
        shown = msgspec.to_builtins(authz.user_refusal(pr.user_code, item_id))
    await ctx.gw.publisher.surface(_authorization_item(ctx, principal, item_id, p.workflow_id, shown), f"authorization:{item_id}")
    if refusal is not None:
        raise Refuse(refusal.code, refusal.reason, details=[refusal.detail], status="gated", verdict_class="denied")
    if deferred is not None:
        try:
            authz.verify_oracles(deferred, workflow)
        except authz.PolicyRefusal as pr:
            await _withdraw(ctx, principal, item_id, p.workflow_id)
            withdrawn = Detail(message=f"ASYNC: authorization item {item_id} was delivered, then withdrawn", rule="withdrawn")
            raise Refuse(pr.code, pr.reason, details=[pr.detail, withdrawn], status="gated", verdict_class="denied") from None
    return accepted(ctx, recorded_event_ids=[item_id])


def _authorization_item(ctx: Ctx, principal: str, item_id: str, workflow_id: str, shown: dict[str, Any]) -> AuthorizationItem:
    return AuthorizationItem(
        agent=ctx.agent,
        principal=principal,
        created_at=now_rfc3339(),
        untrusted=ctx.untrusted,
        traceparent=ctx.turn.traceparent,
        node_id=ctx.node_id,
        item_id=item_id,
        envelope_id=ctx.envelope_id or "",
        workflow_id=workflow_id,
        envelope=shown,
    )


async def _withdraw(ctx: Ctx, principal: str, item_id: str, workflow_id: str) -> None:
    """ASYNC verification failed: withdraw the delivered item, then say so (spec 001 Binding Rules)."""
    await ctx.gw.publisher.surface(WithdrawnItem(
        agent=ctx.agent, principal=principal, created_at=now_rfc3339(), untrusted=ctx.untrusted,
        traceparent=ctx.turn.traceparent, moment_id=item_id, reason="superseded",
    ), f"withdrawn:{item_id}")
    notice_id = stable_id("authorization-withdrawn", ctx.agent, ctx.envelope_id or "")
    shown = msgspec.to_builtins(authz.user_refusal("POLICY_VIOLATION", notice_id, authz.WITHDRAWN_MESSAGE))
    await ctx.gw.publisher.surface(_authorization_item(ctx, principal, notice_id, workflow_id, shown), f"authorization:{notice_id}")


class _Claim(msgspec.Struct):
    owner: str  # Ctx.envelope_key of the envelope that delivered the id
    agent: str


_claim_enc = msgspec.json.Encoder()
_claim_dec = msgspec.json.Decoder(_Claim)


async def _claim_envelope_id(ctx: Ctx, workflow_id: str, envelope_id: str) -> None:
    """spec 001 Provenance ``envelope_id`` "Unique identifier for audit": one delivery per id and workflow."""
    key = authz.envelope_id_key(workflow_id, envelope_id)
    claim = _claim_enc.encode(_Claim(owner=ctx.envelope_key, agent=ctx.agent))
    for _ in range(2):
        try:
            await ctx.state.writer.create(key, claim)
            return
        except KeyWrongLastSequenceError:
            try:
                entry = await ctx.state.kv.get(key)
            except KeyNotFoundError:
                continue  # expired (bucket TTL) between the two calls: claim it afresh
        if entry.value:
            try:
                owner = _claim_dec.decode(entry.value).owner
            except msgspec.DecodeError:
                # No claim of the gateway's: the server's acknowledgement a party aimed at this key
                # (docs/security.md "Replies"), which made every delivery of the envelope fail until it
                # was dead-lettered. Taken over by compare-and-set: no envelope delivered this id.
                log.warning("an envelope-id claim is no record of the gateway's; taken over", key=key)
                try:
                    await ctx.state.kv.update(key, claim, last=entry.revision)
                    return
                except KeyWrongLastSequenceError:
                    continue
            if owner == ctx.envelope_key:
                return  # the redelivery of the envelope that claimed it (a crash after the claim)
        break
    raise authz.PolicyRefusal(
        "envelope_id_reused",
        f"provenance.envelope_id {envelope_id[:128]!r} was already delivered in this workflow; each envelope needs its own (spec 001 Provenance)",
        "$.payload.envelope.provenance.envelope_id",
    )


HANDLERS = {
    "binding_moment": binding_moment,
    "clarification": clarification,
    "schema_request": schema_request,
    "record": record,
    "error": error,
    "authorization": authorization,
}
