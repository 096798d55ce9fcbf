"""``pgw replay``: re-drive a range of a stream (issue 8 "Ops", spec 002 "Replay determinism").

A range is chosen by subject filter, stream sequence and/or time, read by
message get, with no consumer and no acknowledgement (the stream is not changed;
consumers/history.py), and
each message is re-driven to one target:

- ``gateway``: republished on its original inbound subject
  (``agent.{agent}.envelope`` / ``.transition``) so the gateway pipeline runs
  it again. The gateway's dedup stage (DESIGN §3.2 step 8, spec 002 "Replay
  determinism") answers a seen correlationId with the *cached* outcome: no new
  surface item, no new verdict, so no second capsule.

  ``Nats-Msg-Id``: by default the original id (``{agent}:{envelopeId}``,
  DESIGN §7). Inside the stream's duplicate window the server drops such a
  republish as a duplicate (the PubAck says so) and nothing runs at all, which
  is the safe default. ``fresh_msg_id=True`` uses
  ``{agent}:{envelopeId}:replay:{stream_seq}`` instead, so the envelope reaches
  the pipeline and exercises the correlationId cache; running the same replay
  twice is still deduplicated by the stream.
- any other subject: the body and headers republished there, with
  ``Pgw-Replay-Of: {stream}:{seq}`` and ``Nats-Msg-Id`` = ``replay:{stream}:{seq}``
  (idempotent when the target is a stream). Writing into the contract's own
  downstream subjects (surface, outcome, verdict, capsule, log) is refused:
  that would forge the gateway's output.

A message that held a secret is no longer in ``PGW_INBOUND`` as sent once
the gateway is done with it (a turn answered or dead-lettered, a transition
report recorded: gateway/at_rest.py; docs/security.md "Data at rest"): a
range of ``PGW_INBOUND`` reads its redacted form from ``PGW_INBOUND_REDACTED``
at the message's own sequence, subject and ``Nats-Msg-Id``. Re-driven, an
answered turn is answered from the dedup record of its correlationId like the
turn itself; run as new (a dead-lettered turn, a record expired), it is the
redacted message, never the secret.

``dry_run=True`` reads the range and reports, per message, what would be sent
where, and for the gateway target whether the PGW_DEDUP cache already holds an
outcome for the envelope's correlationId (so the replay would be answered from
the cache).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from consumers.history import StoredMsg, read_stored
from pgwcore.atomic import stored_by_reply
from pgwcore.logs import get_logger
from pgwcore.msgget import subject_matches
from pgwcore.streams import INBOUND_MSG_ID_HEADER, INBOUND_REDACTED_BUCKET, INBOUND_SUBJECT_HEADER
from subjects.errors import PgwError, SubjectError
from subjects.names import Subjects

log = get_logger("pgw.replay")

GATEWAY = "gateway"
REPLAY_HEADER = "Pgw-Replay-Of"
# Headers that belong to the original publish and must not be copied verbatim.
_DROP_HEADERS = {"Nats-Msg-Id", "Nats-Expected-Stream", "Nats-Expected-Last-Sequence",
                 "Nats-Expected-Last-Subject-Sequence", "Nats-Expected-Last-Msg-Id"}


class ReplayError(PgwError):
    """A replay request that cannot be carried out; ``why`` says what to change."""

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(f"replay refused: {why}")


@dataclass(frozen=True)
class ReplayRange:
    """Which messages: a stream (or the one holding ``subject``), a filter, and bounds."""

    stream: str | None = None
    subject: str | None = None
    from_seq: int | None = None
    to_seq: int | None = None
    since: datetime | None = None
    until: datetime | None = None
    limit: int | None = None


@dataclass
class ReplayAction:
    """What happened (or, in a dry run, would happen) to one message."""

    seq: int
    subject: str
    target: str | None
    msg_id: str | None
    action: str  # "republish" | "skip" | "duplicate" | "published"
    reason: str | None = None
    correlation_id: str | None = None
    envelope_type: str | None = None
    cached: bool | None = None


@dataclass
class ReplayReport:
    stream: str
    actions: list[ReplayAction] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for a in self.actions:
            out[a.action] = out.get(a.action, 0) + 1
        return out


async def stream_of(js: Any, rng: ReplayRange) -> str:
    """The stream ``rng`` reads: the one named, else the one that stores its subject filter."""
    if rng.stream is not None:
        return rng.stream
    if not rng.subject:
        raise ReplayError("name a stream (--stream) or a subject filter (--subject)")
    try:
        return await js.find_stream_name_by_subject(rng.subject)
    except NotFoundError:
        raise ReplayError(f"no stream holds subject {rng.subject!r} (`pgw streams` lists each stream's subjects)") from None


async def redacted_turns(nc: Client, rng: ReplayRange, prefix: str) -> list[StoredMsg]:
    """The redacted forms of settled messages of ``PGW_INBOUND`` in ``rng``, as the messages were stored."""
    js = nc.jetstream()
    stream, pre = f"KV_{INBOUND_REDACTED_BUCKET}", f"$KV.{INBOUND_REDACTED_BUCKET}."
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        return []
    if not info.state.messages:
        return []
    out: list[StoredMsg] = []
    async for m in read_stored(nc, stream, from_seq=info.state.first_seq or 1, to_seq=info.state.last_seq):
        if not m.headers or not m.subject.startswith(pre):  # each of the gateway's copies carries its headers
            # An answer of the server's (an acknowledgement or refusal, a JetStream API answer, an empty status
            # answer) a party aimed at this key, or a message the server delivered there, stored under its own
            # subject (docs/security.md "Replies"): no redacted copy, never replayed as the agent's message.
            log.warning("a redacted copy is an answer of the server's; passed over", subject=m.subject)
            continue
        agent, _, seq = m.subject[len(pre):].rpartition(".")
        # The message's own subject, one of the agent's two inputs (a copy without it is an envelope's).
        inputs = (f"{prefix}.agent.{agent}.envelope", f"{prefix}.agent.{agent}.transition")
        subject = m.headers.get(INBOUND_SUBJECT_HEADER, inputs[0])
        if subject not in inputs:
            continue
        if not seq.isdigit() or (rng.subject and not subject_matches(rng.subject, subject)):
            continue
        n = int(seq)
        if (rng.from_seq and n < rng.from_seq) or (rng.to_seq and n > rng.to_seq):
            continue
        headers = {k: v for k, v in m.headers.items()
                   if k not in (INBOUND_MSG_ID_HEADER, INBOUND_SUBJECT_HEADER) and not k.startswith("Nats-")}
        if m.headers.get(INBOUND_MSG_ID_HEADER):
            headers["Nats-Msg-Id"] = m.headers[INBOUND_MSG_ID_HEADER]
        out.append(StoredMsg("PGW_INBOUND", n, subject, m.data, headers, m.time))
    return out


async def read_range(nc: Client, rng: ReplayRange, *, prefix: str = "pgw") -> AsyncIterator[StoredMsg]:
    """Yield the messages of ``rng`` in stream order, without a consumer or any change.

    Read by message get (consumers/history.py), so ops credentials, which may
    create, pull from or ack no consumer (issue 19), can replay. A range of
    ``PGW_INBOUND`` yields a processed turn that held a secret in its redacted form.
    """
    js = nc.jetstream()
    stream = await stream_of(js, rng)
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        raise ReplayError(f"stream {stream!r} does not exist") from None
    last_seq = info.state.last_seq
    to_seq = min(rng.to_seq, last_seq) if rng.to_seq else last_seq
    copies = await redacted_turns(nc, rng, prefix) if stream == "PGW_INBOUND" else []
    if info.state.messages == 0 and not copies:
        return
    since = rng.since.astimezone() if rng.since else None
    until = rng.until.astimezone() if rng.until else None
    yielded = 0
    async for m in _merged(read_stored(nc, stream, rng.subject, from_seq=rng.from_seq or 1, to_seq=to_seq)
                           if info.state.messages else None, sorted(copies, key=lambda c: c.seq)):
        if since and m.time and m.time < since:
            continue
        if until and m.time and m.time > until:
            return
        yield m
        yielded += 1
        if rng.limit and yielded >= rng.limit:
            return


async def _merged(stored: AsyncIterator[StoredMsg] | None, copies: list[StoredMsg]) -> AsyncIterator[StoredMsg]:
    """The stored messages and the redacted copies (sorted) in one sequence order, streamed."""
    i = 0
    if stored is not None:
        async for m in stored:
            while i < len(copies) and copies[i].seq < m.seq:
                yield copies[i]
                i += 1
            yield m
    for c in copies[i:]:
        yield c


def _envelope_ids(data: bytes) -> list[tuple[str | None, str | None, str | None]]:
    """(envelopeId, correlationId, type) of each envelope in a turn; empty if unreadable."""
    try:
        body = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return []
    items = body if isinstance(body, list) else [body]
    out = []
    for e in items:
        if isinstance(e, dict):
            out.append((_s(e.get("envelopeId")), _s(e.get("correlationId")), _s(e.get("type"))))
    return out


def _s(v: object) -> str | None:
    return v if isinstance(v, str) else None


class Replayer:
    """Re-drives a range; ``dedup_lookup(agent, correlation_id)`` tells a dry run about the cache."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        *,
        dedup_lookup: Callable[[str, str], Any] | None = None,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.dedup_lookup = dedup_lookup
        self._core_target = False

    def _check_target(self, target: str) -> None:
        if target == GATEWAY:
            return
        if not target or any(c in target for c in " \t\r\n*>"):
            raise ReplayError(f"target subject {target!r} must be a concrete subject")
        if target.startswith(self.subjects.prefix + "."):
            try:
                parsed = self.subjects.parse(target)
            except SubjectError:
                return  # under the prefix but not a contract subject: ops' own
            if not (parsed.role == "agent" and parsed.channel in ("envelope", "transition")):
                raise ReplayError(
                    f"{target!r} is gateway output; replaying into it would forge the gateway's "
                    "records (use --to gateway to re-drive inputs)"
                )

    async def replay(self, rng: ReplayRange, target: str, *, dry_run: bool = False,
                     fresh_msg_id: bool = False) -> ReplayReport:
        self._check_target(target)
        stream = await stream_of(self.js, rng)
        report = ReplayReport(stream=stream)
        self._core_target = False
        if target != GATEWAY:
            try:
                await self.js.find_stream_name_by_subject(target)
            except NotFoundError:
                self._core_target = True  # not stored by any stream: a core publish
        async for msg in read_range(self.nc, rng, prefix=self.subjects.prefix):
            action = await self._one(msg, stream, target, dry_run=dry_run, fresh_msg_id=fresh_msg_id)
            report.actions.append(action)
        return report

    async def _one(self, msg: StoredMsg, stream: str, target: str, *, dry_run: bool,
                   fresh_msg_id: bool) -> ReplayAction:
        seq = msg.seq
        headers = dict(msg.headers or {})
        if stored_by_reply(msg):
            # An answer of the server's a party aimed at this subject (docs/security.md "Replies"): the
            # consumers pass it over, and republished with a message id it would no longer be.
            return ReplayAction(seq, msg.subject, None, None, "skip",
                                reason="the server's answer to a party's request or publish, stored here; no message")
        if target == GATEWAY:
            try:
                parsed = self.subjects.parse(msg.subject)
            except SubjectError:
                parsed = None
            if parsed is None or parsed.role != "agent" or parsed.channel not in ("envelope", "transition"):
                return ReplayAction(seq, msg.subject, None, None, "skip",
                                    reason="not a gateway input (agent.*.envelope / .transition)")
            subject = msg.subject
            msg_id = headers.get("Nats-Msg-Id") or f"replay:{stream}:{seq}"
            if fresh_msg_id:
                msg_id = f"{msg_id}:replay:{seq}"
            ids = _envelope_ids(msg.data) if parsed.channel == "envelope" else []
            corr = ids[0][1] if ids else None
            etype = ids[0][2] if ids else None
            cached = None
            if self.dedup_lookup is not None and corr is not None and parsed.token:
                try:
                    cached = bool(await self.dedup_lookup(parsed.token, corr))
                except Exception:  # noqa: BLE001 - a dry-run hint only
                    cached = None
        else:
            subject, msg_id, corr, etype, cached = target, f"replay:{stream}:{seq}", None, None, None
        for h in _DROP_HEADERS:
            headers.pop(h, None)
        headers["Nats-Msg-Id"] = msg_id
        headers[REPLAY_HEADER] = f"{stream}:{seq}"
        act = ReplayAction(seq, msg.subject, subject, msg_id, "republish",
                           correlation_id=corr, envelope_type=etype, cached=cached)
        if dry_run:
            return act
        if self._core_target:
            # Not a stream subject: a core publish (nobody stores it, so no dedup either).
            await self.nc.publish(subject, msg.data, headers=headers)
            await self.nc.flush()
            act.action = "published"
            return act
        try:
            ack = await self.js.publish(subject, msg.data, headers=headers)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            # The server drops a publish the credentials may not make, and says nothing to the publisher.
            raise ReplayError(f"no acknowledgement for {subject!r} from its stream: these credentials may not "
                              "publish it (a replay that publishes needs the gateway's: `pgw --as service:gateway "
                              "replay ...`; ops credentials can --dry-run)") from None
        act.action = "duplicate" if ack.duplicate else "published"
        if ack.duplicate:
            act.reason = "dropped by the stream's duplicate window (same Nats-Msg-Id)"
        return act


def format_action(a: ReplayAction, *, dry_run: bool) -> str:
    verb = {"republish": "would republish" if dry_run else "republish"}.get(a.action, a.action)
    line = f"#{a.seq} {a.subject} -> {verb}"
    if a.target:
        line += f" to {a.target} (Nats-Msg-Id {a.msg_id})"
    if a.envelope_type:
        line += f" type={a.envelope_type}"
    if a.correlation_id:
        line += f" correlationId={a.correlation_id}"
    if a.cached is True:
        line += " [cached outcome: the gateway answers from the dedup cache, nothing new is published]"
    elif a.cached is False:
        line += " [not in the dedup cache: the gateway would process it as new]"
    if a.reason:
        line += f" ({a.reason})"
    return line
