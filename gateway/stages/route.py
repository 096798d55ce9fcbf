"""Stage 9, route: each kind's handler (spec 002 "Production flow").

A handler returns the accepted EnvelopeOutcome; the pipeline publishes it and
the handler's own messages (surface item, verdict) are published before that.
"""

from __future__ import annotations

from gateway.stages.base import Ctx, Refuse
from subjects.util import now_rfc3339
from subjects.wire import BindingMomentPayload, Detail, EnvelopeOutcome


def accepted(ctx: Ctx, **kw: object) -> EnvelopeOutcome:
    assert ctx.env is not None
    return EnvelopeOutcome(
        agent=ctx.agent,
        ts=now_rfc3339(),
        untrusted=ctx.untrusted,
        traceparent=ctx.turn.traceparent,
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


async def binding_moment(ctx: Ctx) -> EnvelopeOutcome:
    p: BindingMomentPayload = ctx.payload
    assert ctx.principal is not None and ctx.envelope_id and ctx.correlation_id
    check_bound(ctx, ctx.principal)
    moment_id = await ctx.gw.desk.dispatch(
        agent=ctx.agent,
        principal=ctx.principal,
        binding_moment=p.binding_moment,
        envelope_id=ctx.envelope_id,
        correlation_id=ctx.correlation_id,
        untrusted=ctx.untrusted,
        expires_in_s=p.expires_in_s,
        traceparent=ctx.turn.traceparent,
    )
    return accepted(ctx, moment_id=moment_id)


HANDLERS = {
    "binding_moment": binding_moment,
}
