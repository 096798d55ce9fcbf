"""Spec 004 read line by line: what a capsule claims, which class it carries, what the verifier reports.

Each test names the rule it holds the code to (spec 004 = draft -01 for
format "2"; draft -05 at the commit named in consumers/capsule_v4.py for
format "4").
"""

from __future__ import annotations

import json
from typing import Any

from consumers import capsule as capm
from consumers import capsule_map, capsule_v4
from consumers.cose import sign_statement
from consumers.signer import claims_for
from consumers.verifier import verify_many, verify_statement
from tests.test_capsule_cose import signing_key, trusted
from tests.test_capsule_model import SALT, design_rows

KEY = signing_key()
KEYS = {KEY.kid: trusted(KEY)}


def _signed(p: dict[str, Any], *, claims: dict[Any, Any] | None = None, content_type: str = capm.MEDIA_TYPE,
            reid: bool = True) -> bytes:
    if reid:
        p["capsule_id"] = capm.compute_capsule_id(p)
    return sign_statement(json.dumps(p).encode(), KEY.private, KEY.kid,
                          claims if claims is not None else claims_for(p), content_type)


def _built(v: Any, parent: str | None = None) -> dict[str, Any]:
    built = capsule_map.capsule_from_verdict_checked(v, operator="acme", salt=SALT)
    _cap, payload = capm.link_built(built, capm.Ledger(position=3, prev_hash="ab" * 32), parent)
    return json.loads(payload)


def _codes(res: Any, severity: str | None = None) -> list[str]:
    return [f.code for f in res.findings if severity is None or f.severity == severity]


# --- §5.3: ledger_mode from the chain block ------------------------------------------------------


def test_chain_block_alone_makes_a_format2_capsule_chained() -> None:
    """A -01 capsule linked only by its chain block, as the reference library builds it, verifies as chained."""
    rows = design_rows("ref-")
    dispatch = _built(rows[2])
    dispatch.pop("ledger", None)
    dispatch["assurance"]["ledger_mode"] = "standalone"
    dispatch["capsule_id"] = capm.compute_capsule_id(dispatch)
    resolution = _built(rows[3], dispatch["capsule_id"])
    resolution.pop("ledger", None)  # the reference library's -01 capsule: linked by its chain block only
    assert resolution["chain"]["parent_capsule_id"] == dispatch["capsule_id"]
    assert resolution["assurance"]["ledger_mode"] == "chained"
    res = verify_many([("d", _signed(dispatch)), ("r", _signed(resolution))], keys=KEYS)
    assert all(r.ok for r in res), [r.findings for r in res]
    assert [r.assurance["ledger_mode"] for r in res] == ["standalone", "chained"]
    assert not [c for r in res for c in _codes(r) if "overclaim" in c]
    # a chained claim with neither a chain block nor a ledger linkage is still an overclaim
    lone = dict(dispatch, assurance=dict(dispatch["assurance"], ledger_mode="chained"))
    assert "ledger_overclaim" in _codes(verify_statement(_signed(lone), keys=KEYS), "error")


def test_format2_capsule_id_does_not_depend_on_the_ledger_position() -> None:
    """The signer's hash chain stays out of a format-2 capsule: one verdict, one capsule_id, at any position."""
    v = design_rows()[0]
    built = capsule_map.capsule_from_verdict_checked(v, operator="acme", salt=SALT)
    a, pa = capm.link_built(built, capm.Ledger(position=1, prev_hash=capm.GENESIS_HASH))
    b, pb = capm.link_built(built, capm.Ledger(position=9, prev_hash="cd" * 32, prev_capsule_id="ef" * 32))
    assert a.capsule_id == b.capsule_id and pa == pb
    body = json.loads(pa)
    assert "ledger" not in body and body["assurance"]["ledger_mode"] == "standalone"  # no chain: standalone


# --- draft -05 {#identity}: spec_version ------------------------------------------------------------


def test_format4_spec_version_is_the_value_the_draft_defines() -> None:
    """A format-4 capsule carries the spec_version the -05 text defines ({#identity}: "...-04")."""
    b4 = capsule_v4.from_verdict(design_rows()[0], operator="acme", salt=SALT)
    assert b4.body["spec_version"] == "draft-mih-scitt-agent-action-capsule-04"
    assert capsule_v4.SPEC_VERSION in capsule_v4.ACCEPTED_SPEC_VERSIONS


# --- §3.1, §9, §9.1: the header and namespacing findings -----------------------------------------------


def _plain() -> dict[str, Any]:
    return _built(design_rows()[1])


def test_cwt_iss_other_than_the_developer_is_an_error() -> None:
    """§3.1: CWT iss is the capsule's developer; another iss is the error cwt_iss."""
    p = _plain()
    claims = {**claims_for(p), 1: "someone-else"}
    assert "cwt_iss" in _codes(verify_statement(_signed(p, claims=claims), keys=KEYS), "error")


def test_missing_statement_type_is_an_error() -> None:
    """§3.1: capsule_statement_type is REQUIRED; without it the statement fails with cwt_statement_type."""
    p = _plain()
    claims = {k: v for k, v in claims_for(p).items() if k != "capsule_statement_type"}
    assert "cwt_statement_type" in _codes(verify_statement(_signed(p, claims=claims), keys=KEYS), "error")


def test_wrong_content_type_is_an_error() -> None:
    """§3.1: the content_type MUST be application/agent-action-capsule+json."""
    res = verify_statement(_signed(_plain(), content_type="application/json"), keys=KEYS)
    assert _codes(res, "error") == ["content_type"]


def test_unknown_capsule_header_claim_is_informational() -> None:
    """§9: an unrecognized capsule_* header claim is verified and reported as info, never rejected."""
    p = _plain()
    claims = {**claims_for(p), "capsule_future_claim": "x"}
    res = verify_statement(_signed(p, claims=claims), keys=KEYS)
    assert res.ok and "unknown_header_claim" in _codes(res, "info")


def test_bare_constraint_names_are_informational() -> None:
    """§9.1: a bare, unseeded constraint id or check_type is non-conforming for a producer; a verifier says info."""
    p = _plain()
    p["constraints"] = [dict(p["constraints"][0], id="margin_floor", check_type="threshold")]
    res = verify_statement(_signed(p), keys=KEYS)
    assert res.ok
    assert [f.path for f in res.findings if f.code == "constraint_not_namespaced"] == [
        "$.constraints[0].id", "$.constraints[0].check_type"]


def test_fixture_rows_are_what_the_gateway_emits() -> None:
    """No fixture verdict pairs approver human with human_disposed false: the gateway never emits that."""
    rows = design_rows()
    assert not [v.verdict_id for v in rows if v.approver == "human" and not v.human_disposed]
