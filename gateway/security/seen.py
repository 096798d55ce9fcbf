"""The seen form of a text: what a person reading the surface takes it to be.

Every rule that judges text judges this form, never the characters as the
agent typed them: the dual veto (spec 000 §7.2), the hatch-as-option,
hedge and leading-stem lints (§6.1, §6.5, §6.6), the non-empty slot rule
(§6), the forbidden markers and the control-plane screen (spec 001 Binding
Rules, RefusalReason), and the redactor's needles (spec 002 SR-1). One fold,
so a disguise that one rule sees through no other rule misses:

- compatibility forms are folded (NFKC/NFKD: full-width, mathematical,
  ligatures), combining marks dropped;
- invisible characters are dropped: zero-width spaces and joiners, soft
  hyphen, word joiner, bidi controls and marks, variation selectors, tag
  characters, fillers, every format (Cf) and control (Cc) character;
- each character is folded to its Unicode UTS #39 skeleton prototype and
  case folded, exactly as SR-1 folds it (``gateway/security/confusables.py``):
  Cyrillic, Greek, Armenian, Cherokee ... look-alikes of a Latin letter read
  as that letter. The fold is a skeleton, not English: ``l``, ``I`` and ``1``
  are one letter (``i``), ``m`` reads as ``rn`` and ``0`` as ``o``, so a rule's
  own words are folded the same way (:func:`seen_pattern`) before they are
  compared;
- runs of whitespace are one space, none at either end.

What the surface renders is what was judged: SR-1 renders a slot without
its invisible characters (``gateway.security.text.visible``), and the seen
form of that rendering is the seen form of the text as sent (this module
drops every character ``visible`` drops, and more), so a rule that refuses
a rendering refuses every disguise of it. The form of a short text is computed
once (a bounded cache: one envelope's slots are judged by several rules); a
text longer than ``CACHED_CHARS`` is folded each time it is judged, so what the
cache holds stays small whatever an agent sends (a 64,000-character string in
each of 4,096 entries would hold about a gigabyte).
"""

from __future__ import annotations

import functools
import unicodedata

from gateway.security.confusables import BRAILLE_BLANK, prototypes, strip_marks
from gateway.security.skeleton import CharTable, seen_words, seen_words_split
from gateway.security.text import visible

CACHED_CHARS = 256  # the longest text whose seen form is remembered (module docstring)
_seen_short = functools.lru_cache(maxsize=4096)(seen_words)


def seen(text: str) -> str:
    """The seen form of ``text`` (module docstring); idempotent: ``seen(seen(t)) == seen(t)``."""
    return _seen_short(text) if len(text) <= CACHED_CHARS else seen_words(text)


# Joins the texts :func:`seen_all` folds at once: an ASCII character that folds to itself, that no other
# character folds to or into (tests/test_seen_words.py checks it against the fold's table), and no white space.
_JOIN = "~"


def seen_all(texts: list[str]) -> list[str]:
    """``[seen(t) for t in texts]``: ASCII texts folded in one pass, joined by a character the fold keeps
    as itself and makes of nothing else, then split on it (the fold is one character at a time, and the
    white space at a text's ends is stripped piece by piece). One envelope's slots, judged by several
    rules, cost one fold instead of one call each (a 1 KB moment's eight texts: 6.7 -> 2.5 us). Texts
    that are not all ASCII, or that hold the joining character, are folded one by one."""
    joined = _JOIN.join(texts)
    if not joined.isascii() or joined.count(_JOIN) != len(texts) - 1:
        return [seen(t) for t in texts]
    return seen_words_split(joined, _JOIN)


def _cased_char(ch: str) -> str:
    f = " " if ch.isspace() else seen(ch)
    return f.upper() if ch.isupper() else f


_CASED = CharTable(_cased_char)  # each character's seen form with its case kept


def _cased(text: str) -> str:
    return " ".join(text.translate(_CASED).split())


_seen_cased_short = functools.lru_cache(maxsize=2048)(_cased)


def seen_cased(text: str) -> str:
    """The seen form with each letter's case kept (a letter written as a capital is a capital).

    For the few rules whose words are case-sensitive (spec 001's control-plane codes such as
    ``BLOCKED`` are control-plane detail where the word "blocked" is not): the same fold as
    :func:`seen`, then upper-cased where the source character was a capital.
    """
    return _seen_cased_short(text) if len(text) <= CACHED_CHARS else _cased(text)


def _latin_char(ch: str) -> str:
    if ch.isascii():
        return ch
    if ch == BRAILLE_BLANK:
        return " "
    out = []
    for c in strip_marks(ch):  # full-width, mathematical, ligatures; a mark on a letter leaves the letter read
        read = c
        if not c.isascii():
            proto = unicodedata.normalize("NFKD", prototypes().get(c, c))
            if proto.isascii() and proto.isalpha():
                # A Cyrillic or Greek look-alike of a Latin letter, in its case: UTS #39 draws a capital I as l.
                read = ("I" if proto == "l" else proto.upper()) if c.isupper() else proto
        out.append(read)
    return "".join(out)


_LATIN = CharTable(_latin_char)


def seen_latin(text: str) -> str:
    """``text`` as a person reads it, in Latin letters and ASCII where a character looks like one: invisible
    characters dropped (``visible``), compatibility forms and look-alike letters folded, marks dropped, but
    case, digits, punctuation and spacing kept, where :func:`seen` folds them. For rules whose patterns read
    those (an e-mail address, a phone number, a title before a capitalised name: spec 003 §9)."""
    text = visible(text)
    return text if text.isascii() else text.translate(_LATIN)


def clear_caches() -> None:
    """Forget every remembered seen form (a benchmark timing what a new text costs)."""
    _seen_short.cache_clear()
    _seen_cased_short.cache_clear()


def seen_pattern(source: str) -> str:
    """A regular expression written for plain lower-case English, folded to match seen forms.

    Only the letters of the pattern's literal text are folded (``l`` becomes ``i``,
    ``m`` becomes ``rn``, capitals their small letter); an escape (``\\b``, ``\\s``,
    ``\\W``), a group's name and a quantifier's digits are kept as written.
    """
    out: list[str] = []
    i, n = 0, len(source)
    while i < n:
        c = source[i]
        if c == "\\" and i + 1 < n:
            out.append(source[i:i + 2])
            i += 2
            continue
        if source.startswith("(?P<", i):
            end = source.index(">", i)
            out.append(source[i:end + 1])
            i = end + 1
            continue
        out.append(seen(c) if c.isascii() and c.isalpha() else c)
        i += 1
    return "".join(out)


__all__ = ["CACHED_CHARS", "clear_caches", "seen", "seen_cased", "seen_pattern"]
