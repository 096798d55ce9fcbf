"""Capsule model and construction rules (spec 004 §2, §5), without NATS.

Also holds the verdict factories the other ``test_capsule_*`` modules use:
one verdict per row of DESIGN §6's table.
"""

from __future__ import annotations

import hashlib
import json

import msgspec
import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import capsule as capm
from consumers import capsule_map
from consumers.capsule import (
    CapsuleError,
    Chain,
    Disposition,
    EffectRecord,
    ExpiryPolicy,
    Ledger,
    build_capsule,
    json_digest,
)
from consumers.capsule_map import capsule_from_verdict
from subjects.util import stable_id
from subjects.wire import Detail, Refusal, ReportedEffect, Verdict

SALT = "11" * 32
TS = "2026-03-01T12:00:00.000Z"


def vid(name: str) -> str:
    return stable_id("verdict", name)


def verdict(name: str, cls: str, **kw: object) -> Verdict:
    """A verdict as the gateway would publish it; ``name`` makes its ids unique."""
    defaults: dict[str, object] = {
        "verdict_id": vid(name),
        "verdict_class": cls,
        "decision": "reject",
        "approver": "policy",
        "human_disposed": False,
        "ts": TS,
        "agent": "bot",
        "action_type": "envelope",
        "action_id": f"bot:{name}",
    }
    defaults.update(kw)
    return Verdict(**defaults)  # type: ignore[arg-type]


def design_rows(tag: str = "") -> list[Verdict]:
    """One verdict per row of DESIGN §6's table (chains included), in publish order."""
    t = tag
    return [
        verdict(f"{t}blocked", "blocked", reason=Refusal("invalid_envelope_shape", "unknown member 'x'",
                                                        [Detail("unknown member", "$.x", "closed_top_level")])),
        verdict(f"{t}denied", "denied", reason=Refusal("IDP_SO_MISMATCH", "so_id differs")),
        verdict(f"{t}dispatch", "hitl_dispatched", decision="needs_input", moment_id="ab" * 16,
                action_id=f"bot:{t}m1"),
        verdict(f"{t}resolved", "resolved", decision="accept", approver="human", human_disposed=True,
                supersedes=vid(f"{t}dispatch"), resolution_kind="option", option_index=0,
                moment_id="ab" * 16, action_id=f"bot:{t}m1"),
        verdict(f"{t}dispatch2", "hitl_dispatched", decision="needs_input", moment_id="cd" * 16,
                action_id=f"bot:{t}m2"),
        # a moment unanswered before its expiry: the decision timed out (spec 004 §5.4.1)
        verdict(f"{t}expired", "timeout", supersedes=vid(f"{t}dispatch2"), moment_id="cd" * 16,
                action_id=f"bot:{t}m2", reason=Refusal("moment_expired", "no answer before expiry")),
        verdict(f"{t}hem", "hitl_dispatched", decision="needs_input", idp_id="idp-1", action_id=f"bot:{t}idp-1"),
        # after a HEM approval the kernel's verdict says the human acted (gateway/kernel/transitions.py)
        verdict(f"{t}executed", "executed", decision="accept", approver="human", human_disposed=True,
                # the HEM approval permits the step and is no closure of its own: the execution
                # supersedes the dispatch (spec 004 §5.4.2 pairing rule)
                supersedes=vid(f"{t}hem"), idp_id="idp-1", action_id=f"bot:{t}idp-1",
                effect=ReportedEffect(type="send_payment", status="confirmed", request={"amount": "12.50"},
                                      response={"ok": True, "id": "tx-9"}, external_ref="tx-9",
                                      irreversibility_class="one_way_consequential")),
        verdict(f"{t}executed_policy", "executed", decision="accept", idp_id="idp-2",
                action_id=f"bot:{t}idp-2",
                effect=ReportedEffect(type="write_order", status="confirmed", request={"n": 1})),
        # ran and threw, state unknown (spec 004 §5.4.2)
        verdict(f"{t}errored", "errored", decision="accept", idp_id="idp-3", action_id=f"bot:{t}idp-3",
                effect=ReportedEffect(type="write_order", status="dispatched")),
        # ran and returned a clean failure: an executed action whose effect status is failed
        verdict(f"{t}failed", "executed", decision="accept", idp_id="idp-5", action_id=f"bot:{t}idp-5",
                effect=ReportedEffect(type="write_order", status="failed", response={"error": "card declined"})),
        verdict(f"{t}engine", "engine_failure", reason=Refusal("engine_failure", "policy engine unavailable")),
        # a kernel PERMIT whose transition report never came (gateway/kernel/overdue.py)
        verdict(f"{t}overdue", "timeout", decision="accept", idp_id="idp-4", action_id=f"bot:{t}idp-4",
                reason=Refusal("TRANSITION_REPORT_MISSING", "no transition report within 60 s of the permit"),
                effect=ReportedEffect(type="envelope", status="dispatched")),  # the permit went out (§5.4.2)
    ]


def make(v: Verdict, **kw: object) -> capm.Capsule:
    """The legacy ledger-linked form (a ``ledger`` block inside the capsule), as stored capsules carry it."""
    kw.setdefault("chained", True)
    cap = capsule_from_verdict(v, operator="acme", salt=SALT, **kw)  # type: ignore[arg-type]
    return capm.attach_ledger(cap, Ledger(position=1, prev_hash=capm.GENESIS_HASH))


# ---------------------------------------------------------------------------


def test_json_digest_drops_absent_fields_bottom_up() -> None:
    """null, [] and {} members are removed bottom-up before JCS, so they never change a digest."""
    messy = {"b": 1, "a": None, "c": [], "d": {"e": {}, "f": None}, "g": [{"h": None}]}
    assert capm.normalize(messy) == {"b": 1, "g": [{}]}
    expected = hashlib.sha256(rfc8785.dumps({"b": 1, "g": [{}]})).hexdigest()
    assert json_digest(messy) == expected
    assert json_digest({"b": 1, "g": [{}]}) == expected


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(json_values)
def test_json_digest_is_canonical(value: object) -> None:
    """JSON-DIGEST ignores key order and whitespace: a re-serialized, re-ordered value digests the same."""
    reordered = json.loads(json.dumps(value, sort_keys=False, indent=1))
    if isinstance(reordered, dict):
        reordered = dict(reversed(list(reordered.items())))
    assert json_digest(reordered) == json_digest(value)
    assert json_digest({"v": value, "pad": None}) == json_digest({"v": value})


def test_disposition_cannot_claim_human_for_policy() -> None:
    """human_disposed true with approver policy is unrepresentable (§5.4, §13)."""
    with pytest.raises(CapsuleError, match="human_disposed"):
        Disposition("accept", "policy", True)
    assert Disposition.by_policy("reject").human_disposed is False
    d = Disposition.by_human("accept")
    assert (d.approver, d.human_disposed) == ("human", True)
    with pytest.raises(CapsuleError, match="approver"):
        Disposition("accept", "robot", False)  # type: ignore[arg-type]


def test_effect_binding_rules() -> None:
    """confirmed needs a response digest, planned carries neither digest nor attestation (§5.2)."""
    d = "ab" * 32
    with pytest.raises(CapsuleError, match="confirmed"):
        EffectRecord(type="write_order", status="confirmed", effect_attestation="runtime_claimed")
    with pytest.raises(CapsuleError, match="planned"):
        EffectRecord(type="write_order", status="planned", request_digest=d)
    with pytest.raises(CapsuleError, match="planned carve"):
        EffectRecord(type="write_order", status="planned", effect_attestation="runtime_claimed")
    with pytest.raises(CapsuleError, match="dispatched"):
        EffectRecord(type="write_order", status="dispatched", response_digest=d, effect_attestation="runtime_claimed")
    for status in ("dispatched", "failed", "reverted", "confirmed"):
        with pytest.raises(CapsuleError, match="REQUIRED"):
            EffectRecord(type="write_order", status=status, response_digest=d if status == "confirmed" else None)


def _build(disp: Disposition, effect: EffectRecord | None = None, **kw: object) -> capm.Capsule:
    return build_capsule(action_id="a1", action_type="decide", operator="acme", developer="bot",
                         timestamp=TS, disposition=disp, effect=effect, **kw)  # type: ignore[arg-type]


def test_orthogonality_enforced_at_construction() -> None:
    """A never-dispatching class with an effect, or errored without one, cannot be built (§5.4.2)."""
    dispatched = EffectRecord(type="write_order", status="dispatched", effect_attestation="runtime_claimed")
    for cls in ("blocked", "denied", "hitl_dispatched", "expired", "engine_failure", "resolved"):
        with pytest.raises(CapsuleError, match="orthogonality"):
            _build(Disposition.by_policy("reject", verdict_class=cls), dispatched)
    with pytest.raises(CapsuleError, match="errored"):
        _build(Disposition.by_policy("accept", verdict_class="errored"))
    ok = _build(Disposition.by_policy("accept", verdict_class="errored"), dispatched)
    assert ok.assurance.effect_mode == "dispatched_unconfirmed"


def test_assurance_only_as_achieved() -> None:
    """effect_mode must equal the derived mode; anchored and unbacked chained are refused (§5.3)."""
    disp = Disposition.by_policy("reject", verdict_class="blocked")
    with pytest.raises(CapsuleError, match="effect_mode"):
        _build(disp, effect_mode="confirmed")
    with pytest.raises(CapsuleError, match="anchored"):
        _build(disp, attestation_mode="anchored")
    with pytest.raises(CapsuleError, match="chained"):
        _build(disp, ledger_mode="chained")
    pending = _build(disp, ledger_pending=True)
    with pytest.raises(CapsuleError, match="chained"):
        capm.ready_to_sign(pending)
    assert _build(disp).assurance.ledger_mode == "standalone"


def test_floats_are_refused() -> None:
    """Amounts are decimal strings: a float anywhere in the capsule is refused (§5.1)."""
    with pytest.raises(CapsuleError, match="floating-point"):
        _build(Disposition.by_policy("reject", verdict_class="blocked"), pgw={"amount": 12.5})


def test_expiry_policy_only_for_deferrals() -> None:
    """expiry_policy is accepted on a deferral and refused elsewhere (§5.4)."""
    ep = ExpiryPolicy(3600, "expired")
    with pytest.raises(CapsuleError, match="deferral"):
        Disposition.by_policy("reject", verdict_class="blocked", expiry_policy=ep)
    d = Disposition.by_human("deferred", verdict_class="deferred", expiry_policy=ep)
    assert _build(d).to_dict()["disposition"]["expiry_policy"] == {"ttl_seconds": 3600, "on_expiry": "expired"}


def test_capsule_id_excludes_chain_linkage() -> None:
    """capsule_id is the digest of the envelope minus capsule_id and the chain block only (§5.1).

    The signer's ledger linkage is hashed in: a verifier that knows only the
    spec's ``chain`` block (the reference one) must recompute the same id.
    """
    v = verdict("x", "resolved", decision="accept", approver="human", human_disposed=True)
    a = capsule_from_verdict(v, operator="acme", salt=SALT, parent_capsule_id="aa" * 32)
    b = capsule_from_verdict(v, operator="acme", salt=SALT, parent_capsule_id="bb" * 32)
    assert a.capsule_id == b.capsule_id
    linked = capm.attach_ledger(a, Ledger(position=7, prev_hash="cc" * 32, prev_capsule_id="dd" * 32))
    body = linked.to_dict()
    expected = json_digest({k: v for k, v in body.items() if k not in ("capsule_id", "chain")})
    assert linked.capsule_id == expected != a.capsule_id
    moved = capm.attach_ledger(a, Ledger(position=8, prev_hash="cc" * 32, prev_capsule_id="dd" * 32))
    assert moved.capsule_id != linked.capsule_id  # the position is part of what the id commits to
    other = capsule_from_verdict(msgspec.structs.replace(v, ts="2026-03-01T12:00:01.000Z"), operator="acme",
                                 salt=SALT)
    assert other.capsule_id != a.capsule_id


def test_same_verdict_same_bytes() -> None:
    """A verdict maps to byte-identical capsule payloads every time (redelivery safety)."""
    for v in design_rows():
        assert make(v).to_json() == make(msgspec.json.decode(msgspec.json.encode(v), type=Verdict)).to_json()


def test_design_table_rows() -> None:
    """Each DESIGN §6 row maps to its verdict_class, decision, approver, human_disposed and effect mode."""
    caps = {v.verdict_id: make(v, parent_capsule_id=("ee" * 32 if v.supersedes else None)).to_dict()
            for v in design_rows()}
    expect = {
        "blocked": ("reject", "policy", False, "not_applicable"),
        "denied": ("reject", "policy", False, "not_applicable"),
        "dispatch": ("needs_input", "policy", False, "not_applicable"),
        "resolved": ("accept", "human", True, "not_applicable"),
        "expired": ("reject", "policy", False, "not_applicable"),
        "failed": ("accept", "policy", False, "dispatched_unconfirmed"),
        "executed": ("accept", "human", True, "confirmed"),
        "executed_policy": ("accept", "policy", False, "dispatched_unconfirmed"),
        "errored": ("accept", "policy", False, "dispatched_unconfirmed"),
        "engine": ("reject", "policy", False, "not_applicable"),
    }
    for name, (decision, approver, human, mode) in expect.items():
        c = caps[vid(name)]
        d = c["disposition"]
        assert (d["decision"], d["approver"], d["human_disposed"], c["assurance"]["effect_mode"]) == (
            decision, approver, human, mode), name
        assert c["assurance"]["ledger_mode"] == "chained"
        assert c["spec_version"] == capm.SPEC_VERSION and c["format_version"] == "2"
    assert caps[vid("blocked")]["disposition"]["verdict_class"] == "blocked"
    assert "verdict_class" not in caps[vid("executed")]["disposition"]  # clean executed: no reason-class
    assert caps[vid("resolved")]["chain"] == {"parent_capsule_id": "ee" * 32, "relation": "supersedes"}
    assert "chain" not in caps[vid("blocked")]
    ex = caps[vid("executed")]["effect"]
    assert ex["status"] == "confirmed" and ex["effect_attestation"] == "runtime_claimed"
    assert ex["response_digest"] == json_digest({"ok": True, "id": "tx-9"})
    # executed_policy reported confirmed without a response: never claimed as confirmed (§5.2).
    assert caps[vid("executed_policy")]["effect"]["status"] == "dispatched"
    assert "response_digest" not in caps[vid("executed_policy")]["effect"]
    assert caps[vid("failed")]["effect"]["status"] == "failed"
    assert caps[vid("errored")]["effect"]["status"] == "dispatched"
    assert caps[vid("expired")]["disposition"]["verdict_class"] == "timeout"


def test_reason_digest_is_structured_and_salted() -> None:
    """reason_digest commits to code and rules, not prose, under the tenant salt (§5.4, §13)."""
    a = verdict("r", "blocked", reason=Refusal("cap.breached", "too many", [Detail("x", "$.a", "limit")]))
    b = msgspec.structs.replace(a, reason=Refusal("cap.breached", "other words", [Detail("y", "$.a", "limit")]))
    da = capsule_from_verdict(a, operator="acme", salt=SALT).disposition.reason_digest
    db = capsule_from_verdict(b, operator="acme", salt=SALT).disposition.reason_digest
    assert da == db
    assert da != json_digest({"code": "cap.breached", "rules": [{"rule": "limit", "path": "$.a"}]})
    assert capsule_from_verdict(a, operator="acme", salt="22" * 32).disposition.reason_digest != da
    assert "too many" not in make(a).to_json().decode()


def test_errored_without_effect_still_dispatched() -> None:
    """An errored verdict with no reported effect records a dispatched effect, never not_applicable (§5.4.2)."""
    c = make(verdict("e", "errored", decision="accept"))
    assert c.effect is not None and c.effect.status == "dispatched"
    assert c.assurance.effect_mode == "dispatched_unconfirmed"


def test_chain_block_validated() -> None:
    """A chain parent must be a capsule_id (§5.4.4)."""
    with pytest.raises(CapsuleError):
        Chain("not-a-digest")


def test_signing_from_the_built_body_equals_the_full_rebuild() -> None:
    """link_built (one normalization walk per capsule) signs exactly what ready_to_sign derives afresh."""
    ledger = Ledger(position=7, prev_hash="ab" * 32, prev_capsule_id="cd" * 32)
    for v in design_rows("lb-"):
        built = capsule_map.capsule_from_verdict_checked(v, operator="acme", salt=SALT)
        linked, payload = capm.link_built(built, ledger)
        assert linked.ledger is None and linked.capsule_id == built.capsule.capsule_id
        assert payload == capm.ready_to_sign(linked) == linked.to_json()
        # the legacy form, the ledger linkage inside the capsule, is still built the same way
        legacy = capsule_map.capsule_from_verdict_checked(v, operator="acme", salt=SALT, chained=True)
        linked, payload = capm.link_built(legacy, ledger, embed_ledger=True)
        assert linked == capm.attach_ledger(legacy.capsule, ledger)
        assert payload == capm.ready_to_sign(linked) == linked.to_json()
        assert json.loads(payload)["capsule_id"] == capm.compute_capsule_id(json.loads(payload))


@pytest.mark.parametrize(("position", "capsule_id", "chain", "prev_hash"), [
    (1, "ab" * 32, None, capm.GENESIS_HASH),
    (2**53 - 1, "cd" * 32, {}, "ef" * 32),
    (7, "", None, ""),
    (3, "ab" * 32, {"parent_capsule_id": "12" * 32, "relation": "supersedes"}, "ef" * 32),  # the walk's path
    (4, "AB" * 32, None, 'a"\\b'),  # not lowercase hex: the walk's path, escapes included
    (2**53, "ab" * 32, None, "ef" * 32),  # beyond the safe integers: the walk's path
    (-5, "ab" * 32, None, "ef" * 32),
])
def test_ledger_entry_hash_is_the_json_digest_of_the_link(position: int, capsule_id: str, chain: dict | None,
                                                          prev_hash: str) -> None:
    """A ledger link's hash is JSON-DIGEST of {position, capsule_id, chain, prev_hash}, whichever way it is written."""
    link = {"position": position, "capsule_id": capsule_id, "chain": dict(chain or {}), "prev_hash": prev_hash}
    try:
        want = json_digest(link)
    except CapsuleError:
        with pytest.raises(CapsuleError):
            capm.ledger_entry_hash(position, capsule_id, chain, prev_hash)
        return
    assert capm.ledger_entry_hash(position, capsule_id, chain, prev_hash) == want


@pytest.mark.parametrize(("ts", "expected"), [
    ("2026-03-01T12:00:00.000Z", "2026-03-01T12:00:00.000Z"),  # already the form written: checked, kept
    ("2026-03-01T14:00:00.123+02:00", "2026-03-01T12:00:00.123Z"),
    ("2026-03-01T12:00:00Z", "2026-03-01T12:00:00.000Z"),
    ("2026-03-01T12:00:00.123456Z", "2026-03-01T12:00:00.123Z"),
])
def test_the_verdict_time_is_written_in_utc_with_milliseconds(ts: str, expected: str) -> None:
    assert capm.utc_z(ts) == expected


@pytest.mark.parametrize("ts", ["2026-02-30T12:00:00.000Z", "2026-03-01T24:00:00.000Z", "2026-03-01T12:00:00.000",
                                "\u0662026-03-01T12:00:00.000Z"])
def test_a_verdict_time_that_is_no_date_is_refused_even_in_the_written_form(ts: str) -> None:
    with pytest.raises(ValueError):
        capm.utc_z(ts)
