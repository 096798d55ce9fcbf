"""Each spec 000 §5-§6 grammar violation is refused with its own reason, and no decision reaches the surface."""

from __future__ import annotations

import asyncio
import copy

import pytest

from gateway.stages.moment_grammar import check_binding_moment
from subjects.client import Agent, Surface
from subjects.wire import BindingMomentItem, NoticeItem
from tests.moments import GOOD_MOMENT
from tests.polling import until
from tests.stored import stored_json


def mutate(path: str, value: object = ...) -> dict:
    """GOOD_MOMENT with ``path`` (dot/index path) set to ``value``, or deleted if ``...``."""
    m = copy.deepcopy(GOOD_MOMENT)
    parts = path.split(".")
    cur: object = m
    for p in parts[:-1]:
        cur = cur[int(p)] if isinstance(cur, list) else cur[p]  # type: ignore[index]
    last = parts[-1]
    if value is ...:
        del cur[int(last) if isinstance(cur, list) else last]  # type: ignore[arg-type]
    elif isinstance(cur, list):
        cur[int(last)] = value
    else:
        cur[last] = value  # type: ignore[index]
    return m


VIOLATIONS = [
    ("synopsis", ..., "missing_member"),
    ("findings", ..., "missing_member"),
    ("recommendations", ..., "missing_member"),
    ("offer", ..., "missing_member"),
    ("question", ..., "missing_member"),
    ("extra_slot", "x", "unknown_member"),
    ("synopsis", "", "synopsis"),
    ("findings", "not a list", "findings"),
    ("recommendations", [1, 2], "recommendations"),
    ("question.stem", ..., "missing_member"),
    ("question.options", [{"label": "Only one", "reasoning": "r"}], "options_count"),
    ("question.options", [{"label": f"o{i}", "reasoning": "r"} for i in range(5)], "options_count"),
    ("question.options", "a, b", "options_type"),
    ("question.options.1.label", ..., "option_label"),
    ("question.options.1.reasoning", ..., "option_reasoning"),
    ("question.options.0", "just a label", "option_type"),
    ("question.recommended_idx", ..., "recommended_idx_missing"),
    ("question.recommended_idx", 3, "recommended_idx_range"),
    ("question.recommended_idx", -1, "recommended_idx_range"),
    ("question.recommended_idx", [0, 1], "recommended_idx_type"),
    ("question.recommended_idx", True, "recommended_idx_type"),
    ("question.recommended_idx", 0.0, "recommended_idx_type"),
    ("question.hatches", ..., "missing_member"),
    ("question.hatches.free_text", "yes", "hatch_not_boolean"),
    ("question.hatches.dialogue", ..., "hatch_not_boolean"),
    ("question.options.0.label", "x" * 201, "string_too_long"),
    ("question.options.1.label", "Send the full ledger \u2605 recommended by the agent", "option_marks_recommendation"),
    ("question.options.1.label", "Send the full ledger (Recommended)", "option_marks_recommendation"),
    ("question.options.1.label", "Send the full ledger - RECOMMENDED", "option_marks_recommendation"),
    ("question.options.1.label", "Send the 2025 tax summary \u043enly", "options_indistinct"),  # Cyrillic o
    ("question.options.1.label", "SEND THE 2025 TAX SUMMARY ONLY\u00a0", "options_indistinct"),
    ("question.options.1.label", "Send the 2025 tax\u200b summary only", "options_indistinct"),
]


def test_good_moment_has_no_violations():
    """The realistic good moment passes the grammar (a false refusal would be a bug)."""
    assert check_binding_moment(GOOD_MOMENT) == []


@pytest.mark.parametrize(("path", "value", "rule"), VIOLATIONS)
def test_each_violation_has_its_own_rule(path, value, rule):
    """Every machine-checkable slot rule of spec 000 §5-§6 is reported with its own rule name."""
    rules = [d.rule for d in check_binding_moment(mutate(path, value))]
    assert rule in rules, rules


def test_a_label_that_only_mentions_a_recommendation_is_not_a_mark():
    """Narrow, as a false refusal is a bug: "recommended" inside an action, or a plain asterisk, marks nothing."""
    for label in ("Apply the recommended settings", "Send the *full* ledger", "Follow the auditor's recommendation",
                  "Skip the backup (not recommended)", "Proceed as recommended", "Use the settings recommended by IT",
                  "Book Hotel Astoria 4\u2605", "Recommended settings"):
        assert check_binding_moment(mutate("question.options.1.label", label)) == [], label


async def test_a_forged_mark_and_look_alike_options_are_refused_through_the_bus(gateway, nc):
    """An agent's moment whose second option's label forges the surfaces' mark ("★ recommended by the agent":
    the terminal and the e-mail then showed two recommended options), or whose options read alike ("Pay now",
    "Pay n\\u043ew"), is refused with its rule and never reaches her (found by a docs-only attack)."""
    agent = Agent(nc, "grammar-agent")
    forged = mutate("question.options.1.label", "Send the full ledger \u2605 recommended by the agent")
    alike = mutate("question.options.2.label", "Send the full l\u0435dger")  # Cyrillic e
    try:
        for moment, rule in ((forged, "option_marks_recommendation"), (alike, "options_indistinct")):
            eid = await agent.send_moment("alice", moment)
            out = await agent.outcome_for(eid, timeout=10)
            assert (out.status, out.code) == ("invalid", "envelope_invalid"), out
            assert rule in [d.rule for d in out.details], out.details
    finally:
        await agent.close()
    blocked = await stored_json(nc, "PGW_VERDICTS")
    assert sum(1 for v in blocked if v.get("agent") == "grammar-agent" and v.get("verdict_class") == "blocked") == 2


async def test_grammar_violations_are_refused_end_to_end(gateway, nc):
    """Malformed moments are refused to the agent with their rule, get a blocked verdict, and never reach the surface
    as a decision: the principal gets a fallback notice for each instead (spec 000 §9.3, §12.5)."""
    agent = Agent(nc, "grammar-agent")
    surface = Surface(nc, "alice")
    seen: list[object] = []

    first_seen = asyncio.Event()

    async def watch() -> None:
        async for item in surface.items():
            seen.append(item)
            first_seen.set()

    watcher = asyncio.create_task(watch())
    cases = [VIOLATIONS[i] for i in (0, 10, 14, 17, 23)]
    for path, value, rule in cases:
        eid = await agent.send_moment("alice", mutate(path, value))
        out = await agent.outcome_for(eid, timeout=10)
        assert (out.status, out.code) == ("invalid", "envelope_invalid"), out
        assert rule in [d.rule for d in out.details]
    # A good one afterwards goes through, proving the surface was listening all along.
    eid = await agent.send_moment("alice", GOOD_MOMENT)
    ok = await agent.outcome_for(eid, timeout=10)
    assert ok.status == "accepted"
    await asyncio.wait_for(first_seen.wait(), 10)

    async def all_seen() -> bool:
        return any(isinstance(i, BindingMomentItem) for i in seen)

    await until(all_seen, timeout=10, what="the good moment on the surface")
    watcher.cancel()
    assert [i.moment_id for i in seen if isinstance(i, BindingMomentItem)] == [ok.moment_id]
    assert [i for i in seen if not isinstance(i, (BindingMomentItem, NoticeItem))] == []
    assert len([i for i in seen if isinstance(i, NoticeItem)]) == len(cases)
    js = nc.jetstream()
    verdicts = await stored_json(js, "PGW_VERDICTS")
    assert sorted(v["verdict_class"] for v in verdicts) == ["blocked"] * len(cases) + ["hitl_dispatched"]
    await agent.close()
