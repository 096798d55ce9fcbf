"""Stage 5, limits → ``cap.breached`` with its kind (spec 002 "Capability handshake
integration", DESIGN §3.2 step 5).

- ``envelopesPerTurn``: a turn is one message, one envelope or a JSON array
  of them; envelopes past the cap (array order) are refused, kind ``envelopes``.
- ``schemaRounds``: re-emissions of one ``correlationId`` after refusals.
  Every refusal of a correlationId is counted (``PGW_DEDUP`` key
  ``rounds.{agent}.{hash}``, once per inbound message, so a redelivery does
  not count twice); the refusal that exceeds the cap is reported as
  ``cap.breached`` kind ``schema`` (with the original code in its details),
  and so is any later emission of that correlationId. A counted refusal
  first makes sure the correlationId's dedup record exists (``mark_refused``),
  so "no dedup record" implies "no refusal counted": the dedup stage's claim
  (a KV create) then proves the count is zero, and the counter is read only
  when the claim finds a record (a re-emission), not for every envelope.
- ``schema.request`` envelopes are bound to ``schemaRounds`` too (spec 002
  "Universal kinds"): per (agent, ``nodeId``), by distinct correlationId.
- ``clarificationRounds``: ``clarification.request`` envelopes per
  (agent, ``nodeId``), counted by distinct correlationId (a replay is not a
  new round); past the cap, kind ``clarification``.

The counters live in JetStream KV, shared by every gateway instance.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from gateway.stages.base import Ctx, Refuse
from gateway.stages.kind import CLARIFICATION, SCHEMA_REQUEST
from subjects.wire import Detail

if TYPE_CHECKING:
    from typing import Any

CODE = "cap.breached"
# Refusals that count as a schema round (spec 002 "Validation outcomes").
ROUND_CODES = frozenset({
    "unknown_envelope_kind", "envelope_invalid", "unknown_schema_version",
    "envelope_schema_version_drift", "invalid_envelope_shape",
})
_dec = msgspec.json.Decoder(list[str])
_enc = msgspec.json.Encoder()
_MAX_SET = 1024


def _h(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def rounds_key(agent: str, correlation_id: str) -> str:
    return f"rounds.{agent}.{_h(correlation_id)}"


def clar_key(agent: str, node_id: str | None) -> str:
    return f"clar.{agent}.{_h(node_id or '-')}"


async def _get_set(kv: Any, key: str) -> tuple[list[str], int | None]:
    try:
        e = await kv.get(key)
    except KeyNotFoundError:
        return [], None
    return (_dec.decode(e.value) if e.value else []), e.revision


async def add_to_set(kv: Any, key: str, member: str) -> int:
    """Add ``member`` to the set at ``key`` (CAS); return the set's size."""
    for _ in range(20):
        members, rev = await _get_set(kv, key)
        if member in members:
            return len(members)
        members = [*members, member][-_MAX_SET:]
        try:
            if rev is None:
                await kv.create(key, _enc.encode(members))
            else:
                await kv.update(key, _enc.encode(members), last=rev)
            return len(members)
        except KeyWrongLastSequenceError:
            continue
    raise RuntimeError(f"could not update counter {key}")  # nak: the message is redelivered


def breached(kind: str, message: str, limit: int, details: list[Detail] | None = None) -> Refuse:
    return Refuse(
        CODE,
        message,
        details=[Detail(message=f"limit {limit}", rule=f"limits.{kind}"), *(details or [])],
        status="breached",
        cap_kind=kind,  # type: ignore[arg-type]
    )


async def run(ctx: Ctx) -> None:
    assert ctx.env is not None
    cfg = ctx.gw.config.pipeline
    if ctx.index >= cfg.envelopes_per_turn:
        raise breached(
            "envelopes",
            f"the turn holds {ctx.extra.get('turn_size')} envelopes; envelopesPerTurn is {cfg.envelopes_per_turn}",
            cfg.envelopes_per_turn,
        )
    st = ctx.state
    if ctx.correlation_id:
        if ctx.env.type in (SCHEMA_REQUEST, CLARIFICATION):
            # These kinds count below: check first, so a breached emission is not counted.
            await check_rounds(ctx, st.kv, ctx.correlation_id)
        else:
            # Checked by the dedup stage: free when its claim finds no record.
            ctx.extra[ROUNDS_DEFERRED] = ctx.correlation_id
    if ctx.env.type == SCHEMA_REQUEST:
        n = await add_to_set(st.kv, f"schemareq.{ctx.agent}.{_h(ctx.env.nodeId or '-')}", ctx.correlation_id or "")
        if n > cfg.schema_rounds:
            raise breached(
                "schema",
                f"{n} schema requests from this node; schemaRounds is {cfg.schema_rounds}",
                cfg.schema_rounds,
            )
    if ctx.env.type == CLARIFICATION:
        n = await add_to_set(st.kv, clar_key(ctx.agent, ctx.env.nodeId), ctx.correlation_id or "")
        if n > cfg.clarification_rounds:
            raise breached(
                "clarification",
                f"{n} clarification requests from this node; clarificationRounds is {cfg.clarification_rounds}",
                cfg.clarification_rounds,
            )


ROUNDS_DEFERRED = "rounds_deferred"  # ctx.extra: the correlationId whose schemaRounds check dedup owes


async def check_rounds(ctx: Ctx, kv: Any, correlation_id: str) -> None:
    """Refuse with ``cap.breached`` (schema) once ``correlation_id`` was refused more than schemaRounds times."""
    cfg = ctx.gw.config.pipeline
    members, _ = await _get_set(kv, rounds_key(ctx.agent, correlation_id))
    if len(members) > cfg.schema_rounds:
        raise breached(
            "schema",
            f"correlationId was refused {len(members)} times; schemaRounds is {cfg.schema_rounds}",
            cfg.schema_rounds,
        )


def counts_against_rounds(ctx: Ctx, r: Refuse) -> bool:
    """Whether refusal ``r`` counts against schemaRounds (spec 002): a validation code and a correlationId."""
    return r.code in ROUND_CODES and bool(ctx.correlation_id)


async def count_refusal(ctx: Ctx, r: Refuse) -> Refuse:
    """Count a refusal against schemaRounds; past the cap it becomes ``cap.breached`` (schema).

    The caller marks the dedup record first (``dedup.mark_refused``, see the
    module docstring): a crash in between leaves a record without a count,
    never a count without a record.
    """
    if not counts_against_rounds(ctx, r):
        return r
    assert ctx.correlation_id is not None
    cfg = ctx.gw.config.pipeline
    st = ctx.state
    n = await add_to_set(st.kv, rounds_key(ctx.agent, ctx.correlation_id), ctx.envelope_key)
    if n > cfg.schema_rounds:
        return breached(
            "schema",
            f"retry budget exhausted: correlationId refused {n} times ({r.code}); schemaRounds is {cfg.schema_rounds}",
            cfg.schema_rounds,
            details=[Detail(message=r.reason, rule=r.code), *r.details],
        )
    return r
