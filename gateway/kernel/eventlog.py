"""The kernel's event log: signed, hash-chained, on stream ``PGW_EVENTLOG``.

spec 003 §5.3 and §8.2: every event is kernel-signed (Ed25519, the
``kernel`` key of ``pgwcore.keys``) and committed to the log, and the
IDP_SUBMITTED event is acknowledged by the server before Cedar runs. The
stream denies delete and purge (``pgwcore.streams``).

The whole stream is one hash chain: each event carries the stream sequence
and the digest of the event before it. Several gateway instances append to
the same chain; each append carries ``Nats-Expected-Last-Sequence`` (the
sequence the writer believes is last), so the server refuses an append
that would fork the chain (error 10071) and the writer re-reads the head and
re-signs. Appends also carry a deterministic ``Nats-Msg-Id``, so a
redelivered input yields the event once (the duplicate's PubAck points at
the original).

The log holds only the kernel's own records (spec 003 §8.2: kernel-signed, and
no one else writes to it). Yet the stream stores whatever a publisher with
rights on ``log.>`` sends, so every reader goes through one walk
(``walk_log``) that classifies each stored record (``check_record``): the
kernel's own (decodes, on the subject of its type, signed by a kernel key,
chained to the record before it), or *foreign*, with what is wrong. A
foreign record is never applied, never trusted as a revocation, and never
stops the kernel: the chain's link is the SHA-256 of the stored bytes of the
record before (for a kernel event that is its ``digest()``), so the kernel's
next event chains over a foreign record's bytes, the stream stays one chain
with no gap, and the foreign record stays pinned where it is. It is
reported at CRITICAL with its stream sequence (``report_foreign``) and
counted in ``pgw_eventlog_foreign_records_total``. An operator who has
looked at it records it as quarantined (``pgw log quarantine SEQ``): a
kernel-signed ``LOG_RECORD_QUARANTINED`` event naming its sequence and the
SHA-256 of its bytes, appended to the same chain. ``verify_stream`` then
reports it as quarantined, not as a break.

``verify_stream`` walks the stream (or one subject) and reports every
problem with its sequence: an undecodable record, a bad or unknown-key
signature, a wrong ``prev_seq`` or ``prev_digest``, an event whose subject
does not match its type, a missing sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError
from prometheus_client import Counter

from pgwcore.atomic import ERR_WRONG_LAST_MSG_ID, ERR_WRONG_LAST_SEQ, AckInbox, not_written_by_us
from pgwcore.keys import SigningKey
from pgwcore.logs import get_logger
from pgwcore.metrics import REGISTRY
from pgwcore.msgget import stored_on, stored_range
from subjects import jcs
from subjects.errors import PgwError
from subjects.idp import GENESIS_DIGEST, LogEvent, b64url, log_event_decoder
from subjects.names import Subjects
from subjects.util import now_rfc3339

log = get_logger("pgw.kernel.eventlog")

STREAM = "PGW_EVENTLOG"
QUARANTINED = "LOG_RECORD_QUARANTINED"
# How far back from the head one read looks for more foreign records (a flood is
# reported by its newest records and by pgw log verify, never walked whole on the append path).
HEAD_LOOKBACK = 64

LOGGED_ONE_BY_ONE = 100  # server answers in the log logged one line each by a process; the rest counted
FOREIGN_RECORDS = Counter(
    "pgw_eventlog_foreign_records_total",
    "Records of the event log that are not the kernel's own (undecodable, unsigned or unchained), "
    "met by this process and not quarantined; each is also logged at CRITICAL with its sequence",
    registry=REGISTRY,
)


class EventLogError(PgwError):
    """The event log could not be written (after retries)."""


class LogAppendError(EventLogError):
    """The server refused one append; ``err_code`` is the JetStream API error code."""

    def __init__(self, err_code: int | None, description: str) -> None:
        self.err_code = err_code
        self.description = description
        super().__init__(f"event log append refused ({err_code}): {description}")


@dataclass(frozen=True)
class Appended:
    seq: int
    event: LogEvent
    duplicate: bool


def with_signature(signing: bytes, sig: str) -> bytes:
    """The JCS of a whole event from the JCS of the event without ``sig`` (``signing_bytes()``).

    Saves canonicalizing the body a second time. JCS (RFC 8785 §3.2.3) orders
    members by key, and ``LogEvent``'s keys sort as ``... prev_seq, sig, ts``:
    ``ts`` is the last member and its RFC 3339 value holds no ``"``, so the
    last ``,"ts":`` is that member, and ``sig`` (base64url, nothing to escape)
    goes just before it.
    """
    i = signing.rindex(b',"ts":')
    return b"".join((signing[:i], b',"sig":"', sig.encode("ascii"), b'"', signing[i:]))


def fast_signer(key: SigningKey) -> Callable[[bytes], bytes]:
    """``key.sign`` through libsodium (PyNaCl, installed with nkeys) where it is there.

    Ed25519 signatures are deterministic (RFC 8032 §5.1.6), so the bytes are the
    same as OpenSSL's; libsodium makes them with about a quarter less CPU here
    (two per PERMIT, spec 003 §8.2). Without PyNaCl, ``key.sign`` itself.
    """
    try:
        from nacl.bindings import crypto_sign, crypto_sign_BYTES, crypto_sign_seed_keypair
    except ImportError:  # pragma: no cover - nkeys depends on PyNaCl
        return key.sign
    _public, secret = crypto_sign_seed_keypair(key.private.private_bytes_raw())

    def sign(data: bytes) -> bytes:
        return crypto_sign(data, secret)[:crypto_sign_BYTES]  # signature || message

    return sign


class EventLog:
    """Append signed events to the chain; one writer lock per process, CAS across processes."""

    def __init__(self, nc: Client, subjects: Subjects, key: SigningKey, *, stream: str = STREAM,
                 keys: Mapping[str, Ed25519PublicKey] | None = None) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.key = key
        # The kernel public keys whose records are the kernel's own (active and retired); the signing key's always.
        self.keys: dict[str, Ed25519PublicKey] = {**(keys or {}), key.kid: key.public}
        self._sign_bytes = fast_signer(key)
        self.stream = stream
        self._reported: set[int] = set()  # foreign sequences already logged by this process
        self._foreign_logged = 0  # server answers in the log this process has met (LOGGED_ONE_BY_ONE)
        # The foreign records an operator quarantined (``load_quarantine``): reported, not alarmed.
        self.quarantine: dict[int, Quarantine] = {}
        self._lock = asyncio.Lock()
        self._head: tuple[int, str] | None = None
        # The Nats-Msg-Id of this process's own append the head was computed from (None: read from the server).
        self._head_msg_id: str | None = None
        self.ack_timeout_s = 10.0
        # The PubAcks' inbox: the connection's request inbox (send_acked) until its owner
        # starts it (KernelService: one of the kernel's own, shared with its KernelState).
        self.acks = AckInbox(nc)

    async def head(self) -> tuple[int, str]:
        """(last sequence, digest of the record stored there) as the server has it now.

        The digest is the SHA-256 of the stored bytes, whoever wrote them, so a foreign
        record at the head never stops the log: the next event chains over it. A foreign
        head is reported, and so are the foreign records just before it."""
        info = await self.js.stream_info(self.stream)
        last = info.state.last_seq or 0
        if last == 0:
            return 0, GENESIS_DIGEST
        raw = await self.js.get_msg(self.stream, last)
        data = raw.data or b""
        # Decoding and signature only (no read of the record before it): this runs on every
        # re-read of the head, after each append another instance got in first. The link is
        # checked by the rebuild's walk and by pgw log verify.
        if last not in self._reported and check_record(last, raw.subject or "", data, self.keys,
                                                       self.subjects, None).problem is not None:
            await self._report_head(last, raw.subject or "", data, info.state.first_seq or 1)
        return last, record_digest(data)

    async def _report_head(self, seq: int, subject: str, data: bytes, first: int) -> None:
        """Report the foreign head, then walk back over the foreign records just before it."""
        for _ in range(HEAD_LOOKBACK):
            prev: tuple[int, str] | None = (0, GENESIS_DIGEST) if seq == 1 else None
            before: Any = None
            if seq > first:
                with contextlib.suppress(NotFoundError):
                    before = await self.js.get_msg(self.stream, seq - 1)
                    prev = (seq - 1, record_digest(before.data or b""))
            rec = check_record(seq, subject, data, self.keys, self.subjects, prev)
            if rec.problem is None or seq in self._reported:
                return
            self.report_foreign(rec, "the head of the log")
            if before is None:
                return
            seq, subject, data = seq - 1, before.subject or "", before.data or b""

    async def load_quarantine(self) -> dict[int, Quarantine]:
        """Read the quarantined records (``quarantined``); at start, before the log is walked."""
        self.quarantine = await quarantined(self.js, self.subjects, self.keys, stream=self.stream)
        return self.quarantine

    def said(self, seq: int) -> None:
        """Take the record at ``seq`` as reported already: the caller has said what it is."""
        self._reported.add(seq)

    def report_foreign(self, rec: LogRecord, where: str) -> None:
        """Log a foreign record once per process: CRITICAL and counted, unless an operator quarantined it."""
        if rec.seq in self._reported:
            return
        if len(self._reported) > 100_000:  # bounded: a flood is counted, not remembered for ever
            self._reported.clear()
        self._reported.add(rec.seq)
        q = self.quarantine.get(rec.seq)
        if q is not None and q.sha256 == rec.digest:
            log.info("event log record is not the kernel's own; quarantined, so not applied", seq=rec.seq,
                     subject=rec.subject, problem=rec.problem, quarantined_by=q.by_seq, found_in=where)
            return
        FOREIGN_RECORDS.inc()
        # The server's answers (a party's publishes it refused put them in the log for free, at thousands a
        # second, docs/security.md "Replies"): one line each for the first LOGGED_ONE_BY_ONE, then one line
        # saying the rest are only counted; a line for each made every walk of the log write as many. Any
        # other foreign record (a forged event, an insider's) is logged each time, whatever came before.
        # A sequence missing from the log (``walk_log`` yields it with no subject and no data) is no answer of the
        # server's: a gap is logged each time, never lost among the first LOGGED_ONE_BY_ONE answers (a review).
        server_answer = bool(rec.subject) and not_written_by_us(rec.data)
        if server_answer:
            self._foreign_logged += 1
        if not server_answer or self._foreign_logged <= LOGGED_ONE_BY_ONE:
            log.critical(
                "event log record is not the kernel's own: it is not applied or trusted; the log goes on over it. "
                f"Inspect it, then record it as quarantined: pgw log quarantine {rec.seq} --reason ...",
                seq=rec.seq, subject=rec.subject, problem=rec.problem, found_in=where, stream=self.stream,
                alert_trigger="EVENTLOG_FOREIGN_RECORD",
            )
        elif self._foreign_logged == LOGGED_ONE_BY_ONE + 1:
            log.critical(
                f"more than {LOGGED_ONE_BY_ONE} event log records are answers of the server's (a publish's "
                "acknowledgement or refusal aimed at the log): the others are counted "
                "(pgw_eventlog_foreign_records_total), not logged one by one; pgw log verify lists every one",
                seq=rec.seq, found_in=where, stream=self.stream, alert_trigger="EVENTLOG_FOREIGN_RECORD",
            )

    def sign_record(self, record: Mapping[str, Any]) -> str:
        """The kernel's signature over the JCS of ``record`` (a commitment record, spec 003 §5.5),
        base64url: the bytes of ``b64url(key.sign(rfc8785.dumps(record)))``, made by the log's
        serializer and signer."""
        return b64url(self._sign_bytes(jcs.dumps(record)))

    def sign(self, event: LogEvent) -> LogEvent:
        self._sign(event)
        return event

    def _sign(self, event: LogEvent, *, plain: bool = False) -> bytes:
        """Sign ``event`` in place; return its wire form (== ``event.canonical_bytes()``)."""
        event.kid = self.key.kid
        # == msgspec.to_builtins(event) without "sig"; ``plain``: the body is builtins
        # already (append converts it once), so it is not walked a second time here.
        unsigned = {"event_id": event.event_id, "event_type": event.event_type, "ts": event.ts,
                    "prev_seq": event.prev_seq, "prev_digest": event.prev_digest, "kid": event.kid,
                    "body": event.body if plain else msgspec.to_builtins(event.body)}
        # == event.signing_bytes(), at msgspec's speed where that is exact
        signing = jcs.dumps(unsigned)
        event.sig = b64url(self._sign_bytes(signing))
        return with_signature(signing, event.sig)

    async def append(
        self,
        event_type: str,
        body: Mapping[str, Any],
        *,
        msg_id: str,
        event_id: str | None = None,
        traceparent: str | None = None,
    ) -> Appended:
        """Sign ``body`` as ``event_type``, chain it, publish and wait for the PubAck.

        Appends are pipelined: the lock covers signing and sending only. The
        next event is chained onto this one's locally computed digest at the
        sequence the server must give it; if the server disagrees (another
        writer, or a duplicate that consumed no sequence) the append fails
        with "wrong last sequence", so does every append pipelined behind
        it, and each re-reads the head and retries. The chain never forks.
        """
        subject = self.subjects.log(event_type)
        plain = msgspec.to_builtins(dict(body))
        event_id = event_id or msg_id  # the msg_id may change below (a foreign record took it); the id does not
        for _attempt in range(50):
            async with self._lock:
                if self._head is None:
                    self._head, self._head_msg_id = await self.head(), None
                prev_seq, prev_digest = self._head
                chained_on = self._head_msg_id
                ev = LogEvent(
                    event_id=event_id,
                    event_type=event_type,
                    ts=now_rfc3339(),
                    prev_seq=prev_seq,
                    prev_digest=prev_digest,
                    kid=self.key.kid,
                    body=plain,
                )
                data = self._sign(ev, plain=True)
                headers = {"Nats-Msg-Id": msg_id, "Nats-Expected-Last-Sequence": str(prev_seq),
                           "Nats-Expected-Stream": self.stream}
                if chained_on is not None:
                    # Chained onto this process's own append, perhaps not stored yet: another instance's
                    # record may take that sequence and the append be refused, and then the last sequence
                    # alone would let this one in, chained to a record that was never stored (spec 003
                    # §8.2: the chain must not break). The last Nats-Msg-Id must be that append's too.
                    headers["Nats-Expected-Last-Msg-Id"] = chained_on
                if traceparent:
                    headers["traceparent"] = traceparent
                # Sent now, in order on this connection; the ack is awaited outside the lock.
                fut = await self.acks.send(subject, data, headers, self.ack_timeout_s)
                # == ev.digest(), without canonicalizing twice
                self._head, self._head_msg_id = (prev_seq + 1, hashlib.sha256(data).hexdigest()), msg_id
            try:
                ack = await fut
            except APIError as e:
                await self._reset(prev_seq + 1)
                if e.err_code in (ERR_WRONG_LAST_SEQ, ERR_WRONG_LAST_MSG_ID):
                    continue
                raise LogAppendError(e.err_code, e.description or "") from None
            except NoStreamResponseError:
                await self._reset(prev_seq + 1)
                raise LogAppendError(None, f"no stream answered (is {self.stream} created?)") from None
            except BaseException:
                await self._reset(prev_seq + 1)
                raise
            if ack.duplicate:
                # Nothing was stored: the optimistic head is wrong.
                await self._reset(prev_seq + 1)
                raw = await self.js.get_msg(self.stream, ack.seq)
                original = self._own_original(ack.seq, raw.subject or "", raw.data or b"", event_type)
                if original is not None:
                    return Appended(ack.seq, original, True)
                # A foreign record took this event's Nats-Msg-Id first (it is predictable):
                # the event is written under one derived from that record's sequence, which a
                # redelivered input derives the same way, so it is still written once.
                msg_id = f"{msg_id}.after-{ack.seq}"
                continue
            if ack.seq != prev_seq + 1:  # pragma: no cover - the server enforces this
                await self._reset(prev_seq + 1)
                raise EventLogError(f"{event_type} stored at {ack.seq}, expected {prev_seq + 1}")
            return Appended(ack.seq, ev, False)
        raise EventLogError(f"could not append {event_type}: the chain head kept moving")

    async def append_chained(
        self,
        event_type: str,
        body: Mapping[str, Any],
        then: Callable[[int, LogEvent], tuple[str, Mapping[str, Any], str]],
        *,
        msg_id: str,
        traceparent: str | None = None,
    ) -> tuple[Appended, Appended]:
        """Two events in one round: ``event_type`` and the event ``then(its sequence, it)`` names
        (``(event_type, body, msg_id)``), a record that must cite the first one's sequence.

        Both are sent back to back under the lock, the second chained onto the first at the
        sequence the server must give it, and their PubAcks awaited together: one round trip
        and the server's two writes back to back instead of two rounds (the gate's
        ``STATE_TRANSITIONED`` and its ``IDP_COMMITMENT_VERIFIED``, spec 003 §5.3, §5.5). The
        same results and errors as two ``append`` calls one after the other: when the first is
        refused for a moved head both are signed again; when it is a duplicate (its original is
        returned), or the second is not stored, the second goes through ``append``, built on
        the first as stored."""
        subject = self.subjects.log(event_type)
        plain = msgspec.to_builtins(dict(body))
        for _attempt in range(50):
            async with self._lock:
                if self._head is None:
                    self._head, self._head_msg_id = await self.head(), None
                prev_seq, prev_digest = self._head
                ev = LogEvent(event_id=msg_id, event_type=event_type, ts=now_rfc3339(), prev_seq=prev_seq,
                              prev_digest=prev_digest, kid=self.key.kid, body=plain)
                data = self._sign(ev, plain=True)
                headers = {"Nats-Msg-Id": msg_id, "Nats-Expected-Last-Sequence": str(prev_seq),
                           "Nats-Expected-Stream": self.stream}
                if self._head_msg_id is not None:  # chained onto this process's own append (``append``)
                    headers["Nats-Expected-Last-Msg-Id"] = self._head_msg_id
                if traceparent:
                    headers["traceparent"] = traceparent
                fut = await self.acks.send(subject, data, headers, self.ack_timeout_s)
                digest = hashlib.sha256(data).hexdigest()
                self._head = (prev_seq + 1, digest)
                type2, body2, msg_id2 = then(prev_seq + 1, ev)
                plain2 = msgspec.to_builtins(dict(body2))
                ev2 = LogEvent(event_id=msg_id2, event_type=type2, ts=now_rfc3339(), prev_seq=prev_seq + 1,
                               prev_digest=digest, kid=self.key.kid, body=plain2)
                data2 = self._sign(ev2, plain=True)
                headers2 = {"Nats-Msg-Id": msg_id2, "Nats-Expected-Last-Sequence": str(prev_seq + 1),
                            "Nats-Expected-Stream": self.stream, "Nats-Expected-Last-Msg-Id": msg_id}
                if traceparent:
                    headers2["traceparent"] = traceparent
                fut2 = await self.acks.send(self.subjects.log(type2), data2, headers2, self.ack_timeout_s)
                self._head, self._head_msg_id = (prev_seq + 2, hashlib.sha256(data2).hexdigest()), msg_id2
            got, got2 = await asyncio.gather(fut, fut2, return_exceptions=True)
            if isinstance(got, BaseException):
                await self._reset(prev_seq + 1)
                if isinstance(got, APIError) and got.err_code in (ERR_WRONG_LAST_SEQ, ERR_WRONG_LAST_MSG_ID):
                    continue
                if isinstance(got, APIError):
                    raise LogAppendError(got.err_code, got.description or "") from None
                if isinstance(got, NoStreamResponseError):
                    raise LogAppendError(None, f"no stream answered (is {self.stream} created?)") from None
                raise got
            if got.duplicate or got.seq != prev_seq + 1:
                # Nothing of the first was stored (the second, chained to it, is refused): the
                # first as ``append`` finds it, then the second built on it.
                await self._reset(prev_seq + 1)
                first = await self.append(event_type, body, msg_id=msg_id, traceparent=traceparent)
                type2, body2, msg_id2 = then(first.seq, first.event)
                return first, await self.append(type2, body2, msg_id=msg_id2, traceparent=traceparent)
            first = Appended(got.seq, ev, False)
            if isinstance(got2, BaseException) or got2.duplicate or got2.seq != prev_seq + 2:
                # The first is stored; the second was not (or was there already): ``append`` decides.
                await self._reset(prev_seq + 2)
                return first, await self.append(type2, body2, msg_id=msg_id2, traceparent=traceparent)
            return first, Appended(got2.seq, ev2, False)
        raise EventLogError(f"could not append {event_type}: the chain head kept moving")

    async def _reset(self, failed_seq: int) -> None:
        """Forget the optimistic head if it still builds on the failed append."""
        async with self._lock:
            if self._head is not None and self._head[0] >= failed_seq:
                self._head, self._head_msg_id = None, None

    def _own_original(self, seq: int, subject: str, data: bytes, event_type: str) -> LogEvent | None:
        """The event stored at ``seq`` under a duplicate's Nats-Msg-Id, if it is the kernel's own
        event of ``event_type``; else None, the record reported as foreign. Its chain link was
        checked when it was appended, so only decoding, subject and signature are checked here."""
        rec = check_record(seq, subject, data, self.keys, self.subjects, None)
        if rec.problem is None and rec.event is not None and rec.event.event_type == event_type:
            return rec.event
        if rec.problem is None:
            rec = LogRecord(seq, subject, data, rec.digest, rec.event,
                            f"holds the Nats-Msg-Id of a {event_type} event but is a {rec.event and rec.event.event_type}")
        self.report_foreign(rec, f"a {event_type} append")
        return None

    async def get(self, seq: int) -> LogEvent:
        raw = await self.js.get_msg(self.stream, seq)
        return log_event_decoder.decode(raw.data)


# ---------------------------------------------------------------------------
# Reading the log: one walk, each record classified (the kernel's own or foreign)
# ---------------------------------------------------------------------------


def record_digest(data: bytes) -> str:
    """The chain link of a stored record: SHA-256 of its bytes (of a kernel event, == ``digest()``)."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class LogRecord:
    """One stored record of the log; ``problem`` is None when it is the kernel's own event."""

    seq: int
    subject: str
    data: bytes
    digest: str
    event: LogEvent | None  # decoded, when it decodes (even if foreign)
    problem: str | None


def check_signature(ev: LogEvent, keys: Mapping[str, Ed25519PublicKey]) -> str | None:
    """None if ``ev`` is signed by a known key, else what is wrong."""
    key = keys.get(ev.kid)
    if key is None:
        return f"signed with unknown kid {ev.kid!r}"
    try:
        key.verify(ev.signature, ev.signing_bytes())
    except (InvalidSignature, ValueError):
        return "bad signature"
    return None


def check_record(
    seq: int, subject: str, data: bytes, keys: Mapping[str, Ed25519PublicKey], subjects: Subjects,
    prev: tuple[int, str] | None,
) -> LogRecord:
    """Classify one stored record: the kernel's own event, or foreign and why.

    ``prev`` is (sequence, digest) of the record stored before it; None when it
    cannot be known (the link is then not checked)."""
    digest = record_digest(data)
    try:
        ev = log_event_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return LogRecord(seq, subject, data, digest, None, f"undecodable: not a kernel event ({e})")

    def foreign(problem: str) -> LogRecord:
        return LogRecord(seq, subject, data, digest, ev, problem)

    try:
        if subject != subjects.log(ev.event_type):
            return foreign(f"event type {ev.event_type!r} published on {subject!r}")
    except ValueError:
        return foreign(f"invalid event type {ev.event_type!r}")
    bad = check_signature(ev, keys)
    if bad:
        return foreign(bad)
    if prev is not None:
        if ev.prev_seq != prev[0]:
            return foreign(f"prev_seq is {ev.prev_seq}, expected {prev[0]}")
        if ev.prev_digest != prev[1]:
            return foreign("prev_digest does not match the digest of the previous record")
    return LogRecord(seq, subject, data, digest, ev, None)


async def walk_log(
    js: JetStreamContext, subjects: Subjects, keys: Mapping[str, Ed25519PublicKey], *,
    stream: str = STREAM, subject: str | None = None, from_seq: int = 1, to_seq: int | None = None,
) -> AsyncIterator[LogRecord]:
    """Every stored record of the log (or of one subject) in [from_seq, to_seq], classified.

    By message get, no consumer (``_iter_stored``), so ops credentials serve. Over the
    whole log each record's link is checked against the record read before it; a
    sequence the server no longer holds is yielded as a record with no data whose
    problem says so, and the next record's link is then not checked. On one subject
    each record's predecessor is read by its sequence."""
    whole = subject is None
    # The whole log is read under every subject: the server stores a message it delivers to a party's reply
    # subject under the message's own subject (pgwcore.msgget.outside), and the next event chains over it; a
    # walk of the log's subjects only read it as a sequence missing, a false gap (found by a docs-only attack).
    # check_record reports such a record as foreign.
    filt = subject or ">"
    prev: tuple[int, str] | None = None
    if whole:
        prev = (0, GENESIS_DIGEST)
        if from_seq > 1:
            try:
                raw = await js.get_msg(stream, from_seq - 1)
                prev = (from_seq - 1, record_digest(raw.data or b""))
            except NotFoundError:
                prev = None
    async with contextlib.aclosing(_iter_stored(js, stream, filt, from_seq, to_seq)) as walk:
        async for seq, subj, data in walk:
            if whole:
                expect = prev[0] + 1 if prev is not None else from_seq
                if prev is not None and seq != expect:
                    yield LogRecord(expect, "", b"", "", None,
                                    f"missing: sequence {expect} is not in the stream (next present: {seq})")
                    prev = None
            else:
                prev = (0, GENESIS_DIGEST) if seq == 1 else None
                if seq > 1:
                    try:
                        raw = await js.get_msg(stream, seq - 1)
                        prev = (seq - 1, record_digest(raw.data or b""))
                    except Exception as e:  # noqa: BLE001 - reported as the record's problem, never raised
                        yield LogRecord(seq, subj, data, record_digest(data), None,
                                        f"predecessor {seq - 1} unreadable: {e}")
                        continue
            rec = check_record(seq, subj, data, keys, subjects, prev)
            prev = (seq, rec.digest)
            yield rec


@dataclass(frozen=True)
class Quarantine:
    """A ``LOG_RECORD_QUARANTINED`` event: the kernel's signed record that ``seq`` is foreign."""

    seq: int  # the foreign record
    sha256: str  # of its stored bytes
    by_seq: int  # the quarantine event
    problem: str
    reason: str | None


async def quarantined(
    js: JetStreamContext, subjects: Subjects, keys: Mapping[str, Ed25519PublicKey], *, stream: str = STREAM,
) -> dict[int, Quarantine]:
    """The foreign records the kernel's own ``LOG_RECORD_QUARANTINED`` events name, by sequence."""
    out: dict[int, Quarantine] = {}
    async for rec in walk_log(js, subjects, keys, stream=stream, subject=subjects.log(QUARANTINED)):
        if rec.problem is None and rec.event is not None:
            b = rec.event.body
            with contextlib.suppress(KeyError, TypeError, ValueError):
                q = Quarantine(seq=int(b["seq"]), sha256=str(b["sha256"]), by_seq=rec.seq,
                               problem=str(b.get("problem") or ""), reason=b.get("reason"))
                out.setdefault(q.seq, q)
    return out


# ---------------------------------------------------------------------------
# Verification (`pgw log verify`)
# ---------------------------------------------------------------------------


@dataclass
class VerifyResult:
    ok: bool
    checked: int
    last_seq: int
    first_break: dict[str, Any] | None = None
    counts: dict[str, int] = field(default_factory=dict)
    problems: list[dict[str, Any]] = field(default_factory=list)
    quarantined: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "last_seq": self.last_seq,
            "first_break": self.first_break,
            "problems": self.problems,
            "quarantined": self.quarantined,
            "counts": self.counts,
        }


async def _iter_stream(js: JetStreamContext, stream: str, subject: str) -> Any:
    """Yield (seq, subject, data) of every message on ``subject`` in stream order."""
    info = await js.stream_info(stream, subjects_filter=subject)
    # With a filter the server lists the matching subjects and their counts.
    if not info.state.messages or not sum((info.state.subjects or {}).values()):
        return
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True)
    try:
        while True:
            msg = await sub.next_msg(timeout=10)
            md = msg.metadata
            yield md.sequence.stream, msg.subject, msg.data
            if md.num_pending == 0:
                return
    finally:
        await sub.unsubscribe()


async def _iter_stored(js: JetStreamContext, stream: str, subject: str, from_seq: int = 1,
                       to_seq: int | None = None) -> Any:
    """Yield (seq, subject, data) of every message on ``subject`` in stream order, by message get.

    No consumer is created: ops credentials may read every stream but create no consumer
    (DESIGN §7), and ``pgw log verify`` must work with them as ``pgw tail`` does. When the filter
    takes every stored message (the whole log), consecutive sequences are read a window at a
    time, a sequence the server no longer holds being skipped (the walk reports the gap);
    otherwise one get of the next message on the subject at a time."""
    info = await js.stream_info(stream, subjects_filter=subject)
    matched = sum((info.state.subjects or {}).values())
    if not info.state.messages or not matched:
        return
    first, last = max(info.state.first_seq, from_seq), min(info.state.last_seq, to_seq or info.state.last_seq)
    if first > last:
        return
    walk = stored_on(js, stream, subject, first, last) if matched < info.state.messages else \
        stored_range(js, stream, first, last)
    async for raw in walk:
        yield raw.seq, raw.subject or "", raw.data or b""


MAX_PROBLEMS = 1000  # listed one by one; past this only counted


async def verify_stream(
    js: JetStreamContext,
    subjects: Subjects,
    keys: Mapping[str, Ed25519PublicKey],
    *,
    stream: str = STREAM,
    subject: str | None = None,
) -> VerifyResult:
    """Walk ``stream`` (or only ``subject``) and report every problem of chain or signature.

    A foreign record that a kernel-signed ``LOG_RECORD_QUARANTINED`` event names,
    with the same SHA-256, is listed as quarantined, not as a problem. With a subject
    filter, each event's predecessor is read by its ``prev_seq`` so the link is still checked.
    """
    result = VerifyResult(ok=True, checked=0, last_seq=0)
    quarantine = await quarantined(js, subjects, keys, stream=stream)
    extra = 0
    async for rec in walk_log(js, subjects, keys, stream=stream, subject=subject):
        result.last_seq = max(result.last_seq, rec.seq)
        if rec.problem is None and rec.event is not None:
            result.counts[rec.event.event_type] = result.counts.get(rec.event.event_type, 0) + 1
            result.checked += 1
            continue
        q = quarantine.get(rec.seq)
        if q is not None and q.sha256 == rec.digest:
            result.quarantined.append({"seq": rec.seq, "subject": rec.subject, "problem": rec.problem,
                                       "quarantined_by": q.by_seq, "reason": q.reason})
            continue
        problem = {"seq": rec.seq, "event_type": rec.event.event_type if rec.event else None,
                   "subject": rec.subject or None, "problem": rec.problem}
        if q is not None:
            problem["problem"] = f"{rec.problem}; the quarantine at {q.by_seq} names other bytes"
        result.ok = False
        if result.first_break is None:
            result.first_break = {k: problem[k] for k in ("seq", "event_type", "problem")}
        if len(result.problems) < MAX_PROBLEMS:
            result.problems.append(problem)
        else:
            extra += 1
    if extra:
        result.problems.append({"seq": None, "event_type": None, "subject": None,
                                "problem": f"{extra} more problem(s) not listed"})
    return result
