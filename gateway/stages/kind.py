"""Stage 2, kind: is ``type`` one this host advertises? (spec 002 "Validation outcomes")

The registry maps each kind to its payload type, advertised schema version
and handler. ``pgw schema`` and the capability document read the same
registry, so what is advertised is what is validated. The four universal
kinds of spec 002 are always registered; configured vendor kinds (with their
JSON Schema files) are added per gateway (``gateway.stages.state``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from gateway.stages.base import Ctx, KindSpec, Refuse
from subjects.wire import (
    BindingMomentPayload,
    ClarificationRequestPayload,
    Detail,
    ErrorEnvelopePayload,
    SchemaRequestPayload,
    SchemaResponsePayload,
)

if TYPE_CHECKING:
    from subjects.wire import Outcome

Handler = Callable[[Ctx], Awaitable["Outcome"]]


BINDING_MOMENT = "vendor.pgw.binding_moment"
AUTHORIZATION = "vendor.pgw.authorization"
CLARIFICATION = "clarification.request"
SCHEMA_REQUEST = "schema.request"
SCHEMA_RESPONSE = "schema.response"
ERROR = "error"
# spec 002 "Universal kinds": always recognised, never refused by a contract gate.
UNIVERSAL_KINDS = (CLARIFICATION, SCHEMA_REQUEST, SCHEMA_RESPONSE, ERROR)


def _authorization_schema() -> dict[str, Any]:
    from gateway.stages.authorization import AuthorizationEnvelopePayload

    return msgspec.json.schema(AuthorizationEnvelopePayload)


def _builtin() -> dict[str, KindSpec]:
    from subjects.wire import AuthorizationPayload

    return {
        CLARIFICATION: KindSpec(CLARIFICATION, ClarificationRequestPayload, 1, "clarification"),
        SCHEMA_REQUEST: KindSpec(SCHEMA_REQUEST, SchemaRequestPayload, 1, "schema_request"),
        SCHEMA_RESPONSE: KindSpec(SCHEMA_RESPONSE, SchemaResponsePayload, 1, "record"),
        ERROR: KindSpec(ERROR, ErrorEnvelopePayload, 1, "error"),
        BINDING_MOMENT: KindSpec(BINDING_MOMENT, BindingMomentPayload, 1, "binding_moment"),
        # The handler validates the RFC-0010 union itself (an unknown variant is
        # refused and rendered BLOCKED, spec 001); the published schema is that union's.
        AUTHORIZATION: KindSpec(AUTHORIZATION, AuthorizationPayload, 1, "authorization", _authorization_schema()),
    }


BUILTIN_KINDS: dict[str, KindSpec] = _builtin()


async def run(ctx: Ctx) -> None:
    assert ctx.env is not None  # configured vendor kinds were registered with ctx.state
    spec = ctx.gw.kinds.get(ctx.env.type)
    if spec is None:
        supported = sorted(ctx.gw.kinds)
        raise Refuse(
            "unknown_envelope_kind",
            f"kind {ctx.env.type[:128]!r} is not supported by this host",
            details=[Detail(message=f"supported kinds: {', '.join(supported)}", path="$.type", rule="kind")],
        )
    ctx.kind = spec
