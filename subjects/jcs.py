"""RFC 8785 JSON Canonicalization Scheme (JCS), at msgspec's speed where that is exact.

The capsule ids and payloads (spec 004 §2, §5.1) and the kernel's signed
event log (spec 003) are hashed or signed over JCS bytes, so those bytes must
be exactly RFC 8785's. JCS is "sorted keys, no whitespace, ES6 number and
string forms". For a value made only of str, bool, None, lists and dicts with
str keys and integers within +-(2**53 - 1), msgspec's sorted encoder writes
exactly those bytes (the same escapes: ``\\" \\\\ \\b \\t \\n \\f \\r`` and
``\\u00xx`` for the other controls, everything else as UTF-8), at C speed.
Where the two could differ, the reference implementation (``rfc8785``)
decides:

- keys sort by UTF-16 code unit in JCS (RFC 8785 §3.2.3) and by code point
  in msgspec; the orders agree unless a key holds a character at or above
  U+D800, so a value with such a key goes wholly to ``rfc8785``;
- floats are written by ``rfc8785`` (ES6 number form) and spliced in raw,
  except where msgspec's text of that float is already the ES6 form (0.9 is,
  2.0 and 1e-06 are not), which :func:`dumps` checks once per value;
- integers beyond 2**53, lone surrogates, non-str keys and any other type go
  wholly to ``rfc8785``, which refuses them or writes them as it does.

``tests/test_jcs.py`` holds :func:`dumps` to ``rfc8785.dumps`` on generated
values, hostile strings and both walk modes included.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

import msgspec
import rfc8785

FLOAT = 1  # the walked value holds a float
NOT_PLAIN = 2  # the walked value holds something only the reference implementation may write

_SORTED = msgspec.json.Encoder(order="sorted")
_MAX_SAFE_INT = 2**53 - 1


def walk(value: Any, *, drop_absent: bool = False) -> tuple[Any, int]:
    """One pass over ``value``: (plain copy, flags).

    With ``drop_absent`` the copy leaves out object members that are null,
    [] or {} (bottom-up), the absent-field normalization of spec 004 §2;
    array elements stay in place. ``flags`` is a mask of :data:`FLOAT` and
    :data:`NOT_PLAIN`, to hand to :func:`encode` with the copy.
    """
    flags = [0]
    return _walk(value, drop_absent, flags), flags[0]


def _walk(value: Any, drop: bool, flags: list[int], raw: bool = False) -> Any:
    t = type(value)
    if t is str or t is bool or value is None:
        return value
    if t is dict or isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not (type(k) is str and (k.isascii() or max(k) < "\ud800")):
                flags[0] |= NOT_PLAIN
            tv = type(v)
            # The common members inline (a call per leaf was most of the walk's cost).
            if tv is str or tv is bool:
                out[k] = v
            elif v is None:
                if not drop:
                    out[k] = v
            elif tv is int and -_MAX_SAFE_INT <= v <= _MAX_SAFE_INT:
                out[k] = v
            else:
                nv = _walk(v, drop, flags, raw)
                if drop and (nv is None or (type(nv) in (dict, list) and not nv)):
                    continue
                out[k] = nv
        return out
    if isinstance(value, (list, tuple)):
        return [v if type(v) is str else _walk(v, drop, flags, raw) for v in value]
    if t is int:
        if not -_MAX_SAFE_INT <= value <= _MAX_SAFE_INT:
            flags[0] |= NOT_PLAIN
        return value
    if t is float:
        flags[0] |= FLOAT
        # ``raw`` (dumps): the ES6 form spliced in now, not by a second copy (_floats_raw).
        return msgspec.Raw(rfc8785.dumps(value)) if raw else value
    flags[0] |= NOT_PLAIN
    return value


def encode(walked: Any, flags: int) -> bytes:
    """The JCS bytes of a value from :func:`walk` (raises ``rfc8785`` errors for values JCS refuses)."""
    if not flags & NOT_PLAIN:
        try:
            return _SORTED.encode(_floats_raw(walked) if flags & FLOAT else walked)
        except UnicodeEncodeError:
            pass  # a lone surrogate: rfc8785 raises its own CanonicalizationError below
    return rfc8785.dumps(walked)


_FLOAT_SAME: dict[float, bool] = {}  # float -> msgspec writes it as RFC 8785 does (0.9: yes; 2.0, 1e-06: no)


def _float_same(f: float) -> bool:
    """Whether msgspec's text of ``f`` is its ES6 form (RFC 8785 §3.2.2.3), remembered per value.

    Only 0.0 and -0.0 are distinct floats that compare equal, and both answer no
    (``0.0``, ``-0.0`` against ``0``); a NaN never equals a key, and is refused by
    the reference anyway."""
    same = _FLOAT_SAME.get(f)
    if same is None:
        try:
            same = _SORTED.encode(f) == rfc8785.dumps(f)
        except Exception:  # noqa: BLE001 - NaN, infinities: the reference path raises its own error
            same = False
        if len(_FLOAT_SAME) < 4096:
            _FLOAT_SAME[f] = same
    return same


def _as_is(value: Any, present: bool = False) -> bool:
    """Whether msgspec's sorted encoder writes ``value`` itself as RFC 8785 does, no copy needed:
    plain dicts with str keys below U+D800, lists and tuples, str, bool, None, integers within
    +-(2**53 - 1) and floats whose msgspec text is their ES6 form. Anything else (a float such
    as 2.0 or 1e-06, a big integer, another key or type) says no, and ``dumps`` copies as before.

    ``present``: also no object member anywhere is null, [] or {}, so the drop_absent walk
    (:func:`normalized_bytes`) would return an equal copy."""
    t = type(value)
    if t is dict:
        try:
            keys = "".join(value)  # one pass over the keys in C; TypeError if one is not a str
        except TypeError:
            return False
        if not (keys.isascii() or max(keys) < "\ud800"):
            return False
        members = value.values()
        refuse_absent = present
    elif t is list or t is tuple:
        members = value
        refuse_absent = False  # array elements stay in place, null and empty ones too
    else:
        return (t is str or t is bool or value is None or (t is int and -_MAX_SAFE_INT <= value <= _MAX_SAFE_INT)
                or (t is float and _float_same(value)))
    for v in members:
        tv = type(v)
        # The common members inline (a call per leaf would be most of the cost).
        if tv is str or tv is bool or (tv is int and -_MAX_SAFE_INT <= v <= _MAX_SAFE_INT):
            continue
        if v is None:
            if refuse_absent:
                return False
            continue
        if refuse_absent and (tv is dict or tv is list or tv is tuple) and not v:
            return False
        if not _as_is(v, present):
            return False
    return True


def dumps(value: Any) -> bytes:
    """``rfc8785.dumps(value)``, byte for byte."""
    if _as_is(value):  # the common case: no float to rewrite, nothing only the reference may write
        try:
            return _SORTED.encode(value)
        except UnicodeEncodeError:
            pass  # a lone surrogate: the walk below hands it to rfc8785, which raises its own error
    flags = [0]
    walked = _walk(value, False, flags, True)  # floats already raw: one copy, not two
    if not flags[0] & NOT_PLAIN:
        try:
            return _SORTED.encode(walked)
        except UnicodeEncodeError:
            pass  # a lone surrogate: rfc8785 raises its own CanonicalizationError below
    return encode(*walk(value))


def json_digest(value: Any) -> str:
    """spec 004 JSON-DIGEST (lowercase hex SHA-256 of the JCS of ``value`` with absent members
    dropped bottom-up) in one walk, msgspec's encoder where that is exact: byte for byte
    ``subjects.idp.json_digest``'s ``rfc8785`` form, which stays as the reference.

    A value with no absent member anywhere and nothing to rewrite (:func:`_as_is`,
    the common small request or reason) is encoded as it is, with no copy."""
    return hashlib.sha256(normalized_bytes(value)).hexdigest()


def normalized_bytes(value: Any) -> bytes:
    """JCS of ``value`` with absent members (null, [] and {} object members, bottom-up) dropped:
    ``encode(*walk(value, drop_absent=True))``, without the copy where nothing would be dropped
    or rewritten. Raises what :func:`encode` raises for a value JCS refuses."""
    if _as_is(value, present=True):
        try:
            return _SORTED.encode(value)
        except UnicodeEncodeError:
            pass  # a lone surrogate: the walk below hands it to rfc8785, which raises its own error
    return encode(*walk(value, drop_absent=True))


def _floats_raw(value: Any) -> Any:
    """A copy with every float replaced by its ES6 form from the reference implementation."""
    t = type(value)
    if t is float:
        return msgspec.Raw(rfc8785.dumps(value))
    if t is dict:
        return {k: _floats_raw(v) for k, v in value.items()}
    if t is list:
        return [_floats_raw(v) for v in value]
    return value


# What in a JSON text can make its value unrecordable: an integer of 16 digits or more (2**53 has 16), or an
# escaped surrogate (a lone one decodes to a str RFC 8785 refuses). A text without either is recordable, and
# :func:`recordable` (a full canonicalization: 30-90 ms for half a megabyte) need not run on it.
_MAYBE_UNRECORDABLE = re.compile(rb"\d{16}|\\[uU][dD][89a-fA-F]")


def maybe_unrecordable(data: bytes) -> bool:
    """False when the JSON text ``data`` certainly decodes to a recordable value (one C scan)."""
    return _MAYBE_UNRECORDABLE.search(data) is not None


def recordable(value: Any) -> bool:
    """Whether ``value`` has an RFC 8785 form (what the kernel digests and signs): no integer beyond
    +-(2**53 - 1), no lone surrogate, no non-string key."""
    try:
        normalized_bytes(value)
    except Exception:  # noqa: BLE001 - rfc8785 raises its own errors (IntegerDomainError, ...) and TypeError
        return False
    return True


def recordable_form(value: Any) -> Any:
    """``value`` with what RFC 8785 cannot write made writable: an integer beyond +-(2**53 - 1) as its decimal
    string, a lone surrogate as U+FFFD, a non-string key as its ``str``. For what the kernel must record though
    it came that way (an executor's result: the tool ran), stated where it is recorded."""
    t = type(value)
    if t is int and abs(value) > _MAX_SAFE_INT:
        return str(value)
    if t is str:
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace") if not value.isascii() else value
    if isinstance(value, Mapping):
        return {k if type(k) is str else str(k): recordable_form(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [recordable_form(v) for v in value]
    return value


def unrecordable(value: Any) -> bool:
    """``not recordable(value)``, at the cost of one JSON encode and a C scan where the value is recordable: the
    full check runs only where they find a long number or an escaped surrogate (:func:`maybe_unrecordable`)."""
    try:
        text = msgspec.json.encode(value)
    except Exception:  # noqa: BLE001 - a lone surrogate, say: let the full check say
        return not recordable(value)
    return maybe_unrecordable(text) and not recordable(value)
