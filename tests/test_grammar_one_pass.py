"""The moment's one-pass judgement (``check_and_fold``, what the pipeline runs) says exactly what the member-by-member
grammar says, and hands the lints the forms they would fold themselves: on every listed violation and on
random disguises of a good moment (white space, controls, look-alikes, marks, exact types, counts, meta)."""

from __future__ import annotations

import copy
import random

import msgspec
import pytest

from gateway.security.seen import seen_all
from gateway.stages import lints
from gateway.stages.moment_grammar import _plain_moment, check_and_fold, check_binding_moment
from subjects.wire import BindingMoment
from tests.moments import GOOD_MOMENT
from tests.test_grammar import VIOLATIONS, mutate


def _lint_texts(bm: BindingMoment) -> list[str]:
    q = bm.question
    return [bm.synopsis, q.stem, *(o.label for o in q.options), *bm.findings, *bm.recommendations]


def _same(moment: object) -> list:
    details, forms = check_and_fold(moment)
    assert details == check_binding_moment(moment)
    if forms is not None:
        typed = msgspec.convert(moment, BindingMoment)
        assert forms == seen_all(_lint_texts(typed))
        assert lints.check(typed, forms) == lints.check(typed)
    return details


def test_the_good_moment_takes_the_one_pass():
    details, forms = check_and_fold(GOOD_MOMENT)
    assert details == [] and forms is not None
    _same(GOOD_MOMENT)


@pytest.mark.parametrize(("path", "value", "rule"), VIOLATIONS)
def test_each_violation_is_found_by_the_one_pass(path, value, rule):
    assert rule in [d.rule for d in _same(mutate(path, value))]


# What a slot can be set to: each is a case the one pass must either judge as the full walk does, or leave to it.
_TEXT_DISGUISES = [
    "", " ", "\t", "\u00a0", "\u200b", " \u200b ", "a\nb", "a\rb", "a\x00b", "a\x7fb", "a\tb", "caf\u00e9",
    "\u0405omething else", "Something else", "Other", "x" * 201, "y" * 1001, "z" * 2001, "recommended",
    "Pay now (recommended)", "Pay now \u2605 recommended by the agent", "Pay now", "Pay n\u043ew", "PAY NOW",
    "Send the 2025 tax summary only", "It depends on the filing.", "Share it. Then wait.", "~", "a~b", 7, None,
    True, ["a"], {"a": 1},
]
_SLOTS = ["synopsis", "offer", "findings.0", "findings.1", "recommendations.0", "question.stem",
          "question.options.0.label", "question.options.1.label", "question.options.0.reasoning",
          "question.options.1.reasoning"]
_SHAPES = [
    ("meta", {"decision_class": "routine"}), ("meta", None), ("meta", {"x": 1}), ("extra", "x"),
    ("meta", {"calibration_note": "n" * 1000}), ("meta", {"calibration_note": "n" * 1001}),
    ("meta", {"decision_class": " "}), ("meta", {"decision_class": "\u200b"}), ("meta", {"decision_class": None}),
    ("meta", {"decision_class": 3}), ("meta", "consent"),
    ("question.recommended_idx", True), ("question.recommended_idx", 1), ("question.recommended_idx", 2),
    ("question.recommended_idx", 1.0), ("question.hatches.free_text", 1), ("question.hatches.x", True),
    ("question.x", 1), ("question.options.0.x", "y"), ("findings", []), ("findings", ["a"] * 33),
    ("recommendations", ["b"] * 32), ("question.options", [{"label": "a", "reasoning": "b"}] * 5),
    ("question.options.1", "label"),
]


def test_random_disguises_are_judged_alike():
    rng = random.Random(48)
    checked = one_pass = 0
    for _ in range(3000):
        m = copy.deepcopy(GOOD_MOMENT)
        for _ in range(rng.randint(1, 3)):
            path, value = (rng.choice(_SLOTS), rng.choice(_TEXT_DISGUISES)) if rng.random() < 0.75 else rng.choice(_SHAPES)
            m = _set(m, path, copy.deepcopy(value))
        _same(m)
        checked += 1
        one_pass += _plain_moment(m) is not None
    # Both paths were exercised: the one pass took some moments and left others to the full walk.
    assert checked == 3000 and 100 < one_pass < 2900, one_pass


def _set(m: dict, path: str, value: object) -> dict:
    parts = path.split(".")
    cur: object = m
    for p in parts[:-1]:
        if isinstance(cur, list):
            if not p.isdigit() or int(p) >= len(cur):
                return m
            cur = cur[int(p)]
        elif isinstance(cur, dict) and p in cur:
            cur = cur[p]
        else:
            return m
    last = parts[-1]
    if isinstance(cur, list):
        if last.isdigit() and int(last) < len(cur):
            cur[int(last)] = value
    elif isinstance(cur, dict):
        cur[last] = value
    return m


def test_the_one_pass_premise_every_printable_ascii_character_but_space_is_seen():
    """``_plain_moment`` takes a non-blank printable ASCII text as one the principal sees (what ``_text`` asks of a
    meta note through its seen form): so every printable ASCII character but the space must fold to something."""
    from gateway.security.seen import seen

    assert [c for c in map(chr, range(32, 127)) if not seen(c).strip()] == [" "]
