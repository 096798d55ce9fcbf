"""``seen_words``, the seen form's fold with its white space normalised, is exactly its definition.

``gateway.security.seen.seen`` returns ``seen_words(text)``, whose ASCII path folds white space to
spaces in the fold's own byte table and splits only when two spaces meet. Every rule that judges
text judges this form, so the fast path must give the definition's answer on every input:
``" ".join(fast_skeleton(text, keep_space=True).split())``.
"""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.harness import moment_of_kb
from gateway.security.seen import seen
from gateway.security.skeleton import fast_skeleton, seen_words
from tests.disguises import disguises


def definition(text: str) -> str:
    return " ".join(fast_skeleton(text, keep_space=True).split())


ASCII = [chr(c) for c in range(128)]


def test_every_ascii_character_alone_and_between_words() -> None:
    for c in ASCII:
        for text in (c, f"a{c}b", f" {c} ", f"{c}{c}", f"Word{c}{c}word{c}"):
            assert seen_words(text) == definition(text), repr(text)


def test_every_pair_of_ascii_characters() -> None:
    for a in ASCII:
        for b in ASCII:
            text = f"x{a}{b}y"
            assert seen_words(text) == definition(text), repr(text)


def test_white_space_runs_at_either_end_and_inside() -> None:
    for text in ("", " ", "  ", "\t\n", " a", "a ", "  a  b  ", "a\t\tb", "a \x1c b", "\x1f\x1ea\x0b", "a\r\nb",
                 "Send  the\u00a0ledger", "\u3000Harbor\u2028", "Ledger\x85line", "two\u2003words "):
        assert seen_words(text) == definition(text), repr(text)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from([*string.printable, "\x00", "\x1c", "\x7f", "\u00a0", "\u200b", "\u0405",
                                         "\u2028", "\uff2d"]), max_size=80))
def test_random_text_reads_as_its_definition(text: str) -> None:
    assert seen_words(text) == definition(text)
    assert seen_words(seen_words(text)) == seen_words(text)  # idempotent, as seen() promises


def test_the_disguises_and_the_bench_moments_read_as_their_definition() -> None:
    for base in ("Something else (free text)", "It depends on what Harbor needs.", "Shouldn't we send the summary?"):
        for _name, text in disguises(base):
            assert seen_words(text) == definition(text), repr(text)
            assert seen(text) == definition(text)
    for kb in (1, 16, 120):
        moment = moment_of_kb(kb, 7)
        for text in (moment["synopsis"], *moment["findings"], *moment["recommendations"], moment["question"]["stem"]):
            assert seen_words(text) == definition(text)
