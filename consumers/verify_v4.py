"""Verification of format "4" statements (draft-mih-scitt-agent-action-capsule-05, see :mod:`consumers.capsule_v4`).

:func:`verify_v4` is what :func:`consumers.verifier.verify_statement` runs for a
statement whose protected content type is ``application/agent-action-capsule-id``.
The draft's verification is compositional ({#registration}, {#verification}):

0. substrate: the registration statement (COSE_Sign1 with the algorithm pinned
   per key, its payload the raw 32-byte capsule_id, CWT ``iss``/``sub``), its
   receipts, and every Producer Envelope carried with it, each checked
   exactly as {#verification} lists (tag, protected map {1, 3, 4},
   empty unprotected map, payload = raw capsule_id, 64-byte Ed25519 signature
   under the key in ``kid``), the authenticated key then held to the trusted
   keys (the caller's authorization policy, {#issuer-binding});
1. structural, 2. identity (plain JCS, only capsule_id removed), 3-8 as
   {#verification} numbers them, 9. provenance mode.

Findings reuse :class:`consumers.verifier.Finding`; the result says
``profile: "4"``. Never raises.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import cbor2
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from consumers import capsule as capm
from consumers import capsule_v4 as v4
from consumers.cose import (
    COSE_SIGN1_TAG,
    CoseError,
    Sign1,
    TrustedKey,
    raw_public,
    sig_structure,
)
from consumers.verifier_structural import parse_payload

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# {#iana} seeded values of -05 (the registries grew since format "2").
VERDICT_CLASSES = capm.VERDICT_CLASSES | {"epoch_boundary"}
EFFECT_TYPES = capm.EFFECT_TYPES | {"inference_completion"}
EFFECT_ATTESTATIONS = capm.EFFECT_ATTESTATIONS | {"host_served_observed"}
CHAIN_RELATIONS = frozenset({"follows", "confirms", "supersedes", "epoch_opens", "duplicates"})
APPROVERS = ("human", "policy", "counterparty")  # {#disposition}: closed, three members
_EFFECT_RANK = {"not_applicable": 0, "dispatched_unconfirmed": 0, "confirmed": 1}
_LEDGER_RANK = {m: i for i, m in enumerate(capm.LEDGER_MODES)}
_STRING_MEMBERS = (
    ("disposition", "decision"), ("disposition", "verdict_class"), ("effect", "status"), ("effect", "type"),
    ("effect", "irreversibility_class"), ("effect", "effect_attestation"), ("effect", "external_ref"),
    ("chain", "relation"), ("assurance", "effect_mode"), ("assurance", "attestation_mode"),
    ("assurance", "ledger_mode"),
)


def capsule_of(msg: Sign1) -> dict[str, Any] | None:
    """The capsule JSON a format "4" bus statement carries, or None."""
    raw = msg.unprotected.get(v4.CAPSULE_LABEL)
    return parse_payload(raw) if isinstance(raw, bytes) else None


def envelopes_of(msg: Sign1) -> list[Any]:
    e = msg.unprotected.get(v4.ENVELOPE_LABEL)
    if e is None:
        return []
    return e if isinstance(e, list) else [e]


def check_envelope(data: Any, capsule_id: str) -> bytes:
    """{#verification} Producer Envelope steps 1-3; returns the authenticated raw public key (step 4)."""
    if not isinstance(data, bytes):
        raise CoseError("envelope_malformed", "a Producer Envelope is a byte string")
    try:
        outer = cbor2.loads(data)
    except Exception:  # noqa: BLE001 - cbor2 raises many types on garbage
        raise CoseError("envelope_malformed", "not CBOR") from None
    if not (isinstance(outer, cbor2.CBORTag) and outer.tag == COSE_SIGN1_TAG
            and isinstance(outer.value, list) and len(outer.value) == 4):
        raise CoseError("envelope_malformed", "must be a tag-18 COSE_Sign1 of four items")
    prot_b, unprot, payload, sig = outer.value
    if not isinstance(prot_b, bytes) or not isinstance(unprot, dict) or not isinstance(payload, bytes) \
            or not isinstance(sig, bytes):
        raise CoseError("envelope_malformed", "protected bstr, unprotected map, attached payload, signature bstr")
    try:
        prot = cbor2.loads(prot_b)
    except Exception:  # noqa: BLE001
        raise CoseError("envelope_malformed", "protected header is not CBOR") from None
    if not isinstance(prot, dict) or any(type(k) is not int for k in prot):
        raise CoseError("envelope_malformed", "protected header must be a map with integer labels")
    if unprot:
        raise CoseError("envelope_unprotected_not_empty", "the unprotected map MUST be empty ({#envelope})")
    if type(prot.get(1)) is not int or prot.get(1) != -8:
        raise CoseError("envelope_alg_unsupported", f"alg {prot.get(1)!r}: only EdDSA (-8) is defined ({{#envelope}})")
    if prot.get(3) != v4.ID_MEDIA_TYPE:
        raise CoseError("envelope_content_type", f"content type must be {v4.ID_MEDIA_TYPE}")
    kid = prot.get(4)
    if not isinstance(kid, bytes) or len(kid) != 32:
        raise CoseError("envelope_kid_invalid", "kid must be the raw 32-byte Ed25519 public key")
    if set(prot) != {1, 3, 4}:
        raise CoseError("envelope_protected_headers", "protected map must hold exactly alg, content type, kid")
    if payload != bytes.fromhex(capsule_id):
        raise CoseError("envelope_payload_mismatch", "payload must be the raw 32-byte capsule_id")
    if len(sig) != 64:
        raise CoseError("envelope_signature_invalid", "an Ed25519 signature is 64 bytes")
    try:
        Ed25519PublicKey.from_public_bytes(kid).verify(sig, sig_structure(prot_b, payload))
    except (InvalidSignature, ValueError):
        raise CoseError("envelope_signature_invalid", "signature does not verify under the kid's key") from None
    return kid


def verify_v4(msg: Sign1, payload: dict[str, Any] | None, keys: Mapping[str, TrustedKey],
              anchored: bool, store: Any, run: Any, res: Any, check_signature: Callable[[], None]) -> None:
    """Checks 0 (statement, envelopes) to 9 for one decoded format-4 statement; findings go to ``run``.

    ``check_signature``: the verifier's one signature check of a statement (trusted kid, or keys given
    on the command line whatever the kid), shared with format "2".
    """
    res.profile = v4.FORMAT
    # -- 0: registration statement --------------------------------------------------------------
    check_signature()
    if not isinstance(msg.payload, bytes) or len(msg.payload) != 32:
        run.add(0, "statement_payload_invalid", "the registration statement's payload is the raw 32-byte capsule_id")
    claims = msg.cwt_claims
    if not (isinstance(claims.get(1), str) and isinstance(claims.get(2), str)):
        run.add(0, "cwt_claims_missing", "RFC 9943 requires protected CWT iss and sub ({#registration})")
    if payload is None:
        run.add(1, "capsule_missing", "the statement carries no capsule JSON object (or it has duplicate keys)")
        return
    cid = payload.get("capsule_id")
    res.capsule_id = cid if isinstance(cid, str) else None
    raw_id = msg.payload if isinstance(msg.payload, bytes) else b""
    if isinstance(cid, str) and raw_id and raw_id.hex() != cid:
        run.add(0, "statement_capsule_id_mismatch", "the signed capsule_id is not the carried capsule's")
    # -- 0: Producer Envelopes -------------------------------------------------------------------
    trusted_raw = {raw_public(k.public): k for k in keys.values()}
    envelopes = envelopes_of(msg)
    if not envelopes:
        run.add(0, "envelope_missing", "no Producer Envelope carried (the capsule is signed by the statement only)",
                "info")
    for env in envelopes:
        try:
            pub = check_envelope(env, raw_id.hex() if len(raw_id) == 32 else str(cid))
        except CoseError as e:
            run.add(0, e.code, e.why)
            continue
        if pub not in trusted_raw:
            run.add(0, "envelope_key_untrusted", f"envelope key {pub.hex()} is not a trusted key ({{#issuer-binding}})")
    # -- 0: statement claims ({#registration}, spec 004 §3.1 as before) ------------------------------
    if isinstance(claims.get(1), str) and claims.get(1) != payload.get("developer"):
        run.add(1, "cwt_iss", "CWT iss must be the capsule's developer")
    if isinstance(payload.get("operator"), str) and isinstance(payload.get("action_id"), str) \
            and claims.get(2) != capm.subject_urn(payload["operator"], payload["action_id"]):
        run.add(1, "cwt_sub", "CWT sub must be urn:agent-action-capsule:{operator}:{action_id}")
    check_capsule(payload, run, res, store=store, anchored=anchored)


def _str(v: Any) -> bool:
    return isinstance(v, str) and bool(v)


def check_capsule(p: Mapping[str, Any], run: Any, res: Any, *, store: Any = None, anchored: bool = False) -> None:
    """Class 1 checks 1-9 of {#verification} over a format-4 capsule JSON object."""
    disp = p.get("disposition") if isinstance(p.get("disposition"), dict) else None
    effect = p.get("effect") if isinstance(p.get("effect"), dict) else None
    chain = p.get("chain") if isinstance(p.get("chain"), dict) else None
    vc = disp.get("verdict_class") if disp else None
    res.verdict_class = vc if isinstance(vc, str) else None
    res.profile = v4.FORMAT
    # -- 1: structural ---------------------------------------------------------------------------
    for f in ("spec_version", "format_version", "capsule_id", "action_id", "action_type", "operator", "developer",
              "timestamp"):
        if f not in p:
            run.add(1, "field_missing", f"{f} is REQUIRED ({{#identity}})", path=f"$.{f}")
        elif not isinstance(p[f], str):
            run.add(1, "field_invalid", f"{f} must be a string", path=f"$.{f}")
    cid = p.get("capsule_id")
    if isinstance(cid, str) and not _HEX64.match(cid):
        run.add(1, "field_invalid", "capsule_id is 64 lowercase hex", path="$.capsule_id")
    fv = p.get("format_version")
    if isinstance(fv, str) and fv != v4.FORMAT:
        run.add(1, "format_version_unsupported", f"format_version {fv!r}: this profile is \"4\"")
    if "canonicalization_id" not in p:
        run.add(1, "canonicalization_id_missing", "format 4 REQUIRES canonicalization_id 'jcs' ({#identity})")
    elif p["canonicalization_id"] != v4.CANONICALIZATION_ID:
        run.add(1, "canonicalization_id_invalid", "format 4 REQUIRES exactly canonicalization_id 'jcs'")
    sv = p.get("spec_version")
    if isinstance(sv, str) and sv not in v4.ACCEPTED_SPEC_VERSIONS:
        # {#identity}: spec_version never selects an algorithm; an unknown value is informational.
        run.add(1, "spec_version_unknown", f"spec_version {sv!r} is not one this verifier knows", "info")
    if p.get("action_type") is not None and p.get("action_type") not in capm.ACTION_TYPES:
        run.add(1, "field_invalid", "action_type must be 'fyi' or 'decide'", path="$.action_type")
    if isinstance(p.get("timestamp"), str):
        try:
            capm._check_timestamp(p["timestamp"])
        except capm.CapsuleError:
            run.add(1, "field_invalid", "timestamp is RFC 3339 UTC with 'Z'", path="$.timestamp")
    for blk in ("effect", "assurance", "disposition", "chain", "cross_party", "provenance_mode",
                "self_reported_reasoning"):
        if blk in p and not isinstance(p[blk], dict):
            run.add(1, "field_invalid", f"{blk} must be an object", path=f"$.{blk}")
    for f in ("domain", "provenance", "epoch_id"):  # -02 addendum members and {#identity} epoch_id: strings
        if f in p and not isinstance(p[f], str):
            run.add(1, "field_invalid", f"{f} must be a string when present", path=f"$.{f}")
    if "constraints" in p and not isinstance(p["constraints"], list):
        run.add(1, "field_invalid", "constraints must be an array", path="$.constraints")
    # {#identity} lists the REQUIRED members; disposition is not among them (an "fyi" record may have
    # none) and the reference verifier does not require it either: checked only when present.
    if disp is not None:
        if "decision" not in disp:
            run.add(1, "field_missing", "disposition.decision is REQUIRED", path="$.disposition.decision")
        if disp.get("approver") not in APPROVERS:
            run.add(1, "approver_not_conforming", "approver is a closed enum: human, policy or counterparty",
                    path="$.disposition.approver")
        if not isinstance(disp.get("human_disposed"), bool):
            run.add(1, "field_invalid", "human_disposed REQUIRED boolean", path="$.disposition.human_disposed")
        elif disp["human_disposed"] and disp.get("approver") != "human":
            # {#verification}: asserted defensively over bytes no conforming constructor made.
            run.add(1, "disposition_dishonest", "human_disposed true requires approver 'human'",
                    path="$.disposition")
    for blk, member in _STRING_MEMBERS:
        b = p.get(blk)
        if isinstance(b, dict) and member in b and not isinstance(b[member], str):
            run.add(1, "field_invalid", f"{blk}.{member} must be a string", path=f"$.{blk}.{member}")
    for path in v4._unsafe(p):
        run.add(1, "float_value", "floating-point or unsafe integer in a digest-bearing field", path=path)
    refs = _references(p.get("references"), chain, run)
    # -- 2: identity -----------------------------------------------------------------------------
    if isinstance(cid, str) and _HEX64.match(cid) and fv == v4.FORMAT \
            and p.get("canonicalization_id") == v4.CANONICALIZATION_ID:
        try:
            got = v4.compute_capsule_id(p)
            if got != cid:
                run.add(2, "capsule_id_mismatch", f"capsule_id does not match plain JCS (recomputed {got})")
        except capm.CapsuleError as e:
            if not v4._unsafe(p):
                run.add(2, "capsule_id_uncomputable", e.why)
    # -- 3: confirmed-effect binding ---------------------------------------------------------------
    if effect is not None and effect.get("status") == "confirmed" and not (
            isinstance(effect.get("response_digest"), str) and _HEX64.match(effect["response_digest"])):
        run.add(3, "confirmed_without_response_digest", "confirmed without a well-formed response_digest",
                path="$.effect")
    derived = capm.effect_mode_of(effect)
    # -- 4: orthogonality --------------------------------------------------------------------------
    if isinstance(vc, str) and vc in capm.NEVER_DISPATCH and derived != "not_applicable":
        run.add(4, "never_dispatch_with_effect", f"verdict_class {vc} never dispatches but the effect derives {derived}")
    # -- 5: attestation matrix ---------------------------------------------------------------------
    att = effect.get("effect_attestation") if effect else None
    if derived != "not_applicable" and att is None:
        run.add(5, "attestation_required", f"effect_attestation REQUIRED for effect_mode {derived}", path="$.effect")
    if derived == "not_applicable" and att is not None:
        run.add(5, "attestation_must_be_absent", "effect_attestation MUST be absent (not_applicable)", path="$.effect")
    # -- 6: chain (store-level) ----------------------------------------------------------------------
    if chain is not None:
        parent = chain.get("parent_capsule_id")
        if not (isinstance(parent, str) and _HEX64.match(parent)):
            run.add(6, "chain_parent_malformed", "chain.parent_capsule_id must be a capsule_id", path="$.chain")
        if "relation" not in chain:
            run.add(6, "field_missing", "chain.relation is REQUIRED with a chain block", path="$.chain")
        if store is None:
            run.add(6, "chain_not_checked", "no store given: chain parent not checked", "info")
        elif parent not in store.by_id:
            run.add(6, "chain_parent_missing", f"chain parent {parent} is not in the store")
        elif chain.get("relation") == "supersedes":
            first = store.authoritative_child(parent)
            if first is not None and first != cid:
                run.add(6, "concurrent_supersedes", f"a later supersedes of {parent}; {first} is authoritative",
                        "warning")
    for f in refs:
        run.add(*f)
    # -- 7: assurance ------------------------------------------------------------------------------
    ledger_mode = "chained" if chain is not None else "standalone"  # {#assurance}: from the chain block alone
    a = p.get("assurance") if isinstance(p.get("assurance"), dict) else {}
    em = a.get("effect_mode")
    if em in _EFFECT_RANK and _EFFECT_RANK[em] > _EFFECT_RANK[derived]:
        run.add(7, "effect_mode_overclaim", f"effect_mode {em} but the effect derives {derived}")
    if a.get("attestation_mode") == "anchored" and not anchored:
        run.add(7, "attestation_overclaim", "attestation_mode anchored without a verified receipt", "info")
    lm = a.get("ledger_mode")
    if lm in _LEDGER_RANK and _LEDGER_RANK[lm] > _LEDGER_RANK[ledger_mode]:
        run.add(7, "ledger_overclaim", f"ledger_mode {lm} but the capsule derives {ledger_mode}", "info")
    res.assurance = {"attestation_mode": "anchored" if anchored else "self_attested", "effect_mode": derived,
                     "ledger_mode": ledger_mode}
    cp = p.get("cross_party")
    if isinstance(cp, dict):  # {#crossparty}: the rung is derived from the block's own bytes
        rung = _cross_party_rung(cp)
        res.assurance["cross_party_rung"] = rung
        claimed = a.get("cross_party_rung")
        if claimed in _RUNGS and _RUNGS.index(claimed) > _RUNGS.index(rung):
            run.add(7, "cross_party_overclaim", f"cross_party_rung {claimed} but the block derives {rung}", "info")
    # -- 8: registry values --------------------------------------------------------------------------
    res.effect_grade = att if att in EFFECT_ATTESTATIONS else ("runtime_claimed" if att is not None else None)
    for name, value, registry in (
        ("verdict_class", vc, VERDICT_CLASSES),
        ("disposition.decision", disp.get("decision") if disp else None, capm.DECISIONS),
        ("effect.type", effect.get("type") if effect else None, EFFECT_TYPES),
        ("irreversibility_class", effect.get("irreversibility_class") if effect else None,
         frozenset(capm.IRREVERSIBILITY_CLASSES)),
        ("effect_attestation", att, EFFECT_ATTESTATIONS),
        ("chain.relation", chain.get("relation") if chain else None, CHAIN_RELATIONS),
    ):
        if isinstance(value, str) and value not in registry:
            run.add(8, "unregistered_value", f"{name} {value!r} is not registered", "info")
    # -- 9: provenance mode ({#provenancemode}) ------------------------------------------------------
    pm = p.get("provenance_mode")
    if isinstance(pm, dict):
        _provenance(pm, p.get("references"), run)


_RUNGS = ("unilateral_fallback", "acknowledged_receipt", "full_bilateral")
CITATION_PURPOSES = frozenset({"acted_on", "responds_to", "counterparty_half", "counterparty_inclusion",
                               "corroborates_source_time"})


def _cross_party_rung(cp: Mapping[str, Any]) -> str:
    ref, corr = cp.get("counterparty_ref"), cp.get("correlator")
    if not (isinstance(ref, str) and _HEX64.match(ref)) or not _str(corr):
        return "unilateral_fallback"
    return "full_bilateral" if cp.get("substantive") is True else "acknowledged_receipt"


def _references(refs: Any, chain: Mapping[str, Any] | None, run: Any) -> list[tuple[Any, ...]]:
    """{#xref}, {#retentiondecl}: structural (check 1) findings now, the rest returned for checks 6 and 8."""
    later: list[tuple[Any, ...]] = []
    if refs is None:
        return later
    if not isinstance(refs, list):
        run.add(1, "references_malformed", "references must be an array", path="$.references")
        return later
    parent = chain.get("parent_capsule_id") if chain else None
    for i, r in enumerate(refs):
        path = f"$.references[{i}]"
        if not isinstance(r, dict):
            run.add(1, "reference_malformed", "a reference is an object", path=path)
            continue
        for f in ("type", "digest_alg", "digest"):
            if not _str(r.get(f)):
                run.add(1, "reference_malformed", f"{f} must be a non-empty string", path=f"{path}.{f}")
        if r.get("type") == "agent-action-capsule" and r.get("digest_alg") == "SHA-256":
            d = r.get("digest")
            if _str(d) and not _HEX64.match(d):
                run.add(1, "reference_malformed", "an AAC SHA-256 reference names a capsule_id", path=path)
            if _str(parent) and d == parent:
                later.append((6, "reference_duplicates_chain_parent", "a reference names the chain parent",
                              "error", path))
        if "citation_purpose" in r:
            cp = r["citation_purpose"]
            if not _str(cp):
                run.add(1, "reference_malformed", "citation_purpose must be a non-empty string", path=path)
            elif cp not in CITATION_PURPOSES:
                later.append((8, "unregistered_value", f"citation_purpose {cp!r} is not registered", "info", path))
        if "retention" in r:
            ret = r["retention"]
            if not isinstance(ret, dict):
                run.add(1, "reference_malformed", "retention must be an object", path=path)
            else:
                if not isinstance(ret.get("declarant"), str):
                    run.add(1, "reference_malformed", "retention.declarant is a REQUIRED string", path=path)
                if not any(b in ret for b in ("retained_until", "not_retained_after")):
                    run.add(1, "reference_malformed", "retention needs retained_until or not_retained_after",
                            path=path)
        if "log_coordinates" in r:
            lc = r["log_coordinates"]
            if not isinstance(lc, dict) or any(lc.get(f) is None for f in ("log_id", "leaf_index", "inclusion_proof")):
                run.add(1, "reference_malformed", "log_coordinates is {log_id, leaf_index, inclusion_proof}",
                        path=path)
    return later


def _provenance(pm: Mapping[str, Any], refs: Any, run: Any) -> None:
    mode = pm.get("mode")
    if mode not in ("contemporaneous", "backfilled"):
        run.add(9, "provenance_mode_invalid", f"provenance_mode.mode {mode!r} is not contemporaneous|backfilled")
        return
    if mode == "contemporaneous":
        return
    for f in ("source_ref", "source_asserted_at", "import_batch", "imported_at"):
        if pm.get(f) in (None, ""):
            run.add(9, "provenance_mode_incomplete", f"provenance_mode.{f} REQUIRED when backfilled")
    if isinstance(pm.get("imported_at"), str) and pm.get("imported_at") == pm.get("source_asserted_at"):
        run.add(9, "provenance_time_laundering", "imported_at equals source_asserted_at on a backfilled record")
    witnessed = isinstance(refs, list) and any(
        isinstance(r, dict) and r.get("citation_purpose") == "corroborates_source_time"
        and all(_str(r.get(f)) for f in ("type", "digest_alg", "digest")) for r in refs)
    if pm.get("time_rung") == "witnessed" and not witnessed:
        run.add(9, "provenance_time_rung_overclaim", "time_rung witnessed without a corroborating reference")
