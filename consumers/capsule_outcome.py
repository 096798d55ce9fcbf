"""Outcome statements (spec 004 §3.3), format "2".

An asynchronously observed consequence of an action (a reversal, dispute,
correction or confirmation) is its own Signed Statement:
``capsule_statement_type: "outcome"``, content type
``application/agent-action-capsule-outcome+json``, and ``sub`` equal to the
original action's ``sub``. It is correlated by subject and decision id and
never mutates the original capsule.

Where the gateway emits them: the kernel's commitment verification of a
transition report (spec 003 §5.5) is an independently sourced check of what
the agent reported it did (spec 004 §13: independently sourced outcome
statements are how a claimed effect is later confirmed or contradicted). So
every kernel transition verdict yields, beside the action's capsule, one
outcome statement: ``confirmation`` when the executed action matches the
declared one, ``dispute`` on an ``IDP_COMMITMENT_GAP``. It names the
action's capsule (``refers_to``) as an extra to the spec's correlation.

Spec 004 leaves the outcome payload open; this profile's payload is::

    {spec_version, format_version: "2", statement_type: "outcome", capsule_id,
     action_id, operator, developer, timestamp, decision_id,
     outcome: {kind, source, reason_digest?}, refers_to?, ledger?, pgw?}

``capsule_id`` is the statement's content address, derived exactly as a
capsule's (§5.1: JSON-DIGEST of the payload minus capsule_id and ``chain``),
so the signer's ledger, the registration queue and the store treat every
statement alike; the ledger linkage is hashed in as for capsules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import msgspec
from msgspec import Struct

from consumers import capsule as capm
from consumers import capsule_kernel as kernel_facts
from subjects import jcs
from subjects.util import stable_id
from subjects.wire import Verdict

OUTCOME_KINDS = frozenset({"confirmation", "reversal", "dispute", "correction"})  # §3.3
STATEMENT_TYPE = "outcome"
SOURCE_COMMITMENT = "io.pgw.kernel_commitment_check"  # §9.1 namespaced
_DETAIL = "outcome"  # Verdict.details key that marks an outcome verdict


class OutcomeBody(Struct, frozen=True, forbid_unknown_fields=True):
    kind: str
    source: str
    reason_digest: str | None = None


class OutcomeStatement(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    spec_version: str = capm.SPEC_VERSION
    format_version: str = capm.FORMAT_VERSION
    statement_type: str = STATEMENT_TYPE
    capsule_id: str = ""
    action_id: str
    operator: str
    developer: str
    timestamp: str
    decision_id: str
    outcome: OutcomeBody
    refers_to: str | None = None
    ledger: capm.Ledger | None = None
    pgw: dict[str, Any] | None = None

    @property
    def chain(self) -> None:  # the signer's ledger reads a statement's supersedes block; outcomes have none
        return None


class OutcomeBuilt(NamedTuple):
    capsule: OutcomeStatement
    body: dict[str, Any]
    flags: int


def is_outcome(payload: Mapping[str, Any]) -> bool:
    return payload.get("statement_type") == STATEMENT_TYPE


def is_outcome_verdict(v: Verdict) -> bool:
    return isinstance(v.details.get(_DETAIL), dict)


def companion(v: Verdict) -> Verdict | None:
    """The outcome verdict that accompanies ``v`` (a kernel transition), or None.

    Deterministic in ``v`` (its id is derived from v's), so a redelivery yields
    the same outcome statement, once. ``supersedes`` names the action's verdict:
    the signer resolves it to the action's capsule_id (``refers_to``).
    """
    facts = kernel_facts.transition_facts(v)
    if facts is None or is_outcome_verdict(v):
        return None
    kind = "dispute" if facts.gap else "confirmation"
    details = dict(v.details)
    details[_DETAIL] = {"kind": kind, "source": SOURCE_COMMITMENT}
    return msgspec.structs.replace(v, verdict_id=stable_id("outcome", v.verdict_id), supersedes=v.verdict_id,
                                   details=details)


def build_outcome(v: Verdict, *, operator: str, salt: str, default_developer: str = "principal-gateway",
                  parent_capsule_id: str | None = None, fallback_ts: Any = None, **_: Any) -> OutcomeBuilt:
    """The outcome statement of an outcome verdict (see :func:`companion`), not yet linked."""
    spec = v.details[_DETAIL]
    facts = kernel_facts.transition_facts(v)
    reason = kernel_facts.gap_reason(facts) if facts is not None and facts.gap else None
    try:
        timestamp = capm.utc_z(v.ts)
    except (ValueError, TypeError):
        fallback = fallback_ts() if callable(fallback_ts) else fallback_ts
        if fallback is None:
            raise capm.CapsuleError("§5.1 timestamp", f"verdict ts {v.ts!r} is not RFC 3339") from None
        timestamp = capm.utc_z(fallback)
    action_id = v.action_id or f"verdict:{v.verdict_id}"
    pgw: dict[str, Any] = {"verdict_id": v.verdict_id, "of_verdict_id": v.supersedes, "idp_id": v.idp_id,
                           "agent": v.agent}
    if facts is not None:
        pgw.update(kernel_facts.pgw_members(facts))
    st = OutcomeStatement(
        action_id=action_id, operator=operator, developer=v.agent or default_developer, timestamp=timestamp,
        decision_id=action_id,
        outcome=OutcomeBody(spec["kind"], spec["source"], capm.salted_digest(salt, reason) if reason else None),
        refers_to=parent_capsule_id, pgw=pgw,
    )
    body, flags = jcs.walk(msgspec.to_builtins(st), drop_absent=True)
    cid = capm.digest_of_walked(capm.identity_form(body), flags)
    body["capsule_id"] = cid
    return OutcomeBuilt(msgspec.structs.replace(st, capsule_id=cid), body, flags)


def link_outcome(built: OutcomeBuilt, ledger: capm.Ledger, parent_capsule_id: str | None = None, *,
                 embed_ledger: bool = True) -> tuple[OutcomeStatement, bytes]:
    """The ledger linkage added and the id derived (hashed in, as for format-2 capsules).

    ``embed_ledger=False`` (a format "4" signer, whose hash chain stays
    store-level): the statement carries no linkage of its own.
    """
    st = built.capsule
    if parent_capsule_id is not None:
        st = msgspec.structs.replace(st, refers_to=parent_capsule_id)
    st = msgspec.structs.replace(st, ledger=ledger if embed_ledger else None, capsule_id="")
    body, flags = jcs.walk(msgspec.to_builtins(st), drop_absent=True)
    cid = capm.digest_of_walked(capm.identity_form(body), flags)
    body["capsule_id"] = cid
    return msgspec.structs.replace(st, capsule_id=cid), capm._payload_bytes(body, flags | built.flags)


def claims(payload: Mapping[str, Any]) -> dict[Any, Any]:
    """§3.1 CWT claims of an outcome: ``sub`` equals the original action's (§3.3)."""
    return {
        1: payload["developer"],
        2: capm.subject_urn(payload["operator"], payload["action_id"]),
        "capsule_statement_type": STATEMENT_TYPE,
        "capsule_decision_id": payload.get("decision_id") or payload["action_id"],
    }


# ---------------------------------------------------------------------------
# Verification (pgw verify)
# ---------------------------------------------------------------------------

Add = Callable[..., None]


def verify_outcome(p: Mapping[str, Any], claims_: Mapping[Any, Any], content_type: Any, store: Any,
                   add: Add) -> None:
    """The checks of one outcome statement, reported through ``add(check, code, message, severity, path)``.

    The same numbering as a capsule's (spec 004 §6) where a check applies:
    1 structural (and the §3.1/§3.3 header), 2 identity, 6 correlation (store).
    """
    hex64 = capm._HEX64
    if content_type != capm.OUTCOME_MEDIA_TYPE:
        add(0, "content_type", f"an outcome statement's content_type must be {capm.OUTCOME_MEDIA_TYPE}")
    for f, ok in (("spec_version", p.get("spec_version") == capm.SPEC_VERSION),
                  ("format_version", p.get("format_version") == capm.FORMAT_VERSION),
                  ("capsule_id", isinstance(p.get("capsule_id"), str) and bool(hex64.match(p["capsule_id"]))),
                  *((f, isinstance(p.get(f), str) and bool(p.get(f)))
                    for f in ("action_id", "operator", "developer", "decision_id"))):
        if not ok:
            add(1, "field_invalid", f"{f} missing or malformed", path=f"$.{f}")
    try:
        capm._check_timestamp(p.get("timestamp"))  # type: ignore[arg-type]
    except (capm.CapsuleError, TypeError, AttributeError):
        add(1, "field_invalid", "timestamp REQUIRED, RFC 3339 UTC with 'Z'", path="$.timestamp")
    out = p.get("outcome")
    if not (isinstance(out, dict) and isinstance(out.get("kind"), str) and isinstance(out.get("source"), str)):
        add(1, "field_invalid", "outcome is {kind, source, reason_digest?}", path="$.outcome")
    elif out["kind"] not in OUTCOME_KINDS:
        add(8, "unregistered_value", f"outcome.kind {out['kind']!r} is not one of §3.3's", "info")
    for path in capm.find_floats(p):
        add(1, "float_value", "floating-point value in a digest-bearing field", path=path)
    if claims_.get("capsule_statement_type") != STATEMENT_TYPE:
        add(1, "cwt_statement_type", "an outcome carries capsule_statement_type 'outcome' (§3.3)")
    if claims_.get(1) != p.get("developer"):
        add(1, "cwt_iss", "CWT iss must be the statement's developer")
    if isinstance(p.get("operator"), str) and isinstance(p.get("action_id"), str) \
            and claims_.get(2) != capm.subject_urn(p["operator"], p["action_id"]):
        add(1, "cwt_sub", "an outcome's sub must equal the original action's sub (§3.3)")
    try:
        if capm.compute_capsule_id(p) != p.get("capsule_id"):
            add(2, "capsule_id_mismatch", "the outcome's id does not match its canonical form")
    except capm.CapsuleError as e:
        add(2, "capsule_id_uncomputable", e.why)
    ref = p.get("refers_to")
    if ref is not None and store is not None:
        action = store.by_id.get(ref)
        if action is None:
            add(6, "outcome_action_missing", f"the action capsule {ref} this outcome refers to is not in the store")
        elif (action.get("operator"), action.get("action_id")) != (p.get("operator"), p.get("action_id")):
            add(6, "outcome_subject_mismatch", "refers_to names a capsule of another action (§3.3: same sub)")
    elif ref is not None:
        add(6, "chain_not_checked", "no store given: the referred action capsule was not checked", "info")
