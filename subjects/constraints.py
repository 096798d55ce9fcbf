"""Constraints of the wire types, each written once (STYLE.md "Wire types").

Size limits here are the gateway's own (DESIGN §7 "string length limits");
spec-given limits cite their section.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

AgentToken = Annotated[str, Meta(pattern=TOKEN_PATTERN, description="agent subject token")]
PrincipalToken = Annotated[
    str, Meta(pattern=TOKEN_PATTERN, description="principal subject token (handle without '~')")
]
# spec 002 "AIEnvelope wire shape": envelopeId and correlationId are <= 128 chars.
EnvelopeId = Annotated[str, Meta(min_length=1, max_length=128)]
CorrelationId = Annotated[str, Meta(min_length=1, max_length=128)]
KindName = Annotated[str, Meta(min_length=1, max_length=128)]
NonNegInt = Annotated[int, Meta(ge=0)]
# Identifiers minted by the gateway (lowercase hex digests).
HexId = Annotated[str, Meta(pattern=r"^[0-9a-f]{16,64}$")]
Timestamp = Annotated[str, Meta(min_length=1, max_length=64, description="RFC 3339 UTC")]
# spec 002 EnvelopeMeta.ts: "ISO 8601 UTC timestamp" (the official schema: format date-time, RFC 3339).
# The calendar (month 13, 25:00) is checked by the shape stage (gateway/stages/shape.py).
RFC3339_PATTERN = r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$"
EnvelopeTimestamp = Annotated[str, Meta(pattern=RFC3339_PATTERN, max_length=64, description="RFC 3339 date-time")]

# Binding-moment slot sizes (spec 000 §6 gives cardinalities; sizes are ours).
SlotText = Annotated[str, Meta(min_length=1, max_length=2000)]
OptionLabel = Annotated[str, Meta(min_length=1, max_length=200)]
OptionReasoning = Annotated[str, Meta(min_length=1, max_length=1000)]
FreeText = Annotated[str, Meta(min_length=1, max_length=4000)]
ShortText = Annotated[str, Meta(max_length=2000)]
Code = Annotated[str, Meta(min_length=1, max_length=128)]

# spec 000 §6.6: "at least two and at most four entries".
MIN_OPTIONS = 2
MAX_OPTIONS = 4
MAX_LIST_ITEMS = 32
