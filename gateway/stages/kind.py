"""Stage 2, kind: is ``type`` one this host advertises? (spec 002 "Validation outcomes")

The registry maps each kind to its payload type, advertised schema version
and handler. ``pgw schema`` and the capability document read the same
registry, so what is advertised is what is validated.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.stages.base import Ctx, Refuse
from subjects.wire import BindingMomentPayload, Detail

if TYPE_CHECKING:
    from subjects.wire import EnvelopeOutcome

Handler = Callable[[Ctx], Awaitable["EnvelopeOutcome"]]


@dataclass(frozen=True)
class KindSpec:
    name: str
    payload_type: Any  # a msgspec Struct type, or None for a JSON-Schema-only vendor kind
    schema_version: int
    handler: str  # name of a handler in gateway.stages.route
    json_schema: dict[str, Any] | None = None  # for configured vendor kinds


BINDING_MOMENT = "vendor.pgw.binding_moment"

BUILTIN_KINDS: dict[str, KindSpec] = {
    BINDING_MOMENT: KindSpec(BINDING_MOMENT, BindingMomentPayload, 1, "binding_moment"),
}


async def run(ctx: Ctx) -> None:
    assert ctx.env is not None
    spec = ctx.gw.kinds.get(ctx.env.type)
    if spec is None:
        supported = sorted(ctx.gw.kinds)
        raise Refuse(
            "unknown_envelope_kind",
            f"kind {ctx.env.type[:128]!r} is not supported by this host",
            details=[Detail(message=f"supported kinds: {', '.join(supported)}", path="$.type", rule="kind")],
        )
    ctx.kind = spec
