"""Check 1 of Class 1 verification (spec 004 §6): structure, types, and the §3.1 header claims."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from consumers import capsule as capm
from consumers.cose import Sign1


class _DuplicateKeyError(ValueError):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKeyError(k)
        out[k] = v
    return out


def parse_payload(data: bytes) -> dict[str, Any] | None:
    """The capsule JSON, or None if not a JSON object without duplicate keys."""
    try:
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=_pairs)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


Add = Callable[..., None]  # add(check, code, message, severity="error", path=None)
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _is_str(v: Any) -> bool:
    return isinstance(v, str) and bool(v)


def structural(p: dict[str, Any], msg: Sign1, add: Add) -> None:
    """Check 1 of spec 004 §6 (and the §3.1 header claims), reported through ``add``."""
    def need(path: str, ok: bool, why: str, code: str = "field_invalid") -> None:
        if not ok:
            add(1, code, why, path=path)

    need("$.spec_version", p.get("spec_version") == capm.SPEC_VERSION,
         f"spec_version must be {capm.SPEC_VERSION!r}", "spec_version_unsupported")
    need("$.format_version", p.get("format_version") == capm.FORMAT_VERSION,
         f"format_version must be {capm.FORMAT_VERSION!r}", "format_version_unsupported")
    need("$.capsule_id", isinstance(p.get("capsule_id"), str) and bool(_HEX64.match(p["capsule_id"])),
         "capsule_id REQUIRED, 64 lowercase hex")
    for f in ("action_id", "operator", "developer"):
        need(f"$.{f}", _is_str(p.get(f)), f"{f} REQUIRED string")
    need("$.action_type", p.get("action_type") in capm.ACTION_TYPES, "action_type must be 'fyi' or 'decide'")
    ts = p.get("timestamp")
    try:
        capm._check_timestamp(ts)
    except (capm.CapsuleError, TypeError, AttributeError):
        add(1, "field_invalid", "timestamp REQUIRED, RFC 3339 UTC with 'Z'", path="$.timestamp")
    d = p.get("disposition")
    if not isinstance(d, dict):
        add(1, "field_missing", "disposition REQUIRED object", path="$.disposition")
    else:
        need("$.disposition.decision", _is_str(d.get("decision")), "decision REQUIRED string")
        need("$.disposition.approver", d.get("approver") in capm.APPROVERS,
             "approver is a closed enum: 'human' or 'policy'", "approver_not_conforming")
        need("$.disposition.human_disposed", isinstance(d.get("human_disposed"), bool),
             "human_disposed REQUIRED boolean")
        if d.get("human_disposed") is True and d.get("approver") != "human":
            # §6: asserted defensively against bytes not made by a conforming constructor.
            add(1, "disposition_dishonest", "human_disposed true requires approver 'human'",
                    path="$.disposition")
        for f in ("verdict_class", "authority"):
            if f in d:
                need(f"$.disposition.{f}", _is_str(d[f]), f"{f} must be a string")
        if "reason_digest" in d:
            need("$.disposition.reason_digest", isinstance(d["reason_digest"], str)
                 and bool(_HEX64.match(d["reason_digest"])), "reason_digest must be a JSON-DIGEST")
        if "expiry_policy" in d:
            ep = d["expiry_policy"]
            ok = (isinstance(ep, dict) and isinstance(ep.get("ttl_seconds"), int)
                  and not isinstance(ep.get("ttl_seconds"), bool) and ep.get("on_expiry") in ("expired", "escalated"))
            need("$.disposition.expiry_policy", ok, "expiry_policy is {ttl_seconds: integer, on_expiry}")
    a = p.get("assurance")
    if not isinstance(a, dict):
        add(1, "field_missing", "assurance REQUIRED object", path="$.assurance")
    else:
        need("$.assurance.attestation_mode", a.get("attestation_mode") in capm.ATTESTATION_MODES, "attestation_mode")
        need("$.assurance.effect_mode", a.get("effect_mode") in capm.EFFECT_MODES, "effect_mode")
        need("$.assurance.ledger_mode", a.get("ledger_mode") in capm.LEDGER_MODES, "ledger_mode")
    e = p.get("effect")
    if e is not None:
        if not isinstance(e, dict):
            add(1, "field_invalid", "effect must be an object", path="$.effect")
        else:
            need("$.effect.type", _is_str(e.get("type")), "effect.type REQUIRED string")
            need("$.effect.status", e.get("status") in capm.EFFECT_STATUSES,
                 f"effect.status must be one of {capm.EFFECT_STATUSES}")
            if "request_digest" in e:
                need("$.effect.request_digest", isinstance(e["request_digest"], str)
                     and bool(_HEX64.match(e["request_digest"])), "request_digest must be a JSON-DIGEST")
    ch = p.get("chain")
    if ch is not None:
        ok = isinstance(ch, dict) and isinstance(ch.get("parent_capsule_id"), str) \
            and bool(_HEX64.match(ch["parent_capsule_id"])) and _is_str(ch.get("relation"))
        need("$.chain", ok, "chain is {parent_capsule_id, relation}")
    led = p.get("ledger")
    if led is not None:
        ok = isinstance(led, dict) and isinstance(led.get("position"), int) \
            and not isinstance(led.get("position"), bool) and led["position"] >= 1 \
            and isinstance(led.get("prev_hash"), str) and bool(_HEX64.match(led["prev_hash"]))
        need("$.ledger", ok, "ledger is {position >= 1, prev_hash, prev_capsule_id?}")
    for path in capm.find_floats(p):
        add(1, "float_value", "floating-point value in a digest-bearing field (use decimal strings)", path=path)
    # §3.1 protected header claims.
    claims = msg.cwt_claims
    if not claims:
        add(1, "cwt_claims_missing", "protected header must carry CWT claims (label 15)")
    else:
        need("cwt.iss", claims.get(1) == p.get("developer"), "CWT iss must be the capsule's developer", "cwt_iss")
        if _is_str(p.get("operator")) and _is_str(p.get("action_id")):
            need("cwt.sub", claims.get(2) == capm.subject_urn(p["operator"], p["action_id"]),
                 "CWT sub must be urn:agent-action-capsule:{operator}:{action_id}", "cwt_sub")
        need("cwt.capsule_statement_type", claims.get("capsule_statement_type") in ("agent_action", "outcome"),
             "capsule_statement_type REQUIRED", "cwt_statement_type")
        known = {"capsule_statement_type", "capsule_action_type", "capsule_decision_id"}
        for k in claims:
            if isinstance(k, str) and k.startswith("capsule_") and k not in known:
                add(1, "unknown_header_claim", f"unrecognized header claim {k!r}", "info")
