"""The shared render model (consumers/surfaces/model.py) and its terminal text.

Each test pins one rule of the renderer contract (spec 000 §9.1-§9.3, §12.5)
or of spec 001's client requirement, so removing the rule fails it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from consumers.surfaces.model import (
    AuthorizationPlan,
    ClarificationPlan,
    DecisionPlan,
    NoticePlan,
    WithdrawPlan,
    plan_item,
)
from consumers.surfaces.terminal import parse_keys
from consumers.surfaces.text import render_plan

sys.path.insert(0, str(Path(__file__).parent / "web"))
import surface_kit

CORPUS = dict(surface_kit.corpus())


def test_every_briefing_slot_and_option_reasoning_is_in_the_plan_and_on_screen() -> None:
    """A well-formed moment plans all four briefing slots and every option with its reasoning, and the text shows them."""
    plan = plan_item(CORPUS["good"])
    assert isinstance(plan, DecisionPlan)
    bm = CORPUS["good"]["binding_moment"]
    assert plan.synopsis == bm["synopsis"]
    assert plan.findings == bm["findings"]
    assert plan.recommendations == bm["recommendations"]
    assert plan.offer == bm["offer"]
    assert [(o.label, o.reasoning) for o in plan.options] == [
        (o["label"], o["reasoning"]) for o in bm["question"]["options"]
    ]
    screen = "\n".join(render_plan(plan, width=200))
    for text in [bm["synopsis"], bm["offer"], bm["question"]["stem"], *bm["findings"], *bm["recommendations"]]:
        assert text in screen
    for o in bm["question"]["options"]:
        assert o["label"] in screen and o["reasoning"] in screen


def test_exactly_the_recommended_option_is_distinguished_before_any_action() -> None:
    """The recommended option (slot 7) is the only one marked, with no option selected yet."""
    plan = plan_item(CORPUS["good"])
    assert isinstance(plan, DecisionPlan)
    assert [o.recommended for o in plan.options] == [False, True, False]
    lines = render_plan(plan, width=200, selected=None)
    marked = [ln for ln in lines if "★ recommended" in ln]
    assert len(marked) == 1 and "Send the summary only" in marked[0]


def test_each_open_hatch_is_its_own_affordance_and_a_closed_one_is_not_offered() -> None:
    """Both hatches set true are offered with distinct keys; a hatch set false is not offered."""
    both = plan_item(CORPUS["good"])
    assert isinstance(both, DecisionPlan)
    assert [h.kind for h in both.hatches] == ["free_text", "dialogue"]
    screen = "\n".join(render_plan(both, width=200))
    assert "[f] Answer in my own words" in screen and "[d] Reject the question" in screen
    one = plan_item(CORPUS["one_hatch"])
    assert isinstance(one, DecisionPlan)
    assert [h.kind for h in one.hatches] == ["dialogue"]
    assert "[f]" not in "\n".join(render_plan(one, width=200))


def test_untrusted_moment_is_visibly_marked() -> None:
    """An item flagged untrusted carries the flag into the plan and an UNTRUSTED mark on screen."""
    plan = plan_item(CORPUS["untrusted"])
    assert isinstance(plan, DecisionPlan) and plan.untrusted
    assert "UNTRUSTED" in "\n".join(render_plan(plan))
    assert "UNTRUSTED" not in "\n".join(render_plan(plan_item(CORPUS["good"])))


def test_malformed_moments_fall_back_to_notice_never_a_partial_decision() -> None:
    """Out-of-range recommended_idx, one option, a missing slot or an unknown member become a notice with a diagnostic."""
    for name in ("out_of_range", "one_option", "no_findings", "extra_member"):
        plan = plan_item(CORPUS[name])
        assert isinstance(plan, NoticePlan), name
        assert plan.diagnostic, name
        screen = "\n".join(render_plan(plan))
        assert "NOTICE" in screen and "Send the full report" not in screen, name
    assert "recommended_idx 3" in plan_item(CORPUS["out_of_range"]).diagnostic  # type: ignore[union-attr]


def test_notice_item_renders_conventional_payload_with_its_diagnostic() -> None:
    """A notice item shows the agent's conventional payload and the gateway's diagnostic."""
    plan = plan_item(CORPUS["notice"])
    assert isinstance(plan, NoticePlan)
    screen = "\n".join(render_plan(plan, width=200))
    assert "synopsis hedges" in screen and '"q3.pdf"' in screen


def test_undecodable_bytes_become_a_notice() -> None:
    """Bytes that are not JSON, or JSON of an unknown item type, become a notice instead of raising."""
    assert isinstance(plan_item(b"\xff\xfe not json"), NoticePlan)
    assert isinstance(plan_item(CORPUS["unknown_item_type"]), NoticePlan)
    assert isinstance(plan_item(msgspec.json.encode(CORPUS["not_an_object"])), NoticePlan)


def test_authorization_variants_render_per_kind() -> None:
    """Each RFC-0010 variant is shown as itself: value, label, action, narrative, refusal, dispute."""
    expect = {
        "auth_measurement": ("Measurement", "42.5"),
        "auth_classification": ("Classification", "low-risk"),
        "auth_action": ("Action", "refund"),
        "auth_narrative": ("Narrative (not authoritative)", "Usage rose this month."),
        "auth_refusal": ("Refused", "This request is not allowed."),
        "auth_dispute": ("Oracles disagree", "escalation required"),
    }
    for name, (title, text) in expect.items():
        plan = plan_item(CORPUS[name])
        assert isinstance(plan, AuthorizationPlan) and plan.status == "shown", name
        assert plan.title == title, name
        assert any(text in f.value for f in plan.fields), name


def test_unknown_or_unprovenanced_authorization_is_blocked_and_not_shown() -> None:
    """An unknown kind, a missing kind, or an action without oracle provenance renders BLOCKED without its content (spec 001)."""
    for name in ("auth_unknown_kind", "auth_no_kind", "auth_action_no_provenance"):
        plan = plan_item(CORPUS[name])
        assert isinstance(plan, AuthorizationPlan) and plan.status == "BLOCKED", name
        screen = "\n".join(render_plan(plan, width=200))
        assert "BLOCKED" in screen
        assert "trust me" not in screen and "no kind at all" not in screen



def test_refusal_with_an_unknown_code_is_blocked_in_python_terminal_and_browser_models() -> None:
    """A refusal whose code is none of spec 001's four is BLOCKED, its message not shown, by model.py, the terminal and plan.js."""
    item = CORPUS["auth_refusal_unknown_code"]
    plan = plan_item(item)
    assert isinstance(plan, AuthorizationPlan) and plan.status == "BLOCKED"
    screen = "\n".join(render_plan(plan, width=200))
    assert "BLOCKED" in screen and "trust me" not in screen and "APPROVED" not in screen
    js = surface_kit.js_plans([item])[0]
    assert js["status"] == "BLOCKED" and "trust me" not in str(js)
    # the four spec codes are still shown
    for code in ("BLOCKED", "UNRESOLVABLE", "POLICY_VIOLATION", "EMERGENCY_ESCALATION"):
        ok = dict(item, envelope={"kind": "refusal", "reason": {"code": code, "user_message": "Not now.", "audit_id": "a"}})
        assert plan_item(ok).status == "shown" and surface_kit.js_plans([ok])[0]["status"] == "shown", code

def test_clarification_becomes_questions_and_withdrawn_a_removal() -> None:
    """A clarification is planned as its questions; a withdrawn item as a withdraw of its moment."""
    c = plan_item(CORPUS["clarification"])
    assert isinstance(c, ClarificationPlan) and c.questions[0].question == "Which account should be billed?"
    w = plan_item(CORPUS["withdrawn"])
    assert isinstance(w, WithdrawPlan) and w.moment_id == "a1" * 16


def test_terminal_key_parser_reads_arrows_hatch_keys_and_text() -> None:
    """Arrow escape sequences, Enter, Backspace and typed UTF-8 text are told apart."""
    assert parse_keys(b"\x1b[A\x1b[Bf\r") == ["up", "down", "char:f", "enter"]
    assert parse_keys("é\x7f\x1b".encode()) == ["char:é", "backspace", "esc"]


def test_the_demo_shows_the_moment_with_the_answer_keys_of_every_surface() -> None:
    """`pgw demo` prints its moment as the terminal surface draws it: options numbered from 1, the recommended one
    marked, `[f]` answer in my own words, `[d]` reject the question (not its old `[0]`, `[w]`, `[x]`)."""
    from pgwcli.commands.demo import DEMO_MOMENT, render
    from subjects.wire import BindingMomentItem

    item = msgspec.convert(surface_kit._base("binding_moment", moment_id="d1" * 16, envelope_id="env-d",
                                             correlation_id="c-d", binding_moment=DEMO_MOMENT), BindingMomentItem)
    text = render(item)
    assert "1. Renew annually at 12 seats ★ recommended by the agent" in text
    assert "3. Let it lapse" in text
    assert "[f] Answer in my own words" in text and "[d] Reject the question" in text
    assert not any(old in text for old in ("[0]", "[w]", "[x]"))
