"""decode_body's two decoders give one answer.

The fast path (msgspec, with the colon tally and the text-level limit
proofs) must accept exactly what the strict decoder and the graph walk
accept, with the same value, and refuse the rest with the same reason and
the same ids read back. The reference here is the strict path alone.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.stages import shape
from gateway.stages.base import Refuse
from pgwcore.config import LimitsConfig
from subjects.client import BINDING_MOMENT_KIND, envelope
from tests.moments import GOOD_MOMENT
from tests.spies import count_calls

SMALL = LimitsConfig(max_depth=4, max_string_chars=64, max_body_bytes=1024 * 1024)
DEFAULT = LimitsConfig()


def reference(body: bytes, limits: LimitsConfig) -> list[Any]:
    """decode_body as it was before the fast path: strict decoder, then the walk."""
    if len(body) > limits.max_body_bytes:
        raise shape._refuse(f"body is {len(body)} bytes; the limit is {limits.max_body_bytes}")
    if len(body) <= 64 and (empty := shape._empty(body)) is not None:
        raise empty
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise shape._refuse(f"body is not valid UTF-8 (byte {e.start})") from None
    value = shape._strict(text, limits)
    shape._check_graph(value, limits)
    if isinstance(value, list):
        if not value:
            raise shape._refuse("the turn is an empty JSON array: a turn must hold at least one envelope", "$",
                                rule="empty_turn")
        return value
    return [value]


def answer(fn: Any, body: bytes, limits: LimitsConfig) -> tuple[str, str, str]:
    try:
        value = fn(body, limits)
    except Refuse as r:
        return ("refused", r.reason, repr(getattr(r, "hint", None)))
    return ("value", repr(value), "")  # repr tells 1 from 1.0 from True, and keeps key order


# Keys from a small alphabet so that duplicates are common; strings with the
# characters the tally depends on (':', quotes, backslashes, non-ASCII).
KEYS = st.sampled_from(["a", "b", "a:", ":", "é", "type", "x\"y", "k\\"])
TEXT = st.text(alphabet=st.sampled_from([*"ab:\"\\/é€\n\t ", "\u2028", "😀"]), max_size=80)
NUMBERS = st.one_of(st.integers(-(10**30), 10**30), st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from(["1e400", "-0", "-0.0", "1E5", "NaN", "Infinity", "9" * 4400]))


def _scalar(draw_value: Any, ensure_ascii: bool) -> str:
    if isinstance(draw_value, str):
        return draw_value  # a number literal from NUMBERS, written as is (strings are ("str", s) nodes)
    return json.dumps(draw_value, ensure_ascii=ensure_ascii)


TREE = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, TEXT.map(lambda s: ("str", s))),
    lambda children: st.one_of(
        st.lists(children, max_size=4).map(lambda xs: ("list", xs)),
        st.lists(st.tuples(KEYS, children), max_size=4).map(lambda ps: ("obj", ps)),
    ),
    max_leaves=20,
)


def render(node: Any, ensure_ascii: bool) -> str:
    """JSON text of a tree whose objects may repeat a key."""
    if isinstance(node, tuple) and node[0] == "list":
        return "[" + ", ".join(render(c, ensure_ascii) for c in node[1]) + "]"
    if isinstance(node, tuple) and node[0] == "obj":
        return "{" + ", ".join(json.dumps(k, ensure_ascii=ensure_ascii) + ": " + render(v, ensure_ascii)
                               for k, v in node[1]) + "}"
    if isinstance(node, tuple) and node[0] == "str":
        return json.dumps(node[1], ensure_ascii=ensure_ascii)
    return _scalar(node, ensure_ascii)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=TREE, ensure_ascii=st.booleans(), small=st.booleans())
def test_fast_and_strict_paths_agree_on_generated_json(tree: Any, ensure_ascii: bool, small: bool) -> None:
    body = render(tree, ensure_ascii).encode("utf-8", "surrogatepass")
    limits = SMALL if small else DEFAULT
    assert answer(shape.decode_body, body, limits) == answer(reference, body, limits)


@settings(max_examples=800, deadline=None)
@given(tree=TREE, cut=st.integers(0, 400), junk=st.sampled_from(["", ",", ":", "\"", "\\", "}", "]", "\\u0041",
                                                               "\\ud800", "\x01", "\ufeff", "NaN", "\xff"]))
@example(tree=("obj", [("a", 1), ("a", 2)]), cut=0, junk="")
@example(tree=("obj", [("a", ("str", ":")), ("a", ("str", "\\u003a"))]), cut=0, junk="")
def test_fast_and_strict_paths_agree_on_damaged_json(tree: Any, cut: int, junk: str) -> None:
    text = render(tree, False)
    cut = min(cut, len(text))
    body = (text[:cut] + junk + text[cut:]).encode("utf-8", "surrogatepass")
    for limits in (SMALL, DEFAULT):
        assert answer(shape.decode_body, body, limits) == answer(reference, body, limits)


@pytest.mark.parametrize("body", [
    b"[[[[[1]]]]]",  # five levels: one over SMALL's max_depth
    b'{"a": {"b": {"c": {"d": {}}}}}',
    b'["' + b"x" * 65 + b'"]',  # one character over SMALL's max_string_chars
    b'{"' + b"k" * 65 + b'": 1}',
    b'["' + "é".encode() * 65 + b'"]',
    # longer than the limit as a whole, every stretch between quotes short (issue 18's proof):
    b'["' + b"x" * 40 + b'\\"' + b"y" * 40 + b'"]',  # one 82-character string, an escaped quote inside
    b'["' + b"x" * 40 + b'\\\\' + b"y" * 40 + b'", "z"]',  # an escaped backslash: 81 characters
])
def test_limits_refuse_on_the_fast_path_too(body: bytes) -> None:
    assert answer(shape.decode_body, body, SMALL)[0] == "refused"
    assert answer(shape.decode_body, body, SMALL) == answer(reference, body, SMALL)
    assert answer(shape.decode_body, body, DEFAULT)[0] == "value"


def test_many_short_strings_skip_the_walk(monkeypatch) -> None:
    """A body longer than max_string_chars whose strings are all short (a large moment) is proved
    by the text itself: no backslash, no stretch between quotes over the limit."""
    def no_walk(*_a: Any) -> Any:
        raise AssertionError("graph walk used")

    body = json.dumps({"findings": ["x" * 40] * 10}).encode()
    assert len(body) > SMALL.max_string_chars
    assert answer(shape.decode_body, body, SMALL) == answer(reference, body, SMALL)
    monkeypatch.setattr(shape, "_check_graph", no_walk)
    assert shape.decode_body(body, SMALL) == [{"findings": ["x" * 40] * 10}]


def test_escaped_colon_cannot_hide_a_duplicate() -> None:
    r"""{"a": ":", "a": "\u003a"}: the tally alone would balance; the \u rule sends it to the strict decoder."""
    body = b'{"a": "x", "a": "\\u003a"}'
    assert answer(shape.decode_body, body, DEFAULT)[0] == "refused"
    body = b'{"a": "\\u003a", "a": "\\u003a", "envelopeId": "e1"}'
    got = answer(shape.decode_body, body, DEFAULT)
    assert got[0] == "refused" and "duplicate key" in got[1] and "e1" in got[2]


def test_the_fast_path_is_taken_for_an_ordinary_envelope(monkeypatch) -> None:
    """The common body never reaches the strict decoder (else the speed-up is gone unnoticed)."""
    def no_strict(*_a: Any) -> Any:
        raise AssertionError("strict decoder used")

    monkeypatch.setattr(shape, "_strict", no_strict)
    env = envelope(BINDING_MOMENT_KIND, {"principal": "alice", "binding_moment": GOOD_MOMENT}, envelope_id="e1")
    assert shape.decode_body(json.dumps(env).encode(), DEFAULT) == [env]


def test_an_escape_other_than_u_keeps_the_fast_path(monkeypatch) -> None:
    r"""A backslash alone (\n, \", \\) does not send a body to the strict decoder; a \u escape does."""
    calls = count_calls(monkeypatch, shape, "_strict")
    body = b'{"a": "line\\nbreak \\"quoted\\" back\\\\slash"}'
    assert shape.decode_body(body, DEFAULT) == [{"a": 'line\nbreak "quoted" back\\slash'}]
    assert calls == []
    assert shape.decode_body(b'{"a": "\\u0041"}', DEFAULT) == [{"a": "A"}]
    assert len(calls) == 1
