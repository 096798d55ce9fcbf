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
from urllib.parse import unquote_plus

MIN_RUN = 12  # base64 of a 4-character secret with one character around it; shorter runs are words
_B64 = re.compile(rf"[A-Za-z0-9+/_-]{{{MIN_RUN},}}={{0,2}}")
_HEX = re.compile(r"(?:0[xX])?((?:[0-9A-Fa-f]{2}[:\s]?){6,})")
_PCT = re.compile(r"[^\s\"'<>]*%[0-9A-Fa-f]{2}[^\s\"'<>]*")
_PRINTABLE_SHARE = 0.85


def _texty(raw: bytes) -> str | None:
    """The bytes as text if they look like text (a secret is text), else None."""
    # errors="replace": a misaligned run decodes to a few bytes of noise, then the text.
    s = raw.decode("utf-8", errors="replace")
    if not s:
        return None
    ok = sum((c.isprintable() and c != "\ufffd") or c in "\t\n\r" for c in s)
    return s if ok >= _PRINTABLE_SHARE * len(s) else None


def _b64(run: str) -> Iterator[str]:
    alt = b"-_" if ("-" in run or "_" in run) else None
    body = run.rstrip("=")
    for off in range(4):
        chunk = body[off:]
        if len(chunk) < 8:
            return
        chunk = chunk[: len(chunk) - len(chunk) % 4] if len(chunk) % 4 == 1 else chunk
        try:
            raw = base64.b64decode(chunk + "=" * (-len(chunk) % 4), altchars=alt, validate=True)
        except (binascii.Error, ValueError):
            continue
        text = _texty(raw)
        if text is not None:
            yield text


def _hex(run: str) -> Iterator[str]:
    digits = re.sub(r"[:\s]", "", run)
    for off in (0, 1):
        d = digits[off:]
        d = d[: len(d) - len(d) % 2]
        try:
            text = _texty(bytes.fromhex(d))
        except ValueError:
            continue
        if text is not None:
            yield text


def _once(text: str) -> Iterator[tuple[int, int, str]]:
    for m in _B64.finditer(text):
        for dec in _b64(m.group()):
            yield m.start(), m.end(), dec
    for m in _HEX.finditer(text):
        for dec in _hex(m.group(1)):
            yield m.start(), m.end(), dec
    if "%" in text:
        for m in _PCT.finditer(text):
            dec = unquote_plus(m.group())
            if dec != m.group():
                yield m.start(), m.end(), dec


def decodings(text: str, depth: int = 2) -> Iterator[tuple[int, int, str]]:
    """(start, end, decoded) for each encoded-looking run of ``text``, nested ``depth`` levels."""
    for start, end, dec in _once(text):
        yield start, end, dec
        if depth > 1:
            for _s, _e, inner in decodings(dec, depth - 1):
                yield start, end, inner


def may_hold_encoding(text: str) -> bool:
    """Cheap pre-check: could any run of ``text`` be decoded at all?"""
    return bool(_B64.search(text) or _HEX.search(text) or ("%" in text and _PCT.search(text)))
