"""Stage 6, SR-1 redaction (spec 002 "Redaction (SR-1 carry-forward)", DESIGN §3.2 step 6).

Walks the whole payload graph (every string leaf and every object key, any
depth, open-shape bags included) plus ``meta`` and the ids, and replaces

- every configured secret (literal values, environment variables, files), and
- every ``secret:``-prefixed token,

with ``[REDACTED]``. Matching runs on a *skeleton* of the text, so the usual
evasions do not work (issue 19 lists the ones a held-out pass tried):

- zero-width, bidi-control, soft-hyphen, variation-selector and other
  invisible characters are dropped before matching, and Unicode tag
  characters (U+E0020-E007E) are read as the ASCII they smuggle;
- each character is folded by every confusable of Unicode UTS #39, by case
  and by NFKD (gateway/security/confusables.py), so full-width,
  mathematical, Greek, Cyrillic (and 6,000 more) look-alikes of a secret
  match it;
- whitespace is ignored for configured secrets, and the skeletons of all
  string leaves are matched *concatenated in document order*, so a secret
  split across two adjacent fields (or array elements) whose concatenation a
  surface renders is found and both halves are redacted;
- a configured secret written in pieces with other text between them
  (in order, each piece at least a quarter of the secret) is found too;
- for configured secrets, runs that decode as base64, base64url, hex or
  URL-encoding are decoded and checked (gateway/security/encoded.py); a run
  carrying a secret is redacted whole. (``secret:`` tokens are matched as
  written: decoding every id-like run of every message to look for one
  would cost the hot path ten times the rest of the stage.)

After redaction every string is passed through
:func:`gateway.security.text.visible`, which drops invisible format and
control characters, so no text a principal reads carries hidden content
(spec 000 §9 renders the slots as written).

The same :class:`Redactor` scrubs the refusal texts, outcomes, verdicts,
notices and log fields the pipeline produces (``scrub_struct``), because a
refusal raised *before* this stage (for example a validator message quoting
a value) must not carry a secret downstream either.
"""

from __future__ import annotations

import functools
import os
import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from gateway.logs import get_logger
from gateway.security.confusables import ascii_table, fold_char
from gateway.security.encoded import decodings, encoded_marks, may_hold_encoding
from gateway.security.text import visible
from gateway.stages.base import Ctx, Refuse
from subjects.wire import Detail

log = get_logger("pgw.redaction")

MARK = "[REDACTED]"
MIN_SECRET = 4
T = TypeVar("T")

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
# token is found in the skeleton as written.
_SECRET_TOKEN = re.compile(r"secret:[^\s]+")
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


@functools.cache
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


@functools.cache
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


_TAGS = re.compile("[\U000E0000-\U000E007F]")


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


def _drop_ascii_ws(text: str) -> str:
    return text.encode("ascii").translate(None, _ASCII_WS_BYTES).decode("ascii")


def _fold_ascii(text: str) -> str:
    table, delete, multi = _ascii_fold()
    out = text.encode("ascii").translate(table, delete).decode("ascii")
    for ch, to in multi:
        if ch in out:
            out = out.replace(ch, to)
    return out


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




def fast_skeleton(text: str, *, keep_space: bool, tags: bool = False) -> str:
    """The skeleton string alone (no index map): the cheap pre-check before mapping."""
    if text.isascii():
        low = _fold_ascii(text)
        return low if keep_space else _drop_ascii_ws(low)
    return skeleton(text, keep_space=keep_space, tags=tags)[0]


def _secret_skeleton(secret: str) -> str:
    return skeleton(secret, keep_space=False)[0]


def _merge(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _apply(text: str, spans: list[tuple[int, int]]) -> str:
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


def _display_view(text: str, tags: bool) -> tuple[str, list[int]]:
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


def _min_piece(needle: str) -> int:
    """The shortest piece of a secret written in pieces that still counts (issue 19)."""
    return max(MIN_SECRET, len(needle) // 4)


def _pieces(hay: str, needle: str, m: int) -> list[tuple[int, int]]:
    """Spans of ``needle`` written in order in pieces of at least ``m`` characters, other text
    between them; [] if it is not there. Each piece starts at the earliest place its first
    ``m`` characters occur and runs as far as the text keeps matching (leaving at least
    ``m`` for the next piece), so halves and thirds of a secret are found; a split this
    choice overshoots can be missed."""
    out: list[tuple[int, int]] = []
    pos, cursor, n = 0, 0, len(needle)
    while pos < n:
        if n - pos < m:
            return []  # every piece is at least m long (the pre-check relies on it)
        at = hay.find(needle[pos:pos + m], cursor)
        if at == -1:
            return []
        size = m
        while pos + size < n and at + size < len(hay) and hay[at + size] == needle[pos + size]:
            size += 1
        left = n - pos - size
        if 0 < left < m:
            size -= m - left
            if size < m:
                return []
        out.append((at, at + size))
        pos, cursor = pos + size, at + size
    return out


def _find_all(hay: str, needle: str) -> Iterable[int]:
    start = hay.find(needle)
    while start != -1:
        yield start
        start = hay.find(needle, start + 1)


class Redactor:
    """Scrubs configured secrets and ``secret:`` tokens out of strings and graphs."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        kept = [s for s in secrets if s and len(s.strip()) >= MIN_SECRET]
        skels = {_secret_skeleton(s) for s in kept}
        self._needles = sorted((s for s in skels if len(s) >= MIN_SECRET), key=len, reverse=True)
        self._marks = sorted({m for s in kept for m in encoded_marks(s)}, key=len, reverse=True)

    @classmethod
    def from_config(cls, cfg: Any) -> Redactor:
        """Secrets from ``pipeline.secrets``: literal values, env var names, files (one per line)."""
        secrets = list(cfg.values)
        for name in cfg.env:
            value = os.environ.get(name)
            if value:
                secrets.append(value)
            else:
                log.warning("secret environment variable is not set; nothing to redact for it", env=name)
        for f in cfg.files:
            try:
                secrets.extend(line.strip() for line in Path(f).expanduser().read_text().splitlines() if line.strip())
            except OSError as e:
                # Fail closed at start: a secrets file that cannot be read is a configuration error.
                from subjects.errors import ConfigError

                raise ConfigError("pipeline.secrets.files", f"cannot read {f}: {e.strerror}") from e
        return cls(secrets)

    # -- strings ----------------------------------------------------------
    def _token_spans(self, text: str, tags: bool = False) -> list[tuple[int, int]]:
        if not _SECRET_TOKEN.search(fast_skeleton(text, keep_space=True, tags=tags)):
            return []
        skel, where = skeleton(text, keep_space=True, tags=tags)
        return [(where[m.start()], where[m.end() - 1] + 1) for m in _SECRET_TOKEN.finditer(skel)]

    def text(self, text: str) -> str:
        """One string on its own (log fields, reasons, ids)."""
        return self._leaves([text])[0]

    def _leaves(self, texts: list[str]) -> list[str]:
        """Redact a sequence of strings rendered adjacently (document order)."""
        joined = "\n".join(texts)
        spans: list[list[tuple[int, int]]] = [[] for _ in texts]
        for tags in (False, True) if _TAGS.search(joined) else (False,):
            self._scan(texts, joined, spans, tags)
        if self._needles and (not joined.isascii() or "%" in joined or any(m in joined for m in self._marks)):
            for li, t in enumerate(texts):
                spans[li].extend(self._encoded_spans(t))
        return [visible(_apply(t, s)) for t, s in zip(texts, spans, strict=True)]

    def _scan(self, texts: list[str], joined: str, spans: list[list[tuple[int, int]]], tags: bool) -> None:
        """Add the spans of ``secret:`` tokens and configured secrets, tags read as ``tags`` says."""
        low = fast_skeleton(joined, keep_space=True) if joined.isascii() else None
        if low is None or "secret:" in low:
            # All ASCII without "secret:" in the folded text: no leaf holds a token.
            for li, t in enumerate(texts):
                spans[li].extend(self._token_spans(t, tags))
        if not self._needles:
            return
        fast = (
            _drop_ascii_ws(low) if low is not None
            else "".join(fast_skeleton(t, keep_space=False, tags=tags) for t in texts)
        )
        whole = [n for n in self._needles if n in fast]
        pieces = [n for n in self._needles if n not in fast and self._may_be_in_pieces(n, fast)]
        if whole or pieces:
            self._needle_spans(texts, spans, whole, pieces, tags)

    def _needle_spans(self, texts: list[str], spans: list[list[tuple[int, int]]],
                      whole: list[str], pieces: list[str], tags: bool) -> None:
        skels = [skeleton(t, keep_space=False, tags=tags) for t in texts]
        joined = "".join(s for s, _ in skels)
        # owner[k] = (leaf index, source index) of joined character k
        owner: list[tuple[int, int]] = [(li, src) for li, (_, w) in enumerate(skels) for src in w]

        def mark(start: int, end: int) -> None:
            """Redact joined[start:end] wherever its characters came from."""
            first_leaf, first_src = owner[start]
            last_leaf, last_src = owner[end - 1]
            if first_leaf == last_leaf:
                spans[first_leaf].append((first_src, last_src + 1))
                return
            # Split across leaves: redact the tail of the first, the whole
            # of any middle leaf, the head of the last.
            spans[first_leaf].append((first_src, len(texts[first_leaf])))
            for mid in range(first_leaf + 1, last_leaf):
                spans[mid].append((0, len(texts[mid])))
            spans[last_leaf].append((0, last_src + 1))

        for needle in whole:
            for start in _find_all(joined, needle):
                mark(start, start + len(needle))
        for needle in pieces:
            for start, end in _pieces(joined, needle, _min_piece(needle)):
                mark(start, end)

    @staticmethod
    def _may_be_in_pieces(needle: str, fast: str) -> bool:
        m = _min_piece(needle)
        return needle[:m] in fast and needle[-m:] in fast

    def _holds_secret(self, text: str) -> bool:
        if not text.isascii() and text.count("\ufffd") * 6 > len(text):
            return False  # bytes that are not text (ids, hashes decoded as base64 or hex)
        for tags in (False, True) if _TAGS.search(text) else (False,):
            if _SECRET_TOKEN.search(fast_skeleton(text, keep_space=True, tags=tags)):
                return True
            fast = fast_skeleton(text, keep_space=False, tags=tags)
            if any(n in fast for n in self._needles):
                return True
        return False

    def _encoded_spans(self, text: str) -> list[tuple[int, int]]:
        """Runs of ``text`` that decode (base64, hex, URL-encoding) to text holding a secret.

        Non-ASCII text is looked at through NFKC with invisible characters dropped, so a
        full-width or zero-width-laced base64 run decodes as what it displays.
        """
        out = [(s, e) for s, e, dec in decodings(text) if self._holds_secret(dec)]
        if not text.isascii():
            for tags in (False, True) if _TAGS.search(text) else (False,):
                view, where = _display_view(text, tags)
                if view != text and may_hold_encoding(view):
                    out += [(where[s], where[e - 1] + 1) for s, e, dec in decodings(view) if self._holds_secret(dec)]
        return out

    # -- graphs ----------------------------------------------------------
    def plainly_clean(self, obj: Any) -> bool:
        """True when ``obj`` (a JSON graph or a wire Struct) certainly holds nothing to redact.

        A cheap pre-check, exact in one direction only: with no configured
        secrets, a graph whose JSON text is ASCII, holds no ``secret:`` in any
        letter case and no escaped control character has nothing to redact or
        drop (the only ASCII characters folding to those of ``secret:`` are
        their capitals, and JSON escapes none of them). Encodings are decoded
        for configured secrets only (docs/pipeline.md). Anything else takes
        the full walk.
        """
        if self._needles:
            return False
        blob = msgspec.json.encode(obj)
        # b"\\u00": JSON writes a control character (NUL, ...) as an escape; it must be
        # dropped (visible()) and may hide a token ("sec\\u0000ret:"), so take the walk.
        return blob.isascii() and b"secret:" not in blob.lower() and b"\\u00" not in blob

    def graph(self, value: Any) -> Any:
        """A copy of a JSON graph with every string leaf and key redacted (``value`` itself if none changed)."""
        leaves: list[str] = []
        is_key: list[bool] = []

        def collect(v: Any) -> None:
            stack: list[tuple[Any, bool]] = [(v, False)]
            while stack:
                x, key = stack.pop()
                if isinstance(x, str):
                    leaves.append(x)
                    is_key.append(key)
                elif isinstance(x, dict):
                    items = list(x.items())
                    for k, child in reversed(items):
                        stack.append((child, False))
                        stack.append((k, True))
                elif isinstance(x, list):
                    stack.extend((c, False) for c in reversed(x))

        collect(value)
        if not leaves:
            return value
        # Keys and values in document order, then the values alone: a renderer
        # may show an object's values side by side without their keys.
        done = self._leaves(leaves)
        vals = [i for i, k in enumerate(is_key) if not k]
        for i, t in zip(vals, self._leaves([done[i] for i in vals]), strict=True):
            done[i] = t
        if all(d is leaf for d, leaf in zip(done, leaves, strict=True)):
            return value  # nothing redacted: no copy
        red = iter(done)

        def rebuild(x: Any) -> Any:
            if isinstance(x, str):
                return next(red)
            if isinstance(x, dict):
                out: dict[Any, Any] = {}
                for k, child in x.items():
                    nk = next(red) if isinstance(k, str) else k
                    nv = rebuild(child)
                    while nk in out:  # two keys redacted to the same text
                        nk = f"{nk}~"
                    out[nk] = nv
                return out
            if isinstance(x, list):
                return [rebuild(c) for c in x]
            return x

        return rebuild(value)

    def clean(self, value: Any) -> bool:
        """True when ``value`` (a JSON graph) would come out of redaction unchanged."""
        return self.graph(value) == value

    def scrub_struct(self, obj: T) -> T:
        """A redacted copy of a wire Struct (outcome, verdict, surface item); ``obj`` itself when clean."""
        if self.plainly_clean(obj):
            return obj
        builtins = msgspec.to_builtins(obj)
        red = self.graph(builtins)
        if red is builtins or red == builtins:
            return obj
        return msgspec.convert(red, type(obj))


async def run(ctx: Ctx) -> None:
    """Redact the envelope in place: payload, meta, ids; re-type the payload."""
    from gateway.stages.state import pipeline_state

    env = ctx.env
    assert env is not None and ctx.kind is not None
    r = (await pipeline_state(ctx.gw)).redactor
    if r.plainly_clean(env):
        return
    raw = msgspec.to_builtins(env)
    red = r.graph(raw)
    if red is raw or red == raw:
        return
    ctx.extra["redacted"] = True
    try:
        red_env = msgspec.convert(red, type(env))
        payload = red_env.payload
        if ctx.kind.payload_type is not None:
            typed = msgspec.convert(payload, ctx.kind.payload_type)
        else:
            typed = payload
    except msgspec.ValidationError:
        raise Refuse(
            "envelope_invalid",
            "the envelope carries secret material or invisible characters that cannot be removed "
            "within the schema's limits",
            details=[Detail(message="remove the secret material and re-emit", path="$", rule="redaction")],
        ) from None
    ctx.env = red_env
    ctx.payload = typed
    ctx.envelope_id = red_env.envelopeId
    ctx.correlation_id = red_env.correlationId
    log.info("redacted secret material", envelope_id=ctx.envelope_id, agent=ctx.agent)
