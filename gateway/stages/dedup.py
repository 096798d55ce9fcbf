"""Stage 8, dedup and replay by ``correlationId`` (spec 002 "Replay determinism", DESIGN §3.2 step 8).

The cache is the JetStream KV bucket ``PGW_DEDUP``, key
``corr.{agent}.{sha256(correlationId)}``, so it survives restarts and is
shared by every gateway instance:

- the first envelope with correlationId C claims the key with a CAS
  ``create`` (status ``pending``, owner = its inbound stream position); two
  instances racing on C cannot both claim it;
- after its outcome is published the record becomes ``done`` and holds the
  outcome and the outcome's ``Nats-Msg-Id``;
- a later envelope with C and the same ``type`` gets the cached outcome: no
  handler runs, no surface item or verdict is published; the outcome is
  addressed to the later envelope's ``envelopeId``, flagged ``replayed`` and
  published under that envelope's own outcome id (``replay_of``), so the
  agent waiting on the new envelopeId gets it, once (issue 15);
- the key is the digest of the correlationId as the agent sent it: an id that
  redaction would change is refused before this stage (``identifier_redacted``,
  gateway.stages.redaction), so two ids differing only inside a secret never
  share a key;
- a replayed answer carries the re-emission's own trust tag (an envelope
  re-sent as ``untrusted`` gets ``untrusted: true``) and ``nodeId``;
- with another ``type`` → ``envelope_correlation_conflict``; but a
  correlationId whose earlier uses were all refused is free: a refusal binds no
  type (see the ``refused`` record below), so an agent that used the wrong
  kind may correct it under the same correlationId;
- while another instance holds C ``pending`` this one waits for it; the
  redelivery of the owner's own message (a crash mid-way) carries on, and its
  deterministic message ids make the repeat harmless; a claim gone stale is
  taken over by another envelope only once its owner's message is done with,
  or its redelivery had its chance and did not renew it (``_owner_may_return``);
  the waiters of one instance share one read of the durable's ack floor
  (``AckFloor``: one request in flight, a reading reused for a poll interval);
- a refusal after this stage (e.g. ``principal_not_bound``) releases the
  claim by turning it into a ``refused`` record, which the next emission of
  C claims straight away, so a corrected re-emission is processed afresh;
- a refusal counted against ``schemaRounds`` (limits) first makes sure C has
  a record here (``mark_refused``), so a claim that creates the key proves C
  has no counted refusal and the round counter is read only when the claim
  finds a record: one KV read fewer for every first emission.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from typing import Any, Literal

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from gateway.stages.base import INBOUND_DURABLE, Ctx, Refuse
from pgwcore.logs import get_logger
from subjects.wire import Detail, EnvelopeOutcome, Outcome, SchemaOutcome

log = get_logger("pgw.dedup")
BUCKET = "PGW_DEDUP"
WAIT_S = 10.0
POLL_S = 0.05  # how often an envelope waiting on another's claim reads it again


class DedupRecord(msgspec.Struct, omit_defaults=True):
    type: str
    owner: str
    created: float
    status: Literal["pending", "done", "refused"] = "pending"
    # msgspec cannot decode ``Raw | None`` (it expects null): an empty Raw means "no outcome yet".
    outcome: msgspec.Raw = msgspec.Raw(b"")
    msg_id: str | None = None
    envelope_id: str | None = None
    key: str | None = None  # Ctx.envelope_key of the envelope that owns it


_dec = msgspec.json.Decoder(DedupRecord)
_enc = msgspec.json.Encoder()
_out_dec = msgspec.json.Decoder(Outcome)


def corr_key(agent: str, correlation_id: str) -> str:
    return f"corr.{agent}.{hashlib.sha256(correlation_id.encode('utf-8', 'surrogatepass')).hexdigest()[:48]}"


async def cached_outcome_exists(js: Any, agent: str, correlation_id: str) -> bool:
    """True when the gateway would answer ``correlation_id`` from the cache (``pgw replay --dry-run``)."""
    try:
        kv = await js.key_value(BUCKET)
        entry = await kv.get(corr_key(agent, correlation_id))
    except Exception:  # noqa: BLE001 - no bucket, no key: not cached
        return False
    rec = _record(entry.value, entry.key) if entry.value else None
    return rec is not None and rec.status == "done"


def _record(value: bytes, key: str) -> DedupRecord | None:
    """The claim stored at ``key``, or None for a value that is no record of the gateway's: the server's
    acknowledgement a party aimed at the key (docs/security.md "Replies"), taken as no claim at all."""
    try:
        return _dec.decode(value)
    except msgspec.DecodeError:
        log.warning("a correlationId claim is no record of the gateway's; taken as released", key=key[:200])
        return None


def _owner(ctx: Ctx) -> str:
    return f"{ctx.turn.stream_seq}:{ctx.index}"


async def run(ctx: Ctx) -> None:
    from gateway.stages import limits

    assert ctx.env is not None and ctx.correlation_id
    st = ctx.state
    kv = st.kv
    # The schemaRounds check the limits stage left to us (limits.ROUNDS_DEFERRED). It is for
    # this very correlationId: an id redaction would change was refused (identifier_redacted).
    rounds_for = ctx.extra.pop(limits.ROUNDS_DEFERRED, None)
    key = corr_key(ctx.agent, ctx.correlation_id)
    mine = _owner(ctx)
    deadline = time.monotonic() + WAIT_S
    stale_after = ctx.gw.config.gateway.ack_wait_s
    while True:
        try:
            rev = await st.writer.create(key, _enc.encode(DedupRecord(ctx.env.type, mine, time.time(), envelope_id=ctx.envelope_id, key=ctx.envelope_key)))
            # No record, so no counted refusal either (mark_refused): the rounds check passes.
            ctx.extra["dedup"] = (key, rev)
            return
        except KeyWrongLastSequenceError:
            pass
        if rounds_for is not None:
            await limits.check_rounds(ctx, kv, rounds_for)
            rounds_for = None
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            continue  # released meanwhile: claim it
        if not entry.value:
            continue
        rec = _record(entry.value, key)
        if rec is None or rec.status == "refused":
            # Released by a refusal: a re-emission is processed afresh.
            if await _take_over(ctx, kv, key, mine, entry.revision):
                return
            continue
        if rec.type != ctx.env.type:
            raise Refuse(
                "envelope_correlation_conflict",
                f"correlationId was already used with type {rec.type!r}; this envelope has type {ctx.env.type[:128]!r}",
                details=[Detail(message="use a new correlationId for a different kind", path="$.correlationId", rule="dedup")],
            )
        if rec.status == "done" and rec.outcome:
            ctx.extra["cached_outcome"] = replay_of(
                _out_dec.decode(rec.outcome), ctx,
                # Anything but our own message redelivered: a replay. (The same envelope stored
                # twice shares its outcome's id with the first, so its flagged copy is dropped.)
                replayed=rec.owner != mine,
            )
            log.info("replay answered from the dedup cache", envelope_id=ctx.envelope_id, agent=ctx.agent)
            return
        stale = time.time() - rec.created > stale_after
        if rec.owner == mine or (stale and not await _owner_may_return(ctx, rec)):
            # Our own message redelivered after a crash, or an owner gone for good: take over.
            if await _take_over(ctx, kv, key, mine, entry.revision):
                return
            continue
        if time.monotonic() > deadline:
            # Another instance is processing it right now; let the stream redeliver later.
            raise RuntimeError("correlationId is being processed by another gateway instance")
        await asyncio.sleep(POLL_S)


async def _owner_may_return(ctx: Ctx, rec: DedupRecord) -> bool:
    """Whether the message that owns the stale claim ``rec`` may still be delivered again.

    A claim goes stale when its owner takes longer than the ack wait: most often it
    crashed, and its message comes back to some instance, which finishes what it began
    (its moment record, its verdict, maybe its item). Another envelope taking the claim
    over meanwhile would open a second moment for the correlationId, its first one left
    half-published (spec 002 "Replay determinism": one outcome per correlationId). So
    it waits, unless the owner's message is done with: at or below the durable's ack
    floor (acked, or terminated when dead-lettered); or the claim is older than twice
    the ack wait, so the owner's redelivery, due one ack wait after the claim, had a
    whole ack wait of its own to take it over (which writes a fresh claim) and did not.
    The second test also ends the wait of an envelope whose own unacked message holds
    the floor below the owner's. Cannot tell (the consumer unreadable): wait.
    """
    cfg = ctx.gw.config.gateway
    if time.time() - rec.created > 2 * cfg.ack_wait_s:
        return False
    try:
        seq = int(rec.owner.split(":", 1)[0])
    except ValueError:
        return False  # not a message's position: no owner to wait for
    try:
        floor = await ctx.state.ack_floor.get()
    except Exception:  # noqa: BLE001 - unknown: waiting is the safe side
        return True
    return seq > floor


class AckFloor:
    """The ack floor of the gateway's inbound durable, one read shared by this instance's waiters.

    Every envelope waiting on a stale claim asks ``_owner_may_return`` once a poll;
    they share one ``consumer_info`` request in flight, and a floor asked for less
    than ``max_age`` ago (the poll interval) is reused rather than asked again. A
    durable's ack floor only rises, so a reading a poll old can only make a waiter
    wait one poll longer, never take a claim over sooner: the rule is unchanged. A
    failed read is not remembered: each caller sharing it gets the error (and waits,
    as before), and the next call asks again.
    """

    def __init__(self, js: Any, max_age: float = POLL_S) -> None:
        self._js = js
        self._max_age = max_age
        self._floor = 0
        self._asked_at = float("-inf")  # time.monotonic() when the remembered floor was asked for
        self._reading: asyncio.Task[int] | None = None

    async def get(self) -> int:
        """The durable's ack floor (a stream sequence), as read at most ``max_age`` ago."""
        if time.monotonic() - self._asked_at < self._max_age:
            return self._floor
        reading = self._reading
        if reading is None:
            reading = self._reading = asyncio.create_task(self._read(), name="dedup-ack-floor")
            reading.add_done_callback(_seen)
        # Shielded: a waiter cancelled (its gateway draining) does not cancel the others' read.
        return await asyncio.shield(reading)

    async def _read(self) -> int:
        asked = time.monotonic()
        try:
            info = await self._js.consumer_info("PGW_INBOUND", INBOUND_DURABLE)
        finally:
            self._reading = None
        floor = info.ack_floor.stream_seq or 0
        self._floor, self._asked_at = floor, asked
        return floor


def _seen(task: asyncio.Task[int]) -> None:
    """Retrieve a shared read's error, so one no caller awaited any more is not logged as lost."""
    if not task.cancelled():
        task.exception()


def replay_of(cached: Outcome, ctx: Ctx, *, replayed: bool) -> Outcome:
    """The cached outcome, addressed to the envelope that asked (spec 002 "Replay determinism", issue 15).

    A re-emission under a new envelopeId waits for *its* envelopeId: it gets
    the cached outcome with its own ``envelope_id``, flagged ``replayed``, and
    published under its own message id (the pipeline's ``outcome_msg_id``), so
    it is stored once for that envelope. Our own message redelivered after a
    crash (the outcome and this record are stored together, so its outcome may
    be missing) gets the same outcome unflagged, under the same id as before.
    """
    if isinstance(cached, EnvelopeOutcome | SchemaOutcome):
        if isinstance(cached, EnvelopeOutcome) and replayed:
            cached.replay_of = cached.replay_of or cached.envelope_id
        cached.envelope_id = ctx.envelope_id
        cached.replayed = replayed
        if replayed:
            cached.traceparent = ctx.turn.traceparent or cached.traceparent
            cached.node_id = ctx.node_id
    # spec 002 "Trust boundary": the answer to an envelope tagged untrusted is untrusted,
    # whatever the tag of the emission whose outcome is cached.
    cached.untrusted = cached.untrusted or ctx.untrusted
    return cached


async def settle(ctx: Ctx, outcome: Outcome, msg_id: str, refused: bool, body: bytes | None = None) -> None:
    """With the outcome's publish: cache an accepted one, release the claim on a refusal.
    ``body``: the outcome's JSON text as published, when the caller has it."""
    claim = ctx.extra.get("dedup")
    if claim is None:
        return
    key, rev = claim
    writer = ctx.state.writer
    assert ctx.env is not None
    if refused:
        # Released, not deleted: the record must outlive any counted refusal (mark_refused).
        released = DedupRecord(ctx.env.type, _owner(ctx), time.time(), status="refused", envelope_id=ctx.envelope_id, key=ctx.envelope_key)
        with contextlib.suppress(Exception):  # someone took it over: nothing to release
            await writer.update(key, _enc.encode(released), last=rev)
        return
    rec = DedupRecord(
        ctx.env.type, _owner(ctx), time.time(), status="done",
        outcome=msgspec.Raw(_enc.encode(outcome) if body is None else body), msg_id=msg_id, envelope_id=ctx.envelope_id, key=ctx.envelope_key,
    )
    try:
        await writer.update(key, _enc.encode(rec), last=rev)
    except KeyWrongLastSequenceError:
        log.warning("dedup record changed under us; not caching", envelope_id=ctx.envelope_id, key=ctx.envelope_key)


async def mark_refused(ctx: Ctx, kv: Any, correlation_id: str) -> None:
    """Before a refusal of ``correlation_id`` is counted: make sure it has a record here, freshly written.

    Absent: a ``refused`` record is created. ``refused`` or ``done``: rewritten
    as it is, so it does not expire before the round counter written after it.
    ``pending``: left alone; its owner rewrites it when it settles (or a
    takeover does).
    """
    key = corr_key(ctx.agent, correlation_id)
    for _ in range(20):
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            entry = None
        rec = _record(entry.value, key) if entry is not None and entry.value else None
        try:
            if entry is None or rec is None:
                # Neither type nor ids: the refusal may come before redaction (SR-1).
                marker = DedupRecord("", _owner(ctx), time.time(), status="refused")
                if entry is None:
                    await kv.create(key, _enc.encode(marker))
                else:
                    await kv.update(key, _enc.encode(marker), last=entry.revision)
                return
            if rec.status == "pending":
                return
            await kv.update(key, entry.value, last=entry.revision)
            return
        except KeyWrongLastSequenceError:
            continue
    raise RuntimeError(f"could not mark correlationId record {key}")  # nak: the message is redelivered


async def _take_over(ctx: Ctx, kv: Any, key: str, mine: str, last: int) -> bool:
    """Claim ``key`` over the record at revision ``last`` (compare-and-set); False if it moved meanwhile."""
    try:
        rev = await kv.update(
            key, _enc.encode(DedupRecord(ctx.env.type, mine, time.time(), envelope_id=ctx.envelope_id, key=ctx.envelope_key)), last=last,
        )
    except KeyWrongLastSequenceError:
        return False
    ctx.extra["dedup"] = (key, rev)
    return True
