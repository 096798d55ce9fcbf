"""Text rules made linear in what an agent sends read exactly as before.

A docs-only attack (issue 48's eighth session) found text rules whose cost grew with the square of
a hostile text, or repeated a whole-text pass once per mark of a configured secret:

- the sentence count's end-of-sentence pattern, from every mark of a run of 2,000 dots (27 ms);
- spec 001's measurement pattern, from every digit of a run "1,1,1,..." (4,000 characters: 1.4 s;
  now 21 ms: each start still reads the rest of its run, but no longer tries every unit on the way back);
- SR-1's whitespace-broken run search, which took the white space out of the whole text once per
  mark, and searched every window of up to 32 tokens of a text holding no mark at all (about
  100 us per character of text with a configured secret).

Each is checked here against its old form: the same matches, splits and redactions.
"""

from __future__ import annotations

import base64
import re

from hypothesis import given, settings
from hypothesis import strategies as st

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
