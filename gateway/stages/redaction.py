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

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from gateway.security.encoded import decodings, encoded_marks, may_hold_encoding
from gateway.security.skeleton import (
    MARK,
    MIN_SECRET,
    SECRET_TOKEN,
    TAGS,
    apply_spans,
    display_view,
    drop_ascii_ws,
    fast_skeleton,
    find_all,
    may_hold_token,
    min_piece,
    piece_spans,
    secret_skeleton,
    skeleton,
)
from gateway.security.text import ASCII_CONTROL_BYTES, all_seen, may_hide, visible
from gateway.stages.base import Ctx, Refuse, Turn
from pgwcore.logs import get_logger
from subjects.wire import Detail

log = get_logger("pgw.redaction")

T = TypeVar("T")

_WS_TEXT = " \t\n\r\f\v"
_WS = re.compile(r"[ \t\n\r\f\v]")
_ENC_TOKEN = re.compile(r"[A-Za-z0-9+/_=%:-]+")  # a piece of a base64, hex or URL-encoded run
_MAX_TOKENS = 32  # pieces of one run broken by white space (a 76-column wrap of a long secret's base64 fits)


def _number(x: float) -> str:
    """A JSON number's text, as a leaf to judge (``msgspec`` writes it as it is sent)."""
    return msgspec.json.encode(x).decode()


_JSON_ESCAPE = re.compile(r"\\u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})|\\u([0-9a-fA-F]{4})")


def json_unescaped(text: str) -> str:
    """``text`` with its JSON ``\\uXXXX`` escapes read (a surrogate pair as its character, a lone surrogate as
    U+FFFD): how a message no parser could read would read once parsed, for judging it as text."""
    def char(m: re.Match[str]) -> str:
        if m.group(3) is not None:
            cp = int(m.group(3), 16)
            return "\ufffd" if 0xD800 <= cp <= 0xDFFF else chr(cp)
        return chr(0x10000 + ((int(m.group(1), 16) - 0xD800) << 10) + (int(m.group(2), 16) - 0xDC00))
    return _JSON_ESCAPE.sub(char, text) if "\\u" in text else text


def _clean_text_json(blob: bytes) -> bool:
    """``Redactor._clean_json`` for JSON text that is not ASCII, exact in the same direction: with no escape
    but the plain ones (no ``\\u``, ``\\b``, ``\\f``), every string of it stands in the text as written, so
    no character a reader cannot see in the whole text (:func:`all_seen`) is none in any string, and no
    ``secret:`` in the fold of the whole text is none in the fold of any string (a character folds alone).
    Two translates of the text instead of a walk of every string (about 1 us a character, issue 48's
    hostile-input work)."""
    if b"\\u" in blob or b"\\b" in blob or b"\\f" in blob:
        return False
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError:
        return False
    fold = fast_skeleton(text, keep_space=True)
    return all_seen(text) and not may_hold_token(fold)


class Redactor:
    """Scrubs configured secrets and ``secret:`` tokens out of strings and graphs."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        kept = [s for s in secrets if s and len(s.strip()) >= MIN_SECRET]
        skels = {secret_skeleton(s) for s in kept}
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
        if not SECRET_TOKEN.search(fast_skeleton(text, keep_space=True, tags=tags)):
            return []
        skel, where = skeleton(text, keep_space=True, tags=tags)
        return [(where[m.start()], where[m.end() - 1] + 1) for m in SECRET_TOKEN.finditer(skel)]

    def text(self, text: str) -> str:
        """One string on its own (log fields, reasons, ids)."""
        return self._leaves([text])[0]

    def _leaves(self, texts: list[str], show: Callable[[str], str] = visible) -> list[str]:
        """Redact a sequence of strings rendered adjacently (document order); ``show`` renders each after."""
        joined = "\n".join(texts)
        spans: list[list[tuple[int, int]]] = [[] for _ in texts]
        for tags in (False, True) if not joined.isascii() and TAGS.search(joined) else (False,):
            self._scan(texts, joined, spans, tags)
        # A mark holds no white space, so one in the text is in it with its white space taken out too:
        # one search covers a run as written and one broken by white space.
        if self._needles and (not joined.isascii() or "%" in joined or self._holds_mark(_WS.sub("", joined))):
            for li, t in enumerate(texts):
                spans[li].extend(self._encoded_spans(t))
        if not may_hide(joined):
            return [apply_spans(t, s) for t, s in zip(texts, spans, strict=True)]
        return [show(apply_spans(t, s)) for t, s in zip(texts, spans, strict=True)]

    def _scan(self, texts: list[str], joined: str, spans: list[list[tuple[int, int]]], tags: bool) -> None:
        """Add the spans of ``secret:`` tokens and configured secrets, tags read as ``tags`` says."""
        # The folded text of the leaves joined by newlines is their folded texts so joined (a character
        # folds alone, a newline to itself): without "secret:" in it no leaf holds a token. One fold of
        # the whole, ASCII or not (each leaf's own fold and search cost a Python call per leaf).
        low = fast_skeleton(joined, keep_space=True, tags=tags)
        if may_hold_token(low):
            for li, t in enumerate(texts):
                spans[li].extend(self._token_spans(t, tags))
        if not self._needles:
            return
        fast = (
            drop_ascii_ws(low) if joined.isascii()
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
            for start in find_all(joined, needle):
                mark(start, start + len(needle))
        for needle in pieces:
            for start, end in piece_spans(joined, needle, min_piece(needle)):
                mark(start, end)

    @staticmethod
    def _may_be_in_pieces(needle: str, fast: str) -> bool:
        m = min_piece(needle)
        return needle[:m] in fast and needle[-m:] in fast

    def _holds_secret(self, text: str) -> bool:
        if not text.isascii() and text.count("\ufffd") * 6 > len(text):
            return False  # bytes that are not text (ids, hashes decoded as base64 or hex)
        for tags in (False, True) if not text.isascii() and TAGS.search(text) else (False,):
            if SECRET_TOKEN.search(fast_skeleton(text, keep_space=True, tags=tags)):
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
        if _WS.search(text):
            out += self._spaced_spans(text)
        if not text.isascii():
            for tags in (False, True) if TAGS.search(text) else (False,):
                view, where = display_view(text, tags)
                if view != text and may_hold_encoding(view):
                    out += [(where[s], where[e - 1] + 1) for s, e, dec in decodings(view) if self._holds_secret(dec)]
        return out

    def _holds_mark(self, squeezed: str) -> bool:
        """Whether ``squeezed`` (a text with its white space taken out) holds a mark of a secret's encodings."""
        return any(m in squeezed for m in self._marks)

    def _spaced_spans(self, text: str) -> list[tuple[int, int]]:
        """Runs broken by white space ("RW5jS2l3 aVNl...", a hex dump "45 6e 63", a wrapped line): the
        shortest window of adjacent tokens, joined without the white space between them, that decodes to
        text holding a secret; its span from the first token to the last."""
        # Every window below is its tokens without the white space between them, so it is a piece of the
        # text with its white space taken out: no mark there, none in any window (the common case, and
        # a text built to make the window search costly holds none).
        if not self._holds_mark(_WS.sub("", text)):
            return []
        toks = [(m.start(), m.end()) for m in _ENC_TOKEN.finditer(text)]
        found: list[tuple[int, int]] = []
        for i in range(len(toks)):
            joined = ""
            for j in range(i, min(len(toks), i + _MAX_TOKENS)):
                if j > i and text[toks[j - 1][1]:toks[j][0]].strip(_WS_TEXT):
                    break  # something other than white space between: the run ends
                joined += text[toks[j][0]:toks[j][1]]
                if any(m in joined for m in self._marks) and any(
                        self._holds_secret(dec) for _s, _e, dec in decodings(joined)):
                    found.append((toks[i][0], toks[j][1]))
                    break
        # Only the windows that hold no smaller one: a word the run was written against is not taken in.
        return [w for w in found if not any(o != w and w[0] <= o[0] and o[1] <= w[1] for o in found)]

    # -- graphs ----------------------------------------------------------
    @property
    def has_secrets(self) -> bool:
        """Whether any secret is configured (``pipeline.secrets``)."""
        return bool(self._needles)

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
        return self._clean_json(msgspec.json.encode(obj))

    @staticmethod
    def _clean_json(blob: bytes) -> bool:
        """``plainly_clean`` on the JSON text of the graph (with no configured secrets)."""
        # A control character must be dropped (visible()) and may hide a token
        # ("sec\\bret:"), so take the walk: JSON writes most as b"\\u00..", backspace and
        # form feed as b"\\b" / b"\\f", and DEL (0x7f) as itself. (b"\\" first: one
        # memchr proves the longer searches unneeded for most bodies.)
        if not blob.isascii():
            return _clean_text_json(blob)
        # One search for what both heads of the token end with (TOKEN_HEADS: "secret:", "fecret:"): a
        # text holding "ecret:" after another letter takes the walk too, which is exact in this direction,
        # and the common text costs one search of its bytes instead of two.
        if b"ecret:" in blob.lower() or b"\x7f" in blob:
            return False
        return b"\\" not in blob or (b"\\u00" not in blob and b"\\b" not in blob and b"\\f" not in blob)

    def graph(self, value: Any, show: Callable[[str], str] = visible, *, checked: bool = False,
              numbers: bool = True) -> Any:
        """A copy of a JSON graph with every string leaf and key redacted (``value`` itself if none changed).

        ``show``: how a leaf is rendered once redacted; by default without its invisible characters
        (``visible``), for data a principal approves as it will run with them marked instead
        (``gateway.security.text.marked``, docs/gate.md "What the principal sees"). ``checked``: the
        caller ran ``plainly_clean`` on it already (and it said no), so the pre-check is not run again."""
        if not self._needles and not checked:
            # The pre-check of ``plainly_clean``, exact in this direction: such a graph has nothing to
            # redact or drop, whatever ``show`` is, so it comes back as it went in, with no walk. Where
            # a caller has not checked first (a turn's raw body, settled at rest once answered:
            # gateway/at_rest.py), the walk cost about as much as the rest of the stages together.
            try:
                blob = msgspec.json.encode(value)
            except Exception:  # noqa: BLE001 - not JSON-encodable as it is (a key type, a depth): the walk decides
                blob = None
            if blob is not None and self._clean_json(blob):
                return value
        leaves: list[str] = []
        is_key: list[bool] = []

        def collect(v: Any) -> None:
            stack: list[tuple[Any, bool]] = [(v, False)]
            while stack:
                x, key = stack.pop()
                if isinstance(x, str):
                    leaves.append(x)
                    is_key.append(key)
                elif numbers and isinstance(x, int | float) and not isinstance(x, bool):
                    leaves.append(_number(x))  # a secret of digits sent as a number (its JSON text)
                    is_key.append(False)
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
        done = self._leaves(leaves, show)
        vals = [i for i, k in enumerate(is_key) if not k]
        for i, t in zip(vals, self._leaves([done[i] for i in vals], show), strict=True):
            done[i] = t
        if all(d is leaf for d, leaf in zip(done, leaves, strict=True)):
            return value  # nothing redacted: no copy
        red = iter(zip(done, leaves, strict=True))

        def rebuild(x: Any) -> Any:
            if isinstance(x, str):
                return next(red)[0]
            if numbers and isinstance(x, int | float) and not isinstance(x, bool):
                d, leaf = next(red)
                return x if d is leaf else d  # a number that held a secret becomes its redacted text
            if isinstance(x, dict):
                out: dict[Any, Any] = {}
                for k, child in x.items():
                    nk = next(red)[0] if isinstance(k, str) else k
                    nv = rebuild(child)
                    while nk in out:  # two keys redacted to the same text
                        nk = f"{nk}~"
                    out[nk] = nv
                return out
            if isinstance(x, list):
                return [rebuild(c) for c in x]
            return x

        return rebuild(value)

    def holding(self, value: Any) -> list[str]:
        """The JSON paths of the leaves of ``value`` that hold a secret: those :meth:`graph` would
        redact, keys (``$.a.<key>``) and values (``$.a.b[0]``), in document order; ``[]`` when none.

        Judged as :meth:`graph` judges (a secret split across adjacent leaves marks each of them);
        nothing is rendered, so a leaf that only holds invisible characters is not named.
        """
        if self.plainly_clean(value):
            return []
        # Each leaf in document order with the path to it: parts ("i", index) of an array, ("k", the
        # key's own leaf index) of an object; a key is named in a path as redacted, never as sent.
        paths: list[tuple[tuple[str, int], ...]] = []
        leaves: list[str] = []
        is_key: list[bool] = []

        def walk(x: Any, path: tuple[tuple[str, int], ...]) -> None:
            if isinstance(x, str):
                paths.append(path)
                leaves.append(x)
                is_key.append(False)
            elif isinstance(x, int | float) and not isinstance(x, bool):
                paths.append(path)
                leaves.append(_number(x))
                is_key.append(False)
            elif isinstance(x, dict):
                for k, child in x.items():
                    if isinstance(k, str):
                        paths.append(path)
                        leaves.append(k)
                        is_key.append(True)
                        walk(child, (*path, ("k", len(leaves) - 1)))
                    else:
                        walk(child, path)
            elif isinstance(x, list):
                for i, c in enumerate(x):
                    walk(c, (*path, ("i", i)))

        try:
            walk(value, ())
        except RecursionError:  # deeper than redaction walks: judged whole, as text
            blob = msgspec.json.encode(value).decode()
            return ["$"] if self.text(blob) != blob else []
        if not leaves:
            return []

        def same(t: str) -> str:
            return t

        done = self._leaves(leaves, same)
        hit = [d is not leaf for d, leaf in zip(done, leaves, strict=True)]
        vals = [i for i, k in enumerate(is_key) if not k]
        for i, t in zip(vals, self._leaves([leaves[i] for i in vals], same), strict=True):
            hit[i] = hit[i] or t is not leaves[i]

        def named(i: int) -> str:
            parts = paths[i] + ((("k", i),) if is_key[i] else ())
            return "$" + "".join(f"[{n}]" if kind == "i" else f".{done[n]}" for kind, n in parts)

        return list(dict.fromkeys(named(i) for i, h in enumerate(hit) if h))

    def bytes_plainly_clean(self, body: bytes) -> bool:
        """True when the bytes of a message certainly hold nothing to redact or drop, however they are
        read: parsed (``graph`` of the value), as text when they are not JSON (``text``), or member by
        member with duplicates kept (``bytes_hold_secret``). One scan instead of a parse, a walk and a
        re-encode, for a message settled at rest (gateway/at_rest.py).

        Exact in this direction, and only with no configured secrets, as :meth:`plainly_clean` is:
        the bytes are ASCII with no ``\\u`` escape, no ``secret:`` in any letter case, no ``\\b`` or
        ``\\f`` escape, no DEL and no control character but JSON's white space (or, not ASCII, UTF-8
        with no such escape, no character a reader cannot see and no ``secret:`` in its fold:
        :func:`_clean_text_json`). Parsed, such bytes
        give strings of those same characters (the escapes left, ``\\n \\r \\t \\" \\\\ \\/``,
        make no letter and nothing :func:`visible` drops), whose JSON text the graph's pre-check
        passes; read as text they hold no token and nothing invisible. Anything else: False, and the
        caller takes the full read."""
        # The control bytes are found by deleting them (bytes.translate): a quarter of a regex search's
        # cost on 1 KB.
        return self._bytes_precheck(body) and len(body.translate(None, ASCII_CONTROL_BYTES)) == len(body)

    def _bytes_precheck(self, body: bytes) -> bool:
        """The pre-check both judgements of a message's bytes start with: exact on text msgspec wrote, which
        escapes nothing but controls (\\u00xx); an agent's bytes may escape any character ("\\uff53ecret:" is a
        full-width "secret:"), so those take the read."""
        # b"\\" first: one memchr where the two-byte search costs six times as much, and most bodies hold no escape.
        return not self._needles and (b"\\" not in body or b"\\u" not in body) and self._clean_json(body)

    def bytes_hold_secret(self, body: bytes) -> bool:
        """Whether the bytes of a message hold a secret anywhere, also where a parse would not show it: a
        JSON member given twice (a parser keeps one of them, the bytes keep both), or text that is not JSON."""
        if self._bytes_precheck(body):
            return False
        if b"\\" in body:  # escapes: read every member's string as a parser would, duplicates kept
            try:
                return bool(self.holding(json.loads(body, object_pairs_hook=lambda pairs: [list(p) for p in pairs])))
            except (ValueError, RecursionError):
                pass
        text = body.decode("utf-8", "replace")
        # Neither parser read it (not JSON, or JSON deeper than they go): judged as text, and as the JSON
        # text it may be, its escapes decoded ("\\u0073ecret:" is "secret:").
        return bool(self.holding(text)) or bool(self.holding(json_unescaped(text)))

    def clean(self, value: Any) -> bool:
        """True when ``value`` (a JSON graph) would come out of redaction unchanged."""
        return self.graph(value) == value

    def scrub_json(self, obj: T) -> tuple[T, bytes]:
        """``scrub_struct(obj)`` and its JSON text (what a publish of it sends): the text the
        pre-check encodes is kept, so a clean Struct is encoded once, not once to check and
        once to send (``msgspec.json.encode``, the same bytes as the publisher's encoder)."""
        blob = None
        if not self._needles:
            blob = msgspec.json.encode(obj)
            if self._clean_json(blob):
                return obj, blob
        red = self._walk(obj)  # the pre-check is done: not again
        if red is obj and blob is not None:  # the walk found nothing: the text encoded above is it
            return obj, blob
        return red, msgspec.json.encode(red)

    def scrub_struct(self, obj: T) -> T:
        """A redacted copy of a wire Struct (outcome, verdict, surface item); ``obj`` itself when clean."""
        if self.plainly_clean(obj):
            return obj
        return self._walk(obj)

    def _walk(self, obj: T) -> T:
        """``scrub_struct`` without the pre-check: the full walk of the Struct's graph."""
        builtins = msgspec.to_builtins(obj)
        red = self.graph(builtins, checked=True)
        if red is builtins or red == builtins:
            return obj
        try:
            return msgspec.convert(red, type(obj))
        except msgspec.ValidationError:
            # A typed number field (a sequence, a count) that reads as a secret of digits stays a number:
            # the Struct's own numbers are the gateway's, not a sender's text.
            return msgspec.convert(self.graph(builtins, checked=True, numbers=False), type(obj))


def body_plainly_clean(red: Redactor, turn: Turn) -> bool:
    """``red.bytes_plainly_clean(turn.body)``, judged once per turn, redactor and body: each envelope's
    redaction asks it, and the turn's settling at rest (gateway/at_rest.py) asks it again."""
    cached = turn.clean
    if cached is not None and cached[0] is red and cached[1] is turn.body:
        return cached[2]
    clean = red.bytes_plainly_clean(turn.body)
    turn.clean = (red, turn.body, clean)
    return clean


async def run(ctx: Ctx) -> None:
    """Redact the envelope in place: payload, meta, ids; re-type the payload."""
    env = ctx.env
    assert env is not None and ctx.kind is not None
    r = ctx.state.redactor
    # The turn's bytes plainly clean: so is every envelope parsed from them (bytes_plainly_clean says
    # why), and none is encoded again to be judged; unless the shape stage synthesized its correlationId
    # (spec 002 Migration 3): the agent's name, the nodeId and the envelopeId joined by ":" can make a
    # token none of them holds ("planner:nodesecret:e-77"), so that envelope is judged as it now stands.
    own_ids = isinstance(ctx.raw, dict) and ctx.raw.get("correlationId") == env.correlationId
    if (own_ids and body_plainly_clean(r, ctx.turn)) or r.plainly_clean(env):
        return
    raw = msgspec.to_builtins(env)
    red = r.graph(raw, checked=True)
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
    changed = [(name, path, was) for name, path, was, now in (
        ("envelopeId", "$.envelopeId", env.envelopeId, red_env.envelopeId),
        ("correlationId", "$.correlationId", env.correlationId, red_env.correlationId),
    ) if was != now]
    if changed:
        raise identifier_redacted(changed)
    log.info("redacted secret material", envelope_id=ctx.envelope_id, agent=ctx.agent)


ID_CODE = "identifier_redacted"


def identifier_redacted(changed: list[tuple[str, str, str | None]]) -> Refuse:
    """An id that held secret material (or invisible characters) is refused, not rewritten.

    The ids are the keys of dedup (spec 002 "Replay determinism") and the
    agent's way to match its outcome. Keyed on the redacted text, two ids
    differing only inside a ``secret:`` token would be one correlationId (the
    second envelope answered with the first's outcome); echoed as written,
    the secret would reach the outcome (spec 002 "Redaction": not in "any
    error envelope returned to the client"). So the envelope is refused; each
    detail gives the sha256 of the id as sent, so the agent can still tell
    which of its envelopes this outcome answers.
    """
    names = " and ".join(n for n, _, _ in changed)
    return Refuse(
        ID_CODE,
        f"{names} held secret material or invisible characters; re-emit with an id that holds neither",
        details=[Detail(
            message=f"sha256 of the {name} as sent: {hashlib.sha256((was or '').encode('utf-8', 'surrogatepass')).hexdigest()}",
            path=path, rule="redaction",
        ) for name, path, was in changed],
    )


__all__ = ["MARK", "MIN_SECRET", "Redactor", "fast_skeleton", "run", "skeleton"]
