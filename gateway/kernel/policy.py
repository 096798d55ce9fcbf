"""Cedar policy evaluation for the kernel (spec 003 §5.4, §6), via cedarpy.

Policies are the ``*.cedar`` files of ``kernel.policy_dir`` (sorted by name),
with an optional schema (``schema.cedarschema`` or ``schema.cedarschema.json``)
that the policies are validated against at start. Each policy statement is
parsed on its own first, so a bad file fails start-up with its name and the
line where the offending statement starts. No folder configured means no
policy, and Cedar's default is DENY.

The request: principal ``Agent::"{agent}"`` (attribute ``principal``),
action ``Action::"{requested_action}"``, resource ``GovernedObject::"{so_id}"``
unless the transition request names another entity (``Type::"id"``).
``context.idp`` carries the §5.4 attributes; an IDP_THIN carries only the
attributes the agent actually sent (never the kernel's stubs), and an absent
attribute read by a policy is an evaluation error. Cedar skips a policy that
errors, which would let a ``forbid`` fail open, so any evaluation error is a
DENY here: absent attributes fail closed (§5.4).

Cedar has no ``null``: ``idp.mission_ref`` is absent rather than null when the
IDP has none; policies test it with ``context.idp has mission_ref``. Cedar
``decimal`` values compare with methods (``greaterThanOrEqual``), not ``>=``.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal
from pathlib import Path
from typing import Any

import cedarpy
import msgspec

from subjects.errors import PgwError
from subjects.idp import Idp, IdpThin

_json = msgspec.json.Encoder()
_UID = re.compile(r'^(?P<type>[A-Za-z_][A-Za-z0-9_]*(::[A-Za-z_][A-Za-z0-9_]*)*)::"(?P<id>[^"\\]{1,256})"$')


class PolicyLoadError(PgwError):
    """A policy or schema file does not parse or validate; names the file and line."""

    def __init__(self, file: str, line: int | None, why: str) -> None:
        self.file = file
        self.line = line
        self.why = why
        where = f"{file}:{line}" if line else file
        super().__init__(f"bad Cedar policy {where}: {why}")


def split_statements(text: str) -> list[tuple[int, str]]:
    """Split Cedar text into ``(start line, statement)`` at top-level ``;``.

    Strings and ``//`` comments are skipped so a ``;`` inside them does not split.
    """
    out: list[tuple[int, str]] = []
    i, n, line = 0, len(text), 1
    start_line: int | None = None
    buf_start = 0
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
        elif c == "/" and text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        elif c == '"':
            if start_line is None:
                start_line = line
            i += 1
            while i < n and text[i] != '"':
                if text[i] == "\\":
                    i += 1
                elif text[i] == "\n":
                    line += 1
                i += 1
        elif c == ";":
            out.append((start_line or line, text[buf_start : i + 1]))
            buf_start = i + 1
            start_line = None
        elif not c.isspace() and start_line is None:
            start_line = line
        i += 1
    if start_line is not None:
        out.append((start_line, text[buf_start:]))
    return out


@dataclass(frozen=True)
class Decision:
    allowed: bool
    errors: tuple[str, ...]
    # Denied by a ``forbid`` policy that applied (Cedar's reasons for a DENY), not merely for want of a
    # permit: no human may allow it (gateway/kernel/service.py, docs/kernel.md "Policies").
    forbidden: bool = False


def entity_uid(value: str) -> dict[str, str] | None:
    m = _UID.match(value)
    return {"type": m["type"], "id": m["id"]} if m else None


_FOUR_PLACES = Decimal("0.0001")


def cedar_decimal(x: float) -> str:
    """``x`` as a Cedar decimal literal: four fractional digits, cut toward zero.

    Cedar decimals hold four fractional digits. Rounding would lift 0.79995
    over a ``greaterThanOrEqual(decimal("0.8"))`` threshold the agent did not
    declare (spec 003 §5.4), so the value is truncated (floor: it lies in
    [0, 1]) from its shortest decimal form (``repr``), never from the binary
    float's expansion: 0.8 stays 0.8000. A threshold of at most four places
    is then decided exactly for ``>=`` and ``<``; ``>`` and ``<=`` err toward
    the lower value (docs/kernel.md, "Cedar policies").
    """
    return _decimal_of(repr(float(x)))


@functools.lru_cache(maxsize=1024)
def _decimal_of(shortest: str) -> str:
    """``cedar_decimal`` of the float whose ``repr`` is ``shortest``, remembered: declared
    confidence levels repeat, and the Decimal quantize was a few microseconds per request.
    Keyed on the text, so -0.0 and 0.0 (equal as floats) stay apart."""
    return str(Decimal(shortest).quantize(_FOUR_PLACES, rounding=ROUND_FLOOR))


def _decimal(x: float) -> dict[str, Any]:
    return {"__extn": {"fn": "decimal", "arg": cedar_decimal(x)}}


def idp_context(idp: Idp) -> dict[str, Any]:
    """``context.idp`` per spec 003 §5.4; THIN absent attributes are left out (fail closed)."""
    ctx: dict[str, Any] = {
        "idp_id": idp.idp_id,
        "session_id": idp.session_id,
        "so_id": idp.so_id,
        "step_sequence": idp.step_sequence,
        "requested_action": idp.requested_action,
        "profile": "IDP_THIN" if isinstance(idp, IdpThin) else "IDP_STANDARD",
    }
    if idp.reasoning_basis is not None:
        ctx["reasoning_basis"] = {"type": idp.reasoning_basis.type}
    if idp.confidence_level is not None:
        ctx["confidence_level"] = _decimal(idp.confidence_level)
    if idp.hem_urgency is not None:
        ctx["hem_urgency"] = idp.hem_urgency
    if idp.declared_goal is not None:
        ctx["goal_id"] = idp.declared_goal.goal_id
    if idp.mission_ref is not None:
        ctx["mission_ref"] = idp.mission_ref
    return ctx


class PolicyEngine:
    """A parsed, validated policy set and the evaluation the kernel needs."""

    def __init__(self, policy_dir: str | Path | None) -> None:
        self.files: list[str] = []
        text_parts: list[str] = []
        self.schema: Any = None
        if policy_dir is not None:
            d = Path(policy_dir).expanduser()
            if not d.is_dir():
                raise PolicyLoadError(str(d), None, "policy folder does not exist")
            for f in sorted(d.glob("*.cedar")):
                text = f.read_text(encoding="utf-8")
                for line, stmt in split_statements(text):
                    try:
                        cedarpy.PolicySet.from_str(stmt)
                    except ValueError as e:
                        raise PolicyLoadError(f.name, line, str(e)) from None
                try:
                    cedarpy.PolicySet.from_str(text)
                except ValueError as e:
                    raise PolicyLoadError(f.name, None, str(e)) from None
                self.files.append(f.name)
                text_parts.append(text)
            for name in ("schema.cedarschema", "schema.cedarschema.json"):
                sf = d / name
                if sf.exists():
                    raw = sf.read_text(encoding="utf-8")
                    self.schema = json.loads(raw) if name.endswith(".json") else raw
        self.text = "\n".join(text_parts)
        try:
            self.policies = cedarpy.PolicySet.from_str(self.text)
        except ValueError as e:  # e.g. duplicate @id across files
            raise PolicyLoadError(",".join(self.files) or "(policies)", None, str(e)) from None
        # What the policies read of the context (evaluate_many); parsed entities and decisions, reused.
        self.context_paths: tuple[tuple[str, ...], ...] | None = ()
        if self.text.strip():
            try:
                self.context_paths = context_paths(json.loads(cedarpy.policies_to_json_str(self.text)))
            except ValueError:  # a policy cedarpy cannot write as JSON: Cedar gets the whole context
                self.context_paths = None
        self._entity_cache: dict[tuple[Any, ...], Any] = {}
        self._decisions: dict[tuple[Any, ...], Decision] = {}
        if self.schema is not None and self.text.strip():
            res = cedarpy.validate_policies(self.text, self.schema)
            if not res.validation_passed:
                errs = "; ".join(str(e) for e in res.errors)
                raise PolicyLoadError("schema validation", None, errs[:1000])

    def _request(
        self, *, agent: str, action: str, resource: dict[str, str], context: dict[str, Any] | str
    ) -> dict[str, Any]:
        return {
            "principal": {"type": "Agent", "id": agent},
            "action": {"type": "Action", "id": action},
            "resource": resource,
            "context": context,
        }

    @staticmethod
    def _entities(agent: str, principal: str, resource: dict[str, str], so_id: str) -> list[dict[str, Any]]:
        return [
            {"uid": {"type": "Agent", "id": agent}, "attrs": {"principal": principal}, "parents": []},
            {"uid": resource, "attrs": {"so_id": so_id}, "parents": []},
        ]

    def _entity_set(self, key: tuple[Any, ...], agent: str, principal: str, resource: dict[str, str], so_id: str) -> Any:
        """The two entities parsed once per (agent, principal, resource, so_id): Cedar's JSON
        parse of them cost about a third of an evaluation."""
        ents = self._entity_cache.get(key)
        if ents is None:
            ents = cedarpy.Entities.from_json_str(_json.encode(self._entities(agent, principal, resource, so_id)).decode())
            _bounded_put(self._entity_cache, key, ents)
        return ents

    def evaluate_many(
        self,
        actions: list[str],
        *,
        agent: str,
        principal: str,
        resource: dict[str, str],
        so_id: str,
        context: dict[str, Any],
    ) -> list[Decision]:
        """Cedar's decision for each action with the same principal, resource and context.

        Cedar sees the context reduced to the attributes the policy set reads
        (``context_paths``; all of it when a policy uses the context otherwise),
        which decides every policy exactly as the whole context would; and since
        Cedar's evaluation is a function of policies, request and entities, a
        decision is kept for that reduced request (``_decisions``) and reused.
        """
        if not actions:
            return []
        ctx = _json.encode(project_context(context, self.context_paths)).decode()
        ekey = (agent, principal, tuple(sorted(resource.items())), so_id)
        out: list[Decision | None] = [self._decisions.get((a, ekey, ctx)) for a in actions]
        missing = [i for i, d in enumerate(out) if d is None]
        if missing:
            # Context handed over as JSON text encoded by msgspec (cedarpy would
            # json.dumps it; the same JSON, about a third of the time).
            reqs = [self._request(agent=agent, action=actions[i], resource=resource, context=ctx) for i in missing]
            results = cedarpy.is_authorized_batch(
                reqs, self.policies, self._entity_set(ekey, agent, principal, resource, so_id)
            )
            for i, r in zip(missing, results, strict=True):
                errors = tuple(str(e) for e in (r.diagnostics.errors or []))
                # Fail closed: an evaluation error (an absent IDP_THIN attribute, a
                # type error) may have silenced a forbid, so it is never a PERMIT.
                allowed = bool(r.allowed) and not errors
                d = Decision(allowed, errors, forbidden=not r.allowed and bool(r.diagnostics.reasons))
                _bounded_put(self._decisions, (actions[i], ekey, ctx), d)
                out[i] = d
        return out  # type: ignore[return-value]

    def evaluate(self, action: str, **kw: Any) -> Decision:
        return self.evaluate_many([action], **kw)[0]


_CACHE_MAX = 4096


def _bounded_put(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= _CACHE_MAX:
        del cache[next(iter(cache))]  # the oldest entry
    cache[key] = value


def _chain(expr: Any) -> list[str] | None:
    """The attribute path of ``expr`` if it is ``context`` followed only by ``.attr`` accesses."""
    if expr == {"Var": "context"}:
        return []
    if isinstance(expr, dict) and len(expr) == 1 and isinstance(expr.get("."), dict):
        inner = expr["."]
        path = _chain(inner.get("left"))
        if path is not None and isinstance(inner.get("attr"), str):
            return [*path, inner["attr"]]
    return None


def context_paths(est: Any) -> tuple[tuple[str, ...], ...] | None:
    """The context attribute paths a policy set reads, from its JSON form (EST), shortest first.

    ``context.a.b`` and ``context.a has b`` read path ``(a, b)``: their value
    depends only on what lies at that path (or that it is absent). Any other
    use of ``context`` (the record itself compared, passed to a function, or
    an attribute of a computed value) returns None: the whole context.
    """
    paths: set[tuple[str, ...]] = set()
    whole = False

    def visit(node: Any) -> None:
        nonlocal whole
        if isinstance(node, dict):
            if len(node) == 1:
                ((k, v),) = node.items()
                if k in (".", "has") and isinstance(v, dict) and isinstance(v.get("attr"), str):
                    path = _chain(v.get("left"))
                    if path is not None:
                        paths.add((*path, v["attr"]))
                        return
                if k == "Var" and v == "context":
                    whole = True
                    return
            for v in node.values():
                visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)

    visit(est)
    if whole:
        return None
    return tuple(sorted(paths, key=len))


def _is_record(value: Any) -> bool:
    # A dict with an escape key (``__extn``, ``__entity``) is a Cedar value, not a record.
    return type(value) is dict and not any(k.startswith("__") for k in value)


def project_context(context: dict[str, Any], paths: tuple[tuple[str, ...], ...] | None) -> dict[str, Any]:
    """``context`` with only the values at ``paths`` (``context_paths``), whole below each; all of it if None.

    A record on the way to a path is kept with only the members the paths go
    through, so ``has`` answers as it would on the whole context; a path that
    is absent stays absent; a non-record on the way is kept whole (reading an
    attribute of it is the same error either way).
    """
    if paths is None:
        return context
    out: dict[str, Any] = {}
    for path in paths:  # shortest first: a value kept whole is never narrowed again
        src: Any = context
        dst = out
        last = len(path) - 1
        for i, a in enumerate(path):
            if a not in src:
                break
            val = src[a]
            if i == last or not _is_record(val):
                dst[a] = val
                break
            sub = dst.get(a)
            if sub is val:  # already kept whole by a shorter path
                break
            if sub is None:
                sub = dst[a] = {}
            src, dst = val, sub
    return out
