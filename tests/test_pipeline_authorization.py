"""Spec 001 (RFC-0010 authorization envelopes) through ``vendor.pgw.authorization``."""

from __future__ import annotations

import pytest

from gateway.stages import authorization as authz
from subjects.wire import AuthorizationItem
from tests.pipeline_helpers import Recorder, env, running_gateway

WORKFLOWS = {
    "labs": {"authoritative_intent": "authoritative", "enforcement_mode": "INLINE"},
    "chat": {"authoritative_intent": "non_authoritative", "enforcement_mode": "NON_AUTHORITATIVE_ONLY"},
}
RECORD = {"oracle_id": "lab-1", "tier": "primary", "value": 5.4, "verified_at": "2026-05-01T09:59:00Z"}
PROV = {"oracle_records": [RECORD], "generated_at": "2026-05-01T10:00:00Z", "envelope_id": "p-1"}


def auth(workflow: str, envelope: dict, **kw) -> dict:
    return env("vendor.pgw.authorization", {"workflow_id": workflow, "principal": "alice", "envelope": envelope}, **kw)


def narrative(text: str, mode: str = "hedged", markers=(), scrub=False, spec="contextualized") -> dict:
    return {"kind": "narrative", "text": text, "policy": {"grammar_mode": mode, "forbidden_markers": list(markers),
                                                           "max_specificity": spec, "scrub_measurements": scrub}}


@pytest.fixture
async def rec(nats_server, tmp_path, nc):
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"workflows": WORKFLOWS}), Recorder(nc) as r:
        yield r


async def test_accepted_measurement_reaches_surface_as_authorization_item(rec):
    """A measurement with an oracle record from an authoritative workflow is delivered as an authorization item."""
    out = await rec.roundtrip("planner", auth("labs", {"kind": "measurement", "value": 5.4, "provenance": PROV}))
    assert out.status == "accepted"
    item = await rec.item(lambda i: isinstance(i, AuthorizationItem))
    assert item.envelope["kind"] == "measurement" and item.workflow_id == "labs" and item.principal == "alice"


async def test_unknown_kind_refused_and_rendered_blocked(rec):
    """An unknown authorization kind is refused to the agent and reaches the user only as a BLOCKED refusal."""
    out = await rec.roundtrip("planner", auth("labs", {"kind": "prediction", "value": 1}))
    assert (out.status, out.code) == ("gated", "unknown_authorization_kind")
    v = await rec.verdict(lambda v: v.envelope_id == out.envelope_id)
    assert v.verdict_class == "denied"
    item = await rec.item(lambda i: isinstance(i, AuthorizationItem))
    assert item.envelope["kind"] == "refusal" and item.envelope["reason"]["code"] == "BLOCKED"


async def test_authoritative_kind_needs_an_oracle_record(rec):
    """measurement / classification / action without an oracle record are refused with provenance_required."""
    empty = dict(PROV, oracle_records=[])
    for e in ({"kind": "measurement", "value": 1, "provenance": empty},
              {"kind": "classification", "label": "benign", "provenance": empty},
              {"kind": "action", "action": "refill", "provenance": empty}):
        out = await rec.roundtrip("planner", auth("labs", e))
        assert out.code == "provenance_required", e["kind"]


async def test_authoritative_kind_refused_from_non_authoritative_workflow(rec):
    """An authoritative kind from a non_authoritative workflow is refused even with provenance."""
    out = await rec.roundtrip("planner", auth("chat", {"kind": "classification", "label": "benign", "provenance": PROV}))
    assert out.code == "authority_not_permitted"


async def test_undeclared_workflow_is_refused(rec):
    """An authorization envelope naming an undeclared workflow is refused."""
    out = await rec.roundtrip("planner", auth("nope", narrative("It may rain.")))
    assert out.code == "unknown_workflow"


async def test_forbidden_markers_in_every_workflow(rec):
    """Soft-authority markers (configured or the envelope's own) are refused in authoritative and non-authoritative workflows."""
    for wf in ("labs", "chat"):
        out = await rec.roundtrip("planner", auth(wf, narrative("This result is Confirmed and may change.")))
        assert out.code == "forbidden_marker", wf
    out = await rec.roundtrip("planner", auth("chat", narrative("Rates may be guaranteed-ish.", markers=["ish"])))
    assert out.code == "forbidden_marker"


async def test_scrub_measurements_strips_numbers_with_units(rec):
    """scrub_measurements removes numbers with units from the delivered narrative."""
    out = await rec.roundtrip("planner", auth("chat", narrative("Levels around 5.4 mmol/L and 120 mg may be typical.", scrub=True)))
    assert out.status == "accepted"
    item = await rec.item(lambda i: isinstance(i, AuthorizationItem))
    assert "5.4" not in item.envelope["text"] and "120 mg" not in item.envelope["text"]
    assert "may be typical" in item.envelope["text"]


async def test_grammar_modes(rec):
    """attributive must attribute, hedged must hedge, educational must not direct the reader's own case."""
    bad = [narrative("Fasting lowers glucose.", mode="attributive"), narrative("Fasting lowers glucose.", mode="hedged"),
           narrative("You should stop taking the drug.", mode="educational")]
    for n in bad:
        assert (await rec.roundtrip("planner", auth("chat", n))).code == "narrative_policy_violation"
    good = [narrative("According to the ADA, fasting lowers glucose.", mode="attributive"),
            narrative("Fasting may lower glucose.", mode="hedged"),
            narrative("Glucose is a sugar the body uses for energy.", mode="educational")]
    for n in good:
        assert (await rec.roundtrip("planner", auth("chat", n))).status == "accepted"


async def test_general_specificity_refuses_precise_measurements(rec):
    """max_specificity general refuses a narrative with precise measurements unless they are scrubbed."""
    out = await rec.roundtrip("planner", auth("chat", narrative("It may be 42 mg.", spec="general")))
    assert out.code == "narrative_policy_violation"


async def test_user_refusal_has_no_control_plane_detail(rec):
    """What the user sees of a refused envelope carries no oracle, workflow or rule detail."""
    out = await rec.roundtrip("planner", auth("chat", {"kind": "measurement", "value": 7, "provenance": PROV}))
    assert out.code == "authority_not_permitted" and "non_authoritative" in out.reason
    item = await rec.item(lambda i: isinstance(i, AuthorizationItem))
    shown = str(item.envelope).lower()
    for leak in ("oracle", "non_authoritative", "workflow", "authority_not_permitted", "lab-1", "threshold"):
        assert leak not in shown


async def test_dispute_summary_delivered_as_such(rec):
    """A dispute summary is delivered as a dispute_summary item, not as a claim."""
    ds = {"kind": "dispute_summary", "sources": [{"axis": "potassium", "resolution_attempted": True, "escalation_required": True,
          "oracles": [{"oracle_id": "a", "tier": "primary", "value": 4.1, "verified_at": "2026-05-01T00:00:00Z"},
                      {"oracle_id": "b", "tier": "secondary", "value": 5.9, "verified_at": "2026-05-01T00:00:00Z"}]}]}
    out = await rec.roundtrip("planner", auth("labs", ds))
    assert out.status == "accepted"
    item = await rec.item(lambda i: isinstance(i, AuthorizationItem))
    assert item.envelope["kind"] == "dispute_summary" and len(item.envelope["sources"][0]["oracles"]) == 2


async def test_untrusted_authoritative_kind_is_blocked(rec):
    """An action authorization carrying untrusted content is refused with untrusted_content_blocks_approval."""
    out = await rec.roundtrip("planner", auth("labs", {"kind": "action", "action": "refill", "provenance": PROV}, content_trust="untrusted"))
    assert out.code == "untrusted_content_blocks_approval" and out.untrusted


def test_scrub_measurements_keeps_plain_numbers_in_prose():
    """Numbers without units (years, counts) are not measurements."""
    assert authz.scrub_measurements("In 2024, 3 of the clinics reported it.") == "In 2024, 3 of the clinics reported it."
    assert "[measurement removed]" in authz.scrub_measurements("Dose: 500 mg twice daily, 37.5 °C")
