"""The signer's ledger: a hash chain over every statement it signs (spec 004 §5.3 ``chained``).

Kept in its own stream ``PGW_SIGNER_LEDGER`` (subject
``{prefix}.signer.ledger.{verdict_id}``); see :mod:`consumers.signer` for how
the signer uses it. Position *n* is the stream sequence; a run of links is
appended with ``Nats-Expected-Last-Sequence`` = the head it was chained onto,
so concurrent signers cannot fork the chain. Each entry stores the exact
signed payload, so a redelivered verdict is re-signed byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from consumers import capsule as cap_mod
from consumers import profiles
from consumers.capsule import Ledger, ledger_entry_hash
from consumers.cose import sign_statement
from pgwcore.atomic import ERR_ATOMIC_DISABLED, ERR_WRONG_LAST_SEQ, enable_atomic, publish_atomic
from pgwcore.keys import SigningKey
from pgwcore.logs import get_logger
from pgwcore.msgget import stored_on
from pgwcore.streams import ensure_stream
from subjects.errors import PgwError
from subjects.wire import Verdict

if TYPE_CHECKING:
    from nats.aio.msg import Msg

LEDGER_STREAM = "PGW_SIGNER_LEDGER"
REGISTRATION_STREAM = "PGW_REGISTRATION"


class LedgerEntry(msgspec.Struct, frozen=True):
    """One link of the signer's hash chain; ``payload`` is exactly what was signed."""

    position: int
    verdict_id: str
    capsule_id: str
    prev_hash: str
    hash: str
    payload: str


_entry_decoder = msgspec.json.Decoder(LedgerEntry)
log = get_logger("pgw.signer")


def _entry_of(data: bytes | None, seq: int) -> LedgerEntry | None:
    """The signer's link stored at ``seq``, or None (with a warning) for a record it did not write (an empty one
    included: ``pgwcore.atomic.not_written_by_us``; nats-py reads it as None)."""
    try:
        return _entry_decoder.decode(data or b"")
    except msgspec.DecodeError:
        log.warning("a record of PGW_SIGNER_LEDGER is no link of the signer's; passed over", seq=seq)
        return None


@dataclass
class _Head:
    seq: int
    hash: str
    capsule_id: str | None


@dataclass(eq=False)
class _Job:
    """One verdict on its way to a capsule."""

    msg: Msg | None
    verdict: Verdict
    entry: LedgerEntry | None = None
    status: str = "new"
    built: cap_mod.Built | None = None
    statement: bytes = b""
    parent_vid: str | None = None  # a supersedes parent built in the same batch, linked first
    profile: Any = None  # the consumers.profiles.Profile that built ``built``
    ack_with: _Job | None = None  # an outcome statement's action job: one ack for both (§3.3)
    # Signing in the workers (signer.workers): the run's statements, this job's at sign_index,
    # awaited when the batch is stored, so the next batch is built while this one is signed.
    signing: asyncio.Future[list[bytes]] | None = None
    sign_index: int = 0


def claims_for(payload: Mapping[str, Any]) -> dict[Any, Any]:
    """§3.1 CWT claims (label 15) of a payload, as the profile it names defines them."""
    return profiles.profile_of(payload).claims(payload)


def sign_payload(payload_json: bytes, key: SigningKey, payload: Mapping[str, Any] | None = None) -> bytes:
    """COSE_Sign1 over the statement payload bytes with the signer's key.

    ``payload``: the same payload already decoded (the body it was encoded from),
    where the caller has it; the claims are read from it instead of decoding again.
    The claims and content type come from the profile the payload itself names
    (its ``format_version``), so a ledger entry re-signed after a change of
    ``signer.capsule_format`` is the same statement as before.
    """
    exact = payload is None  # decoded here from the very bytes signed
    if payload is None:
        payload = msgspec.json.decode(payload_json)
    prof = profiles.profile_of(payload)
    if prof.sign is not None:
        return prof.sign(payload_json, payload if exact else None, key)
    return sign_statement(payload_json, key.private, key.kid, prof.claims(payload), prof.content_type(payload))


class LedgerMixin:
    """The ledger methods of :class:`consumers.signer.Signer` (state lives on the signer)."""

    js: Any
    nc: Any
    subjects: Any
    config: Any
    key: SigningKey | None
    _head: _Head | None
    _atomic_ledger: bool
    _atomic_register: bool
    _timeout: float
    pool: Any  # consumers.signer_pool.SigningPool | None

    def _ledger_subject(self, verdict_id: str) -> str:
        return f"{self.subjects.prefix}.signer.ledger.{verdict_id}"

    async def _ensure_ledger(self) -> None:
        await ensure_stream(self.js, StreamConfig(
            name=LEDGER_STREAM,
            subjects=[f"{self.subjects.prefix}.signer.ledger.*"],
            storage=StorageType.FILE,
            retention=RetentionPolicy.LIMITS,
            duplicate_window=self.config.signer.ledger_duplicate_window_s,
            deny_delete=True,
            deny_purge=True,
            allow_atomic=True,
        ))
        # Both streams take a batch per fetched batch of verdicts; a stream made before this
        # (or by an operator) gets the additive allow_atomic flag, or the signer goes one by one.
        self._atomic_ledger = await enable_atomic(self.js, LEDGER_STREAM)
        self._atomic_register = await enable_atomic(self.js, REGISTRATION_STREAM)

    async def _lookup(self, verdict_id: str) -> LedgerEntry | None:
        subject = self._ledger_subject(verdict_id)
        try:
            raw = await self.js.get_last_msg(LEDGER_STREAM, subject)
        except NotFoundError:
            return None
        entry = _entry_of(raw.data, raw.seq)
        if entry is not None or not raw.seq:
            return entry
        # A record that is no link, aimed at the subject after the verdict's link (a party's reply subject,
        # docs/security.md "Replies"), hid the link: a child superseding the verdict waited for it for ever, and a
        # redelivery linked the verdict twice (a review). The subject's last link before it.
        found = None
        async for m in stored_on(self.js, LEDGER_STREAM, subject, 1, raw.seq - 1):
            found = _entry_of(m.data, m.seq) or found
        return found

    async def _read_head(self) -> _Head:
        """The link to chain onto: the stream's last sequence (the next link's position is the one after it,
        and its append expects it), with the hash and capsule of the last link the signer wrote.

        A record that is no link of the signer's is passed over: a party's JetStream publish with a
        ``signer.ledger.*`` subject as its reply subject makes nats-server store its acknowledgement here
        (docs/security.md "Replies"), and the stream denies deletes. Before, the head was read from the
        last record alone, and one such publish stopped all signing for good. The chain stays whole across
        it (``consumers.ledger_check`` reports it as a foreign record)."""
        info = await self.js.stream_info(LEDGER_STREAM)
        last = info.state.last_seq
        if not last:
            return _Head(0, cap_mod.GENESIS_HASH, None)
        for seq in range(last, (info.state.first_seq or 1) - 1, -1):
            try:
                raw = await self.js.get_msg(LEDGER_STREAM, seq)
            except NotFoundError:
                continue
            if (e := _entry_of(raw.data, seq)) is not None:
                return _Head(last, e.hash, e.capsule_id)
        return _Head(last, cap_mod.GENESIS_HASH, None)  # no link yet, only foreign records

    @staticmethod
    def _link(head: _Head, job: _Job, linked_ids: dict[str, str]) -> tuple[LedgerEntry, _Head]:
        """The ledger entry for ``job``'s capsule right after ``head`` (§5.3 chained), and the new head.

        ``linked_ids``: verdict id -> capsule_id of the capsules linked before
        this one in the same run (where an in-batch supersedes parent is found).
        """
        assert job.built is not None
        parent = None
        if job.parent_vid is not None:
            parent = linked_ids.get(job.parent_vid)
            if parent is None:  # the parent was not linked before it: leave the run for redelivery
                raise PgwError(f"supersedes parent {job.parent_vid} not linked before its child")
        position = head.seq + 1
        prof = job.profile or profiles.profile_of(job.built.body)  # the profile that built it links it
        linked, payload = prof.link(
            job.built, Ledger(position=position, prev_hash=head.hash, prev_capsule_id=head.capsule_id), parent
        )
        chain = msgspec.to_builtins(linked.chain) if linked.chain else None
        h = ledger_entry_hash(position, linked.capsule_id, chain, head.hash)
        vid = job.verdict.verdict_id
        entry = LedgerEntry(position, vid, linked.capsule_id, head.hash, h, payload.decode())
        linked_ids[vid] = linked.capsule_id
        return entry, _Head(position, h, linked.capsule_id)

    async def _append_jobs(self, jobs: list[_Job]) -> None:
        """Append the jobs' capsules to the ledger as one chained run; set each job's entry.

        One atomic batch whose first message carries ``Nats-Expected-Last-Sequence``
        = the head we chained onto: either every link lands right after it, in
        order, or none does. Another signer having appended first (wrong last
        sequence) means re-reading the head; a verdict it signed meanwhile is
        taken from the ledger as it stands.
        """
        pending = list(jobs)
        linked_ids: dict[str, str] = {}
        for _ in range(100):
            if not pending:
                return
            if not self._atomic_ledger:
                for job in pending:
                    job.entry, job.status = await self._append(job, linked_ids)
                return
            head = self._head or await self._read_head()
            entries, last = [], head
            run_ids = dict(linked_ids)
            for job in pending:
                entry, last = self._link(last, job, run_ids)
                entries.append(entry)
            items = [(self._ledger_subject(e.verdict_id), msgspec.json.encode(e), {"Nats-Msg-Id": e.verdict_id})
                     for e in entries]
            commit = asyncio.ensure_future(publish_atomic(
                self.nc, items, timeout=self._timeout, first_headers={"Nats-Expected-Last-Sequence": str(head.seq)}))
            # Sign while the run is being stored; a signature over a link that does not land is
            # simply dropped (nothing is published before the ledger holds its entry). With signing
            # workers the statements are awaited only when the batch is stored (Signer._publish_jobs).
            signing: asyncio.Future[list[bytes]] | None = None
            statements: list[bytes] = []
            try:
                if self.pool is not None:
                    signing = asyncio.ensure_future(self.pool.sign([e.payload.encode() for e in entries]))
                else:
                    statements = await self._sign_yielding(entries, [j.built.body for j in pending])
            except BaseException as e:
                # Nothing is published: the run's verdicts are redelivered and re-signed from the
                # ledger. Whether the run is stored is not known on a cancel: re-read the head.
                self._head = None
                if isinstance(e, Exception):
                    with contextlib.suppress(Exception):
                        await commit
                else:
                    commit.cancel()
                raise
            try:
                ack = await commit
            except APIError as e:
                self._head = None
                if signing is not None:  # the run is not stored as signed: nothing of it goes out
                    signing.cancel()
                if e.err_code == ERR_WRONG_LAST_SEQ:
                    found = await asyncio.gather(*(self._lookup(j.verdict.verdict_id) for j in pending))
                    still = []
                    for job, existing in zip(pending, found, strict=True):
                        if existing is None:
                            still.append(job)
                        else:
                            job.entry, job.status = existing, "replayed"
                            linked_ids[job.verdict.verdict_id] = existing.capsule_id
                    pending = still
                    continue
                if e.err_code == ERR_ATOMIC_DISABLED:
                    self._atomic_ledger = False
                # A verdict already in the ledger (it reached the stream twice) refuses the whole
                # batch: append one at a time, which settles each duplicate on its own.
                for job in pending:
                    job.entry, job.status = await self._append(job, linked_ids)
                return
            except BaseException:
                self._head = None  # unanswered: the run may or may not be stored
                if signing is not None:
                    signing.cancel()
                raise
            if ack.seq != last.seq:  # cannot happen with the expected-sequence header; be loud
                self._head = None
                if signing is not None:
                    signing.cancel()
                raise PgwError(f"ledger run ended at {ack.seq}, expected {last.seq}")
            self._head = last
            for i, (job, entry) in enumerate(zip(pending, entries, strict=True)):
                job.entry, job.status = entry, "new"
                if signing is not None:
                    job.signing, job.sign_index = signing, i
                else:
                    job.statement = statements[i]
            return
        raise PgwError("ledger append kept losing the race; giving up for this delivery")

    async def _sign_yielding(self, entries: list[LedgerEntry], bodies: list[dict[str, Any]]) -> list[bytes]:
        """Sign the entries' payloads, handing the loop a turn every few signatures.

        The turns let the ledger run's messages go out (nats-py writes from its
        flusher task) and the previous batch's acks come in while this CPU
        work goes on.
        """
        assert self.key is not None
        out: list[bytes] = []
        for i, (e, body) in enumerate(zip(entries, bodies, strict=True)):
            if i % 8 == 0:
                await asyncio.sleep(0)
            out.append(sign_payload(e.payload.encode(), self.key, body))
        return out

    async def _append(self, job: _Job, linked_ids: dict[str, str]) -> tuple[LedgerEntry, str]:
        """Append one link (the one-at-a-time path: duplicates, streams without atomic batches).

        ``linked_ids`` gets the verdict's capsule_id, as stored, for a child later in the batch.
        """
        verdict_id = job.verdict.verdict_id
        entry, status = await self._append_one(job, linked_ids)
        linked_ids[verdict_id] = entry.capsule_id
        return entry, status

    async def _append_one(self, job: _Job, linked_ids: dict[str, str]) -> tuple[LedgerEntry, str]:
        verdict_id = job.verdict.verdict_id
        for _ in range(100):
            head = self._head or await self._read_head()
            entry, new_head = self._link(head, job, dict(linked_ids))
            try:
                ack = await self.js.publish(
                    self._ledger_subject(verdict_id),
                    msgspec.json.encode(entry),
                    stream=LEDGER_STREAM,
                    headers={"Nats-Msg-Id": verdict_id, "Nats-Expected-Last-Sequence": str(head.seq)},
                )
            except APIError as e:
                if e.err_code == ERR_WRONG_LAST_SEQ:
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
            if ack.seq != new_head.seq:  # cannot happen with the expected-sequence header; be loud
                self._head = None
                raise PgwError(f"ledger position {ack.seq} != expected {new_head.seq}")
            self._head = new_head
            return entry, "new"
        raise PgwError("ledger append kept losing the race; giving up for this delivery")
