"""The capsule serializer is RFC 8785 (JCS), byte for byte (spec 004 §2).

``consumers.capsule.canonical_bytes`` writes with msgspec's sorted encoder when
that is provably the same bytes, and falls back to the reference
implementation (``rfc8785``) otherwise. These tests hold it to the reference on
generated values: every string hazard (controls, quotes, backslash, U+2028,
non-BMP, keys on both sides of U+D800 / U+E000, lone surrogates), integers
around 2**53, floats, and nesting with the §2 absent-field normalization.
"""

from __future__ import annotations

import os

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import capsule as capm

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


def _reference(value: object) -> bytes | type[Exception]:
    try:
        return rfc8785.dumps(capm.normalize(value))
    except Exception as e:  # noqa: BLE001 - the kind of failure is what is compared
        return type(e)


def _ours(value: object) -> bytes | type[Exception]:
    try:
        return capm.canonical_bytes(value)
    except Exception as e:  # noqa: BLE001
        return type(e)


@settings(max_examples=EXAMPLES, deadline=None)
@given(values)
def test_canonical_bytes_equal_the_reference_jcs(value: object) -> None:
    assert _ours(value) == _reference(value)


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
    assert capm.canonical_bytes(value) == rfc8785.dumps(capm.normalize(value))


@pytest.mark.parametrize("value", [{"big": 2**53}, {"s": "\ud800"}, {"k": object()}, {1: "non-string key"}])
def test_values_without_a_jcs_form_are_refused_as_before(value: object) -> None:
    with pytest.raises(capm.CapsuleError, match="§2 JSON-DIGEST"):
        capm.json_digest(value)
