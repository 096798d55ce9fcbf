"""Text rules made linear in what an agent sends read exactly as before.

A docs-only attack (issue 48's eighth session) found text rules whose cost grew with the square of
a hostile text, or repeated a whole-text pass once per mark of a configured secret:

- the sentence count's end-of-sentence pattern, from every mark of a run of 2,000 dots (27 ms);
- spec 001's measurement pattern, from every digit of a run "1,1,1,..." (4,000 characters: 1.4 s;
  then 21 ms: each start still read the rest of its run, but no longer tried every unit on the way back;
  since the ninth session a run that failed once is not read again, 0.04 ms);
- SR-1's whitespace-broken run search, which took the white space out of the whole text once per
  mark, and searched every window of up to 32 tokens of a text holding no mark at all (about
  100 us per character of text with a configured secret);
- spec 001's forbidden markers (ninth session), each compiled into a pattern of its own for every
  envelope: an agent's own 256 markers of 200 characters, each folding to 3,600, cost 0.47 s; now
  found by substring searches (``authorization.Markers``), 11 ms.

Each is checked here against its old form: the same matches, splits and redactions.
"""

from __future__ import annotations

import base64
import json
import re
import sys
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.security.seen import seen
from gateway.stages import authorization, lints
from gateway.stages.redaction import MARK, Redactor

OLD_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s+(?=[A-Z0-9\"'(\[])")
OLD_MEASUREMENT = re.compile(
    r"(?:[$€£]\s?\d[\d,]*(?:\.\d+)?)|(?:\b\d[\d,]*(?:\.\d+)?\s?(?:" + authorization._UNITS + r")(?![A-Za-z]))",
    re.IGNORECASE,
)


@settings(max_examples=1500, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("..!!??\"')]([ \n\tAaZz09b")), max_size=40))
def test_the_sentence_end_splits_as_before(text: str) -> None:
    assert lints._SENTENCE_END.split(text) == OLD_SENTENCE_END.split(text)


@settings(max_examples=1500, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("1234567890,,.. $€£mgkcalLh%°CMz-µ\n")), max_size=60))
def test_a_measurement_reads_as_before(text: str) -> None:
    assert [m.span() for m in authorization.MEASUREMENT.finditer(text)] == \
        [m.span() for m in OLD_MEASUREMENT.finditer(text)]


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet=st.sampled_from([*"1234567890,,.. $€£mgkcalLh%°CMz-µ\nx_", "\u0663", "\uff11"]),
               max_size=40))
def test_the_linear_measurement_scan_is_the_pattern(text: str) -> None:
    """``MEASUREMENT`` (the scan that skips a failed run) finds, searches and replaces what its pattern does."""
    pattern = authorization.MEASUREMENT_PATTERN
    assert [m.span() for m in authorization.MEASUREMENT.finditer(text)] == [m.span() for m in pattern.finditer(text)]
    found, expected = authorization.MEASUREMENT.search(text), pattern.search(text)
    assert (found and found.span()) == (expected and expected.span())
    assert authorization.MEASUREMENT.sub("[m]", text) == pattern.sub("[m]", text)


def test_a_run_of_numbers_is_tried_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a number fails, the rest of its run of digits and commas is not tried again: a few attempts for
    4,000 characters of "1,1,1,...", where the pattern's own search tried every digit after a comma."""
    attempts: list[int] = []
    pattern = authorization.MEASUREMENT_PATTERN

    class Counting:
        def match(self, text: str, pos: int) -> re.Match[str] | None:
            attempts.append(pos)
            return pattern.match(text, pos)

    monkeypatch.setattr(authorization, "MEASUREMENT_PATTERN", Counting())
    for text in ("1," * 2000, "11," * 1333, "\u0663," * 2000):
        attempts.clear()
        assert authorization.MEASUREMENT.search(text) is None
        assert attempts == [0], (text[:8], attempts[:5])
    attempts.clear()
    assert authorization.MEASUREMENT.search("1," * 2000 + " 5 mg").group(0) == "5 mg"
    assert len(attempts) == 2


def test_a_long_number_still_reads_as_a_measurement() -> None:
    """However many digits and commas a number has (leading zeros as a disguise), it reads whole before its unit."""
    for text in ("1," * 1900 + "1 mg", "0" * 500 + "5.9 kg", "$" + "1," * 1900 + "1"):
        m = authorization.MEASUREMENT.search(text)
        assert m is not None and m.span() == (0, len(text)), text[-20:]
    assert authorization.control_plane_detail("The reading was " + "0" * 300 + "5.9 mg/dl.")


SECRET = "hunter2-Zulu-88"
B64 = base64.b64encode(SECRET.encode()).decode()
HEX = SECRET.encode().hex()


class _NoPrecheck(Redactor):
    """The redactor as it was: every text's windows searched, whatever marks the text holds."""

    def _holds_mark(self, squeezed: str) -> bool:
        return True


def _broken(run: str, every: int, sep: str) -> str:
    return sep.join(run[i:i + every] for i in range(0, len(run), every))


def test_a_run_broken_by_white_space_is_still_found() -> None:
    red = Redactor([SECRET])
    for run in (B64, HEX):
        for every, sep in ((4, " "), (8, "\n"), (2, " "), (16, "  \t")):
            text = f"Logs: {_broken(run, every, sep)} end."
            out = red.text(text)
            assert MARK in out and out == _NoPrecheck([SECRET]).text(text), (every, sep, out)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([B64[:6], B64[6:12], B64[12:], HEX[:8], HEX[8:20], HEX[20:], "é", "a", "%2F", "41",
                                 "Zulu", "hunter", "88", "ledger"]), max_size=24),
       st.lists(st.sampled_from([" ", "\n", "  ", "", "-", ", "]), min_size=24, max_size=24))
def test_the_mark_prechecks_change_no_redaction(pieces: list[str], seps: list[str]) -> None:
    text = "".join(p + s for p, s in zip(pieces, seps, strict=False))
    assert Redactor([SECRET]).text(text) == _NoPrecheck([SECRET]).text(text)


# A word character (\w) that is of no script written without spaces (those are read as none).
WORD = "[^\\W" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in authorization._UNSPACED) + "]"


def _marker_rule(text: str, markers: list[str]) -> str | None:
    """The marker rule written as patterns (one per marker, as it was judged until the ninth session): a
    word-character edge of the marker meets no word character in the seen form of the text, or, for a
    marker of letters, digits and spaces of one script, case folded, in the seen form of the text's
    reader words (``authorization._reader_words``, tested on its own below)."""
    t, tw = seen(text), seen(authorization._reader_words(text).casefold())
    for m in markers:
        s = seen(m)
        if not s:
            continue
        if re.search(_whole(s), t):
            return m
        r = seen(m.casefold()) if authorization._reader_words(m) == m else ""
        if r and re.search(_whole(r), tw):
            return m
    return None


def _whole(s: str) -> str:
    return (f"(?<!{WORD})" if re.match(WORD, s[0]) else "") + re.escape(s) + (f"(?!{WORD})" if re.match(WORD, s[-1]) else "")


MARKER_ALPHABET = [*"ab _-.'1,!x|%", "\u00e9", "\u0430", "\u200b", "\u03a9", "\u0663", "\ufdfa", "\u00ad", "\n",
                   "\u2014", "\u2122", "\u00b9", "\u1d20", "\u4e00", "\u30fc",
                   "\u0411", "\u0431", "\u1d40", "\u01c0", "\u0332", "\u0640", "\u20dd", "\u03b9"]


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet=st.sampled_from(MARKER_ALPHABET), max_size=16),
       st.lists(st.text(alphabet=st.sampled_from(MARKER_ALPHABET), max_size=5), min_size=1, max_size=4))
def test_a_forbidden_marker_is_found_as_the_patterns_find_it(text: str, markers: list[str]) -> None:
    """The same marker found (the first, in order) or none, as a pattern per marker finds it."""
    assert authorization.has_marker(text, markers) == _marker_rule(text, markers)


def test_reader_words_end_where_a_reader_ends_a_word() -> None:
    """What ``_reader_words`` writes as a space, by class, on every code point: a character a reader takes for a
    word's edge (no letter or digit, a raised or lowered letter, a click, a line-drawing or enclosing mark), and
    nothing else; a script change between two letters is a space too."""
    for cp in range(sys.maxunicode + 1):
        ch = chr(cp)
        if 0xD800 <= cp <= 0xDFFF:
            continue
        cat = unicodedata.category(ch)
        letter = cat[0] == "L" and cat != "Lm" and not 0x01C0 <= cp <= 0x01C3 \
            and not unicodedata.decomposition(ch).startswith(("<super>", "<sub>"))
        kept = (ch.isspace() or cat[0] == "C" or cat == "Nd" or letter
                or (cat[0] == "M" and cat != "Me" and cp not in authorization._LINE_MARKS))
        assert (authorization._reader_words(f"a{ch}") == f"a{ch}") == (kept and (
            (not letter and cat != "Nd") or authorization._script_code(ch) == authorization._script_code("a")
            or (cat == "Nd" and unicodedata.normalize("NFKC", ch).isascii()))) or ch.isspace(), hex(cp)
    assert authorization._reader_words("verified\u043f\u0440\u0430\u0432\u0434\u0430 x") == "verified \u043f\u0440\u0430\u0432\u0434\u0430 x"
    assert authorization._reader_words("e\u0301\u043f") == "e\u0301 \u043f"  # the mark stays with its letter


def test_the_marker_rule_reads_word_characters_as_the_pattern_does() -> None:
    """``Markers`` reads a word character as ``str.isalnum()`` or ``_``: ``\\w``, on every code point (but
    those of scripts written without spaces, which it reads as none)."""
    word = re.compile(r"\w")
    differ = [cp for cp in range(sys.maxunicode + 1)
              if authorization._word_char(chr(cp)) != bool(word.match(chr(cp)))]
    assert differ and all(any(lo <= cp <= hi for lo, hi in authorization._UNSPACED) for cp in differ)


def test_a_marker_at_either_end_and_beside_any_character() -> None:
    """A marker between every pair of ASCII characters: found exactly where the patterns find it."""
    for a in map(chr, range(1, 128)):
        for b in ("", " ", "x", "_", ".", "|", a):
            for marker in ("verified", "-ok-", "a b", "!!!"):
                text = f"{a}{marker}{b}"
                assert authorization.has_marker(text, [marker]) == _marker_rule(text, [marker]), (text, marker)


def test_what_a_reader_takes_for_a_words_edge() -> None:
    """A marker next to a dash, a bar, a symbol, a footnote mark or an underscore reads as a word, and so does
    one drawn in small capitals or enclosed letters; inside a longer word it does not. A marker in a script
    written without spaces is found wherever it stands (the docs-only attack of the ninth session)."""
    markers = ["verified", "approved", "clinically tested"]
    for text in ("It may be verified\u2014nothing more.", "Status: verified|approved.", "It may be verified%.",
                 "It may be verified\u00d72.", "It may be verified\u2122.", "It may be verified\u00b9.",
                 "It may be _verified_.", "It may be \u30fcverified\u30fc now.", "It may be \u4e00verified\u4e00.",
                 "It may be \u1d20\u1d07\u0280\u026a\ua730\u026a\u1d07\u1d05.",
                 "It may be \U0001f165\U0001f154\U0001f161\U0001f158\U0001f155\U0001f158\U0001f154\U0001f153.",
                 "It may be \u24b1\u24a0\u24ad\u24a4\u24a1\u24a4\u24a0\u249f.", "It is clinically\u2014tested."):
        assert authorization.has_marker(text, markers) is not None, text
    # The second docs-only attack: raised letters, bars and dashes that are letters of another script or
    # clicks, line-drawing and enclosing marks, a tatweel between words, a change of script.
    for text in ("It may be verified\u1d40\u1d39.", "It may be verified\u00aa.", "verified\u01c0approved",
                 "verified\u0399x", "verified\u04c0x", "verified\u3127nothing", "official\u0640verified",
                 "official\u0332verified", "official\u0361verified", "verifiedA\u20dd", "verified\u043f\u0440\u0430\u0432\u0434\u0430",
                 "verified\u05d0\u05de\u05ea", "\u0432\u0435\u0440\u0438\u0444\u0438\u0446\u0438\u0440\u043e\u0432\u0430\u043dverified"):
        assert authorization.has_marker(text, markers) is not None, text
    for text in ("It may be unverified.", "It may be reapproved.", "It is officially so.", "It may be modern.",
                 "caf\u00e9verified", "cafe\u0301verified"):
        assert authorization.has_marker(text, markers) is None, text
    # Case is folded for every script: a Cyrillic or Greek marker in capitals, or at a sentence's start.
    own = ["\u043f\u0440\u043e\u0432\u0435\u0440\u0435\u043d\u043e", "\u03b5\u03c0\u03af\u03c3\u03b7\u03bc\u03bf"]
    for text in ("It may be: \u041f\u0420\u041e\u0412\u0415\u0420\u0415\u041d\u041e.", "\u0395\u03c0\u03af\u03c3\u03b7\u03bc\u03bf.",
                 "\u0395\u03a0\u0399\u03a3\u0397\u039c\u039f"):
        assert authorization.has_marker(text, own) is not None, text
    assert authorization.has_marker("\u044d\u0442\u043e \u043f\u0440\u043e\u0432\u0435\u0440\u0435\u043d\u043e",
                                    ["\u041f\u0420\u041e\u0412\u0415\u0420\u0415\u041d\u041e"])
    assert authorization.has_marker("It may be true: \u3053\u308c\u306f\u8a8d\u8a3c\u6e08\u307f\u3067\u3059\u3002",
                                    ["\u8a8d\u8a3c\u6e08\u307f"])
    assert authorization.has_marker("\u0e1c\u0e25\u0e19\u0e35\u0e49\u0e44\u0e14\u0e49\u0e23\u0e31\u0e1a\u0e01\u0e32\u0e23"
                                    "\u0e23\u0e31\u0e1a\u0e23\u0e2d\u0e07\u0e41\u0e25\u0e49\u0e27", ["\u0e23\u0e31\u0e1a\u0e23\u0e2d\u0e07"])
    assert authorization.has_marker("It may be: \u0645\u0640\u0648\u062b\u0640\u0642 now.", ["\u0645\u0648\u062b\u0642"])  # tatweel
    assert authorization.has_marker("It may be safe!!!", ["!!!"]) == "!!!"


def test_no_pattern_is_compiled_for_a_marker(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent's own markers, new in each envelope, cost substring searches: no pattern is compiled
    for them (compiling 256 markers of 200 characters that fold to 3,600 each was 0.47 s an envelope)."""
    own = [f"{i} " + "\ufdfa" * 200 for i in range(256)]
    text = "It may rain. " + own[200]
    re.purge()

    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a pattern was compiled: {str(args[0])[:40]!r}")

    monkeypatch.setattr(re, "_compile", no_compile)
    assert authorization.has_marker(text, own) == own[200]
    assert authorization.has_marker(text.replace("200 ", "200x"), own) is None


def _old_visible(text: str) -> str:
    """``text.visible`` as a Python loop over the characters (as it was, and the reference of its translate)."""
    from gateway.security import text as t

    if text.isascii():
        return t._ASCII_CONTROLS.sub("", text)
    out: list[str] = []
    in_flag = False
    for i, ch in enumerate(text):
        c = ord(ch)
        if t._TAG_FIRST <= c <= t._TAG_LAST:
            if in_flag:
                out.append(ch)
                in_flag = c != t._CANCEL_TAG
            continue
        in_flag = c == t._BLACK_FLAG
        if c in t._KEEP_CF:
            out.append(ch)
            continue
        if c == t._ZWJ:
            if out and i + 1 < len(text) and t._pictographic(out[-1]) and t._pictographic(text[i + 1]):
                out.append(ch)
            continue
        if 0xFE00 <= c <= 0xFE0F or 0xE0100 <= c <= 0xE01EF:  # one selector, after what it selects a form of
            if i and out and out[-1] == text[i - 1] and t._selects(c, text[i - 1]):
                out.append(ch)
            continue
        if c in t._FILLERS:
            continue
        cat = unicodedata.category(ch)
        if cat == "Cf" or (cat == "Cc" and ch not in "\t\n\r"):
            continue
        out.append(ch)
    return "".join(out)


def test_visible_drops_what_it_did_on_every_code_point() -> None:
    """``visible``'s one-translate path (no joiner, no tag) keeps and drops every code point as the loop did."""
    from gateway.security.text import visible

    for start in range(0, sys.maxunicode + 1, 1000):
        chunk = "é" + "".join(chr(cp) for cp in range(start, min(start + 1000, sys.maxunicode + 1))
                              if not 0xD800 <= cp <= 0xDFFF)
        assert visible(chunk) == _old_visible(chunk), hex(start)


VISIBLE_ALPHABET = ["a", " ", "\n", "\t", "é", "д", "\u200b", "\u200d", "\u200e", "\u00ad", "\u3164", "\x00", "\x7f",
                    "\U0001f468", "\U0001f3f4", "\U000e0067", "\U000e007f", "\u202e", "\ufeff", "\u2764", "\ufe0f",
                    "\ufe00", "\U000e0100", "\u8fbb"]


def test_variation_selectors_carry_no_hidden_data() -> None:
    """One selector after what it selects a form of is kept (an emoji's presentation, a Han variant); a run of
    them after an emoji, or one of the supplement's after a Latin letter, is data a reader cannot see, and is
    dropped (the third docs-only attack: "hunter2-zulu" written as sixteen selectors after an emoji)."""
    from gateway.security.text import visible

    smuggled = "".join(chr(0xE0100 + b) for b in b"hunter2-zulu")
    assert visible("ledger \U0001f600" + smuggled + " done") == "ledger \U0001f600 done"
    assert visible("a\ufe00\ufe01b") == "a\ufe00b"
    assert visible("x\U000e0100") == "x"
    assert visible("\u2764\ufe0f and \u8fbb\U000e0100") == "\u2764\ufe0f and \u8fbb\U000e0100"


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet=st.sampled_from(VISIBLE_ALPHABET), max_size=24))
def test_visible_reads_joiners_and_tags_as_before(text: str) -> None:
    from gateway.security.text import visible

    assert visible(text) == _old_visible(text)


class _EachLeafFolded(Redactor):
    """The redactor as it was: a text that is not ASCII had each leaf folded and searched for a token."""

    def _scan(self, texts, joined, spans, tags) -> None:  # type: ignore[no-untyped-def]
        if joined.isascii():
            return super()._scan(texts, joined, spans, tags)
        for li, t in enumerate(texts):
            spans[li].extend(self._token_spans(t, tags))
        return None


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.lists(st.sampled_from(["secret:", "s\u0435cret:", "SECRET:", "\u0455", "ecret", ":", "x", " ",
                                          "\n", "é", "\u200b", "\U000e0073", "\U000e0065", "\u0663"]),
                        max_size=8).map("".join), min_size=1, max_size=5))
def test_one_fold_of_the_joined_leaves_finds_every_token(leaves: list[str]) -> None:
    """Leaves that are not all ASCII are folded once, joined, before any is searched for a ``secret:`` token:
    the same redactions as each leaf folded and searched."""
    assert Redactor([])._leaves(leaves) == _EachLeafFolded([])._leaves(leaves)


TEXT_PIECES = ["é", "ж", "a", " ", "secret:", "s\u0435cret:", "ｓ", "ecret", ":", "\u00a0", "\u200b", "\u200e", "\u00ad",
               "\U0001f600", "\u3164", "\n", "\t", "\"", "\\", "\x7f", "\x08", "٣", "\ufdfa"]


@settings(max_examples=3000, deadline=None)
@given(st.dictionaries(st.lists(st.sampled_from(TEXT_PIECES), max_size=4).map("".join),
                       st.lists(st.lists(st.sampled_from(TEXT_PIECES), max_size=8).map("".join), max_size=3),
                       max_size=3))
def test_a_text_json_pre_check_is_exact_where_it_says_clean(value: dict[str, list[str]]) -> None:
    """Text that is not ASCII is judged clean by two translates of its JSON text (``_clean_text_json``) only
    where the walk of every string, rendered for reading or marked for approval, changes nothing; the bytes of
    such a message, settled at rest, are kept as sent."""
    from gateway.at_rest import redacted_turn
    from gateway.security.text import marked

    red = Redactor([])
    body = json.dumps(value, ensure_ascii=False).encode()
    if red.plainly_clean(value):
        assert red.graph(value, checked=True) == value
        assert red.graph(value, marked, checked=True) == value
    if red.bytes_plainly_clean(body):
        assert redacted_turn(red, body) is None and not red.bytes_hold_secret(body)
