"""Stage 3, payload: the per-kind schema (spec 002 "Validation outcomes", "Schema version advertisement").

- ``schemaVersion`` (absent = 0) higher than advertised → ``unknown_schema_version``;
  lower → the ``envelope_schema_version_drift`` warning, or a refusal with that
  code under ``envelopeStrictness = "strict"``; validation always runs against
  the advertised version.
- The payload against its kind's type → ``envelope_invalid`` with validator
  details the agent can act on (configured vendor kinds: their JSON Schema).
- A binding moment is checked against the slot grammar of spec 000 §5-§6 rule
  by rule, then the construction-discipline lints (``gateway.stages.lints``).
  A malformed moment is never delivered as a decision (spec 000 §12.5): the
  principal gets a notice instead (spec 000 §9.3: "the fallback is always
  available") with the envelope's ``conventional`` payload, or, when the agent
  sent none, a plain one the gateway writes (``fallback``), while the agent
  gets the refusal.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.security.text import visible
from gateway.stages import lints
from gateway.stages.base import Ctx, Refuse
from gateway.stages.kind import BINDING_MOMENT, CLARIFICATION
from gateway.stages.moment_grammar import check_and_fold
from subjects.names import principal_token
from subjects.wire import Detail

CODE = "envelope_invalid"


def fallback(ctx: Ctx, raw: Any) -> Any:
    """The notice's payload for a malformed moment: the agent's ``conventional``, else a plain one.

    spec 000 §9.3 assumes the conventional payload "is always present"; on this bus it is
    optional, so the gateway writes one rather than leave the principal with nothing.
    """
    conventional = raw.get("conventional") if isinstance(raw, dict) else None
    if conventional is not None:
        return conventional
    return {"text": f"Agent {ctx.agent} tried to put a decision to you, but it was malformed and was discarded. "
                    "Nothing was decided; the agent has been told what to fix."}
_validators: dict[int, Any] = {}


def _path_of(e: msgspec.ValidationError) -> str | None:
    msg = str(e)
    return msg.rsplit("at `", 1)[-1].rstrip("`").replace("$", "$.payload", 1) if "at `" in msg else "$.payload"


def _check_version(ctx: Ctx) -> None:
    assert ctx.env is not None and ctx.kind is not None
    advertised = ctx.kind.schema_version
    got = ctx.env.schemaVersion or 0  # spec 002: "absent → treat as 0"
    if got > advertised:
        raise Refuse(
            "unknown_schema_version",
            f"schemaVersion {got} of {ctx.kind.name} is higher than the advertised {advertised}",
            details=[Detail(message=f"this host advertises schemaVersion {advertised}", path="$.schemaVersion", rule="schema_version")],
        )
    if got < advertised:
        msg = f"schemaVersion {got} of {ctx.kind.name} is lower than the advertised {advertised}; validated against {advertised}"
        if ctx.gw.config.pipeline.envelope_strictness == "strict":
            raise Refuse(
                "envelope_schema_version_drift",
                msg + " (envelopeStrictness strict refuses drift)",
                details=[Detail(message=msg, path="$.schemaVersion", rule="envelope_schema_version_drift")],
            )
        ctx.warn(msg, "envelope_schema_version_drift", "$.schemaVersion")


def _without_nulls(value: Any) -> Any:
    """``value`` with every object member whose value is null left out (at any depth)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _null_is_absent_validator(schema: dict[str, Any]) -> Any:
    """A 2020-12 validator for which a member set to null and an absent member are the same.

    spec 002 "Reasoning field": "Hosts MUST treat null and absence equivalently
    when reading payloads" (the strict-mode pattern ``"type": ["string", "null"]``
    listed in ``required``). The payload is validated with its null members left
    out, and a ``required`` member that is absent is satisfied when its own
    schema accepts null: so ``{"reasoning": null}`` passes where an absent
    ``reasoning`` passes, and an absent one passes where null would.
    """
    import jsonschema

    base = jsonschema.Draft202012Validator

    def required(validator: Any, names: Any, instance: Any, sch: dict[str, Any]) -> Any:
        if not validator.is_type(instance, "object"):
            return
        props = sch.get("properties", {})
        for name in names:
            if name in instance:
                continue
            sub = props.get(name)
            if sub is not None and validator.evolve(schema=sub).is_valid(None):
                continue
            yield jsonschema.ValidationError(f"{name!r} is a required property")

    cls = jsonschema.validators.extend(base, {"required": required})
    return cls(schema)


def _json_schema_errors(ctx: Ctx, raw: Any) -> list[Detail]:
    assert ctx.kind is not None and ctx.kind.json_schema is not None
    v = _validators.get(id(ctx.kind.json_schema))
    if v is None:
        v = _validators[id(ctx.kind.json_schema)] = _null_is_absent_validator(ctx.kind.json_schema)
    out = []
    for err in sorted(v.iter_errors(_without_nulls(raw)), key=lambda e: list(e.absolute_path))[:32]:
        path = "$.payload" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
        out.append(Detail(message=err.message[:500], path=path, rule=str(err.validator)))
    return out


async def run(ctx: Ctx) -> None:
    assert ctx.env is not None and ctx.kind is not None
    _check_version(ctx)
    raw = ctx.env.payload
    forms = None  # a binding moment's texts as the lints read them, folded once (check_and_fold)
    if ctx.kind.name == BINDING_MOMENT:
        forms = _check_moment_payload(ctx, raw)
    if ctx.kind.payload_type is None:
        details = _json_schema_errors(ctx, raw)
        if details:
            raise Refuse(CODE, f"payload does not match the schema of {ctx.kind.name}", details=details)
        ctx.payload = raw
        return
    try:
        ctx.payload = msgspec.convert(raw, ctx.kind.payload_type)
    except msgspec.ValidationError as e:
        raise Refuse(
            CODE,
            f"payload does not match the schema of {ctx.kind.name}",
            details=[Detail(message=str(e), path=_path_of(e), rule="schema")],
        ) from None
    if ctx.kind.name == CLARIFICATION:
        _check_question_ids(ctx.payload.questions)
    if ctx.kind.name == BINDING_MOMENT:
        reject, warn = lints.apply(ctx.payload.binding_moment, ctx.gw.config.pipeline.lints, forms)
        ctx.warnings.extend(warn)
        if reject:
            raise Refuse(
                CODE,
                f"malformed binding moment: {reject[0].message}",
                details=reject,
                notice=fallback(ctx, raw),
            )


def _check_question_ids(questions: list[Any]) -> None:
    """Each question of a ``clarification.request`` is answered under its ``id`` (spec 002: the answers come back
    keyed by it), so two questions under one id would hand her answer to one as the answer to the other, in
    the agent's resolution and in the record; and an id holding a character the gateway drops (redaction keeps
    what a person sees, gateway.security.text.visible) would be rewritten into another's. Both are refused, as
    ids are, not rewritten (found by a docs-only attack: ``ok`` and ``ok`` + U+200B, her "NO" to a wire of
    99,999 EUR lost under the id of a 12 EUR payment)."""
    details: list[Detail] = []
    seen: set[str] = set()
    for i, q in enumerate(questions):
        path = f"$.payload.questions[{i}].id"
        if visible(q.id) != q.id or not q.id.strip():
            details.append(Detail(message="a question id holds a character that is not shown (a control or "
                                  "invisible character), or only white space", path=path, rule="question_id"))
        elif q.id in seen:
            details.append(Detail(message=f"two questions share the id {q.id!r}: each answer is keyed by its "
                                  "question's id", path=path, rule="question_id"))
        seen.add(q.id)
    if details:
        raise Refuse(CODE, f"malformed clarification: {details[0].message}", details=details)


def _check_moment_payload(ctx: Ctx, raw: object) -> list[str] | None:
    """The moment's grammar (spec 000 §5-§6), refused whole; the seen forms ``check_and_fold`` folded, or None."""
    if not isinstance(raw, dict):
        raise Refuse(CODE, "payload must be an object", details=[Detail(message="payload must be an object", path="$.payload", rule="payload_type")])
    details: list[Detail] = []
    forms = None
    principal = raw.get("principal")
    try:
        ctx.principal = principal_token(principal)  # type: ignore[arg-type]
    except ValueError as e:
        details.append(Detail(message=str(e), path="$.payload.principal", rule="principal"))
    if "binding_moment" not in raw:
        details.append(Detail(message="binding_moment is REQUIRED", path="$.payload.binding_moment", rule="missing_member"))
    else:
        grammar, forms = check_and_fold(raw["binding_moment"])
        details.extend(grammar)
    if details:
        notice = fallback(ctx, raw) if ctx.principal else None
        raise Refuse(
            CODE,
            f"malformed binding moment: {details[0].message}",
            details=details,
            notice=notice,
        )
    return forms
