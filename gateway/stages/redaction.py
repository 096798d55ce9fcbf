"""Stage 6, SR-1 redaction (spec 002 "Redaction (SR-1 carry-forward)", DESIGN §3.2 step 6).

Walks the whole payload graph (every string leaf and every object key, any
depth, open-shape bags included) plus ``meta`` and the ids, and replaces

- every configured secret (literal values, environment variables, files), and
- every ``secret:``-prefixed token,

with ``[REDACTED]``. Matching runs on a *skeleton* of the text, so the usual
evasions do not work:

- zero-width, bidi-control, soft-hyphen, variation-selector and Unicode tag
  characters are dropped before matching;
- each character is NFKC-folded and case-folded, and a small table folds the
  Cyrillic/Greek letters that look Latin, so full-width or mathematical
  look-alikes of a secret match it;
- whitespace is ignored for configured secrets, and the skeletons of all
  string leaves are matched *concatenated in document order*, so a secret
  split across two adjacent fields (or array elements) whose concatenation a
  surface renders is found and both halves are redacted.

The same :class:`Redactor` scrubs the refusal texts, outcomes, verdicts,
notices and log fields the pipeline produces (``scrub_struct``), because a
refusal raised *before* this stage (for example a validator message quoting
a value) must not carry a secret downstream either.
"""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from gateway.logs import get_logger
from gateway.stages.base import Ctx, Refuse
from subjects.wire import Detail

log = get_logger("pgw.redaction")

MARK = "[REDACTED]"
MIN_SECRET = 4
T = TypeVar("T")

# Characters a renderer shows as nothing: zero-width, joiners, bidi controls,
# soft hyphen, word joiner, invisible operators, BOM, variation selectors,
# Mongolian vowel separator, combining grapheme joiner, Unicode tags.
_INVISIBLE_RANGES = (
    (0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160),
    (0x17B4, 0x17B5), (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E),
    (0x2060, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0000, 0xE0FFF),
)

# Look-alikes NFKC leaves alone (Cyrillic and Greek letters shaped like Latin).
_CONFUSABLES = str.maketrans({
    "а": "a", "в": "b", "е": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p",
    "с": "c", "т": "t", "у": "y", "х": "x", "і": "i", "ј": "j", "ѕ": "s", "ԁ": "d",
    "ɡ": "g", "ӏ": "l", "ԛ": "q", "ԝ": "w", "α": "a", "β": "b", "ε": "e", "ι": "i",
    "κ": "k", "ν": "v", "ο": "o", "ρ": "p", "τ": "t", "υ": "u", "χ": "x", "ϲ": "c",
})

_SECRET_TOKEN = re.compile(r"secret:[^\s]+")


def _invisible(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _INVISIBLE_RANGES) or unicodedata.category(chr(cp)) == "Cf"


def _fold(ch: str) -> str:
    """The skeleton of one character: '' for invisible ones."""
    cp = ord(ch)
    if cp < 0x80:
        return ch.lower()
    if _invisible(cp):
        return ""
    return unicodedata.normalize("NFKC", ch).casefold().translate(_CONFUSABLES)


def skeleton(text: str, *, keep_space: bool) -> tuple[str, list[int]]:
    """Folded text and, per skeleton character, the index of the source character."""
    out: list[str] = []
    where: list[int] = []
    for i, ch in enumerate(text):
        f = _fold(ch)
        if not keep_space:
            f = "".join(c for c in f if not c.isspace())
        for c in f:
            out.append(c)
            where.append(i)
    return "".join(out), where


_ASCII_WS = {ord(c): None for c in " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"}


def fast_skeleton(text: str, *, keep_space: bool) -> str:
    """The skeleton string alone (no index map): the cheap pre-check before mapping."""
    if text.isascii():
        low = text.lower()
        return low if keep_space else low.translate(_ASCII_WS)
    return skeleton(text, keep_space=keep_space)[0]


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


def _find_all(hay: str, needle: str) -> Iterable[int]:
    start = hay.find(needle)
    while start != -1:
        yield start
        start = hay.find(needle, start + 1)


class Redactor:
    """Scrubs configured secrets and ``secret:`` tokens out of strings and graphs."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        skels = {_secret_skeleton(s) for s in secrets if s and len(s.strip()) >= MIN_SECRET}
        self._needles = sorted((s for s in skels if len(s) >= MIN_SECRET), key=len, reverse=True)

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
    def _token_spans(self, text: str) -> list[tuple[int, int]]:
        if not _SECRET_TOKEN.search(fast_skeleton(text, keep_space=True)):
            return []
        skel, where = skeleton(text, keep_space=True)
        return [(where[m.start()], where[m.end() - 1] + 1) for m in _SECRET_TOKEN.finditer(skel)]

    def text(self, text: str) -> str:
        """One string on its own (log fields, reasons, ids)."""
        return self._leaves([text])[0]

    def _leaves(self, texts: list[str]) -> list[str]:
        """Redact a sequence of strings rendered adjacently (document order)."""
        joined = "\n".join(texts)
        low = joined.lower() if joined.isascii() else None
        if low is not None and "secret:" not in low:
            # All ASCII: each leaf's skeleton is its lower-case text, so no
            # leaf holds a token unless the joined lower-case text does.
            spans: list[list[tuple[int, int]]] = [[] for _ in texts]
        else:
            spans = [self._token_spans(t) for t in texts]
        if self._needles:
            fast = (
                low.translate(_ASCII_WS) if low is not None
                else "".join(fast_skeleton(t, keep_space=False) for t in texts)
            )
            if not any(n in fast for n in self._needles):
                return [_apply(t, s) for t, s in zip(texts, spans, strict=True)]
            skels = [skeleton(t, keep_space=False) for t in texts]
            joined = "".join(s for s, _ in skels)
            # owner[k] = (leaf index, source index) of joined character k
            owner: list[tuple[int, int]] = [(li, src) for li, (_, w) in enumerate(skels) for src in w]
            for needle in self._needles:
                for start in _find_all(joined, needle):
                    end = start + len(needle) - 1
                    first_leaf, first_src = owner[start]
                    last_leaf, last_src = owner[end]
                    if first_leaf == last_leaf:
                        spans[first_leaf].append((first_src, last_src + 1))
                        continue
                    # Split across leaves: redact the tail of the first, the whole
                    # of any middle leaf, the head of the last.
                    spans[first_leaf].append((first_src, len(texts[first_leaf])))
                    for mid in range(first_leaf + 1, last_leaf):
                        spans[mid].append((0, len(texts[mid])))
                    spans[last_leaf].append((0, last_src + 1))
        return [_apply(t, s) for t, s in zip(texts, spans, strict=True)]

    # -- graphs ----------------------------------------------------------
    def plainly_clean(self, obj: Any) -> bool:
        """True when ``obj`` (a JSON graph or a wire Struct) certainly holds nothing to redact.

        A cheap pre-check, exact in one direction only: with no configured
        secrets, a graph whose JSON text is ASCII and holds no ``secret:`` in
        any letter case has no ``secret:`` token in any leaf or key (every
        leaf's skeleton is then its lower-case text, and JSON escapes none of
        those characters). Anything else takes the full walk.
        """
        if self._needles:
            return False
        blob = msgspec.json.encode(obj)
        return blob.isascii() and b"secret:" not in blob.lower()

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
            "the envelope carries secret material that cannot be redacted within the schema's limits",
            details=[Detail(message="remove the secret material and re-emit", path="$", rule="redaction")],
        ) from None
    ctx.env = red_env
    ctx.payload = typed
    ctx.envelope_id = red_env.envelopeId
    ctx.correlation_id = red_env.correlationId
    log.info("redacted secret material", envelope_id=ctx.envelope_id, agent=ctx.agent)
