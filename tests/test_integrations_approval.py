"""subjects/approval.py: a yes/no approval as a spec 000 moment, and back (the plain client and every framework integration)."""

from __future__ import annotations

import msgspec
import pytest

from subjects.approval import (
    Decision,
    approval_moment,
    argument_findings,
    decision_of,
    stable_id,
)
from subjects.wire import (
    BindingMoment,
    DialogueVeto,
    FreeTextAnswer,
    OptionChoice,
    ResolutionOutcome,
)


def outcome(resolution) -> ResolutionOutcome:
    return ResolutionOutcome(
        agent="a", ts="2026-01-01T00:00:00Z", moment_id="ab" * 16, principal="alice",
        envelope_id="e", correlation_id="c", resolution=resolution, resolved_at="2026-01-01T00:00:00Z",
    )


def test_the_approval_moment_is_a_valid_two_option_moment_with_hatches_open():
    """The moment passes the wire type's own validation: 2 options, one recommended, both hatches true (spec 000 §6.6-§6.8)."""
    m = approval_moment("pay invoice NW-311", ["total = 120 EUR"], recommend="reject")
    back = msgspec.json.decode(msgspec.json.encode(m), type=BindingMoment)
    assert [o.label for o in back.question.options] == ["Approve", "Reject"]
    assert back.question.recommended_idx == 1
    assert back.question.hatches.free_text and back.question.hatches.dialogue
    assert "Approve" not in back.question.stem and "Reject" not in back.question.stem  # a neutral stem (§6.5)


def test_an_empty_action_is_refused_with_a_clear_error():
    """An approval of nothing cannot be phrased: ValueError naming the argument."""
    with pytest.raises(ValueError, match="action"):
        approval_moment("  ", [])


def test_arguments_become_one_clipped_finding_each():
    """JSON-string arguments are decoded to one finding per argument, each at most 500 characters."""
    assert argument_findings('{"a": 1, "b": "x"}') == ["a = 1", 'b = "x"']
    assert argument_findings("{}") == ["the call takes no arguments"]
    assert argument_findings("not json") == ["arguments (not JSON): not json"]
    assert len(argument_findings({"long": "y" * 2000})[0]) == 500


def test_only_option_zero_is_a_consent():
    """Option 0 approves; option 1, free text, dialogue and expiry all are not approved, and keep the principal's words."""
    assert decision_of(outcome(OptionChoice(index=0))).approved
    assert decision_of(outcome(OptionChoice(index=1))).kind == "reject"
    free = decision_of(outcome(FreeTextAnswer(text="only 100")))
    assert (free.kind, free.text, free.approved) == ("free_text", "only 100", False)
    veto = decision_of(outcome(DialogueVeto(objection="wrong question")))
    assert (veto.kind, veto.approved) == ("dialogue", False) and "wrong question" in veto.message()
    assert decision_of(None) == Decision("expired")


def test_the_correlation_id_is_deterministic_and_separates_its_parts():
    """The same parts give the same id; moving a separator between parts does not."""
    assert stable_id("t", "n", "0") == stable_id("t", "n", "0")
    assert stable_id("t", "n0") != stable_id("tn", "0")
