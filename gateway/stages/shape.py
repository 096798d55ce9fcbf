"""Stage 1, shape: bytes -> JSON -> the closed AIEnvelope top level.

Refusal code ``invalid_envelope_shape`` (spec 002 "Validation outcomes").
Hostile bodies are refused, never crash the worker: too large, not UTF-8,
not JSON, duplicate keys, NaN/Infinity, nesting too deep, strings too long
(DESIGN §3.2, §7). The migration defaults of spec 002 "Migration" (missing
``meta``/``meta.source``, missing ``correlationId``) are applied with warnings;
under ``envelope_strictness = "strict"`` a missing ``meta.source`` is refused
(spec 002 "Validation outcomes").
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import msgspec

from gateway.security.text import visible
from gateway.stages.base import Ctx, Refuse
from pgwcore.config import LimitsConfig
from subjects.util import now_rfc3339
from subjects.wire import AIEnvelope, Detail, EnvelopeMeta

CODE = "invalid_envelope_shape"


def _no_dupes(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k[:64]!r}")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _refuse(reason: str, path: str | None = None, rule: str = "shape") -> Refuse:
    return Refuse(CODE, reason, details=[Detail(message=reason, path=path, rule=rule)])


def _empty(body: bytes) -> Refuse | None:
    """A body with nothing in it: empty, whitespace only, or invisible characters only.

    Each is its own case (``details[0].rule``: ``empty_body`` / ``invisible_body``)
    under spec 002's code for malformed JSON, ``invalid_envelope_shape``.
    """
    if not body.strip():
        return _refuse("the body is empty: a turn holds one envelope or a JSON array of them", rule="empty_body")
    if not body.isascii():  # a few bytes, some not ASCII: perhaps only invisible characters
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if not visible(text).strip():
            return _refuse("the body holds only invisible characters (no JSON): a turn holds one envelope "
                           "or a JSON array of them", rule="invisible_body")
    return None


def _check_graph(value: Any, limits: LimitsConfig) -> None:
    """Depth and string-length limits over the whole graph, iteratively."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            if depth > limits.max_depth:
                raise _refuse(f"nested deeper than {limits.max_depth} levels")
            for k, child in v.items():
                if len(k) > limits.max_string_chars:
                    raise _refuse(f"a key is longer than {limits.max_string_chars} characters")
                _check_unicode(k)
                stack.append((child, depth + 1))
        elif isinstance(v, list):
            if depth > limits.max_depth:
                raise _refuse(f"nested deeper than {limits.max_depth} levels")
            stack.extend((child, depth + 1) for child in v)
        elif isinstance(v, str):
            if len(v) > limits.max_string_chars:
                raise _refuse(f"a string is longer than {limits.max_string_chars} characters")
            _check_unicode(v)


def _check_unicode(s: str) -> None:
    # "\ud800" is valid JSON syntax but not Unicode: it cannot be re-encoded as
    # UTF-8, so every publish that echoes it would fail and the turn would be
    # redelivered until dead-lettered (issue 7 gauntlet). Refuse it here.
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise _refuse("a string holds a lone UTF-16 surrogate escape (not valid Unicode)") from None


def decode_body(body: bytes, limits: LimitsConfig) -> list[Any]:
    """Decode a turn: one envelope, or a JSON array of envelopes (DESIGN §3.2 step 5).

    Two decoders, one answer. The strict one (``_strict``) refuses duplicate
    keys, NaN/Infinity and over-long integers, and its refusals are the ones
    agents see. msgspec's decodes the common body several times faster but
    keeps the last of two equal keys, so its value is taken only when it
    provably is the strict decoder's:

    - the body holds no ``\\u`` escape, so every ``:`` in the text is a
      member's separator or stands as itself inside a key or string, and (being
      valid UTF-8) no string can hold a lone surrogate;
    - re-encoded, the value holds as many ``:`` as the text: a dropped duplicate
      member would take at least its own separator away.

    The graph walk (depth, string length) is skipped only where the text
    itself proves it cannot refuse: no more brackets than ``max_depth`` and
    no more characters than ``max_string_chars``. Anything else, every error
    and every refusal included, goes through the strict decoder and the walk.
    """
    if len(body) > limits.max_body_bytes:
        raise _refuse(f"body is {len(body)} bytes; the limit is {limits.max_body_bytes}")
    if len(body) <= 64 and (empty := _empty(body)) is not None:
        raise empty
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _refuse(f"body is not valid UTF-8 (byte {e.start})") from None
    value: Any = _UNSET
    # No \u escape (a body with no backslash at all is found by one memchr; the two-byte search
    # costs a tenth of a millisecond per 100 KB, issue 18). Same answer as ``"\\u" not in text``:
    # UTF-8 never puts an ASCII byte inside a multi-byte character.
    if b"\\" not in body or b"\\u" not in body:
        try:
            value = _fast.decode(body)
            if _fast_enc.encode(value).count(b":") != text.count(":"):
                value = _UNSET  # a duplicate key was dropped
            elif not _walk_cannot_refuse(text, limits):
                _check_graph(value, limits)
        except (msgspec.DecodeError, msgspec.EncodeError, RecursionError, Refuse):
            value = _UNSET  # the strict path answers, as it always did (a duplicate key first)
    if value is _UNSET:
        value = _strict(text, limits)
        _check_graph(value, limits)
    if isinstance(value, list):
        if not value:
            raise _refuse("the turn is an empty JSON array: a turn must hold at least one envelope", "$",
                          rule="empty_turn")
        if len(value) > limits.max_turn_envelopes:
            # Every envelope of a turn gets an outcome and every refusal a verdict: a
            # 100k-element turn would be 100k durable publishes past ack_wait (DESIGN §7).
            raise _refuse(f"the turn holds {len(value)} envelopes; the limit is {limits.max_turn_envelopes}")
        return value
    return [value]


def _walk_cannot_refuse(text: str, limits: LimitsConfig) -> bool:
    """The text proves the graph walk would pass: no more brackets than ``max_depth``, and no
    string or key longer than ``max_string_chars``, either because the whole text is not, or
    (issue 18: a large moment is many short strings) because the text holds no backslash, so
    every string and key is exactly the characters between two quotes, and no stretch between
    quotes is longer."""
    if text.count("{") + text.count("[") > limits.max_depth:
        return False
    if len(text) <= limits.max_string_chars:
        return True
    return "\\" not in text and max(map(len, text.split('"'))) <= limits.max_string_chars


_UNSET: Any = object()
_fast = msgspec.json.Decoder()
_fast_enc = msgspec.json.Encoder()


def _strict(text: str, limits: LimitsConfig) -> Any:
    """The reference decoder: refuses duplicate keys, NaN/Infinity, over-long integers."""
    try:
        return json.loads(text, object_pairs_hook=_no_dupes, parse_constant=_no_constants)
    except RecursionError:
        raise _refuse(f"nested deeper than {limits.max_depth} levels") from None
    except ValueError as e:  # JSONDecodeError, duplicates, NaN, over-long integers
        r = _refuse(f"body is not valid JSON: {str(e)[:200]}")
        r.hint = _lenient(text)
        raise r from None


def _lenient(text: str) -> Any:
    """Best-effort parse (last duplicate wins, NaN allowed) only to read ids back to the agent."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _is_date_time(ts: str) -> bool:
    ts = ts.upper()
    if ts[17:19] == "60":  # RFC 3339 allows a leap second (the pattern fixed the positions)
        ts = ts[:17] + "59" + ts[19:]
    try:
        datetime.fromisoformat(ts)
    except ValueError:
        return False
    return True


def readable_id(raw: Any, key: str) -> str | None:
    """An id from a raw envelope that failed validation, where one can be read."""
    if isinstance(raw, dict):
        v = raw.get(key)
        if isinstance(v, str) and 0 < len(v) <= 128:
            return v
    return None


async def run(ctx: Ctx) -> None:
    raw = ctx.raw
    ctx.envelope_id = readable_id(raw, "envelopeId")
    ctx.correlation_id = readable_id(raw, "correlationId")
    # spec 002 "Trust boundary": even a refusal of an untrusted envelope is marked untrusted.
    meta = raw.get("meta") if isinstance(raw, dict) else None
    ctx.untrusted = isinstance(meta, dict) and meta.get("contentTrust") == "untrusted"
    if not isinstance(raw, dict):
        raise _refuse(f"an envelope must be a JSON object, not {type(raw).__name__}", f"$[{ctx.index}]")
    try:
        env = msgspec.convert(raw, AIEnvelope)
    except msgspec.ValidationError as e:
        raise _refuse(str(e)) from None
    if env.meta is not None and not _is_date_time(env.meta.ts):
        # spec 002 EnvelopeMeta.ts: "ISO 8601 UTC timestamp" (the official schema: format date-time);
        # the Struct's pattern checked the form, this the calendar.
        raise _refuse("meta.ts is not a valid RFC 3339 date-time", "$.meta.ts")
    if env.envelopeId is None:
        # spec 002: "Engine assigns if absent" - deterministic, so a redelivery, or the
        # same turn stored twice by an agent's retry, agrees (ctx.envelope_key).
        env.envelopeId = f"auto-{ctx.envelope_key[:24]}"
        ctx.warn("envelopeId absent; assigned by the gateway", "migration", "$.envelopeId")
    if (env.meta is None or env.meta.source is None) and ctx.gw.config.pipeline.envelope_strictness == "strict":
        # spec 002 "Validation outcomes": meta.source absent is a top-level shape mismatch. Its
        # Migration section (warning-only for v1.x) is applied only under "warn" (issue 15 point 2).
        raise _refuse("meta.source is absent (envelopeStrictness is 'strict': no migration default)", "$.meta.source")
    if env.meta is None:
        env.meta = EnvelopeMeta(ts=now_rfc3339(), source="ai-generation")
        ctx.warn("meta absent; synthesized (spec 002 Migration 2)", "migration", "$.meta")
    elif env.meta.source is None:
        env.meta.source = "ai-generation"
        ctx.warn("meta.source absent; assumed 'ai-generation' (spec 002 Migration 2)", "migration", "$.meta.source")
    if env.correlationId is None:
        # spec 002 Migration 3: synthesize ${runId}:${nodeId}:${envelopeId}.
        env.correlationId = f"{ctx.agent}:{env.nodeId or '-'}:{env.envelopeId}"[:128]
        ctx.warn("correlationId absent; synthesized (spec 002 Migration 3)", "migration", "$.correlationId")
    ctx.env = env
    ctx.envelope_id = env.envelopeId
    ctx.correlation_id = env.correlationId
