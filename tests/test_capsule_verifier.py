"""Class 1 verifier (spec 004 §6): passes what the signer makes, fails each hand-crafted violation."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import cbor2
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import capsule as capm
from consumers import capsule_map
from consumers.cose import (
    TrustedKey,
    inclusion_path,
    merkle_root,
    sign_receipt,
    statement_leaf,
    with_receipt,
)
from consumers.signer import claims_for, sign_payload
from consumers.verifier import Store, open_items, payload_of, verify_many, verify_statement
from tests.test_capsule_cose import signing_key, trusted
from tests.test_capsule_model import SALT, design_rows, verdict, vid

KEY = signing_key()
KEYS = {KEY.kid: trusted(KEY)}


def signer_chain(rows: list[Any] | None = None) -> list[bytes]:
    """Statements in the legacy ledger-linked form (a ``ledger`` block inside), chains resolved to parent ids."""
    out, ids = [], {}
    prev_hash, prev_id = capm.GENESIS_HASH, None
    for pos, v in enumerate(rows or design_rows(), start=1):
        cap = capsule_map.capsule_from_verdict(v, operator="acme", salt=SALT, parent_capsule_id=ids.get(v.supersedes),
                                               chained=True)
        cap = capm.attach_ledger(cap, capm.Ledger(position=pos, prev_hash=prev_hash, prev_capsule_id=prev_id))
        chain = cap.to_dict().get("chain")
        prev_hash, prev_id = capm.ledger_entry_hash(pos, cap.capsule_id, chain, prev_hash), cap.capsule_id
        ids[v.verdict_id] = cap.capsule_id
        out.append(sign_payload(cap.to_json(), KEY))
    return out


def craft(base: bytes, mutate: Callable[[dict[str, Any]], None], *, reid: bool = True) -> bytes:
    """Re-sign ``base`` with a mutated payload (capsule_id recomputed unless ``reid`` is False)."""
    p = json.loads(cbor2.loads(base).value[2])
    mutate(p)
    if reid:
        p["capsule_id"] = capm.compute_capsule_id(p)
    body = json.dumps(p).encode()
    from consumers.cose import sign_statement

    claims = cbor2.loads(cbor2.loads(base).value[0])[15]
    return sign_statement(body, KEY.private, KEY.kid, claims, capm.MEDIA_TYPE)


def codes(res: Any, severity: str | None = None) -> list[tuple[int, str]]:
    return [(f.check, f.code) for f in res.findings if severity is None or f.severity == severity]


def test_signer_output_passes() -> None:
    """Every capsule of every DESIGN §6 row verifies ok, chained, with chain parents present."""
    stmts = signer_chain()
    results = verify_many([(str(i), s) for i, s in enumerate(stmts)], keys=KEYS)
    for r in results:
        assert r.ok, (r.source, codes(r))
        assert r.assurance == {"attestation_mode": "self_attested", "effect_mode": r.assurance["effect_mode"],
                               "ledger_mode": "chained"}
        assert not codes(r, "error")


def test_single_statement_without_store() -> None:
    """Alone, a chained resolution verifies ok; its parent is reported as not checked."""
    stmts = signer_chain()
    r = verify_statement(stmts[3], keys=KEYS)
    assert r.ok
    assert (6, "chain_not_checked") in codes(r, "info")
    assert (7, "ledger_unverified") in codes(r, "info")
    assert r.assurance["ledger_mode"] == "standalone"  # never upgraded past what was checked


def _one(stmt: bytes, store_stmts: list[bytes] | None = None) -> Any:
    store = Store(p for p in map(payload_of, [stmt, *(store_stmts or signer_chain())]) if p is not None)
    return verify_statement(stmt, keys=KEYS, store=store)


def test_check1_structural() -> None:
    """Missing fields, floats, a dishonest disposition and a bad CWT sub are structural failures."""
    base = signer_chain()[0]
    r = _one(craft(base, lambda p: p.pop("operator")))
    assert (1, "field_invalid") in codes(r) and not r.ok
    r = _one(craft(base, lambda p: p["pgw"].update(amount=12.5)))
    assert (1, "float_value") in codes(r)
    r = _one(craft(base, lambda p: p["disposition"].update(human_disposed=True)))
    assert (1, "disposition_dishonest") in codes(r)
    r = _one(craft(base, lambda p: p["disposition"].update(approver="robot")))
    assert (1, "approver_not_conforming") in codes(r)
    p = json.loads(cbor2.loads(base).value[2])
    bad_sub = claims_for(p) | {2: "urn:agent-action-capsule:other:x"}
    from consumers.cose import sign_statement

    r = _one(sign_statement(cbor2.loads(base).value[2], KEY.private, KEY.kid, bad_sub, capm.MEDIA_TYPE))
    assert (1, "cwt_sub") in codes(r)


def test_check2_identity() -> None:
    """A payload changed after capsule_id was computed fails the identity check."""
    r = _one(craft(signer_chain()[0], lambda p: p.update(timestamp="2026-03-01T12:00:09.000Z"), reid=False))
    assert codes(r, "error") == [(2, "capsule_id_mismatch")]


def test_check3_confirmed_binding() -> None:
    """confirmed without a well-formed response_digest fails check 3."""
    executed = signer_chain()[7]
    r = _one(craft(executed, lambda p: p["effect"].pop("response_digest")))
    assert codes(r, "error") == [(3, "confirmed_without_response_digest")]
    r = _one(craft(executed, lambda p: p["effect"].update(response_digest="not-hex")))
    assert (3, "confirmed_without_response_digest") in codes(r, "error")


def test_check4_orthogonality() -> None:
    """A blocked capsule carrying a dispatched effect fails check 4 (and overclaims nothing else)."""
    def add_effect(p: dict[str, Any]) -> None:
        p["effect"] = {"type": "write_order", "status": "dispatched", "effect_attestation": "runtime_claimed"}
        p["assurance"]["effect_mode"] = "dispatched_unconfirmed"

    r = _one(craft(signer_chain()[0], add_effect))
    assert codes(r, "error") == [(4, "never_dispatch_with_effect")]
    # resolved is in the never-dispatch set too (pairing rule).
    r = _one(craft(signer_chain()[3], add_effect))
    assert (4, "never_dispatch_with_effect") in codes(r, "error")


def test_check5_attestation_matrix_vectors() -> None:
    """failed and reverted without effect_attestation fail check 5; planned with one fails too (§6 vector)."""
    errored = signer_chain()[9]
    for status in ("failed", "reverted"):
        def drop(p: dict[str, Any], status: str = status) -> None:
            p["effect"]["status"] = status
            p["effect"].pop("effect_attestation")

        r = _one(craft(errored, drop))
        assert codes(r, "error") == [(5, "attestation_required")], status

    def planned(p: dict[str, Any]) -> None:
        p["verdict_class"] = None
        p["disposition"]["verdict_class"] = "executed"
        p["effect"] = {"type": "write_order", "status": "planned", "effect_attestation": "runtime_claimed"}
        p["assurance"]["effect_mode"] = "not_applicable"

    r = _one(craft(errored, planned))
    assert codes(r, "error") == [(5, "attestation_must_be_absent")]


def test_check6_chain_semantics() -> None:
    """A missing parent fails check 6; a second supersedes of one parent is a warning, not a failure."""
    stmts = signer_chain()
    resolution = stmts[3]
    r = verify_statement(resolution, keys=KEYS, store=Store([payload_of(resolution)]))
    assert (6, "chain_parent_missing") in codes(r, "error") and not r.ok
    rows = design_rows()
    late = verdict("late", "resolved", decision="reject", approver="human", human_disposed=True,
                   supersedes=vid("dispatch"), action_id="bot:m1")
    both = signer_chain([*rows, late])
    results = verify_many([(str(i), s) for i, s in enumerate(both)], keys=KEYS)
    assert all(r.ok for r in results)
    assert codes(results[-1], "warning") == [(6, "concurrent_supersedes")]
    assert not codes(results[3], "warning")  # the earliest in ledger order is authoritative


def test_check7_assurance_overclaims() -> None:
    """Claimed anchored without a receipt, a wrong effect_mode, unbacked chained and a broken link fail check 7."""
    base = signer_chain()[0]
    r = _one(craft(base, lambda p: p["assurance"].update(attestation_mode="anchored")))
    assert codes(r, "error") == [(7, "attestation_overclaim")]
    r = _one(craft(base, lambda p: p["assurance"].update(effect_mode="confirmed")))
    assert codes(r, "error") == [(7, "effect_mode_overclaim")]
    r = _one(craft(base, lambda p: p.pop("ledger")))
    assert codes(r, "error") == [(7, "ledger_overclaim")]
    stmts = signer_chain()
    broken = craft(stmts[4], lambda p: p["ledger"].update(prev_hash="ab" * 32))
    r = verify_many([(str(i), s) for i, s in enumerate([*stmts[:4], broken])], keys=KEYS)[-1]
    assert codes(r, "error") == [(7, "ledger_broken")]


def test_check8_unknown_registry_values_are_informational() -> None:
    """Unregistered verdict_class/effect.type/attestation values are info only; unknown grades as runtime_claimed."""
    def exotic(p: dict[str, Any]) -> None:
        p["disposition"]["verdict_class"] = "com.example.paused"
        p["effect"]["type"] = "com.example.ship"
        p["effect"]["effect_attestation"] = "com.example.tee"

    r = _one(craft(signer_chain()[9], exotic))
    assert r.ok
    assert [c for c in codes(r, "info") if c[0] == 8] == [(8, "unregistered_value")] * 3
    assert r.effect_grade == "runtime_claimed"


def test_findings_in_fixed_order() -> None:
    """Several violations are reported in check order 1..8."""
    def many(p: dict[str, Any]) -> None:
        p["disposition"]["verdict_class"] = "com.example.x"
        p["assurance"]["attestation_mode"] = "anchored"
        p["effect"]["effect_attestation"] = None
        p["pgw"]["f"] = 1.5

    r = _one(craft(signer_chain()[9], many, reid=False))
    checks = [f.check for f in r.findings]
    assert checks == sorted(checks) and {1, 2, 5, 7, 8} <= set(checks)


def test_signature_and_key_findings() -> None:
    """An unknown key or a bad signature fails at the substrate, before the profile checks."""
    stmt = signer_chain()[0]
    r = verify_statement(stmt, keys={})
    assert codes(r, "error") == [(0, "cose_key_untrusted")]
    obj = cbor2.loads(stmt).value
    bad = cbor2.dumps(cbor2.CBORTag(18, [obj[0], obj[1], obj[2], bytes(64)]))
    r = verify_statement(bad, keys=KEYS)
    assert codes(r, "error")[0] == (0, "cose_signature_invalid")


def test_anchored_only_with_verified_receipt() -> None:
    """A Transparent Statement is reported anchored only when its receipt verifies under a trusted TS key."""
    stmts = signer_chain()[:3]
    ts = signing_key()
    leaves = [statement_leaf(s) for s in stmts]
    receipt = sign_receipt(ts.private, ts.kid, 3, 1, inclusion_path(1, leaves), merkle_root(leaves))
    transparent = with_receipt(stmts[1], receipt)
    r = verify_statement(transparent, keys=KEYS, ts_keys={ts.kid: TrustedKey(ts.kid, ts.public)})
    assert r.ok and r.assurance["attestation_mode"] == "anchored"
    r = verify_statement(transparent, keys=KEYS)
    assert r.ok and r.assurance["attestation_mode"] == "self_attested"
    assert (0, "receipt_not_verified") in codes(r, "info")
    forged = with_receipt(stmts[0], receipt)  # a receipt for another statement
    r = verify_statement(forged, keys=KEYS, ts_keys={ts.kid: TrustedKey(ts.kid, ts.public)})
    assert not r.ok and r.assurance["attestation_mode"] == "self_attested"


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_never_throws_on_garbage(data: bytes) -> None:
    """Arbitrary bytes give a result with ok false, never an exception."""
    r = verify_statement(data, keys=KEYS)
    assert r.ok is False and r.findings


def test_never_throws_on_hostile_payloads() -> None:
    """Non-JSON, duplicate keys, deep nesting and wrong types in a validly signed statement are findings."""
    from consumers.cose import sign_statement

    claims = {1: "bot", 2: "x", "capsule_statement_type": "agent_action"}
    for body in [b"\xff\xfe", b"[1,2]", b'{"a":1,"a":2}', b"[" * 5000 + b"]" * 5000,
                 b'{"disposition": 5, "assurance": [], "effect": "x", "chain": 1, "ledger": {"position": true}}',
                 b'{"spec_version": 1, "timestamp": 5, "effect": {"status": "confirmed"}}', b"NaN"]:
        r = verify_statement(sign_statement(body, KEY.private, KEY.kid, claims, capm.MEDIA_TYPE), keys=KEYS)
        assert r.ok is False and r.findings, body[:40]


def test_open_items_predicate() -> None:
    """Open items are open-class capsules with no superseding capsule in the store (§5.4.4)."""
    stmts = signer_chain()
    store = Store(map(payload_of, stmts))
    open_ = {p["capsule_id"] for p in open_items(store)}
    payloads = [payload_of(s) for s in stmts]
    by_vid = {p["pgw"]["verdict_id"]: p["capsule_id"] for p in payloads}
    # blocked is open; the three dispatches are closed by resolution/expiry; denied is not an open class.
    assert open_ == {by_vid[vid("blocked")]}
    store = Store(map(payload_of, stmts[:3]))  # the resolution is not in the store yet
    assert {p["capsule_id"] for p in open_items(store)} == {by_vid[vid("blocked")], by_vid[vid("dispatch")]}


def test_removed_reordered_or_altered_capsule_is_detected() -> None:
    """With the ledger inside capsule_id: a removed capsule leaves a ledger_gap, a capsule re-signed at
    another position (reordered) or with altered content breaks the next link; the intact set verifies."""
    stmts = signer_chain()
    whole = verify_many([(str(i), s) for i, s in enumerate(stmts)], keys=KEYS)
    assert all(r.ok and r.assurance["ledger_mode"] == "chained" for r in whole)
    removed = verify_many([(str(i), s) for i, s in enumerate(stmts) if i != 5], keys=KEYS)
    after = removed[5]  # position 7, whose predecessor (position 6) is gone
    assert (7, "ledger_gap") in codes(after, "warning") and after.assurance["ledger_mode"] == "standalone"
    # an altered capsule re-signed with a fresh id: the next capsule's link no longer verifies
    altered = craft(stmts[3], lambda p: p.update(timestamp="2026-03-01T12:00:09.000Z"))
    res = verify_many([(str(i), s) for i, s in enumerate([*stmts[:3], altered, *stmts[4:]])], keys=KEYS)
    assert res[3].ok and codes(res[4], "error") == [(7, "ledger_broken")]
    # swapping two capsules' positions (re-signed) changes their ids, breaking the links around them
    swapped = [craft(stmts[2], lambda p: p["ledger"].update(position=4)),
               craft(stmts[3], lambda p: p["ledger"].update(position=3))]
    res = verify_many([(str(i), s) for i, s in enumerate([*stmts[:2], *swapped, *stmts[4:]])], keys=KEYS)
    assert any(codes(r, "error") for r in res)
