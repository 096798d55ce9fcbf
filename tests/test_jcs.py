"""subjects.jcs is RFC 8785 (JCS), byte for byte.

``subjects.jcs`` writes with msgspec's sorted encoder when that is provably
the same bytes and falls back to the reference implementation (``rfc8785``)
otherwise; capsules (spec 004 §2, with the absent-field normalization) and the
kernel's event log (spec 003) are written with it. These tests hold it to the
reference on generated values: every string hazard (controls, quotes,
backslash, U+2028, non-BMP, keys on both sides of U+D800 / U+E000, lone
surrogates), integers around 2**53, floats, and nesting.
"""

from __future__ import annotations

import os

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import capsule as capm
from subjects import jcs

EXAMPLES = int(os.environ.get("PGW_FUZZ_EXAMPLES", "300"))

# Characters where JSON writers disagree, plus ordinary ones so keys collide in sorting.
HAZARDS = [chr(c) for c in range(0x20)] + [
    '"', "\\", "/", "\x7f", "\x80", "\u00e9", "\u2028", "\u2029", "\ud7ff", "\ud800", "\udfff",
    "\ue000", "\uffff", "\U0001f600", "\U00010000", "a", "b", "Z", "0", " ",
]
text = st.text(alphabet=st.sampled_from(HAZARDS) | st.characters(), max_size=12)
ints = st.integers(min_value=-(2**54), max_value=2**54) | st.sampled_from([2**53 - 1, 2**53, -(2**53 - 1), -(2**53)])
scalars = st.none() | st.booleans() | ints | text | st.floats(allow_nan=False, allow_infinity=False)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(text, inner, max_size=6),
    max_leaves=30,
)


def _outcome(f: object, value: object) -> bytes | type[Exception]:
    try:
        return f(value)  # type: ignore[operator]
    except Exception as e:  # noqa: BLE001 - the kind of failure is what is compared
        return type(e)


@settings(max_examples=EXAMPLES, deadline=None)
@given(values)
def test_dumps_equals_the_reference_jcs(value: object) -> None:
    assert _outcome(jcs.dumps, value) == _outcome(rfc8785.dumps, value)


@settings(max_examples=EXAMPLES, deadline=None)
@given(values)
def test_capsule_canonical_bytes_equal_the_reference_on_the_normalized_value(value: object) -> None:
    reference = _outcome(lambda v: rfc8785.dumps(capm.normalize(v)), value)
    assert _outcome(capm.canonical_bytes, value) == reference


def test_walk_drops_absent_members_bottom_up_and_keeps_array_positions() -> None:
    walked, flags = jcs.walk({"a": None, "b": [], "c": {"d": {}, "e": [None, {}]}, "f": 0}, drop_absent=True)
    assert walked == {"c": {"e": [None, {}]}, "f": 0} and flags == 0
    assert jcs.walk({"x": 1.5, "k\U0001f600": 1})[1] == jcs.FLOAT | jcs.NOT_PLAIN


@pytest.mark.parametrize(
    "value",
    [
        {"\ue000": 1, "\U0001f600": 2},  # UTF-16 order puts the surrogate pair first (RFC 8785 §3.2.3)
        {"a\u2028": "\u2029", "b": "\x1f\x7f"},
        {"n": 2**53 - 1, "m": -(2**53 - 1)},
        {"x": [None, {}, [], {"y": None}], "z": {"w": []}},
        {"f": 1.5},
    ],
)
def test_known_hazards_match_the_reference(value: object) -> None:
    assert jcs.dumps(value) == rfc8785.dumps(value)
    assert capm.canonical_bytes(value) == rfc8785.dumps(capm.normalize(value))


@pytest.mark.parametrize("value", [{"big": 2**53}, {"s": "\ud800"}, {"k": object()}, {1: "non-string key"}])
def test_values_without_a_jcs_form_are_refused_as_before(value: object) -> None:
    with pytest.raises(capm.CapsuleError, match="§2 JSON-DIGEST"):
        capm.json_digest(value)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(st.sampled_from([0.9, 2.0, -0.0, 0.0, 1e-06, 1e-07, 1e21, 5e-324, 0.1 + 0.2, -1.5, 1e16, 123456.789]),
                max_size=6), values)
def test_dumps_on_repeated_floats_equals_the_reference(floats: list[float], value: object) -> None:
    """Floats msgspec writes as ES6 does (0.9) and those it writes otherwise (2.0, -0.0, 1e-06, 1e21), seen again and
    again in any order (``dumps`` remembers which is which per value), give the reference's bytes, alone and nested."""
    for v in (floats, {"f": floats, "v": value}, *floats):
        assert _outcome(jcs.dumps, v) == _outcome(rfc8785.dumps, v)


def test_a_log_event_of_strings_ints_and_an_es6_float_is_written_without_a_copy() -> None:
    """The kernel's events (strings, small integers, a confidence like 0.9) take the no-copy path; a float msgspec
    writes otherwise, a big integer or a key at or above U+D800 do not, and all give the reference's bytes."""
    event = {"event_type": "IDP_SUBMITTED", "prev_seq": 12, "body": {"idp": {"confidence_level": 0.9, "step_sequence": 1,
             "declared_goal": {"description": "Close the booking"}}, "pii_markers": [], "audit_accessible": True,
             "mission_ref": None}}
    assert jcs._as_is(event)
    for other in ({"c": 2.0}, {"c": [1e-06]}, {"n": 2**53}, {"\U0001f600": 1}, {1: "a"}):
        assert not jcs._as_is({**event, "x": other})
        assert _outcome(jcs.dumps, {**event, "x": other}) == _outcome(rfc8785.dumps, {**event, "x": other})
    assert jcs.dumps(event) == rfc8785.dumps(event)


# Values with no absent member anywhere (no null, [] or {} in an object), the shape json_digest writes without a copy.
present_scalars = st.booleans() | ints | text | st.floats(allow_nan=False, allow_infinity=False)
present_values = st.recursive(
    present_scalars,
    lambda inner: st.lists(inner | st.none(), min_size=1, max_size=5) | st.dictionaries(text, inner, min_size=1,
                                                                                     max_size=6),
    max_leaves=30,
)


def _reference_digest(value: object) -> str:
    import hashlib

    return hashlib.sha256(rfc8785.dumps(capm.normalize(value))).hexdigest()


@settings(max_examples=EXAMPLES, deadline=None)
@given(values | present_values)
def test_json_digest_equals_the_reference_with_and_without_the_copy(value: object) -> None:
    """JSON-DIGEST (spec 004 §2) is the reference's on any value: the walked copy where a member is absent or a
    value must be rewritten, msgspec on the value itself where nothing is (``subjects.jcs.normalized_bytes``)."""
    expected = _outcome(_reference_digest, value)
    assert _outcome(jcs.json_digest, value) == expected
    got = _outcome(capm.json_digest, value)
    assert got == expected or (got is capm.CapsuleError and isinstance(expected, type))


def test_the_copy_is_skipped_only_where_nothing_is_dropped_or_rewritten() -> None:
    plain = {"salt": "00" * 32, "value": {"code": "x", "reason": "y", "n": [1, None, [], {}], "ok": True}}
    assert jcs._as_is(plain, present=True)
    for absent in (None, [], {}, (), {"k": None}, [{"k": []}]):
        assert not jcs._as_is({**plain, "x": absent}, present=True)
        assert jcs.json_digest({**plain, "x": absent}) == _reference_digest({**plain, "x": absent})
    for other in (2.0, 1e-06, 2**53, {"\U0001f600": 1}, {1: "a"}):
        assert not jcs._as_is({**plain, "x": other}, present=True)
    assert jcs.json_digest(plain) == _reference_digest(plain)
