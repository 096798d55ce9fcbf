"""The IDP record's field rules (spec 003 §4, §7), PII markers (§9) and policy loading (§5.4)."""

from __future__ import annotations

import uuid
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.kernel.policy import PolicyEngine, PolicyLoadError, idp_context, split_statements
from subjects.idp import IdpStandard, IdpThin, LogEvent, decode_idp, idp_json_schemas, pii_markers
from tests.kernel_support import EXAMPLE_POLICIES, idp, thin

SO = str(uuid.uuid4())


def _bad(**over: object) -> str:
    with pytest.raises(msgspec.ValidationError) as e:
        rec = idp(so_id=SO, mandate_id="m", step=1, action="A")
        rec.update(over)
        decode_idp({k: v for k, v in rec.items() if v is not None})
    return str(e.value)


def test_valid_standard_idp_decodes_with_its_profile() -> None:
    """A complete IDP_STANDARD record decodes as IdpStandard and keeps audit_accessible true by default."""
    rec = decode_idp(idp(so_id=SO, mandate_id="m", step=1, action="A"))
    assert isinstance(rec, IdpStandard)
    assert rec.audit_accessible is True


@pytest.mark.parametrize(
    ("over", "where"),
    [
        ({"idp_id": "not-a-uuid"}, "$.idp_id"),
        ({"idp_id": "6f1c1d2e-3b4a-1c5d-8e6f-7a8b9c0d1e2f"}, "$.idp_id"),  # UUID v1, not v4
        ({"so_id": "x"}, "$.so_id"),
        ({"confidence_level": 1.01}, "$.confidence_level"),
        ({"confidence_level": -0.1}, "$.confidence_level"),
        ({"hem_urgency": "SOMETIMES"}, "$.hem_urgency"),
        ({"step_sequence": 0}, "$.step_sequence"),
        ({"declared_goal": {"goal_id": str(uuid.uuid4()), "description": "g" * 501}}, "$.declared_goal.description"),
        ({"reasoning_basis": {"type": "INFERENCE", "description": "r" * 1001}}, "$.reasoning_basis.description"),
        ({"timestamp": "2026-01-01T10:00:00+02:00"}, "$.timestamp"),
        ({"timestamp": "2026-01-01 10:00"}, "$.timestamp"),
        ({"declared_goal": None}, "declared_goal"),
        ({"reasoning_basis": None}, "reasoning_basis"),
        ({"context_refs": ["nope"]}, "$.context_refs[0]"),
    ],
)
def test_each_field_rule_is_enforced(over: dict, where: str) -> None:
    """Every field rule of spec 003 §4.1-§4.2 (UUIDs, 500/1000 lengths, [0,1], UTC time, enums) refuses a bad value."""
    assert where in _bad(**over)


def test_limits_are_inclusive() -> None:
    """A 500-char goal, a 1000-char reasoning and confidence 0 and 1 are all accepted (spec 003 §4.2)."""
    for c in (0.0, 1.0):
        decode_idp(idp(so_id=SO, mandate_id="m", step=1, action="A", confidence_level=c,
                       declared_goal={"goal_id": str(uuid.uuid4()), "description": "g" * 500},
                       reasoning_basis={"type": "INFERENCE", "description": "r" * 1000}))


def test_impossible_date_is_malformed() -> None:
    """A timestamp shaped like RFC 3339 but with month 13 is malformed."""
    assert "timestamp" in _bad(timestamp="2026-13-01T00:00:00Z")


def test_unknown_reasoning_type_is_accepted() -> None:
    """An unregistered reasoning_basis.type is recorded, never rejected (spec 003 §4.3)."""
    rec = decode_idp(idp(so_id=SO, mandate_id="m", step=1, action="A",
                         reasoning_basis={"type": "https://example.org/HUNCH", "description": "x"}))
    assert rec.reasoning_basis.type == "https://example.org/HUNCH"


def test_mission_stage_needs_mission_ref() -> None:
    """reasoning_basis.type MISSION_STAGE without mission_ref is malformed (spec 003 §4.3)."""
    assert "mission_ref" in _bad(reasoning_basis={"type": "MISSION_STAGE", "description": "advance"})


def test_thin_profile_needs_only_the_core_fields() -> None:
    """An IDP_THIN with only the §7 REQUIRED fields decodes as IdpThin; missing so_id is still malformed."""
    full = idp(so_id=SO, mandate_id="m", step=1, action="A")
    rec = decode_idp(thin(full))
    assert isinstance(rec, IdpThin) and rec.confidence_level is None
    broken = thin(full)
    del broken["so_id"]
    with pytest.raises(msgspec.ValidationError):
        decode_idp(broken)


def test_thin_context_leaves_absent_attributes_out() -> None:
    """Cedar sees no stub values for an IDP_THIN: absent attributes are absent (spec 003 §5.4)."""
    ctx = idp_context(decode_idp(thin(idp(so_id=SO, mandate_id="m", step=1, action="A"))))
    assert "confidence_level" not in ctx and "reasoning_basis" not in ctx and "hem_urgency" not in ctx


@pytest.mark.parametrize(
    ("text", "kinds"),
    [
        ("write to jane.doe@example.com", ["email"]),
        ("call +44 20 7946 0958 now", ["phone"]),
        ("call 555-123-4567", ["phone"]),
        ("booking 2026-11-21 closes at confidence 0.85 for 3 nights", []),
        ("object 0a4c661a-4172-40d7-9aab-b1073e9c1bcb", []),
        ("ask Dr. Okafor first", ["name"]),
        ("the doctor of the booking", []),
    ],
)
def test_pii_markers(text: str, kinds: list[str]) -> None:
    """E-mail addresses and phone numbers are flagged; dates, decimals and UUIDs are not (spec 003 §9)."""
    assert pii_markers(text) == kinds


@given(st.text(max_size=300))
def test_pii_markers_never_crash(text: str) -> None:
    """Any text yields a list of known marker kinds."""
    assert set(pii_markers(text, ("Jane Doe",))) <= {"email", "phone", "name"}


def test_log_event_signing_bytes_exclude_the_signature() -> None:
    """The signed form of an event is its JCS without sig, and the digest covers the sig."""
    ev = LogEvent(event_id="e", event_type="X", ts="t", prev_seq=0, prev_digest="0" * 64, kid="k", body={"b": 1.5})
    before = ev.signing_bytes()
    d1 = ev.digest()
    ev.sig = "abc"
    assert ev.signing_bytes() == before and ev.digest() != d1
    assert b'"sig"' not in before


def test_json_schemas_come_from_the_structs() -> None:
    """The published schemas carry the spec limits (500, 1000, [0,1])."""
    s = msgspec.json.encode(idp_json_schemas()).decode()
    assert '"maxLength":500' in s and '"maxLength":1000' in s and '"maximum":1.0' in s


def test_example_policies_load() -> None:
    """The shipped example policies parse and validate."""
    assert PolicyEngine(EXAMPLE_POLICIES).files == ["example.cedar"]


def test_bad_policy_names_file_and_line(tmp_path: Path) -> None:
    """A policy file that does not parse fails loading with its file name and the line of the bad statement."""
    (tmp_path / "a_good.cedar").write_text('permit(principal, action == Action::"A", resource);\n')
    (tmp_path / "b_bad.cedar").write_text(
        '// header\npermit(principal, action, resource);\n\n\nforbid(principal, action ==, resource);\n'
    )
    with pytest.raises(PolicyLoadError) as e:
        PolicyEngine(tmp_path)
    assert e.value.file == "b_bad.cedar" and e.value.line == 5
    assert "b_bad.cedar:5" in str(e.value)


def test_missing_policy_folder_fails(tmp_path: Path) -> None:
    """A configured policy folder that does not exist fails start-up."""
    with pytest.raises(PolicyLoadError):
        PolicyEngine(tmp_path / "nope")


def test_split_ignores_semicolons_in_strings_and_comments() -> None:
    """Statement splitting skips ';' inside strings and comments and reports start lines."""
    text = '// a; b\npermit(principal, action == Action::"x;y", resource);\nforbid(principal, action, resource);'
    assert [ln for ln, _ in split_statements(text)] == [2, 3]


def test_dev_issuer_trusted_only_when_configured(tmp_path: Path) -> None:
    """A mandate from `pgw mandate issue`'s dev key verifies only with kernel.trust_dev_issuer = true."""
    from gateway.kernel.mandate import DEV_ISSUER_ROLE, MandateError, MandateVerifier, issue_mandate
    from pgwcore.config import KernelConfig
    from pgwcore.keys import load_or_create

    key = load_or_create(tmp_path, DEV_ISSUER_ROLE)
    token = issue_mandate(key.private, key.kid, agent="bot", so_id=SO, principal="~alice", actions=["A"])
    m = MandateVerifier(KernelConfig(trust_dev_issuer=True), tmp_path).verify(token, agent="bot")
    assert m.principal == "alice" and m.actions == ("A",)
    with pytest.raises(MandateError) as e:
        MandateVerifier(KernelConfig(), tmp_path).verify(token, agent="bot")
    assert e.value.code == "MANDATE_INVALID"


def test_mandate_without_so_id_is_invalid(tmp_path: Path) -> None:
    """A signed mandate lacking the so_id claim is MANDATE_INVALID."""
    import jwt

    from gateway.kernel.mandate import DEV_ISSUER_ROLE, MandateError, MandateVerifier
    from pgwcore.config import KernelConfig
    from pgwcore.keys import load_or_create

    key = load_or_create(tmp_path, DEV_ISSUER_ROLE)
    token = jwt.encode({"jti": "j", "sub": "bot", "principal": "alice", "actions": [], "exp": 4102444800},
                       key.private, algorithm="EdDSA", headers={"kid": key.kid})
    with pytest.raises(MandateError) as e:
        MandateVerifier(KernelConfig(trust_dev_issuer=True), tmp_path).verify(token, agent="bot")
    assert e.value.code == "MANDATE_INVALID" and "so_id" in e.value.reason
