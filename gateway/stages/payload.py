"""Stage 3, payload: the per-kind schema (spec 002 "Validation outcomes").

Refusal code ``envelope_invalid`` with validator details the agent can act
on. A binding moment is checked against the slot grammar of spec 000 §5-§6
rule by rule; a malformed moment is never delivered as a decision
(spec 000 §12.5): if the envelope carries ``conventional`` the principal gets
a notice instead (spec 000 §9.3) while the agent gets the refusal.
"""

from __future__ import annotations

import msgspec

from gateway.stages.base import Ctx, Refuse
from gateway.stages.kind import BINDING_MOMENT
from gateway.stages.moment_grammar import check_binding_moment
from subjects.names import principal_token
from subjects.wire import Detail

CODE = "envelope_invalid"


def _path_of(e: msgspec.ValidationError) -> str | None:
    msg = str(e)
    return msg.rsplit("at `", 1)[-1].rstrip("`").replace("$", "$.payload", 1) if "at `" in msg else "$.payload"


async def run(ctx: Ctx) -> None:
    assert ctx.env is not None and ctx.kind is not None
    raw = ctx.env.payload
    if ctx.kind.name == BINDING_MOMENT:
        _check_moment_payload(ctx, raw)
    if ctx.kind.payload_type is None:
        ctx.payload = raw
        return
    try:
        ctx.payload = msgspec.convert(raw, ctx.kind.payload_type)
    except msgspec.ValidationError as e:
        raise Refuse(
            CODE,
            f"payload does not match the schema of {ctx.kind.name}",
            details=[Detail(message=str(e), path=_path_of(e), rule="schema")],
        ) from None


def _check_moment_payload(ctx: Ctx, raw: object) -> None:
    if not isinstance(raw, dict):
        raise Refuse(CODE, "payload must be an object", details=[Detail(message="payload must be an object", path="$.payload", rule="payload_type")])
    details: list[Detail] = []
    principal = raw.get("principal")
    try:
        ctx.principal = principal_token(principal)  # type: ignore[arg-type]
    except ValueError as e:
        details.append(Detail(message=str(e), path="$.payload.principal", rule="principal"))
    if "binding_moment" not in raw:
        details.append(Detail(message="binding_moment is REQUIRED", path="$.payload.binding_moment", rule="missing_member"))
    else:
        details.extend(check_binding_moment(raw["binding_moment"]))
    if details:
        notice = raw.get("conventional") if ctx.principal else None
        raise Refuse(
            CODE,
            f"malformed binding moment: {details[0].message}",
            details=details,
            notice=notice,
        )
