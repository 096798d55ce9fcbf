"""The Agent Action Capsule of spec 004 §5: model, JSON-DIGEST and construction rules.

A capsule is built only through :func:`build_capsule`, which enforces at
construction time every producer-side rule the spec states:

- the honest in-the-loop flag (§5.4, §13): :class:`Disposition` cannot hold
  ``human_disposed: true`` with a non-human approver (the typed constructors
  :meth:`Disposition.by_human` / :meth:`Disposition.by_policy` are the way in);
- the confirmed-effect binding (§5.2): ``confirmed`` needs a response digest,
  ``planned`` carries no digest, ``dispatched`` no response digest;
- the effect-attestation matrix with the planned carve (§5.2);
- verdict_class / effect_mode orthogonality (§5.4.2);
- assurance claimed only as achieved (§5.3): effect_mode must equal the mode
  derived from the effect, ``anchored`` is never claimed at signing time, and
  ``chained`` only with the ``chain`` block (§5.4.4) present, the linkage a
  verifier can check from the capsule's own bytes;
- no floating-point numbers anywhere (§5.1: amounts are decimal strings).

:func:`consumers.capsule_map.capsule_from_verdict` maps a
gateway verdict to a capsule (DESIGN §6 table); :func:`link_built` adds a
supersedes parent known only when the signer links its run and derives the
capsule_id (§5.1). The signer's hash chain over everything it signs stays in
its own stream (``PGW_SIGNER_LEDGER``), outside the capsule: a ``ledger``
block inside the capsule would make the content address depend on the
ledger position. Capsules signed before carry one; :func:`attach_ledger`
still builds that legacy form and the verifier still checks it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC
from typing import Any, Literal, NamedTuple

import msgspec
import rfc8785
from msgspec import Struct

from consumers.capsule_digest import (  # also re-exported: callers know them as capsule.*
    IDENTITY_EXCLUDED,  # noqa: F401
    CapsuleError,
    canonical_bytes,
    compute_capsule_id,  # noqa: F401
    digest_of_walked,
    find_floats,
    identity_form,
    json_digest,
    ledger_entry_hash,  # noqa: F401
    normalize,
)
from subjects import jcs
from subjects.util import parse_rfc3339

SPEC_VERSION = "draft-mih-scitt-agent-action-capsule-01"
FORMAT_VERSION = "2"
MEDIA_TYPE = "application/agent-action-capsule+json"
OUTCOME_MEDIA_TYPE = "application/agent-action-capsule-outcome+json"

# --- §12.1 registries (seeded values, verbatim). Unknown values are informational.
VERDICT_CLASSES = frozenset(
    {
        "executed", "blocked", "hitl_dispatched", "denied", "timeout", "errored",
        "engine_failure", "deferred", "needs_decision", "expired", "escalated", "resolved",
    }
)
DECISIONS = frozenset({"accept", "reject", "needs_input", "deferred"})
EFFECT_TYPES = frozenset({"write_order", "send_payment"})
IRREVERSIBILITY_CLASSES = ("two_way", "one_way_recoverable", "one_way_consequential", "one_way_terminal")
EFFECT_ATTESTATIONS = frozenset({"gate_executed", "runtime_claimed"})
CHAIN_RELATIONS = frozenset({"supersedes"})

# --- closed enums fixed by the spec text (not registry-governed).
EFFECT_STATUSES = ("planned", "dispatched", "confirmed", "failed", "reverted")  # §5.2
APPROVERS = ("human", "policy")  # §5.4
ATTESTATION_MODES = ("self_attested", "anchored")  # §5.3
EFFECT_MODES = ("not_applicable", "dispatched_unconfirmed", "confirmed")  # §5.3
LEDGER_MODES = ("standalone", "chained", "anchored")  # §5.3, ordered
ACTION_TYPES = ("fyi", "decide")  # §5.1

# §5.4.2: classes that by their kind never dispatch (resolved per the pairing rule).
NEVER_DISPATCH = frozenset(
    {"blocked", "hitl_dispatched", "denied", "engine_failure", "deferred",
     "needs_decision", "expired", "escalated", "resolved"}
)
# §5.4.4 open-items predicate.
OPEN_CLASSES = frozenset({"deferred", "needs_decision", "hitl_dispatched", "escalated", "blocked"})

GENESIS_HASH = "0" * 64
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def effect_mode_of(effect: Mapping[str, Any] | None) -> str:
    """Derive assurance.effect_mode from the effect record (§5.2 matrix, total over status)."""
    if not effect:
        return "not_applicable"
    status = effect.get("status")
    if status == "planned":
        return "not_applicable"
    if status == "confirmed":
        return "confirmed"
    return "dispatched_unconfirmed"  # dispatched, failed, reverted (and anything unknown)


# ---------------------------------------------------------------------------
# The typed capsule (§5)
# ---------------------------------------------------------------------------


class _Block(Struct, frozen=True, forbid_unknown_fields=True):
    # Defaults are emitted (spec_version, relation...); normalize() drops the None ones.
    pass


class ExpiryPolicy(_Block):
    """§5.4 expiry_policy: integer seconds, never a duration string."""

    ttl_seconds: int
    on_expiry: Literal["expired", "escalated"]

    def __post_init__(self) -> None:
        if isinstance(self.ttl_seconds, bool) or self.ttl_seconds < 0:
            raise CapsuleError("§5.4 expiry_policy", "ttl_seconds must be a non-negative integer")


class Disposition(_Block):
    """§5.4 disposition. ``human_disposed: true`` with a non-human approver is unrepresentable."""

    decision: str
    approver: Literal["human", "policy"]
    human_disposed: bool
    authority: str | None = None
    verdict_class: str | None = None
    reason_digest: str | None = None
    expiry_policy: ExpiryPolicy | None = None

    def __post_init__(self) -> None:
        # §5.4, §13: a producer cannot construct a capsule claiming a human disposed a policy act.
        if self.human_disposed and self.approver != "human":
            raise CapsuleError("§5.4 human_disposed", "human_disposed: true requires approver 'human'")
        if self.approver not in APPROVERS:
            raise CapsuleError("§5.4 approver", f"approver must be one of {APPROVERS}")
        if self.expiry_policy is not None and self.decision != "deferred" and self.verdict_class != "deferred":
            raise CapsuleError("§5.4 expiry_policy", "expiry_policy is for deferral dispositions only")
        if self.reason_digest is not None and not _HEX64.match(self.reason_digest):
            raise CapsuleError("§5.4 reason_digest", "reason_digest must be a JSON-DIGEST")

    @classmethod
    def by_human(cls, decision: str, *, verdict_class: str | None = None,
                 reason_digest: str | None = None, expiry_policy: ExpiryPolicy | None = None) -> Disposition:
        """A human acted: approver human, human_disposed true."""
        return cls(decision, "human", True, None, verdict_class, reason_digest, expiry_policy)

    @classmethod
    def by_policy(cls, decision: str, *, authority: str | None = None, verdict_class: str | None = None,
                  reason_digest: str | None = None, expiry_policy: ExpiryPolicy | None = None) -> Disposition:
        """A policy disposed it: approver policy, human_disposed false (no way to say otherwise)."""
        return cls(decision, "policy", False, authority, verdict_class, reason_digest, expiry_policy)


class EffectRecord(_Block):
    """§5.2 Effect Record."""

    type: str
    status: Literal["planned", "dispatched", "confirmed", "failed", "reverted"]
    request_digest: str | None = None
    response_digest: str | None = None
    external_ref: str | None = None
    irreversibility_class: str | None = None
    effect_attestation: str | None = None

    def __post_init__(self) -> None:
        if self.status not in EFFECT_STATUSES:
            raise CapsuleError("§5.2 status", f"effect.status must be one of {EFFECT_STATUSES}")
        for name in ("request_digest", "response_digest"):
            v = getattr(self, name)
            if v is not None and not _HEX64.match(v):
                raise CapsuleError("§5.2 binding", f"{name} must be a JSON-DIGEST (64 lowercase hex)")
        if self.status == "planned" and (self.request_digest or self.response_digest):
            raise CapsuleError("§5.2 binding", "planned: request_digest and response_digest MUST be absent")
        if self.status == "dispatched" and self.response_digest:
            raise CapsuleError("§5.2 binding", "dispatched: response_digest MUST be absent")
        if self.status == "confirmed" and not self.response_digest:
            raise CapsuleError("§5.2 confirmed-effect", "confirmed without a response_digest")
        # §5.2 matrix with the planned carve: absent for planned, REQUIRED once dispatched.
        if self.status == "planned" and self.effect_attestation is not None:
            raise CapsuleError("§5.2 planned carve", "effect_attestation MUST be absent for planned")
        if self.status != "planned" and not self.effect_attestation:
            raise CapsuleError("§5.2 attestation matrix", f"effect_attestation REQUIRED for status {self.status}")


class Assurance(_Block):
    """§5.3 assurance: every mode a rederivable claim."""

    attestation_mode: Literal["self_attested", "anchored"]
    effect_mode: Literal["not_applicable", "dispatched_unconfirmed", "confirmed"]
    ledger_mode: Literal["standalone", "chained", "anchored"]


class Chain(_Block):
    """§5.4.4 chain block: single parent."""

    parent_capsule_id: str
    relation: str = "supersedes"

    def __post_init__(self) -> None:
        if not _HEX64.match(self.parent_capsule_id):
            raise CapsuleError("§5.4.4 chain", "parent_capsule_id must be a capsule_id")


class Ledger(_Block):
    """The signer's hash-chain linkage (§5.3 ``chained``); inside capsule_id (see :func:`identity_form`)."""

    position: int
    prev_hash: str
    prev_capsule_id: str | None = None


class ConstraintRecord(_Block):
    """§8.1: the public verdict of one deterministic check; evidence by digest only."""

    id: str
    result: Literal["pass", "fail", "n/a"]
    blocking: bool
    check_type: str | None = None
    severity: str | None = None
    evidence_digest: str | None = None


class Capsule(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """§5 payload. Field order is irrelevant on the wire: it is serialized with JCS."""

    spec_version: str = SPEC_VERSION
    format_version: str = FORMAT_VERSION
    capsule_id: str = ""
    action_id: str
    action_type: Literal["fyi", "decide"]
    operator: str
    developer: str
    timestamp: str
    decision_id: str | None = None
    disposition: Disposition
    effect: EffectRecord | None = None
    assurance: Assurance
    constraints: list[ConstraintRecord] | None = None
    chain: Chain | None = None
    ledger: Ledger | None = None
    # Payload-only extension (§9): this host's correlation ids, namespaced.
    pgw: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return normalize(msgspec.to_builtins(self))

    def to_json(self) -> bytes:
        """The payload bytes that get signed: JCS of the normalized capsule."""
        return canonical_bytes(msgspec.to_builtins(self))  # canonical_bytes normalizes

    def checked_body(self, *, identify: bool = True) -> tuple[dict[str, Any], str, int]:
        """(normalized payload, the capsule_id it derives (§5.1), its jcs flags), from one walk.

        Floats are refused here (§5.1 decimal strings), with their paths.
        ``identify=False``: the id is left out ("") for a caller that derives
        its own (format 4's {#identity}, :mod:`consumers.capsule_v4`).
        """
        body, flags = jcs.walk(msgspec.to_builtins(self), drop_absent=True)
        if flags & jcs.FLOAT:
            raise CapsuleError("§5.1 decimal strings", f"floating-point values at {', '.join(find_floats(body))}")
        return body, digest_of_walked(identity_form(body), flags) if identify else "", flags

    def checked_form(self) -> tuple[dict[str, Any], str, bytes]:
        """(normalized payload, the capsule_id it derives (§5.1), its JCS bytes)."""
        body, capsule_id, flags = self.checked_body()
        return body, capsule_id, _payload_bytes(body, flags)


def _payload_bytes(body: dict[str, Any], flags: int) -> bytes:
    try:
        return jcs.encode(body, flags)
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as e:
        raise CapsuleError("§2 JSON-DIGEST", f"capsule has no JCS form: {e}") from e


_UTC_OFFSET = parse_rfc3339("2000-01-01T00:00:00Z").utcoffset()
# The form utc_z writes (and the gateway stamps every verdict with): ASCII digits only, milliseconds, "Z".
_UTC_Z_MS = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z")


def _check_timestamp(ts: str) -> None:
    try:
        dt = parse_rfc3339(ts)
    except ValueError as e:
        raise CapsuleError("§5.1 timestamp", str(e)) from e
    if not ts.endswith("Z") or dt.utcoffset() != _UTC_OFFSET:
        raise CapsuleError("§5.1 timestamp", "timestamp must be RFC 3339 UTC with a 'Z' suffix")


class Built(NamedTuple):
    """A constructed capsule with the normalized payload its capsule_id was derived from."""

    capsule: Capsule
    body: dict[str, Any]
    flags: int  # subjects.jcs.walk flags of the body


def build_capsule(**kw: Any) -> Capsule:
    """Construct a capsule, enforcing §5.2-§5.4.2 and computing capsule_id (§5.1)."""
    return build_capsule_checked(**kw).capsule


def build_capsule_checked(
    *,
    action_id: str,
    action_type: str,
    operator: str,
    developer: str,
    timestamp: str,
    disposition: Disposition,
    effect: EffectRecord | None = None,
    ledger: Ledger | None = None,
    chain: Chain | None = None,
    constraints: list[ConstraintRecord] | None = None,
    decision_id: str | None = None,
    attestation_mode: str = "self_attested",
    effect_mode: str | None = None,
    ledger_mode: str | None = None,
    pgw: dict[str, Any] | None = None,
    ledger_pending: bool = False,
    identify: bool = True,
) -> Built:
    """:func:`build_capsule`, also returning the normalized body (so signing needs no second walk).

    ``identify=False``: every rule is checked but no §5.1 capsule_id is derived
    (the capsule's and the body's stay ""), for a profile that derives its own.
    """
    if action_type not in ACTION_TYPES:
        raise CapsuleError("§5.1 action_type", f"must be one of {ACTION_TYPES}")
    for name, v in (("action_id", action_id), ("operator", operator), ("developer", developer)):
        if not isinstance(v, str) or not v:
            raise CapsuleError(f"§5.1 {name}", "REQUIRED non-empty string")
    _check_timestamp(timestamp)
    derived = effect_mode_of({"status": effect.status} if effect else None)  # the status is all it reads
    if effect_mode is None:
        effect_mode = derived
    # §5.3: never record a mode that was not achieved.
    if effect_mode != derived:
        raise CapsuleError("§5.3 assurance", f"effect_mode {effect_mode!r} but the effect derives {derived!r}")
    if attestation_mode != "self_attested":
        raise CapsuleError("§5.3 assurance", "anchored needs a verified receipt, which a capsule cannot carry at signing")
    # §5.3: "standalone" versus "chained" from the presence of the linkage a verifier can check:
    # the chain block (§5.4.4); ``ledger``/``ledger_pending`` only for the legacy in-capsule ledger.
    linked = chain is not None or ledger is not None or ledger_pending
    if ledger_mode is None:
        ledger_mode = "chained" if linked else "standalone"
    if ledger_mode == "chained" and not linked:
        raise CapsuleError("§5.3 assurance", "ledger_mode chained without a hash-chain linkage")
    if ledger_mode == "anchored":
        raise CapsuleError("§5.3 assurance", "ledger_mode anchored is never claimed at signing")
    # §5.4.2 orthogonality, enforced at construction.
    vc = disposition.verdict_class
    if vc in NEVER_DISPATCH and derived != "not_applicable":
        raise CapsuleError("§5.4.2 orthogonality", f"{vc} never dispatches but effect_mode is {derived}")
    if vc == "errored" and derived != "dispatched_unconfirmed":
        raise CapsuleError("§5.4.2 orthogonality", "errored pairs with effect_mode dispatched_unconfirmed")
    if vc == "resolved" and effect is not None and effect.effect_attestation is not None:
        raise CapsuleError("§5.4.2 pairing rule", "resolved carries no effect_attestation")
    cap = Capsule(
        action_id=action_id,
        action_type=action_type,  # type: ignore[arg-type]
        operator=operator,
        developer=developer,
        timestamp=timestamp,
        decision_id=decision_id,
        disposition=disposition,
        effect=effect,
        assurance=Assurance(attestation_mode, effect_mode, ledger_mode),  # type: ignore[arg-type]
        constraints=constraints or None,
        chain=chain,
        ledger=ledger,
        pgw=pgw or None,
    )
    body, capsule_id, flags = cap.checked_body(identify=identify)
    if not identify:
        return Built(cap, body, flags)
    body["capsule_id"] = capsule_id
    return Built(msgspec.structs.replace(cap, capsule_id=capsule_id), body, flags)


# ---------------------------------------------------------------------------
# Verdict -> capsule (DESIGN §6)
# ---------------------------------------------------------------------------


def utc_z(ts: str) -> str:
    """The verdict time as RFC 3339 UTC 'Z' (deterministic: from the verdict, not the clock)."""
    if type(ts) is str and _UTC_Z_MS.fullmatch(ts):
        parse_rfc3339(ts)  # a real date and time (ValueError as below); already in the form written here
        return ts
    dt = parse_rfc3339(ts).astimezone(UTC)
    return dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def salted_digest(salt: str, value: Any) -> str:
    """§13: commit a low-entropy value under the per-tenant salt, as a JSON-DIGEST."""
    return json_digest({"salt": salt, "value": value})


def attach_ledger(cap: Capsule, ledger: Ledger) -> Capsule:
    """Add the hash-chain linkage and derive the capsule_id it gives (§5.1: the ledger is hashed in)."""
    if cap.assurance.ledger_mode != "chained":
        raise CapsuleError("§5.3 assurance", "ledger linkage on a capsule not claiming chained")
    if ledger.position < 1 or not _HEX64.match(ledger.prev_hash):
        raise CapsuleError("§5.3 ledger", "malformed ledger linkage")
    linked = msgspec.structs.replace(cap, ledger=ledger)
    return msgspec.structs.replace(linked, capsule_id=linked.checked_body()[1])


def link_built(built: Built, ledger: Ledger | None = None, parent_capsule_id: str | None = None, *,
               embed_ledger: bool = False) -> tuple[Capsule, bytes]:
    """The capsule as signed, and its payload bytes, from the body built once.

    ``parent_capsule_id``: the supersedes parent when it was only known at
    linking (a parent signed in the same batch). ``chain`` is outside
    capsule_id (§5.1) but the ``chained`` it supports (§5.3) is not, so the id
    is derived again. The signer's ``ledger`` linkage is not embedded (it
    stays in ``PGW_SIGNER_LEDGER``): the capsule_id is then a pure function of
    the verdict, whatever ledger position it is signed at. ``embed_ledger``
    builds the legacy form signed before, with the linkage inside the id.
    """
    cap = built.capsule
    body = dict(built.body)
    flags = built.flags
    chain = cap.chain
    assurance = cap.assurance
    if parent_capsule_id is not None:
        chain = Chain(parent_capsule_id)
        body["chain"] = jcs.walk(msgspec.to_builtins(chain), drop_absent=True)[0]
        if assurance.ledger_mode == "standalone":
            assurance = Assurance(assurance.attestation_mode, assurance.effect_mode, "chained")
            body["assurance"] = jcs.walk(msgspec.to_builtins(assurance), drop_absent=True)[0]
    kept = None
    if embed_ledger:
        if ledger is None or ledger.position < 1 or not _HEX64.match(ledger.prev_hash):
            raise CapsuleError("§5.3 ledger", "malformed ledger linkage")
        body["ledger"], lflags = jcs.walk(msgspec.to_builtins(ledger), drop_absent=True)
        flags |= lflags
        kept = ledger
    if assurance.ledger_mode == "chained" and chain is None and kept is None:
        raise CapsuleError("§5.3 assurance", "ledger_mode chained without a hash-chain linkage")
    capsule_id = digest_of_walked(identity_form(body), flags)
    body["capsule_id"] = capsule_id
    linked = msgspec.structs.replace(cap, ledger=kept, chain=chain, assurance=assurance, capsule_id=capsule_id)
    return linked, _payload_bytes(body, flags)


def ready_to_sign(cap: Capsule) -> bytes:
    """The payload bytes to sign; refuse a capsule whose claims are not backed by what it carries."""
    if cap.assurance.ledger_mode == "chained" and cap.ledger is None and cap.chain is None:
        raise CapsuleError("§5.3 assurance", "ledger_mode chained without a hash-chain linkage")
    _body, capsule_id, payload = cap.checked_form()
    if cap.capsule_id != capsule_id:
        raise CapsuleError("§5.1 capsule_id", "capsule_id does not match the canonical form")
    return payload


def subject_urn(operator: str, action_id: str) -> str:
    """§3.1 CWT ``sub``."""
    return f"urn:agent-action-capsule:{operator}:{action_id}"
