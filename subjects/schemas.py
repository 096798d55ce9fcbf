"""JSON Schemas of every wire type, generated from the Structs that validate.

``pgw schema NAME`` prints one; a surface or agent author in another
language builds against these.
"""

from __future__ import annotations

import importlib
from typing import Any

import msgspec

from subjects import wire

WIRE_TYPES: dict[str, Any] = {
    "AIEnvelope": wire.AIEnvelope,
    "EnvelopeMeta": wire.EnvelopeMeta,
    "BindingMoment": wire.BindingMoment,
    "BindingMomentPayload": wire.BindingMomentPayload,
    "ClarificationRequestPayload": wire.ClarificationRequestPayload,
    "SchemaRequestPayload": wire.SchemaRequestPayload,
    "SchemaResponsePayload": wire.SchemaResponsePayload,
    "ErrorEnvelopePayload": wire.ErrorEnvelopePayload,
    "AuthorizationPayload": wire.AuthorizationPayload,
    "SurfaceItem": wire.SurfaceItem,
    "BindingMomentItem": wire.BindingMomentItem,
    "ClarificationItem": wire.ClarificationItem,
    "AuthorizationItem": wire.AuthorizationItem,
    "NoticeItem": wire.NoticeItem,
    "WithdrawnItem": wire.WithdrawnItem,
    "Resolution": wire.Resolution,
    "ResolveRequest": wire.ResolveRequest,
    "ResolveReply": wire.ResolveReply,
    "PendingReply": wire.PendingReply,
    "Outcome": wire.Outcome,
    "EnvelopeOutcome": wire.EnvelopeOutcome,
    "ResolutionOutcome": wire.ResolutionOutcome,
    "MomentExpired": wire.MomentExpired,
    "HemDecision": wire.HemDecision,
    "SchemaOutcome": wire.SchemaOutcome,
    "ActionResult": wire.ActionResult,
    "Verdict": wire.Verdict,
    "Refusal": wire.Refusal,
}

# Modules that contribute more wire types (each exposes WIRE_TYPES: dict[str, type]).
EXTRA_MODULES = ["subjects.idp", "subjects.kernelops", "subjects.momentquery", "subjects.gate", "subjects.approvals"]


def all_types() -> dict[str, Any]:
    types = dict(WIRE_TYPES)
    for name in EXTRA_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        types.update(getattr(mod, "WIRE_TYPES", {}))
    return types


def json_schema(name: str) -> dict[str, Any]:
    """The JSON Schema (2020-12) of wire type ``name``; KeyError if unknown."""
    return msgspec.json.schema(all_types()[name])
