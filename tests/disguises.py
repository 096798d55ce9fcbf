"""One generator of disguises for every text rule's tests (and the SR-1 canaries).

A disguise changes the characters of a text but not what a person reading
the surface takes it to be: look-alike letters from several scripts
(Cyrillic, Greek, Armenian, Cherokee, mathematical alphanumerics),
zero-width and other format characters, soft hyphens, full-width forms,
combining marks, case, spacing, letters drawn as small capitals or enclosed
or parenthesized, and mixtures of them. Each leaves the seen
form (gateway/security/seen.py) unchanged, which ``test_seen_disguises``
checks for every disguise of every example, so a rule that refuses a text
must refuse each disguise of it.

Bidi controls are not here: the moment grammar refuses them outright under
their own rule (``hidden_characters``), whatever the text says.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

ZWSP, ZWNJ, ZWJ, WJ, BOM, SHY, CGJ, NBSP = "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\u034f", "\u00a0"

# Small Latin letters and the look-alike each script offers (UTS #39 lists each as confusable).
CYRILLIC = str.maketrans({"a": "\u0430", "c": "\u0441", "e": "\u0435", "i": "\u0456", "j": "\u0458", "o": "\u043e",
                          "p": "\u0440", "s": "\u0455", "x": "\u0445", "y": "\u0443", "h": "\u04bb",
                          "A": "\u0410", "B": "\u0412", "C": "\u0421", "E": "\u0415", "H": "\u041d", "I": "\u0406",
                          "K": "\u041a", "M": "\u041c", "O": "\u041e", "P": "\u0420", "S": "\u0405", "T": "\u0422",
                          "X": "\u0425"})
GREEK = str.maketrans({"o": "\u03bf", "i": "\u03b9", "v": "\u03bd", "u": "\u03c5", "A": "\u0391", "B": "\u0392",
                       "E": "\u0395", "H": "\u0397", "I": "\u0399", "K": "\u039a", "M": "\u039c", "N": "\u039d",
                       "O": "\u039f", "P": "\u03a1", "T": "\u03a4", "X": "\u03a7", "Y": "\u03a5", "Z": "\u0396"})
ARMENIAN = str.maketrans({"o": "\u0585", "u": "\u057d", "h": "\u0570", "n": "\u0578", "q": "\u0566", "g": "\u0581"})
CHEROKEE = str.maketrans({"A": "\u13aa", "B": "\u13f4", "C": "\u13df", "D": "\u13a0", "E": "\u13ac", "G": "\u13c0",
                          "H": "\u13bb", "J": "\u13ab", "K": "\u13e6", "M": "\u13b7", "P": "\u13e2", "R": "\u13a1",
                          "S": "\u13da", "T": "\u13a2", "V": "\u13d9", "W": "\u13b3", "Z": "\u13c3"})


def _letters(s: str, between: str) -> str:
    """``between`` inside every word (between its letters), never at a word's edge."""
    return " ".join(between.join(w) for w in s.split(" "))


def _math_bold(s: str) -> str:
    out = []
    for c in s:
        if "A" <= c <= "Z":
            out.append(chr(0x1D400 + ord(c) - 65))
        elif "a" <= c <= "z":
            out.append(chr(0x1D41A + ord(c) - 97))
        else:
            out.append(c)
    return "".join(out)


def _full_width(s: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in s)


def _combining(s: str) -> str:
    return "".join(c + "\u0301" if c.isalpha() else c for c in s)


def _soft_hyphens(s: str) -> str:
    """A soft hyphen in the middle of each word of three letters or more."""
    return " ".join(w[: len(w) // 2] + SHY + w[len(w) // 2:] if len(w) >= 3 else w for w in s.split(" "))


def _spacing(s: str) -> str:
    return "  " + s.replace(" ", f" {NBSP}\t ") + " \u3000"


def _title_swap(s: str) -> str:
    return "".join(c.upper() if i % 2 else c.lower() for i, c in enumerate(s))


def _cherokee(s: str) -> str:
    return s.upper().translate(CHEROKEE)


def _styled(prefix: str) -> Callable[[str], str]:
    """Each Latin letter as the character named ``prefix`` + that letter, where Unicode has one."""
    def style(s: str) -> str:
        out = []
        for c in s:
            try:
                out.append(unicodedata.lookup(prefix + c.upper()) if c.isascii() and c.isalpha() else c)
            except KeyError:
                out.append(c)
        return "".join(out)
    return style


DISGUISES: dict[str, Callable[[str], str]] = {
    "Cyrillic look-alikes": lambda s: s.translate(CYRILLIC),
    "Greek look-alikes": lambda s: s.translate(GREEK),
    "Armenian look-alikes": lambda s: s.translate(ARMENIAN),
    "Cherokee capitals": _cherokee,
    "mathematical bold": _math_bold,
    "zero-width spaces": lambda s: _letters(s, ZWSP),
    "zero-width (non-)joiners": lambda s: _letters(s, ZWNJ + ZWJ),
    "word joiner and BOM": lambda s: _letters(s, WJ + BOM),
    "combining grapheme joiner": lambda s: _letters(s, CGJ),
    "soft hyphens": _soft_hyphens,
    "full-width": _full_width,
    "combining marks": _combining,
    "upper case": str.upper,
    "alternating case": _title_swap,
    "spacing (NBSP, tabs, ideographic space)": _spacing,
    "mixed: Cyrillic, zero-width, soft hyphens": lambda s: _soft_hyphens(_letters(s.translate(CYRILLIC), ZWSP)),
    "mixed: full-width upper case, combining marks": lambda s: _combining(_full_width(s.upper())),
    "mixed: Greek, word joiners, spacing": lambda s: _spacing(_letters(s.translate(GREEK), WJ)),
    # Letters drawn in styles UTS #39 does not list (the docs-only attack of the ninth session).
    "small capitals": _styled("LATIN LETTER SMALL CAPITAL "),
    "negative circled letters": _styled("NEGATIVE CIRCLED LATIN CAPITAL LETTER "),
    "negative squared letters": _styled("NEGATIVE SQUARED LATIN CAPITAL LETTER "),
    "parenthesized letters": _styled("PARENTHESIZED LATIN SMALL LETTER "),
    # A mark drawn around each letter, and a blank that Unicode calls a symbol (a docs-only attack).
    "enclosing marks": lambda s: "".join(c + "\u20dd" if c.isalnum() else c for c in s),
    "Braille blanks for spaces": lambda s: s.replace(" ", "\u2800"),
}


def disguises(text: str) -> list[tuple[str, str]]:
    """``(name, disguised text)`` for every disguise that changes ``text``."""
    out = []
    for name, f in DISGUISES.items():
        d = f(text)
        if d != text:
            out.append((name, d))
    return out
