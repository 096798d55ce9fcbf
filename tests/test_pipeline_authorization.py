"""Spec 001 (RFC-0010 authorization envelopes) through ``vendor.pgw.authorization``."""

from __future__ import annotations

import io
import re
import sys
from datetime import UTC
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from consumers.surfaces.model import plan_item
from consumers.surfaces.terminal import TerminalSurface
from consumers.surfaces.text import render_plan
from gateway.stages import authorization as authz
from gateway.stages import route
from gateway.stages.base import Ctx, Turn
from pgwcore.config import load_config
from subjects.errors import ConfigError
from subjects.wire import AuthorizationItem, WithdrawnItem
from tests.pipeline_helpers import Recorder, env, running_gateway

sys.path.insert(0, str(Path(__file__).parent / "web"))
import surface_kit

WORKFLOWS = {
    "labs": {"authoritative_intent": "authoritative", "enforcement_mode": "INLINE"},
    "chat": {"authoritative_intent": "non_authoritative", "enforcement_mode": "NON_AUTHORITATIVE_ONLY"},
    "labs-async": {"authoritative_intent": "authoritative", "enforcement_mode": "ASYNC"},
    "labs-strict": {"authoritative_intent": "authoritative", "enforcement_mode": "INLINE", "oracles": ["lab-1"]},
    "locked": {"authoritative_intent": "authoritative", "enforcement_mode": "NON_AUTHORITATIVE_ONLY"},
}
RECORD = {"oracle_id": "lab-1", "tier": "primary", "value": 5.4, "verified_at": "2026-05-01T09:59:00Z"}
PROV = {"oracle_records": [RECORD], "generated_at": "2026-05-01T10:00:00Z", "envelope_id": "p-1"}


def prov(envelope_id: str, **kw) -> dict:
    """Provenance with its own envelope_id (spec 001: unique per workflow); ``kw`` overrides fields."""
    return dict(PROV, envelope_id=envelope_id, **kw)


def measurement(envelope_id: str, **kw) -> dict:
    return {"kind": "measurement", "value": 5.4, "provenance": prov(envelope_id, **kw)}


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



# --- spec 001 RefusalReason: an agent-authored refusal, as every surface shows it

LEAKY = {"code": "POLICY_VIOLATION", "user_message": "Oracle lab-1 (primary) read 5.9 > threshold 5.5; workflow labs is INLINE",
         "recovery_hint": "Lower labs.threshold_potassium below 5.9", "audit_id": "lab-1/threshold-5.5"}


def surfaces_show(item: AuthorizationItem) -> str:
    """Everything the terminal surface and the browser's plan.js make of ``item``, as one text."""
    raw = msgspec.json.encode(item)
    terminal = "\n".join(render_plan(plan_item(raw), width=400))
    browser = str(surface_kit.js_plans([msgspec.json.decode(raw)])[0])
    return terminal + "\n" + browser


async def test_agent_refusal_reaches_surfaces_without_control_plane_detail(rec):
    """An agent's refusal keeps its code, but its oracle/threshold message, hint and audit id never reach a surface; the id is kept for audit."""
    out = await rec.roundtrip("planner", auth("labs", {"kind": "refusal", "reason": LEAKY}))
    assert out.status == "accepted"
    rules = {w.rule: w.message for w in out.warnings}
    assert "lab-1/threshold-5.5" in rules["audit_id_opaque"] and "control_plane_detail_withheld" in rules
    item = await rec.item(lambda i: isinstance(i, AuthorizationItem))
    reason = item.envelope["reason"]
    assert reason["code"] == "POLICY_VIOLATION" and reason["audit_id"] == item.item_id
    assert reason["user_message"] == authz.USER_MESSAGES["POLICY_VIOLATION"] and "recovery_hint" not in reason
    assert "workflow" not in str(item.envelope).lower()
    # Every surface names the item's workflow in its header (the context the principal
    # set up, as on every authorization item); nothing of the agent's reason is shown.
    shown = (str(item.envelope) + surfaces_show(item)).lower()
    for leak in ("lab-1", "threshold", "oracle", "inline", "primary"):
        assert leak not in shown, leak
    # The readings as numbers of their own: a timestamp's "…:55.566z" holds "5.5" too.
    for reading in ("5.9", "5.5"):
        assert not re.search(rf"(?<![\d.]){re.escape(reading)}(?![\d])", shown), reading


async def test_clean_agent_refusal_is_shown_with_its_words_and_an_opaque_audit_id(rec):
    """A refusal message free of control-plane detail is shown as written, with the gateway's opaque audit id."""
    reason = {"code": "EMERGENCY_ESCALATION", "user_message": "Please call your doctor today.",
              "recovery_hint": "Ask again after you have spoken to them.", "audit_id": "case-77/oracle-a"}
    out = await rec.roundtrip("planner", auth("chat", {"kind": "refusal", "reason": reason}))
    rules = [w.rule for w in out.warnings]
    assert out.status == "accepted" and "audit_id_opaque" in rules and "control_plane_detail_withheld" not in rules
    item = await rec.item(lambda i: isinstance(i, AuthorizationItem))
    assert item.envelope["reason"] == dict(reason, audit_id=item.item_id)
    shown = surfaces_show(item)
    assert "Please call your doctor today." in shown and "case-77" not in shown


def test_gateway_user_messages_pass_the_control_plane_screen():
    """The gateway's own refusal texts pass the screen agent refusals are held to, and the brief's leak does not."""
    for text in [*authz.USER_MESSAGES.values(), authz.WITHDRAWN_MESSAGE]:
        assert authz.control_plane_detail(text) is None, text
    assert authz.control_plane_detail(LEAKY["user_message"]) is not None
    assert authz.control_plane_detail("Your potassium reading 5.9 >= 5.5") is not None
    assert authz.control_plane_detail("Ask lab-7 again", ["lab-7"]) == "lab-7"


# --- spec 001 Binding Rules: forbidden markers on every principal-visible string

async def test_soft_authority_markers_refused_in_every_visible_string(rec):
    """A soft-authority marker in a refusal message or hint, an action, its params or a label is refused like one in a narrative."""
    claim = "Your diagnosis is confirmed and clinically proven."
    cases = [
        ("chat", {"kind": "refusal", "reason": {"code": "UNRESOLVABLE", "user_message": claim, "audit_id": "a"}}),
        ("chat", {"kind": "refusal", "reason": {"code": "UNRESOLVABLE", "user_message": "Not now.",
                                                "recovery_hint": claim, "audit_id": "a"}}),
        ("labs", {"kind": "action", "action": claim, "provenance": prov("m-action")}),
        ("labs", {"kind": "action", "action": "refill", "params": {"note": claim}, "provenance": prov("m-params")}),
        ("labs", {"kind": "classification", "label": "benign (verified)", "provenance": prov("m-label")}),
    ]
    for wf, e in cases:
        out = await rec.roundtrip("planner", auth(wf, e))
        assert out.code == "forbidden_marker", e


async def test_refused_emergency_escalation_keeps_its_code_for_the_principal(rec):
    """An EMERGENCY_ESCALATION refused for a marker still reaches the principal as EMERGENCY_ESCALATION, in the gateway's words."""
    reason = {"code": "EMERGENCY_ESCALATION", "user_message": "Confirmed: call 911 now.", "audit_id": "a"}
    out = await rec.roundtrip("planner", auth("chat", {"kind": "refusal", "reason": reason}))
    assert out.code == "forbidden_marker"
    item = await rec.item(lambda i: isinstance(i, AuthorizationItem) and i.envelope_id == out.envelope_id)
    assert item.envelope["reason"]["code"] == "EMERGENCY_ESCALATION"
    assert item.envelope["reason"]["user_message"] == authz.USER_MESSAGES["EMERGENCY_ESCALATION"]


# --- spec 001 Provenance: oracle records

async def test_malformed_oracle_records_refused_with_their_own_code(rec):
    """An empty, untimed or unknown-tier oracle record is refused as oracle_record_invalid, not counted as a record."""
    for records in ([{}], [{"oracle_id": "lab-1", "tier": "primary"}],
                    [dict(RECORD, verified_at="yesterday")], [dict(RECORD, tier="gold")], ["lab-1"]):
        out = await rec.roundtrip("planner", auth("labs", {"kind": "measurement", "value": 1,
                                                           "provenance": prov("m-bad", oracle_records=records)}))
        assert out.code == "oracle_record_invalid", records
        assert out.details[0].path.startswith("$.payload.envelope.provenance.oracle_records[0]")


async def test_oracle_verification_failures_refused(rec):
    """Only unverified-tier records, an oracle the workflow does not declare, or a record verified in the future fail verification."""
    cases = [("labs", [dict(RECORD, tier="unverified")]), ("labs-strict", [dict(RECORD, oracle_id="lab-9")]),
             ("labs", [dict(RECORD, verified_at="2999-01-01T00:00:00Z")])]
    for i, (wf, records) in enumerate(cases):
        out = await rec.roundtrip("planner", auth(wf, measurement(f"m-v{i}", oracle_records=records)))
        assert out.code == "oracle_verification_failed", records
    out = await rec.roundtrip("planner", auth("labs-strict", measurement("m-v-ok")))
    assert out.status == "accepted"


# --- spec 001 Binding Rules: enforcement_mode

async def test_inline_verifies_before_delivery(rec):
    """INLINE: an envelope failing oracle verification is never delivered; the principal sees only a refusal."""
    out = await rec.roundtrip("planner", auth("labs", measurement("m-inline", oracle_records=[dict(RECORD, tier="unverified")])))
    assert (out.status, out.code) == ("gated", "oracle_verification_failed")
    await rec.verdict(lambda v: v.envelope_id == out.envelope_id and v.verdict_class == "denied")
    items = [i for i in rec.items if getattr(i, "envelope_id", None) == out.envelope_id]
    assert [i.envelope["kind"] for i in items] == ["refusal"]


async def test_async_delivers_then_withdraws_when_verification_fails(rec):
    """ASYNC: the envelope is delivered first, then withdrawn with a notice and refused when oracle verification fails."""
    out = await rec.roundtrip("planner", auth("labs-async", measurement("m-async", oracle_records=[dict(RECORD, tier="unverified")])))
    assert (out.status, out.code) == ("gated", "oracle_verification_failed")
    assert "withdrawn" in [d.rule for d in out.details]
    first = await rec.item(lambda i: isinstance(i, AuthorizationItem) and i.envelope["kind"] == "measurement")
    gone = await rec.item(lambda i: isinstance(i, WithdrawnItem) and i.moment_id == first.item_id)
    notice = await rec.item(lambda i: isinstance(i, AuthorizationItem) and i.envelope["kind"] == "refusal")
    order = [id(x) for x in rec.items]
    assert order.index(id(first)) < order.index(id(gone)) < order.index(id(notice))
    assert notice.envelope["reason"]["user_message"] == authz.WITHDRAWN_MESSAGE
    await rec.verdict(lambda v: v.envelope_id == out.envelope_id and v.verdict_class == "denied")
    # The terminal surface drops the measurement and keeps the notice; the browser's model plans the removal of that card.
    term = TerminalSurface(None, out=io.StringIO(), color=False)  # type: ignore[arg-type]
    for i in (first, gone, notice):
        term.apply(msgspec.json.encode(i))
    assert list(term.board) == [notice.item_id]
    js_first, js_gone = surface_kit.js_plans([msgspec.to_builtins(first), msgspec.to_builtins(gone)])
    assert js_gone == dict(js_gone, plan="withdraw", moment_id=js_first["item_id"])


async def test_async_delivers_a_verified_envelope_without_withdrawal(rec):
    """ASYNC: an envelope that passes verification is delivered and accepted, and nothing is withdrawn."""
    out = await rec.roundtrip("planner", auth("labs-async", measurement("m-async-ok")))
    assert out.status == "accepted"
    await rec.item(lambda i: isinstance(i, AuthorizationItem) and i.envelope["kind"] == "measurement")
    assert not any(isinstance(i, WithdrawnItem) for i in rec.items)


async def test_non_authoritative_only_refuses_authority_even_with_authoritative_intent(rec):
    """NON_AUTHORITATIVE_ONLY refuses an authoritative kind even in a workflow declaring authoritative intent."""
    out = await rec.roundtrip("planner", auth("locked", measurement("m-locked")))
    assert out.code == "authority_not_permitted"


# --- spec 001 Provenance: generated_at and envelope_id

async def test_generated_at_must_be_rfc3339(rec):
    """A generated_at that is not an RFC 3339 timestamp is refused as provenance_invalid."""
    for bad in ("whenever", "2026-05-01", "2026-13-01T10:00:00Z", "2026-05-01T10:00:00"):
        out = await rec.roundtrip("planner", auth("labs", measurement("m-time", generated_at=bad)))
        assert (out.code, out.details[0].path) == ("provenance_invalid", "$.payload.envelope.provenance.generated_at"), bad


async def test_reused_envelope_id_refused_per_workflow(rec):
    """A provenance envelope_id already delivered in a workflow is refused as envelope_id_reused; another workflow may use it."""
    assert (await rec.roundtrip("planner", auth("labs", measurement("m-dup")))).status == "accepted"
    again = await rec.roundtrip("planner", auth("labs", {"kind": "classification", "label": "benign", "provenance": prov("m-dup")}))
    assert (again.status, again.code) == ("gated", "envelope_id_reused")
    kv = await rec.js.key_value("PGW_DEDUP")
    assert (await kv.get(authz.envelope_id_key("labs", "m-dup"))).value
    assert (await rec.roundtrip("planner", auth("labs-async", measurement("m-dup")))).status == "accepted"


async def test_refused_envelope_does_not_burn_its_envelope_id(rec):
    """An envelope refused before delivery leaves its provenance envelope_id free for the corrected one."""
    bad = await rec.roundtrip("planner", auth("labs", measurement("m-fix", generated_at="whenever")))
    assert bad.code == "provenance_invalid"
    assert (await rec.roundtrip("planner", auth("labs", measurement("m-fix")))).status == "accepted"


# --- spec 001 "Every workflow MUST declare" its intent

def test_workflow_without_authoritative_intent_fails_start_up(tmp_path):
    """A [pipeline.workflows.X] table without authoritative_intent fails loading with the field named."""
    cfg = tmp_path / "pgw.toml"
    cfg.write_text('[pipeline.workflows.labs]\nenforcement_mode = "INLINE"\n')
    with pytest.raises(ConfigError, match=r"pipeline\.workflows\.labs\.authoritative_intent"):
        load_config(cfg)
    cfg.write_text('[pipeline.workflows.labs]\nauthoritative_intent = "authoritative"\n')
    assert load_config(cfg).pipeline.workflows["labs"].enforcement_mode == "NON_AUTHORITATIVE_ONLY"


async def test_supporting_types_enforce_their_minimum_schemas(rec):
    """Each supporting type's normative minimum schema is enforced: a variant missing or misusing a field is envelope_invalid."""
    bad = [
        ("labs", {"kind": "measurement", "value": 1, "provenance": {"oracle_records": [RECORD], "generated_at": "2026-05-01T10:00:00Z"}}),
        ("chat", {"kind": "narrative", "text": "It may rain."}),
        ("chat", dict(narrative("It may rain."), policy={"grammar_mode": "poetic", "forbidden_markers": [],
                                                          "max_specificity": "general", "scrub_measurements": False})),
        ("chat", {"kind": "refusal", "reason": {"code": "NOPE", "user_message": "No.", "audit_id": "a"}}),
        ("chat", {"kind": "refusal", "reason": {"code": "BLOCKED", "user_message": "No."}}),
        ("labs", {"kind": "dispute_summary", "sources": [{"axis": "k", "resolution_attempted": True, "escalation_required": False,
                  "oracles": [{"oracle_id": "a", "tier": "gold", "value": 1, "verified_at": "2026-05-01T00:00:00Z"}]}]}),
    ]
    for wf, e in bad:
        out = await rec.roundtrip("planner", auth(wf, e))
        assert out.code == "envelope_invalid", e


@given(st.datetimes(timezones=st.just(UTC)))
def test_rfc3339_reads_every_aware_timestamp_and_refuses_naive_ones(dt):
    """Every timezone-aware ISO timestamp is RFC 3339 and reads back as itself; the same without a zone is refused."""
    assert authz.rfc3339(dt.isoformat()) == dt
    assert authz.rfc3339(dt.replace(tzinfo=None).isoformat()) is None



async def test_an_envelope_id_claim_is_its_owners_on_redelivery(nats_server, tmp_path):
    """The envelope that claimed a provenance envelope_id may claim it again (a redelivery); any other envelope is refused."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"workflows": WORKFLOWS}) as gw:
        state = await gw.stage_state.get()

        def ctx(body: bytes) -> Ctx:
            return Ctx(gw=gw, turn=Turn(agent="planner", subject="s", stream_seq=1, body=body, msg_id=None, traceparent=None),
                       index=0, raw=None, state=state)

        await route._claim_envelope_id(ctx(b"first"), "labs", "m-claim")
        await route._claim_envelope_id(ctx(b"first"), "labs", "m-claim")
        with pytest.raises(authz.PolicyRefusal) as refused:
            await route._claim_envelope_id(ctx(b"second"), "labs", "m-claim")
        assert refused.value.code == "envelope_id_reused"
