"""The seen form's fast paths give exactly what its definition gives.

``gateway.security.seen.seen`` returns ``seen_words(text)``, whose ASCII path folds white space to
spaces in the fold's own byte table and splits only when two spaces meet. Every rule that judges
text judges this form, so the fast path must give the definition's answer on every input:
``" ".join(fast_skeleton(text, keep_space=True).split())``. Non-ASCII text is folded through
``str.translate`` tables filled as characters are met; they must fold every character as
``skeleton``'s loop does, and ``seen_cased`` as it was defined. A text longer than
``CACHED_CHARS`` reads the same and is not kept.
"""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.harness import moment_of_kb
from gateway.security.seen import (
    CACHED_CHARS,
    _seen_cased_short,
    _seen_short,
    clear_caches,
    seen,
    seen_cased,
)
from gateway.security.skeleton import (
    _TABLES,
    CHARS_KEPT,
    _fold,
    fast_skeleton,
    seen_words,
    skeleton,
)
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


def _reference_cased(text: str) -> str:
    """``seen_cased`` as it was defined: each character's seen form, upper-cased where it was a capital."""
    out = []
    for ch in text:
        f = seen(ch) if not ch.isspace() else " "
        out.append(f.upper() if ch.isupper() else f)
    return " ".join("".join(out).split())


# Every code point of the scripts, symbols and invisible characters the disguises use (Latin, Greek,
# Cyrillic, Armenian, Cherokee, general punctuation and format characters, letter-like symbols,
# variation selectors, half- and full-width forms, mathematical alphanumerics, the tag block), and a
# sample of the rest, lone surrogates included: more distinct characters than the tables keep.
_CODE_POINTS = "".join(chr(c) for c in [
    *range(0x0, 0x600), *range(0x13A0, 0x1400), *range(0x2000, 0x2200), *range(0xFE00, 0x10000),
    *range(0x1D400, 0x1D800), *range(0xE0000, 0xE0080), *range(0x600, 0x13A0, 3), *range(0x2200, 0xFE00, 5),
    *range(0x10000, 0x1D400, 53), *range(0x1D800, 0xE0000, 89), *range(0xE0080, 0x110000, 97)])


def test_the_translate_tables_fold_every_character_as_skeleton_does() -> None:
    for keep_space in (True, False):
        for tags in (True, False):
            want = skeleton(_CODE_POINTS, keep_space=keep_space, tags=tags)[0]
            assert fast_skeleton(_CODE_POINTS, keep_space=keep_space, tags=tags) == want, (keep_space, tags)
    assert seen_words(_CODE_POINTS) == " ".join(skeleton(_CODE_POINTS, keep_space=True)[0].split())
    # More distinct characters than the tables keep have been met: they stopped growing, and still fold right.
    assert len(set(_CODE_POINTS)) > CHARS_KEPT
    assert all(len(table) <= CHARS_KEPT for table in _TABLES.values())
    assert _fold.cache_info().currsize <= CHARS_KEPT


def test_seen_cased_reads_every_character_as_before() -> None:
    assert seen_cased(_CODE_POINTS) == _reference_cased(_CODE_POINTS)
    for base in ("The oracle BLOCKED it.", "Your reading crossed the threshold."):
        for _name, text in disguises(base):
            assert seen_cased(text) == _reference_cased(text)


def test_a_long_text_reads_the_same_and_is_not_kept() -> None:
    short, long = "\u0405hared ledger " * 18, "\u0405hared ledger " * 19  # 252 and 266 characters
    assert len(short) <= CACHED_CHARS < len(long)
    want_short, want_long = definition(short), definition(long)
    clear_caches()
    assert seen(short) == want_short and seen(long) == want_long
    assert _seen_short.cache_info().currsize == 1  # the short text only
    assert seen_cased(long) == _reference_cased(long)
    assert _seen_cased_short.cache_info().currsize == 0


def test_the_joining_character_of_seen_all_folds_to_itself_alone() -> None:
    """``seen_all`` splits one fold of the joined texts on ``_JOIN``: exact only if the fold keeps it as itself,
    makes it of no other character (alone or inside a longer fold) and it is no white space."""
    from gateway.security.seen import _JOIN

    assert not _JOIN.isspace() and _JOIN.isascii()
    for c in map(chr, range(128)):
        folded = fast_skeleton(c, keep_space=True)
        assert (folded == _JOIN) if c == _JOIN else (_JOIN not in folded), repr(c)


_PIECES = [*string.printable, "~", "~~", "  ", "\t\n", "m", "M", "%", '"', "\x00", "\x7f", "\u00a0", "\u200b", "\u0405",
           "\u00e9", "l1I", "secret:", "\U0001f600"]


@settings(max_examples=1500, deadline=None)
@given(st.lists(st.lists(st.sampled_from(_PIECES), max_size=10).map("".join), max_size=9))
def test_seen_all_reads_each_text_as_seen_does(texts: list[str]) -> None:
    """One fold of the joined texts, split again, is each text's own seen form: white space at either end and
    inside, empty and blank texts, the fold's longer outputs (``m`` to ``rn``), texts holding the joining
    character (folded one by one) and texts that are not ASCII."""
    from gateway.security.seen import seen_all

    assert seen_all(texts) == [definition(t) for t in texts]


def test_seen_all_reads_the_bench_moments_as_seen_does() -> None:
    from gateway.security.seen import seen_all

    for kb in (1, 16, 120):
        m = moment_of_kb(kb, 7)
        texts = [m["synopsis"], m["question"]["stem"], *(o["label"] for o in m["question"]["options"]),
                 *m["findings"], *m["recommendations"]]
        assert seen_all(texts) == [seen(t) for t in texts]
