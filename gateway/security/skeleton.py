"""The skeleton SR-1 matches on: one folded string per text, with a map back to the source.

Split out of ``gateway/stages/redaction.py`` (issue 19). A character's fold
is '' for invisible characters, the UTS #39 / case / NFKD fold of
``gateway/security/confusables.py`` otherwise; Unicode tag characters are
either dropped or read as the ASCII they smuggle (``tags=True``). ASCII text
folds at C speed (a byte table, then ``str.replace`` for the three
characters that fold to several). Also here: the span helpers the redactor
uses to replace what it found, and the piece search for a secret written in
pieces with other text between them.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable, Iterable

from gateway.security.confusables import CHARS_KEPT, ascii_table, fold_char

MARK = "[REDACTED]"
MIN_SECRET = 4


# Characters a renderer shows as nothing: zero-width, joiners, bidi controls,
# soft hyphen, word joiner, invisible operators, BOM, variation selectors,
# Mongolian vowel separator, combining grapheme joiner, fillers (plus every Cf).
_INVISIBLE_RANGES = (
    (0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160),
    (0x17B4, 0x17B5), (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E),
    (0x2060, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF),
)
# ``secret:`` folds to itself (none of its characters has another fold), so the
# token is found in the skeleton as written. A long s (U+017F) folds to "f", as UTS #39
# draws it, and reads "s": the token may begin with either (TOKEN_HEADS).
SECRET_TOKEN = re.compile(r"[sf]ecret:[^\s]+")
TOKEN_HEADS = ("secret:", "fecret:")


def may_hold_token(fold: str) -> bool:
    """Whether a folded text may hold a ``secret:`` token (:data:`SECRET_TOKEN`): one of its heads is in it."""
    return any(head in fold for head in TOKEN_HEADS)
_TAG_ASCII = (0xE0020, 0xE007E)  # tag characters mirroring printable ASCII ("ASCII smuggling")
_ASCII_WS_CHARS = " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"


def _invisible(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _INVISIBLE_RANGES) or unicodedata.category(chr(cp)) in ("Cf", "Cc")


def _ascii_fold_table() -> dict[int, str | None]:
    t: dict[int, str | None] = dict(ascii_table())
    for cp in [*range(0x20), 0x7F]:
        if chr(cp) not in _ASCII_WS_CHARS:
            t[cp] = None  # NUL and other controls are invisible
    return t


@functools.lru_cache(maxsize=CHARS_KEPT)
def _fold(ch: str) -> str:
    """The skeleton of one character: '' for invisible ones (tag characters included)."""
    cp = ord(ch)
    if cp < 0x80:
        if ch in _ASCII_WS_CHARS:
            return ch
        return "" if cp < 0x20 or cp == 0x7F else fold_char(ch)
    if _invisible(cp):
        return ""
    return fold_char(ch)


@functools.lru_cache(maxsize=CHARS_KEPT)
def _fold_tags(ch: str) -> str:
    """As :func:`_fold`, but a tag character reads as the ASCII it smuggles.

    Tags are matched both ways: dropped (tags sprinkled between the letters of
    a secret) and read (a secret written in tags, invisible to the reader but
    not to a model).
    """
    cp = ord(ch)
    if _TAG_ASCII[0] <= cp <= _TAG_ASCII[1]:
        return fold_char(chr(cp - 0xE0000))
    return _fold(ch)


TAGS = re.compile("[\U000E0000-\U000E007F]")


@functools.cache
def _ascii_fold() -> tuple[bytes, bytes, tuple[tuple[str, str], ...]]:
    """The ASCII fold as C-speed steps: a 1:1 byte table, the bytes to delete, and the
    few characters that fold to several (``m`` -> ``rn``), replaced afterwards."""
    table = bytearray(range(256))
    delete = bytearray()
    multi: list[tuple[str, str]] = []
    for cp, to in _ascii_fold_table().items():
        if to is None or to == "":
            delete.append(cp)
        elif len(to) == 1:
            table[cp] = ord(to)
        else:
            multi.append((chr(cp), to))
    # A multi-character fold is itself folded already, so replacing last is exact.
    return bytes(table), bytes(delete), tuple(multi)


_ASCII_WS_BYTES = _ASCII_WS_CHARS.encode()


def drop_ascii_ws(text: str) -> str:
    return text.encode("ascii").translate(None, _ASCII_WS_BYTES).decode("ascii")


def _fold_ascii(text: str, spaced: bool = False) -> str:
    table, delete, multi = _ascii_fold_spaced() if spaced else _ascii_fold()
    out = text.encode("ascii").translate(table, delete).decode("ascii")
    for ch, to in multi:
        if ch in out:
            out = out.replace(ch, to)
    return out


@functools.cache
def _ascii_fold_spaced() -> tuple[bytes, bytes, tuple[tuple[str, str], ...]]:
    """:func:`_ascii_fold` with every ASCII white space character (``str.isspace``) read as a space.
    No fold makes or takes a white space character, so the order of the two steps does not matter."""
    table, delete, multi = _ascii_fold()
    spaced = bytearray(table)
    for c in _ASCII_WS_BYTES:
        spaced[c] = 0x20
    return bytes(spaced), delete, multi


def _words_of_spaced(out: str) -> str:
    """A fold with its white space read as spaces, as :func:`seen_words` gives it: each run of spaces one,
    none at either end (the split and join only where two spaces meet)."""
    return out.strip(" ") if "  " not in out else " ".join(out.split())


def seen_words_split(text: str, sep: str) -> list[str]:
    """``[seen_words(piece) for piece in text.split(sep)]`` for an ASCII ``text``, folded once; exact where
    ``sep`` is an ASCII character the fold keeps as itself and makes of no other (the fold is one
    character at a time)."""
    return [_words_of_spaced(piece) for piece in _fold_ascii(text, spaced=True).split(sep)]


def seen_words(text: str) -> str:
    """The skeleton of ``text`` (``keep_space``) with its white space runs as one space, none at
    either end: ``" ".join(fast_skeleton(text, keep_space=True).split())``. ASCII text is folded
    with its white space read as spaces in the same byte table, so its split and join (most of
    the cost on a long text) only run when two spaces meet."""
    if text.isascii():
        return _words_of_spaced(_fold_ascii(text, spaced=True))
    return " ".join(fast_skeleton(text, keep_space=True).split())


def skeleton(text: str, *, keep_space: bool, tags: bool = False) -> tuple[str, list[int]]:
    """Folded text and, per skeleton character, the index of the source character."""
    out: list[str] = []
    where: list[int] = []
    fold = _fold_tags if tags else _fold
    for i, ch in enumerate(text):
        f = fold(ch)
        if not keep_space:
            f = "".join(c for c in f if not c.isspace())
        for c in f:
            out.append(c)
            where.append(i)
    return "".join(out), where




class CharTable(dict[int, str]):
    """A per-character fold as a ``str.translate`` table, filled as characters are met:
    ``text.translate(table)`` is ``"".join(fold(ch) for ch in text)``, looked up in C for every
    character met before instead of a Python call per character (a 64,000-character non-ASCII text:
    25 ms -> 2 ms). It keeps the first ``CHARS_KEPT`` distinct characters met; others are folded each
    time they are met."""

    def __init__(self, fold: Callable[[str], str]) -> None:
        super().__init__()
        self.fold = fold

    def __missing__(self, cp: int) -> str:
        f = self.fold(chr(cp))
        if len(self) < CHARS_KEPT:
            self[cp] = f
        return f


def _without_space(fold: Callable[[str], str]) -> Callable[[str], str]:
    return lambda ch: "".join(c for c in fold(ch) if not c.isspace())


# fast_skeleton's tables: ``skeleton(text, keep_space=..., tags=...)[0]`` (its fold is one character at a time).
_TABLES = {(keep_space, tags): CharTable(fold if keep_space else _without_space(fold))
           for keep_space in (True, False) for tags, fold in ((True, _fold_tags), (False, _fold))}


def fast_skeleton(text: str, *, keep_space: bool, tags: bool = False) -> str:
    """The skeleton string alone (no index map): the cheap pre-check before mapping."""
    if text.isascii():
        low = _fold_ascii(text)
        return low if keep_space else drop_ascii_ws(low)
    return text.translate(_TABLES[keep_space, tags])


def secret_skeleton(secret: str) -> str:
    return skeleton(secret, keep_space=False)[0]


def _merge(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def apply_spans(text: str, spans: list[tuple[int, int]]) -> str:
    if not spans:
        return text
    parts: list[str] = []
    pos = 0
    for s, e in _merge(spans):
        parts.append(text[pos:s])
        parts.append(MARK)
        pos = e
    parts.append(text[pos:])
    return "".join(parts)


def display_view(text: str, tags: bool) -> tuple[str, list[int]]:
    """NFKC of each visible character (case kept: encodings are case-sensitive), with the
    index of its source character; invisible characters dropped, tags read as ASCII if ``tags``."""
    out: list[str] = []
    where: list[int] = []
    for i, ch in enumerate(text):
        cp = ord(ch)
        if tags and _TAG_ASCII[0] <= cp <= _TAG_ASCII[1]:
            f = chr(cp - 0xE0000)
        elif cp >= 0x80 and _invisible(cp):
            f = ""
        else:
            f = unicodedata.normalize("NFKC", ch) if cp >= 0x80 else ch
        out.append(f)
        where.extend([i] * len(f))
    return "".join(out), where


def min_piece(needle: str) -> int:
    """The shortest piece of a secret written in pieces that still counts (issue 19)."""
    return max(MIN_SECRET, len(needle) // 4)


_PIECE_BUDGET = 4000  # search steps per needle and text: repetitive text cannot stall the stage


def piece_spans(hay: str, needle: str, m: int) -> list[tuple[int, int]]:
    """Spans of ``needle`` written in order in pieces of at least ``m`` characters, other text
    between them; [] if it is not there (or the bounded search gives up on pathological
    repetitive text). A small memoised search: each piece starts at an occurrence of its
    first ``m`` characters and may end anywhere that leaves the rest empty or ``m`` long."""
    n, seen = len(needle), set()
    budget = [_PIECE_BUDGET]

    def solve(pos: int, cursor: int) -> list[tuple[int, int]] | None:
        if pos == n:
            return []
        if n - pos < m or (pos, cursor) in seen or budget[0] <= 0:
            return None
        seen.add((pos, cursor))
        budget[0] -= 1
        head = needle[pos:pos + m]
        at = hay.find(head, cursor)
        while at != -1:
            size = m
            while pos + size < n and at + size < len(hay) and hay[at + size] == needle[pos + size]:
                size += 1
            for take in range(size, m - 1, -1):
                left = n - pos - take
                if 0 < left < m:
                    continue
                budget[0] -= 1
                if budget[0] <= 0:
                    return None
                rest = solve(pos + take, at + take)
                if rest is not None:
                    return [(at, at + take), *rest]
            at = hay.find(head, at + 1)
        return None

    return solve(0, 0) or []


def find_all(hay: str, needle: str) -> Iterable[int]:
    start = hay.find(needle)
    while start != -1:
        yield start
        start = hay.find(needle, start + 1)
