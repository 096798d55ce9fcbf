"""Tokens that may carry a secret in an encoding: base64, base64url, hex, URL-encoding (issue 19).

SR-1 (spec 002 "Redaction") says a known secret "MUST NOT appear verbatim";
an agent (or a model that read the secret) can still write it encoded, and a
renderer or the next tool decodes it. :func:`decodings` yields, for every run
of a string that could be such an encoding, its span and the decoded text;
the redactor checks the decoded text like any other and redacts the whole run
when it holds a secret. Decoding is tried a second level down (base64 of a
URL-encoded secret, say), and at the four base64 alignments, since a run may
start with a few characters that belong to the surrounding word.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterator
from urllib.parse import quote, unquote_plus

MIN_RUN = 12  # base64 of a 4-character secret with one character around it; shorter runs are words
# The lookbehind starts a run only at a word boundary: without it, finditer tries a
# 12-character match at every position inside every word (quadratic in practice).
_B64 = re.compile(rf"(?<![A-Za-z0-9+/_-])[A-Za-z0-9+/_-]{{{MIN_RUN},}}={{0,2}}")
_HEX = re.compile(r"(?:0[xX])?((?:[0-9A-Fa-f]{2}[:\s]?){6,})")
_PCT = re.compile(r"[^\s\"'<>%]*(?:%[0-9A-Fa-f]{2}[^\s\"'<>%]*)+")
_URLSAFE = bytes.maketrans(b"-_", b"+/")


def _text(raw: bytes) -> str:
    # errors="replace": a misaligned run decodes to a few bytes of noise, then the text.
    return raw.decode("utf-8", errors="replace")


def _b64(run: str) -> Iterator[str]:
    body = run.rstrip("=").encode().translate(_URLSAFE)
    for off in range(4):
        chunk = body[off:]
        if len(chunk) < 8:
            return
        if len(chunk) % 4 == 1:
            chunk = chunk[:-1]  # one stray character cannot end a group
        try:
            yield _text(binascii.a2b_base64(chunk + b"=" * (-len(chunk) % 4)))
        except binascii.Error:
            continue


def _hex(run: str) -> Iterator[str]:
    digits = re.sub(r"[:\s]", "", run)
    for off in (0, 1):
        d = digits[off:]
        d = d[: len(d) - len(d) % 2]
        try:
            yield _text(bytes.fromhex(d))
        except ValueError:
            continue


def _once(text: str) -> Iterator[tuple[int, int, str]]:
    for m in _B64.finditer(text):
        for dec in _b64(m.group()):
            yield m.start(), m.end(), dec
    for m in _HEX.finditer(text):
        end = m.end()
        while end > m.start() and text[end - 1] in ": \t\n\r\f\v":
            end -= 1  # a separator after the last pair belongs to the text around the run
        for dec in _hex(m.group(1)):
            yield m.start(), end, dec
    if "%" in text:
        for m in _PCT.finditer(text):
            dec = unquote_plus(m.group())
            if dec != m.group():
                yield m.start(), m.end(), dec


def decodings(text: str, depth: int = 2) -> Iterator[tuple[int, int, str]]:
    """(start, end, decoded) for each encoded-looking run of ``text``, nested ``depth`` levels."""
    for start, end, dec in _once(text):
        yield start, end, dec
        if depth > 1 and may_hold_encoding(dec):
            for _s, _e, inner in decodings(dec, depth - 1):
                yield start, end, inner


def may_hold_encoding(text: str) -> bool:
    """Cheap pre-check: could any run of ``text`` be decoded at all?"""
    return bool(_B64.search(text) or _HEX.search(text) or ("%" in text and _PCT.search(text)))


def encoded_marks(secret: str) -> set[str]:
    """Substrings any base64, base64url or hex text carrying ``secret`` must contain.

    For base64 it is the run of characters fully determined by the secret's
    bytes at each of the three byte alignments; also for the URL-encoded secret
    (base64 of URL-encoding). The redactor decodes only text holding one of
    these (or a ``%``, or non-ASCII text that may display as one), which keeps
    the decoding off the hot path of text that carries none.
    """
    raw = secret.encode()
    pct = "".join(f"%{c:02X}" for c in raw)  # every byte percent-encoded, as some encoders write it
    first = _marks({raw, quote(secret, safe="").encode(), pct.encode(), pct.lower().encode()})
    # Nested once (decodings' depth 2): a mark is a run every first encoding holds, so its own
    # encodings are runs every second encoding (base64 of base64, hex of base64, ...) holds.
    return first | _marks({m.encode() for m in first})


def _marks(sources: set[bytes]) -> set[str]:
    """The runs determined by each of ``sources`` in its hex and, at each alignment, its base64 and base64url."""
    out: set[str] = set()
    for b in sources:
        out.update((b.hex(), b.hex().upper()))
        for off in range(3):
            enc = base64.b64encode(b"\0" * off + b).decode()
            first, last = -(-off * 8 // 6), (off + len(b)) * 8 // 6
            mark = enc[first:last]
            out.update((mark, mark.translate(_TO_URLSAFE)))
    return {m for m in out if len(m) >= 4}


_TO_URLSAFE = str.maketrans("+/", "-_")
