"""The signer: one signed Agent Action Capsule for every verdict (spec 004, DESIGN §6).

A durable pull consumer on ``PGW_VERDICTS``. For each verdict:

1. look the verdict up in the signer's ledger (see below); if it was already
   signed (a redelivery after a crash), reuse the recorded payload verbatim;
2. otherwise build the capsule (:func:`consumers.capsule.capsule_from_verdict`),
   append a ledger entry for it, and use that;
3. sign the payload as a COSE_Sign1 (Ed25519 is deterministic, so the same
   payload gives the same bytes) and publish it to ``capsule.register`` with
   ``Nats-Msg-Id`` = capsule_id, waiting for the PubAck;
4. only then ack the verdict.

The ledger (§5.3 ``ledger_mode: chained``) is a hash chain over every capsule
the signer signed, kept in its own stream ``PGW_SIGNER_LEDGER`` (subject
``{prefix}.signer.ledger.{verdict_id}``). Position *n* is the stream
sequence; an entry is appended with ``Nats-Expected-Last-Sequence`` = *n-1*
(so concurrent signers cannot fork the chain: the loser re-reads the head and
retries) and ``Nats-Msg-Id`` = verdict_id. The entry stores the complete
signed payload, so the chain position is assigned once per verdict: a
redelivered verdict finds its entry (by subject, which survives any dedup
window) and is re-signed from the stored payload, byte for byte.

Residual: if the signer dies after publishing a capsule but before acking the
verdict, and the verdict is redelivered only after ``PGW_REGISTRATION``'s
duplicate window (``gateway.duplicate_window_s``) has passed, the repeat
publish is not deduplicated; the repeat is byte-identical and carries the
same capsule_id, so consumers can still drop it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, NotFoundError

from consumers import capsule as cap_mod
from consumers.capsule import CapsuleError, Ledger, ledger_entry_hash
from consumers.cose import sign_statement
from gateway import micro
from gateway.keys import SigningKey, load_or_create
from gateway.logs import get_logger
from gateway.service import stop_pull_loop
from gateway.streams import cluster_replicas
from subjects.errors import PgwError
from subjects.wire import Verdict, verdict_decoder

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from gateway.config import Config

log = get_logger("pgw.signer")

LEDGER_STREAM = "PGW_SIGNER_LEDGER"
VERDICT_STREAM = "PGW_VERDICTS"
_WRONG_LAST_SEQ = 10071  # JSStreamWrongLastSequenceErr


class LedgerEntry(msgspec.Struct, frozen=True):
    """One link of the signer's hash chain; ``payload`` is exactly what was signed."""

    position: int
    verdict_id: str
    capsule_id: str
    prev_hash: str
    hash: str
    payload: str


_entry_decoder = msgspec.json.Decoder(LedgerEntry)


@dataclass
class _Head:
    seq: int
    hash: str
    capsule_id: str | None


def load_or_create_salt(path: Path) -> str:
    """The per-tenant salt (§13), 32 random bytes as hex, created 0600 on first use."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PgwError(f"salt file {path} has mode {mode:o}; it must be 0600")
    return path.read_text().strip()


def salt_path(config: Config) -> Path:
    if config.signer.tenant_salt_file:
        return Path(config.signer.tenant_salt_file).expanduser()
    return config.data_path / "signer" / "tenant_salt"


def claims_for(payload: dict[str, Any]) -> dict[Any, Any]:
    """§3.1 CWT claims (label 15); the capsule_* set is closed."""
    return {
        1: payload["developer"],
        2: cap_mod.subject_urn(payload["operator"], payload["action_id"]),
        "capsule_statement_type": "agent_action",
        "capsule_action_type": payload["action_type"],
        "capsule_decision_id": payload.get("decision_id") or payload["action_id"],
    }


def sign_payload(payload_json: bytes, key: SigningKey) -> bytes:
    """COSE_Sign1 over the capsule payload bytes with the signer's key."""
    payload = msgspec.json.decode(payload_json)
    return sign_statement(payload_json, key.private, key.kid, claims_for(payload), cap_mod.MEDIA_TYPE)


class Signer:
    """The signer service: an async context manager with an idempotent ``drain()``."""

    name = "signer"

    def __init__(self, config: Config, nc: Client) -> None:
        self.config = config
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = config.subjects
        self.key: SigningKey | None = None
        self.salt = ""
        self._head: _Head | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._sub: Any = None
        self.signed = 0
        self._progress = asyncio.Condition()

    # -- life cycle ---------------------------------------------------------
    async def __aenter__(self) -> Signer:
        self._micro = await micro.register(self.nc, "signer", self.config)  # nats micro ls (issue 8)
        self.key = load_or_create(self.config.data_path, "signer")
        self.salt = load_or_create_salt(salt_path(self.config))
        await self._ensure_ledger()
        sc = self.config.signer
        self._sub = await self.js.pull_subscribe(
            self.subjects.all_verdicts,
            durable=sc.durable,
            stream=VERDICT_STREAM,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=sc.ack_wait_s,
                max_deliver=-1,  # a verdict is never dropped: every verdict gets its capsule
                max_ack_pending=sc.batch * 4,
            ),
        )
        self._task = asyncio.create_task(self._run(), name="pgw-signer")
        log.info("signer started", kid=self.key.kid, durable=sc.durable)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()

    async def drain(self) -> None:
        """Stop fetching, finish the batch in hand, release the subscription. Idempotent."""
        await micro.unregister(getattr(self, "_micro", None))
        self._micro = None
        task, self._task = self._task, None
        sub, self._sub = self._sub, None
        await stop_pull_loop(self._stopping, task, sub)

    async def wait_signed(self, n: int, timeout: float | None = None) -> None:
        """Wait until this instance has stored ``n`` capsules (tests, benchmarks)."""
        async with self._progress:
            await asyncio.wait_for(self._progress.wait_for(lambda: self.signed >= n), timeout)

    # -- the loop -----------------------------------------------------------
    async def _run(self) -> None:
        batch = self.config.signer.batch
        while not self._stopping.is_set():
            try:
                msgs = await self._sub.fetch(batch, timeout=0.5)
            except (TimeoutError, NatsTimeoutError):
                continue
            except Exception:
                if self._stopping.is_set() or self.nc.is_closed:
                    return
                log.exception("fetch failed; retrying")
                await asyncio.sleep(0.5)
                continue
            # Ledger appends stay sequential (they build the chain); the capsule publishes of a
            # batch then run concurrently, each verdict acked after its own capsule's PubAck.
            prepared = [p for p in [await self._prepare(m) for m in msgs] if p is not None]
            await asyncio.gather(*(self._publish(*p) for p in prepared))

    async def handle(self, msg: Msg) -> None:
        """Turn one verdict message into one capsule; ack only after the capsule is stored."""
        prepared = await self._prepare(msg)
        if prepared is not None:
            await self._publish(*prepared)

    async def _prepare(self, msg: Msg) -> tuple[Msg, Verdict, bytes, str, str] | None:
        try:
            verdict = verdict_decoder.decode(msg.data)
        except (msgspec.DecodeError, ValueError) as e:
            # Not a verdict at all: there is no action to record. Kept out of the loop, loudly.
            log.error("undecodable verdict message terminated", subject=msg.subject, error=str(e))
            await msg.term()
            return None
        try:
            statement, capsule_id, status = await self.sign_verdict(verdict, msg)
        except _ParentPending as e:
            await msg.nak(delay=min(0.2 * e.deliveries, 2.0))
            return None
        except CapsuleError:
            log.exception("capsule construction refused; verdict left for redelivery",
                          verdict_id=verdict.verdict_id)
            await msg.nak(delay=5.0)
            return None
        except Exception:
            log.exception("signing failed; verdict left for redelivery", verdict_id=verdict.verdict_id)
            await msg.nak(delay=1.0)
            return None
        return msg, verdict, statement, capsule_id, status

    async def _publish(self, msg: Msg, verdict: Verdict, statement: bytes, capsule_id: str, status: str) -> None:
        headers = {"Nats-Msg-Id": capsule_id, "Pgw-Capsule-Id": capsule_id, "Pgw-Verdict-Id": verdict.verdict_id}
        if verdict.traceparent:
            headers["traceparent"] = verdict.traceparent
        try:
            ack = await self.js.publish(self.subjects.capsule_register, statement, headers=headers)
        except Exception:
            log.exception("capsule publish failed; verdict left for redelivery", verdict_id=verdict.verdict_id)
            await msg.nak(delay=1.0)
            return
        await msg.ack()
        self.signed += 1
        async with self._progress:
            self._progress.notify_all()
        log.info("capsule signed", verdict_id=verdict.verdict_id, capsule_id=capsule_id,
                 verdict_class=verdict.verdict_class, ledger=status, duplicate=bool(ack.duplicate))

    async def sign_verdict(self, verdict: Verdict, msg: Msg | None = None) -> tuple[bytes, str, str]:
        """(statement bytes, capsule_id, "new" | "replayed") for ``verdict``."""
        assert self.key is not None
        # A first delivery cannot have been signed before, except when the same verdict reached
        # the stream twice; the ledger's Msg-Id dedup (window: signer.ledger_duplicate_window_s)
        # catches that case in _append. Redeliveries look the verdict up by subject, which has
        # no window at all.
        first = msg is not None and msg.metadata.num_delivered == 1
        entry = None if first else await self._lookup(verdict.verdict_id)
        status = "replayed"
        if entry is None:
            parent = None
            if verdict.supersedes:
                pentry = await self._lookup(verdict.supersedes)
                if pentry is not None:
                    parent = pentry.capsule_id
                else:
                    deliveries = msg.metadata.num_delivered if msg is not None else 1
                    if msg is not None and deliveries < self.config.signer.parent_wait_deliveries:
                        raise _ParentPending(deliveries)
                    log.warning("superseded parent never signed; capsule carries no chain",
                                verdict_id=verdict.verdict_id, parent_verdict=verdict.supersedes)
            capsule = cap_mod.capsule_from_verdict(
                verdict,
                operator=self.config.operator,
                salt=self.salt,
                default_developer=self.config.signer.developer,
                authority=self.config.signer.authority,
                parent_capsule_id=parent,
                fallback_ts=_stream_time(msg),
            )
            entry, status = await self._append(verdict.verdict_id, capsule)
        payload = entry.payload.encode()
        return sign_payload(payload, self.key), entry.capsule_id, status

    # -- the ledger ---------------------------------------------------------
    def _ledger_subject(self, verdict_id: str) -> str:
        return f"{self.subjects.prefix}.signer.ledger.{verdict_id}"

    async def _ensure_ledger(self) -> None:
        try:
            await self.js.stream_info(LEDGER_STREAM)
        except NotFoundError:
            await self.js.add_stream(StreamConfig(
                name=LEDGER_STREAM,
                subjects=[f"{self.subjects.prefix}.signer.ledger.*"],
                storage=StorageType.FILE,
                retention=RetentionPolicy.LIMITS,
                duplicate_window=self.config.signer.ledger_duplicate_window_s,
                deny_delete=True,
                deny_purge=True,
                num_replicas=await cluster_replicas(self.js),  # R3 in a cluster, like the rest
            ))

    async def _lookup(self, verdict_id: str) -> LedgerEntry | None:
        try:
            raw = await self.js.get_last_msg(LEDGER_STREAM, self._ledger_subject(verdict_id))
        except NotFoundError:
            return None
        return _entry_decoder.decode(raw.data)

    async def _read_head(self) -> _Head:
        info = await self.js.stream_info(LEDGER_STREAM)
        last = info.state.last_seq
        if not last:
            return _Head(0, cap_mod.GENESIS_HASH, None)
        raw = await self.js.get_msg(LEDGER_STREAM, last)
        e = _entry_decoder.decode(raw.data)
        return _Head(last, e.hash, e.capsule_id)

    async def _append(self, verdict_id: str, capsule: cap_mod.Capsule) -> tuple[LedgerEntry, str]:
        for _ in range(100):
            head = self._head or await self._read_head()
            position = head.seq + 1
            linked = cap_mod.attach_ledger(
                capsule, Ledger(position=position, prev_hash=head.hash, prev_capsule_id=head.capsule_id)
            )
            cap_mod.ready_to_sign(linked)
            chain = msgspec.to_builtins(linked.chain) if linked.chain else None
            h = ledger_entry_hash(position, linked.capsule_id, chain, head.hash)
            entry = LedgerEntry(position, verdict_id, linked.capsule_id, head.hash, h, linked.to_json().decode())
            try:
                ack = await self.js.publish(
                    self._ledger_subject(verdict_id),
                    msgspec.json.encode(entry),
                    stream=LEDGER_STREAM,
                    headers={"Nats-Msg-Id": verdict_id, "Nats-Expected-Last-Sequence": str(head.seq)},
                )
            except APIError as e:
                if e.err_code == _WRONG_LAST_SEQ:
                    # Another signer appended (perhaps this very verdict): re-read and retry.
                    # The server checks the expected sequence before the Msg-Id dedup.
                    self._head = None
                    existing = await self._lookup(verdict_id)
                    if existing is not None:
                        return existing, "replayed"
                    continue
                raise
            if ack.duplicate:
                self._head = None
                raw = await self.js.get_msg(LEDGER_STREAM, ack.seq)
                return _entry_decoder.decode(raw.data), "replayed"
            if ack.seq != position:  # cannot happen with the expected-sequence header; be loud
                self._head = None
                raise PgwError(f"ledger position {ack.seq} != expected {position}")
            self._head = _Head(position, h, linked.capsule_id)
            return entry, "new"
        raise PgwError("ledger append kept losing the race; giving up for this delivery")


def _stream_time(msg: Msg | None) -> str | None:
    """The verdict's JetStream storage time: fixed for every redelivery of the message."""
    if msg is None:
        return None
    try:
        return msg.metadata.timestamp.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    except Exception:  # noqa: BLE001 - only a fallback
        return None


class _ParentPending(Exception):
    def __init__(self, deliveries: int) -> None:
        self.deliveries = deliveries
