"""The gateway's per-envelope helpers made cheaper keep their exact results (benchmarks/performance-changes.md,
"Gateway CPU per envelope"): timestamps, the lints' and the grammar's fast paths, the redactor's
encoded text, the envelope's key."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from datetime import UTC, datetime

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.security.seen import seen
from gateway.stages import lints, moment_grammar
from gateway.stages.base import Ctx, Turn
from gateway.stages.redaction import Redactor
from subjects.util import to_rfc3339
from subjects.wire import EnvelopeOutcome
from tests.spies import count_calls


def _reference_rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@settings(max_examples=2000, deadline=None)
@given(st.floats(min_value=0, max_value=4_102_444_800) | st.integers(1_700_000_000, 1_900_000_000).flatmap(
    lambda s: st.sampled_from([0.0, 0.0005, 0.0004995, 0.0005005, 0.9995, 0.9999995, 0.9999994, 0.9999996]).map(
        lambda f: s + f)))
def test_to_rfc3339_is_datetimes_isoformat(ts: float) -> None:
    """Any timestamp, half-microsecond and carry cases included, gives the text datetime's isoformat gives."""
    assert to_rfc3339(ts) == _reference_rfc3339(ts)


@pytest.mark.parametrize("ts", [-1.5, -0.0004, 253402300799.9, 1e12])
def test_to_rfc3339_outside_the_cached_range_is_datetimes(ts: float) -> None:
    """Before 1970 and past year 9999 the text (or the error) is datetime's own."""
    try:
        want = _reference_rfc3339(ts)
    except (ValueError, OverflowError, OSError) as e:
        with pytest.raises(type(e)):
            to_rfc3339(ts)
        return
    assert to_rfc3339(ts) == want


def test_to_rfc3339_of_nan_fails_as_datetime_does() -> None:
    """A NaN timestamp is refused with datetime's own error."""
    with pytest.raises(ValueError):
        to_rfc3339(math.nan)


VOCAB = ["harbor", "ledger", "tax", "summary", "filing", "send", "the", "and", "of", "2025", "only", "Harbor's",
         "full", "portal", "accounting", "letter", "covers", "annual"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(VOCAB), max_size=120).map(" ".join),
       st.lists(st.sampled_from(VOCAB), min_size=1, max_size=12).map(" ".join))
def test_restates_reads_short_and_long_findings_alike(finding: str, syn: str) -> None:
    """A finding split whole (up to 400 characters) and one read word by word give the same answer."""
    syn_all = lints._words(syn)
    syn_words, syn_n = set(syn_all) - lints._STOP, " ".join(syn_all)
    short = lints.restates(finding, syn_words, syn_n)
    old = lints._SHORT_FINDING
    try:
        lints._SHORT_FINDING = -1  # every finding word by word
        assert lints.restates(finding, syn_words, syn_n) == short
    finally:
        lints._SHORT_FINDING = old


@settings(max_examples=1000, deadline=None)
@given(st.text(max_size=30) | st.sampled_from(["", " ", "\x1c", "\t\n", "ok", "a" * 41]), st.integers(0, 40))
def test_a_plain_slot_is_one_the_grammar_passes(value: str, limit: int) -> None:
    """Whatever the grammar's fast path takes as plain, its full check finds nothing in."""
    if moment_grammar._plain(value, limit):
        out: list = []
        moment_grammar._text(out, value, "$.x", "synopsis", limit)
        assert out == []


@pytest.mark.parametrize("secrets", [(), ("hunter2-very-secret",)])
@pytest.mark.parametrize("reason", [None, "plain words", "a secret:abc123 token", "hunter2-very-secret leaked",
                                    "bell\x07 and zero\u200bwidth", "café au lait, nothing secret"])
def test_scrub_json_is_the_scrubbed_struct_as_published(secrets: tuple[str, ...], reason: str | None) -> None:
    """scrub_json gives the Struct scrub_struct gives and exactly the bytes the publisher would encode for it."""
    red = Redactor(secrets)
    out = EnvelopeOutcome(agent="a1", ts="2026-11-28T00:00:00.000Z", status="invalid", envelope_id="e",
                          code="envelope_invalid", reason=reason)
    scrubbed, body = red.scrub_json(out)
    assert scrubbed == red.scrub_struct(out)
    assert body == msgspec.json.Encoder().encode(scrubbed)


@pytest.mark.parametrize(("reason", "encodes"), [("plain words", 1), ("café au lait, nothing secret", 1),
                                                ("a secret:abc123 token", 2)])
def test_scrub_json_encodes_once_per_text_it_returns_or_checks(monkeypatch: pytest.MonkeyPatch, reason: str,
                                                               encodes: int) -> None:
    """A clean Struct is encoded once; one the pre-check doubts but the walk leaves alone, once too; a
    redacted one twice (the check, then the redacted copy), never a third time for a second pre-check."""
    from gateway.stages import redaction

    real = msgspec.json.encode
    calls = count_calls(monkeypatch, redaction.msgspec.json, "encode")
    out = EnvelopeOutcome(agent="a1", ts="2026-11-28T00:00:00.000Z", status="invalid", envelope_id="e",
                          code="envelope_invalid", reason=reason)
    scrubbed, body = Redactor(()).scrub_json(out)
    assert len(calls) == encodes
    assert body == real(scrubbed) and (scrubbed is out) == (encodes == 1)


def test_the_envelope_key_is_computed_once_and_follows_anonymous() -> None:
    """The cached key is the one a fresh computation gives, and a change of ``anonymous`` recomputes it."""
    turn = Turn(agent="a1", subject="pgw.agent.a1.envelope", stream_seq=7, body=b"{}", msg_id="m1", traceparent=None)

    def fresh(anonymous: bool) -> str:
        c = Ctx(None, turn, 0, None, None)  # type: ignore[arg-type]
        c.anonymous = anonymous
        return c.envelope_key

    ctx = Ctx(None, turn, 0, None, None)  # type: ignore[arg-type]
    assert ctx.envelope_key == ctx.envelope_key == fresh(False)
    ctx.anonymous = True
    assert ctx.envelope_key == fresh(True) != fresh(False)


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=70) | st.sampled_from(["envelope_invalid", "accepted", "a" * 64, "a" * 65, "x y", ""]))
def test_a_remembered_metric_label_is_the_one_judged_afresh(value: str) -> None:
    """safe_label gives a string's label from its memory exactly as it judged it the first time."""
    from pgwcore import metrics

    want = "none" if value == "" else (value if metrics._LABEL_OK.match(value) else "other")
    assert metrics.safe_label(value) == want
    assert metrics.safe_label(value) == want


def _hatch_reference(label: str) -> str | None:
    m = lints._HATCH_LABEL.match(seen(label))
    if m is None:
        return None
    return "free_text" if m.group("answer") else "dialogue" if m.group("question") else None


WORDISH = st.text(alphabet=st.sampled_from("aZ09-'_ .,!?()\t\n\x1c\xe9\u017f\u212a"), max_size=40)
HATCH_PARTS = ["Something else", "anything else", "Other", "others", "None of these", "free-text answer", "Freeform",
               "write in my own answer", "Type your own", "custom response", "write-in", "Let me type",
               "I'll specify", "specify other", "other, please specify", "a different answer", "Reject the question",
               "decline this framing", "this is the wrong question", "wrong question", "neither, let's discuss",
               "let us talk about it further", "reopen the discussion", "I don't accept the question",
               "do not accept the question", "not the right question", "ask me a different question",
               "discuss it first", "Send the summary", "_other", "Otherwise fine", "Kelvin", "\u212aeep it",
               "\u017fomething else"]


@settings(max_examples=3000, deadline=None)
@given(st.sampled_from(["", " ", "-- ", "(", "\"", "I'd rather ", "please ", "i would like to  ", "_"]),
       st.sampled_from(HATCH_PARTS) | WORDISH,
       st.sampled_from(["", " (free text)", "!", ".", " [x]", " more", "?)"]))
def test_the_hatch_lint_first_word_filter_answers_as_the_regex(pre: str, body: str, post: str) -> None:
    """An option label's hatch, judged through the first-word filter, is the anchored regex's alone."""
    label = pre + body + post
    assert lints.hatch_of(label) == _hatch_reference(label)


def test_the_hatch_filter_lets_every_hatch_through() -> None:
    """Each kind of hatch label is still found (the filter's word list covers every alternative)."""
    found = {lints.hatch_of(p) for p in HATCH_PARTS[:-6]}
    assert found == {"free_text", "dialogue"}
    assert all(lints.hatch_of(p) == _hatch_reference(p) for p in HATCH_PARTS)


@settings(max_examples=2000, deadline=None)
@given(st.from_regex(lints._HATCH_LABEL, fullmatch=True))
def test_every_label_the_hatch_regex_matches_passes_the_first_word_filter(label: str) -> None:
    """Labels generated from the hatch regex itself (any alternative, a new one too) are judged as the regex
    judges them: the hand-kept first-word list cannot silently miss an alternative added to the regex."""
    assert lints.hatch_of(label) == _hatch_reference(label)


@settings(max_examples=3000, deadline=None)
@given(WORDISH | st.text(max_size=60) | st.lists(st.sampled_from([*VOCAB, "-", "'", "a-b", "x'", "--", " "]),
                                                  max_size=20).map("".join))
def test_words_split_in_c_are_the_word_regexs(text: str) -> None:
    """A text's words split by the byte table are exactly the word regex's over the lower-cased text."""
    assert lints._words(text) == lints._WORD.findall(text.lower())


def test_a_turns_bytes_are_judged_once_per_redactor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The redaction stage and the settling at rest ask ``body_plainly_clean`` of one turn: the bytes are
    scanned once, the answer is ``bytes_plainly_clean``'s, and a reloaded redactor judges them afresh."""
    from gateway.stages.redaction import body_plainly_clean

    real = Redactor.bytes_plainly_clean
    calls = count_calls(monkeypatch, Redactor, "bytes_plainly_clean")
    plain, held = Redactor([]), Redactor(["hunter2-zulu-9"])
    for body in (b'{"a": "plain"}', b'{"a": "secret: x"}', b'{"a": "hunter2-zulu-9"}'):
        turn = Turn(agent="a", subject="s", stream_seq=1, body=body, msg_id=None, traceparent=None)
        calls.clear()
        assert body_plainly_clean(plain, turn) == real(plain, body) == body_plainly_clean(plain, turn)
        assert len(calls) == 1
        assert body_plainly_clean(held, turn) is False  # a configured secret: never plainly clean
        assert len(calls) == 2
    # A copy of a turn with another body (dataclasses.replace) is judged, and hashed, for its own body.
    clean = Turn(agent="a", subject="s", stream_seq=1, body=b'{"a": "plain"}', msg_id=None, traceparent=None)
    assert body_plainly_clean(plain, clean) is True and clean.digest == hashlib.sha256(clean.body).hexdigest()
    other = dataclasses.replace(clean, body=b'{"a": "secret: x"}')
    assert body_plainly_clean(plain, other) is False
    assert other.digest == hashlib.sha256(other.body).hexdigest() != clean.digest
