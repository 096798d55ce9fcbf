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

``verify_stream`` walks the stream (or one subject) and reports the first
break: an undecodable entry, a bad or unknown-key signature, a wrong
``prev_seq`` or ``prev_digest``, an event whose subject does not match its type.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError

from pgwcore.atomic import ERR_WRONG_LAST_SEQ, AckInbox
from pgwcore.keys import SigningKey
from pgwcore.logs import get_logger
from pgwcore.msgget import stored_on, stored_range
from subjects import jcs
from subjects.errors import PgwError
from subjects.idp import GENESIS_DIGEST, LogEvent, b64url, log_event_decoder
from subjects.names import Subjects
from subjects.util import now_rfc3339

log = get_logger("pgw.kernel.eventlog")

STREAM = "PGW_EVENTLOG"


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

    def __init__(self, nc: Client, subjects: Subjects, key: SigningKey, *, stream: str = STREAM) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.key = key
        self._sign_bytes = fast_signer(key)
        self.stream = stream
        self._lock = asyncio.Lock()
        self._head: tuple[int, str] | None = None
        self.ack_timeout_s = 10.0
        # The PubAcks' inbox: the connection's request inbox (send_acked) until its owner
        # starts it (KernelService: one of the kernel's own, shared with its KernelState).
        self.acks = AckInbox(nc)

    async def head(self) -> tuple[int, str]:
        """(last sequence, digest of the last event) as the server has it now."""
        info = await self.js.stream_info(self.stream)
        last = info.state.last_seq or 0
        if last == 0:
            return 0, GENESIS_DIGEST
        raw = await self.js.get_msg(self.stream, last)
        return last, log_event_decoder.decode(raw.data).digest()

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
        for _attempt in range(50):
            async with self._lock:
                if self._head is None:
                    self._head = await self.head()
                prev_seq, prev_digest = self._head
                ev = LogEvent(
                    event_id=event_id or msg_id,
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
                if traceparent:
                    headers["traceparent"] = traceparent
                # Sent now, in order on this connection; the ack is awaited outside the lock.
                fut = await self.acks.send(subject, data, headers, self.ack_timeout_s)
                # == ev.digest(), without canonicalizing twice
                self._head = (prev_seq + 1, hashlib.sha256(data).hexdigest())
            try:
                ack = await fut
            except APIError as e:
                await self._reset(prev_seq + 1)
                if e.err_code == ERR_WRONG_LAST_SEQ:
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
                return Appended(ack.seq, log_event_decoder.decode(raw.data), True)
            if ack.seq != prev_seq + 1:  # pragma: no cover - the server enforces this
                await self._reset(prev_seq + 1)
                raise EventLogError(f"{event_type} stored at {ack.seq}, expected {prev_seq + 1}")
            return Appended(ack.seq, ev, False)
        raise EventLogError(f"could not append {event_type}: the chain head kept moving")

    async def _reset(self, failed_seq: int) -> None:
        """Forget the optimistic head if it still builds on the failed append."""
        async with self._lock:
            if self._head is not None and self._head[0] >= failed_seq:
                self._head = None

    async def get(self, seq: int) -> LogEvent:
        raw = await self.js.get_msg(self.stream, seq)
        return log_event_decoder.decode(raw.data)


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "last_seq": self.last_seq,
            "first_break": self.first_break,
            "counts": self.counts,
        }


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


async def _iter_stored(js: JetStreamContext, stream: str, subject: str) -> Any:
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
    first, last = info.state.first_seq, info.state.last_seq
    walk = stored_on(js, stream, subject, first, last) if matched < info.state.messages else \
        stored_range(js, stream, first, last)
    async for raw in walk:
        yield raw.seq, raw.subject or "", raw.data or b""


async def verify_stream(
    js: JetStreamContext,
    subjects: Subjects,
    keys: Mapping[str, Ed25519PublicKey],
    *,
    stream: str = STREAM,
    subject: str | None = None,
) -> VerifyResult:
    """Walk ``stream`` (or only ``subject``) and report the first break of chain or signature.

    With a subject filter, each event's predecessor is fetched by its
    ``prev_seq`` so the chain link is still checked.
    """
    whole = subject is None
    filt = subject or f"{subjects.prefix}.log.>"
    result = VerifyResult(ok=True, checked=0, last_seq=0)
    # aclosing: a break returns mid-walk, and the walk's consumer must be gone before
    # the caller closes the connection (else "Task exception was never retrieved").
    async with contextlib.aclosing(_iter_stored(js, stream, filt)) as walk:
        return await _walk(walk, js, subjects, keys, stream, whole, result)


async def _walk(
    walk: Any, js: JetStreamContext, subjects: Subjects, keys: Mapping[str, Ed25519PublicKey],
    stream: str, whole: bool, result: VerifyResult,
) -> VerifyResult:
    prev: tuple[int, str] | None = (0, GENESIS_DIGEST) if whole else None

    def brk(seq: int, problem: str, event_type: str | None = None) -> VerifyResult:
        result.ok = False
        result.first_break = {"seq": seq, "event_type": event_type, "problem": problem}
        return result

    async for seq, subj, data in walk:
        if whole and prev is not None and seq != prev[0] + 1:
            # A sequence the server no longer returns (lost or cut from its store): the
            # break is that sequence, not the next event whose link then fails.
            return brk(prev[0] + 1, f"missing: sequence {prev[0] + 1} is not in the stream (next present: {seq})")
        result.last_seq = seq
        try:
            ev = log_event_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return brk(seq, f"undecodable event: {e}")
        result.counts[ev.event_type] = result.counts.get(ev.event_type, 0) + 1
        try:
            if subj != subjects.log(ev.event_type):
                return brk(seq, f"event type {ev.event_type!r} published on {subj!r}", ev.event_type)
        except ValueError:
            return brk(seq, f"invalid event type {ev.event_type!r}", ev.event_type)
        bad = check_signature(ev, keys)
        if bad:
            return brk(seq, bad, ev.event_type)
        if whole:
            assert prev is not None
            expect_seq, expect_digest = prev
        else:
            expect_seq = seq - 1
            if expect_seq == 0:
                expect_digest = GENESIS_DIGEST
            else:
                try:
                    raw = await js.get_msg(stream, expect_seq)
                    expect_digest = log_event_decoder.decode(raw.data).digest()
                except Exception as e:  # noqa: BLE001 - reported as a break, never raised
                    return brk(seq, f"predecessor {expect_seq} unreadable: {e}", ev.event_type)
        if ev.prev_seq != expect_seq:
            return brk(seq, f"prev_seq is {ev.prev_seq}, expected {expect_seq}", ev.event_type)
        if ev.prev_digest != expect_digest:
            return brk(seq, "prev_digest does not match the digest of the previous event", ev.event_type)
        prev = (seq, ev.digest())
        result.checked += 1
    return result
