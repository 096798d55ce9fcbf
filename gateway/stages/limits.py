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
  "Universal kinds"), and ``clarificationRounds`` caps ``clarification.request``
  envelopes "per node" (spec 002 "Capability handshake integration"). Both
  are rounds of one exchange: one node in one run. The gateway reads the
  exchange from the correlationId, whose recommended form is
  ``${runId}:${nodeId}:${turnIndex}:${kindHash}`` (spec 002 "AIEnvelope wire
  shape"): the *chain* is the correlationId without its last two fields
  (``runId:nodeId``), plus the envelope's ``nodeId``. A correlationId not in
  that form (fewer than four fields) is an exchange of its own. Rounds are
  counted by distinct correlationId (a replay is not a new round), in
  ``PGW_DEDUP`` keys ``clar.{agent}.{hash(chain)}`` and
  ``schemareq.{agent}.{hash(chain)}`` whose members are hashes of the
  correlationIds (no raw id is stored, SR-1); a new run starts at zero. An
  envelope refused after it was counted (no principal, a correlation
  conflict, ...) is taken back out: only rounds that reached their handler
  use up the allowance.
- ``clarificationRounds`` is a *hard* cap (spec 002: "Hard cap on total
  clarification.request envelopes per node"), and on this bus the run and the
  node are the agent's word: a new runId or nodeId per clarification would
  make every one the first of its exchange. So two more counts bind each
  clarification, keyed by what the agent cannot choose away: the principal it
  is put to. Within the last ``CLARIFICATION_WINDOW_S`` seconds, one agent may
  put at most ``clarificationRounds`` clarifications to one principal per
  node (the envelope's ``nodeId``; none named, the agent is one node), any
  run (``clarnode.{agent}.{hash(principal, node)}``), and at most
  ``PRINCIPAL_ROUNDS_FACTOR`` times that over all its nodes
  (``clarpr.{agent}.{hash(principal)}``), so a fresh nodeId per question runs
  out too. Members are ``{hash(correlationId)}@{unix seconds}``; entries older
  than the window are dropped as the set is written. Past either cap the
  envelope is ``cap.breached`` (``clarification``) and counts nowhere. The
  principal is the one the route stage will address
  (``route.addressed_principal``); one it then refuses is taken back like any
  other refusal after this stage.

The counters live in JetStream KV, shared by every gateway instance.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from gateway.stages.base import Ctx, Refuse
from gateway.stages.kind import CLARIFICATION, SCHEMA_REQUEST
from gateway.stages.route import addressed_principal
from pgwcore.logs import get_logger
from subjects.wire import Detail

if TYPE_CHECKING:
    from typing import Any

log = get_logger("pgw.limits")
CODE = "cap.breached"
# Refusals that count as a schema round (spec 002 "Validation outcomes").
ROUND_CODES = frozenset({
    "unknown_envelope_kind", "envelope_invalid", "unknown_schema_version",
    "envelope_schema_version_drift", "invalid_envelope_shape",
})
_dec = msgspec.json.Decoder(list[str])
_enc = msgspec.json.Encoder()
_MAX_SET = 1024
# The window of the hard clarification caps (module docstring): an hour, the time a person takes to
# answer a few questions and the agent to act on them; an agent that asks more than clarificationRounds
# times per node in an hour is looping, not clarifying. Constants until they are settings.
CLARIFICATION_WINDOW_S = 3600.0
PRINCIPAL_ROUNDS_FACTOR = 4  # all of an agent's nodes together: four nodes' worth for one principal
_clock = time.time  # the windows' clock (a test moves it past a window instead of waiting one out)


def _h(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def rounds_key(agent: str, correlation_id: str) -> str:
    return f"rounds.{agent}.{_h(correlation_id)}"


def chain_of(correlation_id: str, node_id: str | None) -> str:
    """The exchange (one node of one run) whose rounds ``correlation_id`` counts against (module docstring)."""
    parts = correlation_id.split(":")
    chain = ":".join(parts[:-2]) if len(parts) >= 4 else correlation_id
    return f"{chain}\x00{node_id or '-'}"


def round_key(family: str, agent: str, correlation_id: str, node_id: str | None) -> str:
    return f"{family}.{agent}.{_h(chain_of(correlation_id, node_id))}"


def clar_node_key(agent: str, principal: str, node_id: str | None) -> str:
    return f"clarnode.{agent}.{_h(principal + chr(0) + (node_id or '-'))}"


def clar_principal_key(agent: str, principal: str) -> str:
    return f"clarpr.{agent}.{_h(principal)}"


COUNTED = "round_counted"  # ctx.extra: the [(key, member)] this envelope added to rounds sets


async def _get_set(kv: Any, key: str) -> tuple[list[str], int | None]:
    try:
        e = await kv.get(key)
    except KeyNotFoundError:
        return [], None
    if not e.value:
        return [], e.revision
    try:
        return _dec.decode(e.value), e.revision
    except msgspec.DecodeError:
        # Not a counter the gateway wrote: the server's acknowledgement a party aimed at this key (its
        # JetStream publish with ``$KV.PGW_DEDUP.…`` as its reply subject, docs/security.md "Replies").
        # Read as empty and written over by this count; before, every count of the key failed (an
        # agent's clarifications to its principal were refused engine_failure for 30 days).
        log.warning("a limit counter is no record of the gateway's; read as empty", key=key[:200])
        return [], e.revision


async def add_to_set(kv: Any, key: str, member: str) -> int:
    """Add ``member`` to the set at ``key`` (CAS); return the set's size."""
    return (await _add(kv, key, member))[0]


async def _add(kv: Any, key: str, member: str, window: tuple[float, float] | None = None) -> tuple[int, bool]:
    """Add ``member`` to the set at ``key`` (CAS): the set's size, and whether this call added it.

    With ``window`` ``(now, seconds)`` the set is windowed: the entry is stamped
    ``member@now``, entries older than the window are dropped, and a member already
    there is not stamped again.
    """
    for _ in range(20):
        members, rev = await _get_set(kv, key)
        entry = member
        if window is not None:
            now, span = window
            members = [e for e in members if _stamped(e)[1] > now - span]
            entry = f"{member}@{now:.0f}"
        if any(e == member or _stamped(e)[0] == member for e in members):
            return len(members), False
        members = [*members, entry][-_MAX_SET:]
        try:
            if rev is None:
                await kv.create(key, _enc.encode(members))
            else:
                await kv.update(key, _enc.encode(members), last=rev)
            return len(members), True
        except KeyWrongLastSequenceError:
            continue
    raise RuntimeError(f"could not update counter {key}")  # nak: the message is redelivered


def _stamped(entry: str) -> tuple[str, float]:
    """A windowed set's entry ``member@seconds`` as (member, seconds)."""
    member, at_sign, at = entry.rpartition("@")
    try:
        return (member, float(at)) if at_sign else (entry, 0.0)
    except ValueError:
        return entry, 0.0


async def _take_back(kv: Any, key: str, member: str) -> None:
    """Remove ``member`` (plain, or stamped ``member@seconds``) from the set at ``key``."""
    for _ in range(20):
        members, rev = await _get_set(kv, key)
        kept = [e for e in members if e != member and _stamped(e)[0] != member]
        if len(kept) == len(members) or rev is None:
            return
        try:
            await kv.update(key, _enc.encode(kept), last=rev)
            return
        except KeyWrongLastSequenceError:
            continue
    # Left counted: the allowance errs on the safe side; the message is not failed for it.
    log.warning("could not take back a counted round", key=key)


async def uncount(ctx: Ctx) -> None:
    """Take back the rounds this envelope counted (it was refused after the limits stage, or breached a cap)."""
    for key, member in ctx.extra.pop(COUNTED, []):
        await _take_back(ctx.state.kv, key, member)


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
    if ctx.env.type in (SCHEMA_REQUEST, CLARIFICATION) and ctx.correlation_id:
        schema = ctx.env.type == SCHEMA_REQUEST
        key = round_key("schemareq" if schema else "clar", ctx.agent, ctx.correlation_id, ctx.env.nodeId)
        # A hash, never the raw correlationId: this runs before redaction (SR-1).
        member = _h(ctx.correlation_id)
        counted: list[tuple[str, str]] = ctx.extra.setdefault(COUNTED, [])
        n, added = await _add(st.kv, key, member)
        if added:
            counted.append((key, member))
        cap = cfg.schema_rounds if schema else cfg.clarification_rounds
        if n > cap:
            await uncount(ctx)  # a breached emission is not a round
            what = "schema requests" if schema else "clarification requests"
            raise breached(
                "schema" if schema else "clarification",
                f"{n} {what} in this exchange (node and run, read from the correlationId); "
                f"{'schemaRounds' if schema else 'clarificationRounds'} is {cap}",
                cap,
            )
        if not schema:
            await _hard_caps(ctx, member, counted)


async def _hard_caps(ctx: Ctx, member: str, counted: list[tuple[str, str]]) -> None:
    """The clarification caps no runId or nodeId escapes (module docstring): per principal and node, and
    per principal over every node, within ``CLARIFICATION_WINDOW_S``."""
    assert ctx.env is not None
    cfg = ctx.gw.config.pipeline
    principal = addressed_principal(ctx) or ""
    node = ctx.env.nodeId
    now = _clock()
    for key, cap, where in (
        (clar_node_key(ctx.agent, principal, node), cfg.clarification_rounds,
         # Not the nodeId itself: this stage runs before redaction (SR-1).
         "for this node" if node else "without a nodeId (the agent is one node)"),
        (clar_principal_key(ctx.agent, principal), cfg.clarification_rounds * PRINCIPAL_ROUNDS_FACTOR,
         "over all of this agent's nodes"),
    ):
        n, added = await _add(ctx.state.kv, key, member, window=(now, CLARIFICATION_WINDOW_S))
        if added:
            counted.append((key, member))
        if n > cap:
            await uncount(ctx)  # a breached emission is not a round
            raise breached(
                "clarification",
                f"{n} clarification requests to this principal {where} within {CLARIFICATION_WINDOW_S:.0f} s, "
                f"whatever the run; the cap is {cap}",
                cap,
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
