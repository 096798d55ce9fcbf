"""Class 1 verification of capsules (spec 004 §6, §7).

:func:`verify_statement` takes the bytes of a Signed or Transparent Statement
and returns a :class:`Result` with one ``ok`` and findings in the fixed order:

0. substrate (COSE_Sign1 by reference to RFC 9052): structure, header rules
   (protected ``alg`` pinned per key; no ``alg``/``crit`` unprotected; no
   unknown critical label), signature against a trusted key, receipts;
1. structural; 2. identity; 3. confirmed-effect binding; 4. verdict/effect
   orthogonality; 5. effect-attestation matrix; 6. chain semantics (store);
7. assurance reconciliation; 8. unknown registry values (informational).

It never raises, whatever the input (garbage bytes included), and consults
no model, clock or network (§6). ``ok`` is false iff a finding has severity
``error``; ``warning`` (concurrent supersedes) and ``info`` never fail it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import msgspec
from msgspec import Struct, field

from consumers import capsule as capm
from consumers import capsule_outcome as outm
from consumers import capsule_v4, profiles, verify_v4
from consumers import checkpoint_statement as cps
from consumers.cose import CoseError, Sign1, TrustedKey, decode_sign1, verify_sign1
from consumers.receipts import verify_receipt
from consumers.verifier_structural import parse_payload, structural

Severity = Literal["error", "warning", "info"]
CHECK_NAMES = {
    0: "substrate",
    1: "structural",
    2: "identity",
    3: "confirmed_effect",
    4: "orthogonality",
    5: "attestation_matrix",
    6: "chain",
    7: "assurance",
    8: "registry",
    9: "provenance",  # format "4" only (draft -05 {#verification} check 9)
}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_MODE_ORDER = {m: i for i, m in enumerate(capm.EFFECT_MODES)}
_LEDGER_ORDER = {m: i for i, m in enumerate(capm.LEDGER_MODES)}


class Finding(Struct, omit_defaults=True):
    check: int
    name: str
    code: str
    severity: Severity
    message: str
    path: str | None = None


class Result(Struct, omit_defaults=True):
    ok: bool
    findings: list[Finding] = field(default_factory=list)
    source: str | None = None
    capsule_id: str | None = None
    kid: str | None = None
    verdict_class: str | None = None
    assurance: dict[str, str] | None = None  # what this verifier rederived (§13: the tier it verified)
    effect_grade: str | None = None
    profile: str | None = None  # the capsule format the statement was verified as: "2" or "4"
    statement_type: str | None = None  # capsule_statement_type: agent_action or outcome (§3.1, §3.3); checkpoint
    unsigned: bool = False  # a bare capsule JSON: its content checked, no signature (anyone can write one)


def _is_json(data: bytes) -> bool:
    return isinstance(data, (bytes, bytearray)) and bytes(data[:64]).lstrip()[:1] == b"{"


def payload_of(data: bytes) -> dict[str, Any] | None:
    """Best-effort payload of a statement, for building a store; never raises."""
    try:
        if _is_json(data):
            return parse_payload(data)
        msg = decode_sign1(data)
        if msg.protected.get(3) == capsule_v4.ID_MEDIA_TYPE:
            return verify_v4.capsule_of(msg)
        return parse_payload(msg.payload or b"")
    except Exception:  # noqa: BLE001
        return None


# ---------------------------------------------------------------------------
# The store (§5.4.4: the producer's store of capsules, for chain checks)
# ---------------------------------------------------------------------------


class Store:
    """Capsules indexed for chain and ledger checks; order = ledger order, then input order."""

    def __init__(self, payloads: Iterable[Mapping[str, Any]]) -> None:
        self.by_id: dict[str, Mapping[str, Any]] = {}
        self.by_position: dict[int, Mapping[str, Any]] = {}
        self.children: dict[str, list[tuple[tuple[int, int], str]]] = defaultdict(list)
        for i, p in enumerate(payloads):
            cid = p.get("capsule_id")
            if not isinstance(cid, str) or cid in self.by_id:
                continue
            self.by_id[cid] = p
            led = p.get("ledger")
            pos = led.get("position") if isinstance(led, dict) else None
            if isinstance(pos, int) and not isinstance(pos, bool):
                self.by_position.setdefault(pos, p)
            ch = p.get("chain")
            if isinstance(ch, dict) and ch.get("relation") == "supersedes":
                parent = ch.get("parent_capsule_id")
                if isinstance(parent, str):
                    order = (pos if isinstance(pos, int) else 1 << 62, i)
                    self.children[parent].append((order, cid))

        self.min_position = min(self.by_position, default=None)

    def authoritative_child(self, parent: str) -> str | None:
        kids = sorted(self.children.get(parent, []))
        return kids[0][1] if kids else None

    def __len__(self) -> int:
        return len(self.by_id)


def open_items(store: Store) -> list[Mapping[str, Any]]:
    """§5.4.4 open-items predicate over the store."""
    out = []
    for cid, p in store.by_id.items():
        disp = p.get("disposition")
        vc = disp.get("verdict_class") if isinstance(disp, dict) else None
        if vc in capm.OPEN_CLASSES and not store.children.get(cid):
            out.append(p)
    return sorted(out, key=lambda p: (str(p.get("timestamp")), str(p.get("capsule_id"))))


# ---------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------


class _Run:
    def __init__(self) -> None:
        self.findings: list[Finding] = []

    def add(self, check: int, code: str, message: str, severity: Severity = "error", path: str | None = None) -> None:
        self.findings.append(Finding(check, CHECK_NAMES[check], code, severity, message, path))

    def errors(self, check: int) -> bool:
        return any(f.check == check and f.severity == "error" for f in self.findings)


def verify_statement(
    data: bytes,
    *,
    keys: Mapping[str, TrustedKey],
    ts_keys: Mapping[str, TrustedKey] | None = None,
    store: Store | None = None,
    source: str | None = None,
    any_kid: Sequence[TrustedKey] = (),
    kernel_keys: Mapping[str, Any] | None = None,
) -> Result:
    """Class 1 verification of one statement; never raises.

    ``kernel_keys``: kid -> Ed25519 public key of the IDP kernel, to check the
    kernel's signature inside an event-log checkpoint statement.

    ``any_kid``: keys the user gave explicitly (``pgw verify --key``), tried
    when the statement's ``kid`` names no trusted key: a producer chooses its
    own kid (RFC 9052 §3.1: kid is a hint), so a key handed over out of band
    is trusted under whatever kid the producer put on its statements.
    """
    run = _Run()
    res = Result(ok=False, source=source)
    try:
        _verify(data, keys, dict(ts_keys or {}), store, run, res, tuple(any_kid), kernel_keys)
    except Exception as e:  # noqa: BLE001 - §6: a verifier returns a result, never throws
        run.add(0, "verifier_internal_error", f"{type(e).__name__}: {e}")
    run.findings.sort(key=lambda f: f.check)  # stable: the fixed order of §6
    res.findings = run.findings
    res.ok = not any(f.severity == "error" for f in run.findings)
    return res


def _verify(data: bytes, keys: Mapping[str, TrustedKey], ts_keys: dict[str, TrustedKey],
            store: Store | None, run: _Run, res: Result, any_kid: tuple[TrustedKey, ...],
            kernel_keys: Mapping[str, Any] | None = None) -> None:
    if _is_json(data):
        # A bare capsule JSON: draft -05 {#verification} "A verifier can validate a Capsule with no
        # envelope". Class 1 by format "4" rules (the reference's public vectors are such files);
        # a format "2" capsule is verified from its Signed Statement instead.
        payload = parse_payload(data)
        if payload is None:
            run.add(1, "payload_not_json", "not a JSON object (or it has duplicate keys)")
            return
        res.capsule_id = payload.get("capsule_id") if isinstance(payload.get("capsule_id"), str) else None
        res.unsigned = True
        verify_v4.check_capsule(payload, run, res, store=store)
        return
    # -- 0: substrate -------------------------------------------------------
    try:
        msg = decode_sign1(data)
    except CoseError as e:
        run.add(0, e.code, e.why)
        return
    res.kid = msg.kid
    if not msg.tagged:
        run.add(0, "cose_untagged", "an untagged COSE_Sign1 (accepted: RFC 9052 §2 makes the tag optional)",
                "info")
    if msg.protected.get(3) == capsule_v4.ID_MEDIA_TYPE:  # format "4": the capsule-id registration statement
        anchored = _check_receipts(msg, ts_keys, run)
        verify_v4.verify_v4(msg, verify_v4.capsule_of(msg), keys, anchored, store, run, res,
                            lambda: _check_signature(msg, keys, any_kid, run))
        return
    res.profile = capm.FORMAT_VERSION
    _check_signature(msg, keys, any_kid, run)
    anchored = _check_receipts(msg, ts_keys, run)
    if cps.is_checkpoint(msg):  # the kernel's anchored log head, not a capsule (consumers.checkpoint_statement)
        res.profile, res.statement_type = None, "checkpoint"
        res.capsule_id = cps.statement_id(msg.payload or b"")
        cps.verify(msg, kernel_keys, run.add)
        res.assurance = {"attestation_mode": "anchored" if anchored else "self_attested"}
        return
    st_type = msg.cwt_claims.get("capsule_statement_type")
    res.statement_type = st_type if isinstance(st_type, str) else None

    payload = parse_payload(msg.payload or b"")
    if payload is None:
        run.add(1, "payload_not_json", "payload is not a JSON object (or has duplicate keys)")
        return
    res.capsule_id = payload.get("capsule_id") if isinstance(payload.get("capsule_id"), str) else None
    fmt = payload.get("format_version")
    res.profile = fmt if isinstance(fmt, str) else None
    if fmt != capm.FORMAT_VERSION and _other_profile(payload, msg, store, anchored, run, res):
        return
    if outm.is_outcome(payload) or st_type == outm.STATEMENT_TYPE:
        outm.verify_outcome(payload, msg.cwt_claims, msg.protected.get(3), store, run.add)
        res.assurance = {"ledger_mode": _ledger_mode(payload, store, run)}
        return
    if msg.protected.get(3) != capm.MEDIA_TYPE:
        run.add(0, "content_type", f"content_type must be {capm.MEDIA_TYPE}")
    disp = payload.get("disposition") if isinstance(payload.get("disposition"), dict) else {}
    vc = disp.get("verdict_class")
    res.verdict_class = vc if isinstance(vc, str) else None

    # -- 1: structural ------------------------------------------------------
    structural(payload, msg, run.add)
    if run.errors(1) and not isinstance(payload.get("disposition"), dict):
        return
    effect = payload.get("effect") if isinstance(payload.get("effect"), dict) else None
    derived = capm.effect_mode_of(effect)

    # -- 2: identity --------------------------------------------------------
    try:
        cid = capm.compute_capsule_id(payload)
        if cid != payload.get("capsule_id"):
            run.add(2, "capsule_id_mismatch", f"capsule_id does not match the canonical form (recomputed {cid})")
    except capm.CapsuleError as e:
        run.add(2, "capsule_id_uncomputable", e.why)

    # -- 3: confirmed-effect binding ------------------------------------------
    if effect is not None:
        st = effect.get("status")
        rd, qd = effect.get("response_digest"), effect.get("request_digest")
        if st == "confirmed" and not (isinstance(rd, str) and _HEX64.match(rd)):
            run.add(3, "confirmed_without_response_digest",
                    "effect.status confirmed without a well-formed response_digest", path="$.effect")
        if st == "planned" and (rd is not None or qd is not None):
            run.add(3, "planned_with_digest", "planned: request_digest and response_digest MUST be absent",
                    path="$.effect")
        if st == "dispatched" and rd is not None:
            run.add(3, "dispatched_with_response_digest", "dispatched: response_digest MUST be absent",
                    path="$.effect")

    # -- 4: orthogonality ---------------------------------------------------------
    if vc in capm.NEVER_DISPATCH and derived != "not_applicable":
        run.add(4, "never_dispatch_with_effect",
                f"verdict_class {vc} never dispatches but the effect derives {derived}")
    if vc == "errored" and derived != "dispatched_unconfirmed":
        run.add(4, "errored_not_dispatched", f"errored pairs with dispatched_unconfirmed, not {derived}")

    # -- 5: effect-attestation matrix -----------------------------------------------
    att = effect.get("effect_attestation") if effect is not None else None
    if effect is not None:
        if derived == "not_applicable" and att is not None:
            run.add(5, "attestation_must_be_absent",
                    "effect_attestation present where nothing executed (planned carve)", path="$.effect")
        if derived != "not_applicable" and att is None:
            run.add(5, "attestation_required",
                    f"effect_attestation REQUIRED for effect.status {effect.get('status')}", path="$.effect")

    # -- 6: chain semantics ---------------------------------------------------------
    chain = payload.get("chain") if isinstance(payload.get("chain"), dict) else None
    if chain is not None:
        parent = chain.get("parent_capsule_id")
        if store is None:
            run.add(6, "chain_not_checked", "no store given: chain parent not checked", "info")
        elif parent not in store.by_id:
            run.add(6, "chain_parent_missing", f"chain parent {parent} is not in the store")
        elif chain.get("relation") == "supersedes":
            first = store.authoritative_child(parent)
            if first is not None and first != payload.get("capsule_id"):
                run.add(6, "concurrent_supersedes",
                        f"a later supersedes of {parent}; {first} is authoritative", "warning")

    # -- 7: assurance reconciliation --------------------------------------------------
    _assurance(payload, derived, anchored, store, run, res)

    # -- 8: unknown registry values -------------------------------------------------
    grade = att if att in capm.EFFECT_ATTESTATIONS else ("runtime_claimed" if att is not None else None)
    res.effect_grade = grade
    checks = [
        ("verdict_class", vc, capm.VERDICT_CLASSES),
        ("disposition.decision", disp.get("decision"), capm.DECISIONS),
        ("effect.type", effect.get("type") if effect else None, capm.EFFECT_TYPES),
        ("irreversibility_class", effect.get("irreversibility_class") if effect else None,
         frozenset(capm.IRREVERSIBILITY_CLASSES)),
        ("effect_attestation", att, capm.EFFECT_ATTESTATIONS),
        ("chain.relation", chain.get("relation") if chain else None, capm.CHAIN_RELATIONS),
    ]
    for name, value, registry in checks:
        if value is not None and value not in registry:
            extra = " (graded no stronger than runtime_claimed)" if name == "effect_attestation" else ""
            run.add(8, "unregistered_value", f"{name} {value!r} is not registered{extra}", "info")
    for i, c in enumerate(payload.get("constraints") or []):
        # §8.1, §9.1: no value is seeded, so a bare name (no namespace separator) is non-conforming.
        for member in ("id", "check_type", "method"):
            v = c.get(member) if isinstance(c, dict) else None
            if isinstance(v, str) and "." not in v and ":" not in v:
                run.add(8, "constraint_not_namespaced", f"constraint {member} {v!r} has no namespace (§9.1)",
                        "info", path=f"$.constraints[{i}].{member}")


def _check_signature(msg: Sign1, keys: Mapping[str, TrustedKey], any_kid: tuple[TrustedKey, ...], run: _Run) -> None:
    """Check 0's signature, any format: under the key its kid names, else under a key given explicitly."""
    key = keys.get(msg.kid or "")
    if key is None and any_kid:
        _verify_explicit(msg, any_kid, run)
    elif key is None:
        run.add(0, "cose_key_untrusted", f"kid {msg.kid!r} is not a trusted key")
    else:
        try:
            verify_sign1(msg, key)
        except CoseError as e:
            run.add(0, e.code, e.why)


def _verify_explicit(msg: Sign1, candidates: tuple[TrustedKey, ...], run: _Run) -> None:
    """Verify under an explicitly given key whatever the statement's kid (one finding either way)."""
    errors: list[CoseError] = []
    for key in candidates:
        try:
            verify_sign1(msg, key)
        except CoseError as e:
            errors.append(e)
            continue
        run.add(0, "cose_kid_explicit_key",
                f"kid {msg.kid!r} names no known key; verified under the key given explicitly ({key.kid})", "info")
        return
    if len(errors) == 1:
        run.add(0, errors[0].code, errors[0].why)
    else:
        run.add(0, "cose_key_untrusted", f"kid {msg.kid!r} is not a trusted key and none of the "
                f"{len(candidates)} keys given explicitly verifies ({', '.join(e.code for e in errors)})")


def _other_profile(payload: dict[str, Any], msg: Sign1, store: Store | None, anchored: bool, run: _Run,
                   res: Result) -> bool:
    """Hand a statement of another format to its profile's verifier; False when none is installed."""
    try:
        prof = profiles.profile_of(payload)
    except profiles.ProfileError:
        return False  # the structural check reports format_version_unsupported
    if prof.verify_payload is None:
        return False
    res.assurance = prof.verify_payload(payload, msg=msg, store=store, anchored=anchored, add=run.add)
    return True


def _check_receipts(msg: Sign1, ts_keys: dict[str, TrustedKey], run: _Run) -> bool:
    receipts = msg.receipts()
    if not receipts:
        return False
    if not ts_keys:
        run.add(0, "receipt_not_verified", "receipt present but no trusted Transparency Service key", "info")
        return False
    statement = msg.statement_bytes()
    # Format "4": what the TS registered is the registration statement alone (draft -05 {#registration});
    # a statement registered before the capsule JSON was left out has receipts over the whole one.
    forms = [capsule_v4.registration_statement(statement), statement]
    anchored = False
    for r in receipts:
        errors: list[CoseError] = []
        for form in dict.fromkeys(forms):
            try:
                verify_receipt(r, form, ts_keys)
                anchored = True
                break
            except CoseError as e:
                errors.append(e)
        else:
            run.add(0, errors[0].code, f"receipt: {errors[0].why}")
    return anchored


def _predecessor_ok(p: Mapping[str, Any], pred: Mapping[str, Any]) -> bool:
    led, pled = p.get("ledger") or {}, pred.get("ledger") or {}
    try:
        h = capm.ledger_entry_hash(pled["position"], pred["capsule_id"], pred.get("chain"), pled["prev_hash"])
    except (KeyError, TypeError, capm.CapsuleError):
        return False
    return h == led.get("prev_hash") and led.get("prev_capsule_id") == pred.get("capsule_id")


def _ledger_mode(p: Mapping[str, Any], store: Store | None, run: _Run) -> str:
    """ledger_mode rederived (§5.3): standalone vs chained from the presence and integrity of the linkage.

    The linkage a capsule carries is its ``chain`` block (§5.4.4), as the
    reference verifier reads it; a missing parent is check 6's finding. A
    capsule signed before the signer's hash chain moved out of the capsule
    carries a ``ledger`` block, checked against its predecessor in the store.
    """
    ch = p.get("chain")
    if isinstance(ch, dict) and isinstance(ch.get("parent_capsule_id"), str) \
            and _HEX64.match(ch["parent_capsule_id"]) and isinstance(ch.get("relation"), str) \
            and not isinstance(p.get("ledger"), dict):
        return "chained"
    led = p.get("ledger") if isinstance(p.get("ledger"), dict) else None
    ledger_mode = "standalone"
    if led is not None and isinstance(led.get("position"), int):
        pos = led["position"]
        if pos == 1:
            if led.get("prev_hash") == capm.GENESIS_HASH and led.get("prev_capsule_id") is None:
                ledger_mode = "chained"
            else:
                run.add(7, "ledger_broken", "ledger position 1 must link to the genesis hash")
        elif store is not None and (pos - 1) in store.by_position:
            if _predecessor_ok(p, store.by_position[pos - 1]):
                ledger_mode = "chained"
            else:
                run.add(7, "ledger_broken", f"hash-chain link to position {pos - 1} does not verify")
        elif store is not None and store.min_position is not None and store.min_position < pos - 1:
            # The store holds statements before and after this one: one is missing between them
            # (removed, or not stored anywhere this run was given). Not an error: a partial store
            # (a queue drained into another stream) is legitimate, so it is said, not failed.
            run.add(7, "ledger_gap", f"ledger position {pos - 1} is missing from a store that holds "
                    f"earlier positions: a statement was removed, or is stored elsewhere", "warning")
        else:
            run.add(7, "ledger_unverified",
                    f"ledger predecessor (position {pos - 1}) not available: linkage present, integrity unchecked",
                    "info")
    return ledger_mode


def _assurance(p: dict[str, Any], derived: str, anchored: bool, store: Store | None, run: _Run,
               res: Result) -> None:
    a = p.get("assurance") if isinstance(p.get("assurance"), dict) else {}
    # attestation_mode: anchored only after a verified receipt (§3.2).
    att_mode = "anchored" if anchored else "self_attested"
    if a.get("attestation_mode") == "anchored" and not anchored:
        run.add(7, "attestation_overclaim", "attestation_mode anchored without a verified receipt")
    # effect_mode: rederived from the effect record.
    claimed = a.get("effect_mode")
    if claimed in _MODE_ORDER and claimed != derived:
        over = _MODE_ORDER[claimed] > _MODE_ORDER[derived]
        run.add(7, "effect_mode_overclaim" if over else "effect_mode_mismatch",
                f"effect_mode {claimed} but the effect derives {derived}")
    ledger_mode = _ledger_mode(p, store, run)
    led = p.get("ledger") if isinstance(p.get("ledger"), dict) else None
    claimed_l = a.get("ledger_mode")
    if claimed_l in _LEDGER_ORDER:
        if claimed_l == "anchored" and not anchored:
            run.add(7, "ledger_overclaim", "ledger_mode anchored without a verified receipt")
        elif claimed_l == "chained" and led is None and ledger_mode != "chained":
            run.add(7, "ledger_overclaim", "ledger_mode chained without a hash-chain linkage (no chain block)")
    res.assurance = {"attestation_mode": att_mode, "effect_mode": derived, "ledger_mode": ledger_mode}


def verify_many(
    items: list[tuple[str, bytes]],
    *,
    keys: Mapping[str, TrustedKey],
    ts_keys: Mapping[str, TrustedKey] | None = None,
    store: Store | None = None,
    any_kid: Sequence[TrustedKey] = (),
    kernel_keys: Mapping[str, Any] | None = None,
) -> list[Result]:
    """Verify a set of statements; the set itself is the store unless one is given."""
    if store is None:
        store = Store(p for p in (payload_of(d) for _, d in items) if p is not None)
    return [verify_statement(d, keys=keys, ts_keys=ts_keys, store=store, source=s, any_kid=any_kid,
                             kernel_keys=kernel_keys) for s, d in items]


result_encoder = msgspec.json.Encoder()
