"""Hypothesis fuzzing of the decoders and the redactor (issue 7 gauntlet).

Short in CI (``PGW_FUZZ_EXAMPLES``, default 150 per property); run longer on
demand: ``PGW_FUZZ_EXAMPLES=100000 .venv/bin/pytest tests/test_security_fuzz.py``.
Every property says which exceptions a decoder may raise on hostile input:
anything else would crash the worker that calls it.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.security import msgid
from gateway.security.text import hidden_controls, may_hide, visible
from gateway.stages.base import Refuse
from gateway.stages.moment_grammar import check_binding_moment
from gateway.stages.redaction import MARK, Redactor
from gateway.stages.shape import decode_body
from pgwcore.config import LimitsConfig
from pgwcore.identity import CredentialsError, read_creds
from subjects.errors import SubjectError
from subjects.names import Subjects
from subjects.wire import (
    AIEnvelope,
    outcome_decoder,
    pending_reply_decoder,
    resolve_reply_decoder,
    resolve_request_decoder,
    surface_item_decoder,
    verdict_decoder,
)

pytestmark = pytest.mark.security
EXAMPLES = int(os.environ.get("PGW_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
LIMITS = LimitsConfig()

_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40)
json_values = st.recursive(
    _scalars,
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=12), kids, max_size=6),
    max_leaves=40,
)


@st.composite
def mutated_json(draw: st.DrawFn) -> bytes:
    """Valid JSON, then byte-level damage: truncation, insertion, flips, deep wrapping."""
    doc = json.dumps(draw(json_values), ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    op = draw(st.sampled_from(["none", "truncate", "insert", "flip", "wrap"]))
    if op == "truncate" and doc:
        doc = doc[: draw(st.integers(0, len(doc) - 1))]
    elif op == "insert":
        at = draw(st.integers(0, len(doc)))
        doc = doc[:at] + draw(st.binary(min_size=1, max_size=8)) + doc[at:]
    elif op == "flip" and doc:
        at = draw(st.integers(0, len(doc) - 1))
        doc = doc[:at] + bytes([doc[at] ^ draw(st.integers(1, 255))]) + doc[at + 1 :]
    elif op == "wrap":
        depth = draw(st.integers(0, 20_000))
        doc = b"[" * depth + doc + b"]" * depth
    return doc


ENVELOPE_DECODERS = {
    "resolve request": resolve_request_decoder,
    "resolve reply": resolve_reply_decoder,
    "pending reply": pending_reply_decoder,
    "surface item": surface_item_decoder,
    "outcome": outcome_decoder,
    "verdict": verdict_decoder,
}


@FUZZ
@given(body=st.binary(max_size=512) | mutated_json())
def test_turn_decoder_only_refuses(body: bytes) -> None:
    """The envelope worker's body decoder returns a non-empty list or raises Refuse, never anything else."""
    try:
        values = decode_body(body, LIMITS)
    except Refuse as r:
        assert r.code == "invalid_envelope_shape"
        return
    assert isinstance(values, list) and values
    msgspec.json.encode(values)  # whatever passes can be re-encoded (no lone surrogates downstream)


@FUZZ
@given(body=st.binary(max_size=512) | mutated_json(), name=st.sampled_from(sorted(ENVELOPE_DECODERS)))
def test_wire_decoders_raise_only_decode_errors(body: bytes, name: str) -> None:
    """Every typed wire decoder raises only msgspec.DecodeError or UnicodeDecodeError on hostile bytes.

    msgspec 0.22 raises UnicodeDecodeError (not DecodeError) for invalid UTF-8
    inside an object key, e.g. ``{"\x80":``, so every caller must catch both
    (fixed in subjects/client.py's outcome pump and surface feed, issue 7).
    """
    with contextlib.suppress(msgspec.DecodeError, UnicodeDecodeError):
        ENVELOPE_DECODERS[name].decode(body)


@FUZZ
@given(value=json_values)
def test_envelope_and_moment_validation_never_crash(value: Any) -> None:
    """Converting any JSON value to an AIEnvelope raises only ValidationError; the moment grammar returns findings."""
    with contextlib.suppress(msgspec.ValidationError):
        msgspec.convert(value, AIEnvelope)
    details = check_binding_moment(value)
    assert isinstance(details, list)
    if isinstance(value, dict):
        check_binding_moment({"question": value, "synopsis": value.get("x", "s")})


@FUZZ
@given(subject=st.text(max_size=80) | st.from_regex(r"pgw\.(agent|principal)\.[^.]{0,70}\.(envelope|resolve|surface)"))
def test_subject_parser_raises_only_subject_errors(subject: str) -> None:
    """Subjects.parse accepts a contract subject or raises SubjectError, for any text."""
    try:
        parsed = Subjects("pgw").parse(subject)
    except SubjectError:
        return
    assert parsed.role in ("agent", "principal", "verdict", "capsule", "log", "capabilities")


@FUZZ
@given(agent=st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True), mid=st.none() | st.text(max_size=200),
       eid=st.none() | st.text(max_size=130), first=st.booleans())
def test_msg_id_rule_never_lets_a_foreign_prefix_through(agent: str, mid: str | None, eid: str | None, first: bool) -> None:
    """msgid.check never raises, and an id accepted for agent A never starts with another agent's 'B:' prefix."""
    why = msgid.check(agent, mid, eid, first=first)
    if why is None and mid is not None and ":" in mid:
        head = mid.split(":", 1)[0]
        assert head in (agent, "replay")


@FUZZ
@given(text=st.text(max_size=200))
def test_hidden_control_scan_never_crashes(text: str) -> None:
    """The bidi/tag scan returns None exactly when no override, isolate or stray tag character is present."""
    found = hidden_controls(text)
    has_bidi = any(0x202A <= ord(c) <= 0x202E or 0x2066 <= ord(c) <= 0x2069 for c in text)
    if has_bidi:
        assert found is not None


@FUZZ
@given(content=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_credentials_reader_raises_only_credentials_errors(tmp_path_factory: pytest.TempPathFactory, content: bytes) -> None:
    """Reading any file as credentials gives Credentials or CredentialsError, nothing else."""
    p = Path(tmp_path_factory.mktemp("c")) / "x.creds"
    p.write_bytes(content)
    os.chmod(p, 0o600)
    with contextlib.suppress(CredentialsError):
        read_creds(p)


SECRET = "hunter2-swordfish-9"


@FUZZ
@given(graph=json_values, where=st.integers(0, 50), before=st.text(max_size=10), after=st.text(max_size=10))
def test_redactor_removes_a_planted_secret_anywhere(graph: Any, where: int, before: str, after: str) -> None:
    """A configured secret planted in any string slot of any graph is gone after redaction, and redaction is idempotent."""
    planted = before + SECRET + after
    slots: list[tuple[Any, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                slots.append((x, k))
                walk(v)
        elif isinstance(x, list):
            for i, v in enumerate(x):
                slots.append((x, i))
                walk(v)

    walk(graph)
    if slots:
        container, key = slots[where % len(slots)]
        container[key] = planted
    else:
        graph = planted
    red = Redactor([SECRET])
    out = red.graph(graph)
    text = json.dumps(out, ensure_ascii=False)
    assert SECRET not in text
    assert MARK in text
    assert red.graph(out) == out


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        ("Approve \u202eyned\u202c", True),  # RIGHT-TO-LEFT OVERRIDE: displays as "Approve deny"
        ("\u2067Deny\u2069 Approve", True),  # isolate
        ("Approve\U000e0020\U000e0064\U000e0065\U000e006e\U000e0079", True),  # hidden ASCII in tags
        ("Scotland \U0001F3F4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f", False),  # flag sequence
        ("שלום\u200f world", False),  # RLM, needed by right-to-left text
        ("👨‍👩‍👧 family", False),  # zero-width joiners of an emoji sequence
    ],
)
def test_hidden_controls_examples(text: str, refused: bool) -> None:
    """Bidi controls and stray tag characters are found; RTL marks, emoji joiners and flag tags are not."""
    assert (hidden_controls(text) is not None) is refused


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet=st.characters(max_codepoint=0x7F), max_size=24) | st.text(max_size=24))
def test_may_hide_is_false_only_where_visible_drops_nothing(text: str) -> None:
    """The cheap pre-check says False only for a text ``visible`` leaves as it is; on ASCII text it says
    True exactly where a control character other than tab, LF and CR is in it (every ASCII character
    is tried below, not left to chance)."""
    if not may_hide(text):
        assert visible(text) == text
    if text.isascii():
        assert may_hide(text) == any((ord(c) < 0x20 and c not in "\t\n\r") or c == "\x7f" for c in text)


def test_may_hide_on_every_ascii_character() -> None:
    for code in range(128):
        c = chr(code)
        hides = (code < 0x20 and c not in "\t\n\r") or code == 0x7F
        for text in (c, f"plain {c} text", f"tab\there {c}", f"{c}\n"):
            assert may_hide(text) == hides, (code, text)
