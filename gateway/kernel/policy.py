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
    return str(Decimal(repr(float(x))).quantize(_FOUR_PLACES, rounding=ROUND_FLOOR))


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
        """Cedar's decision for each action with the same principal, resource and context."""
        if not actions:
            return []
        # Context and entities handed over as JSON text encoded by msgspec (cedarpy
        # would json.dumps them; the same JSON, about a third of the time).
        ctx = _json.encode(context).decode()
        reqs = [self._request(agent=agent, action=a, resource=resource, context=ctx) for a in actions]
        results = cedarpy.is_authorized_batch(
            reqs, self.policies, _json.encode(self._entities(agent, principal, resource, so_id)).decode()
        )
        out = []
        for r in results:
            errors = tuple(str(e) for e in (r.diagnostics.errors or []))
            # Fail closed: an evaluation error (an absent IDP_THIN attribute, a
            # type error) may have silenced a forbid, so it is never a PERMIT.
            out.append(Decision(bool(r.allowed) and not errors, errors))
        return out

    def evaluate(self, action: str, **kw: Any) -> Decision:
        return self.evaluate_many([action], **kw)[0]
