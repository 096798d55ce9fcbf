"""The registrar: registers queued capsules with a SCITT Transparency Service (spec 004 §3.2).

A durable pull consumer on ``PGW_REGISTRATION`` (work queue). For each Signed
Statement it speaks SCRAPI (``consumers.scrapi``): ``POST /entries``, then the
receipt is verified (``consumers.receipts``: inclusion proof with the TS's
leaf construction + TS signature with the algorithm pinned per key) BEFORE
anything is reported anchored; the Transparent Statement (receipt in
unprotected label 394) goes to ``capsule.registered`` with ``Nats-Msg-Id`` =
capsule_id, and only then is the queue message acked.

Failures, by kind:

- the TS already holds the statement (``409``, or ``400 Already Registered``
  after a crash between its answer and our ack): the existing entry's receipt
  is fetched, verified and the capsule finished like a fresh one. Never a
  failure, never dead-lettered.
- transient (5xx, 429, timeouts, connection refused: the TS is down or busy):
  the message goes back to the queue and the registrar pauses before the next
  attempt, backing off exponentially to ``registrar.backoff_max_s``. No limit
  on attempts: a TS down for an hour loses nothing and the queue drains when
  it is back (one probe per back-off interval meanwhile, not one per capsule).
- permanent (another 4xx, a receipt that does not verify, a malformed
  statement): nak'ed with back-off; after ``registrar.max_failures`` such
  refusals the statement is written to ``PGW_REGISTRATION_DLQ``
  (``{prefix}.capsule.deadletter``) with the last error, and acked off the queue.

With no ``registrar.ts_url`` the registrar starts, consumes nothing, and says
so: capsules wait in ``capsule.register`` until a TS is configured.

TS keys (``consumers.ts_keys``): ``registrar.ts_public_key`` pins them;
without it, the keys the TS publishes (``jwks`` or ``jwks_uri``) are trusted
on first use and pinned to ``{data_dir}/registrar/ts_keys.json`` (``pgw
verify`` reads it); later runs use the pinned keys, never new ones.
Progress (waiting, retrying, registered, failed): ``pgw capsules status`` and
the ``pgw_registrar_*`` metrics (``consumers.registrar_status``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from typing import TYPE_CHECKING

import aiohttp
import msgspec
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from consumers import capsule_v4
from consumers.cose import CoseError, with_receipt
from consumers.receipts import ReceiptInfo, entry_hash, leaf_kinds, verify_receipt
from consumers.registrar_status import (
    DLQ_STREAM,
    RECEIPT_LEAVES,
    REGISTRATION_STREAM,
    REGISTRATIONS,
    TS_UP,
    WAITING,
)
from consumers.scrapi import AlreadyRegistered, RegistrationError, ScrapiClient
from consumers.ts_keys import (
    TsKey,
    UnsupportedTsKey,
    keys_from_jwks,
    load_ts_key,
    pinned_ts_keys_path,
    read_pinned_ts_keys,
    write_pinned_ts_keys,
)
from consumers.verifier import payload_of
from pgwcore import tracing
from pgwcore.atomic import not_written_by_us
from pgwcore.logs import get_logger
from pgwcore.service import PullService, hand_back
from pgwcore.streams import ensure_stream
from subjects.util import now_rfc3339

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from pgwcore.config import Config

log = get_logger("pgw.registrar")

__all__ = ["DLQ_STREAM", "REGISTRATION_STREAM", "DeadLetter", "Registrar", "RegistrationError",
           "configured_ts_keys", "load_ts_key", "pinned_ts_keys_path", "read_pinned_ts_keys"]


class DeadLetter(msgspec.Struct, omit_defaults=True):
    """What the dead-letter stream keeps for a statement that could not be registered."""

    capsule_id: str | None
    attempts: int
    last_error: str
    ts: str
    ts_url: str
    statement_b64: str


def configured_ts_keys(config: Config) -> dict[str, TsKey]:
    """The TS keys pinned in configuration, or else in the data folder; {} if none yet."""
    rc = config.registrar
    if rc.ts_public_key:
        return load_ts_key(rc.ts_public_key, rc.ts_key_id)
    return read_pinned_ts_keys(config.data_path)


async def discover_ts_keys(client: ScrapiClient) -> dict[str, TsKey]:
    """The keys the TS publishes: inline ``jwks`` or ``jwks_uri`` of its configuration document."""
    doc = await client.configuration()
    if isinstance(doc.get("jwks"), dict):
        return keys_from_jwks(doc["jwks"])
    if isinstance(doc.get("jwks_uri"), str):
        return keys_from_jwks(await client.jwks(doc["jwks_uri"]))
    raise UnsupportedTsKey("the transparency configuration has neither jwks nor jwks_uri; set registrar.ts_public_key")


class Registrar(PullService):
    """The registrar service; its life cycle (start, idempotent ``drain()``, close) is ``PullService``'s."""

    name = "registrar"

    def __init__(self, config: Config, nc: Client) -> None:
        super().__init__(config, nc)
        self.client: ScrapiClient | None = None
        self.ts_keys: dict[str, TsKey] = {}
        self.leaves = leaf_kinds(config.registrar.receipt_leaf)
        self._outage = 0  # consecutive transient failures: the TS is down or busy while > 0
        self._refusals: dict[str, int] = {}  # permanent refusals per statement (in memory: a restart only adds tries)
        self.registered = 0
        self.already_registered = 0
        self.dead_lettered = 0
        self.waiting: int | None = None

    async def start(self) -> None:
        rc = self.config.registrar
        if not rc.ts_url:
            self.waiting = await self._queue_depth()
            log.warning(
                "registrar idle: no Transparency Service configured (set registrar.ts_url); "
                "capsules wait in capsule.register",
                waiting=self.waiting,
            )
            return
        self.client = ScrapiClient(rc.ts_url, timeout_s=rc.http_timeout_s, poll_timeout_s=rc.poll_timeout_s)
        self.ts_keys = configured_ts_keys(self.config)  # a bad configured key fails here, at start
        await self._ensure_dlq()
        self._sub = await self.js.pull_subscribe(
            self.subjects.capsule_register,
            durable=rc.durable,
            stream=REGISTRATION_STREAM,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=rc.http_timeout_s * 2 + rc.poll_timeout_s + 5.0,  # POST, poll, receipt GET
                max_deliver=-1,  # the dead-letter decision is ours, for permanent refusals only
            ),
        )
        TS_UP.set(1)
        self.spawn(self._run(), name="pgw-registrar")
        log.info("registrar started", ts_url=rc.ts_url, pinned_keys=sorted(self.ts_keys),
                 receipt_leaf=rc.receipt_leaf)

    async def close(self) -> None:
        """After the statement in hand is finished (``drain()``): close HTTP."""
        client, self.client = self.client, None
        if client is not None:
            await client.close()

    async def _queue_depth(self) -> int | None:
        try:
            n = (await self.js.stream_info(REGISTRATION_STREAM)).state.messages
        except Exception:  # noqa: BLE001 - only informational
            return None
        WAITING.set(n)
        return n

    async def _ensure_dlq(self) -> None:
        await ensure_stream(self.js, StreamConfig(
            name=DLQ_STREAM, subjects=[f"{self.subjects.prefix}.capsule.deadletter"],
            storage=StorageType.FILE, retention=RetentionPolicy.LIMITS,
        ))

    async def _trusted_keys(self) -> dict[str, TsKey]:
        if self.ts_keys:
            return self.ts_keys
        assert self.client is not None
        keys = await discover_ts_keys(self.client)
        path = write_pinned_ts_keys(self.config.data_path, keys)
        log.warning("trusting the TS's published keys on first use; pinned",
                    kids=sorted(keys), algs=sorted({k.alg_name for k in keys.values()}), file=str(path))
        self.ts_keys = keys
        return keys

    def _backoff(self, n: int) -> float:
        rc = self.config.registrar
        return min(rc.backoff_base_s * 2 ** max(n - 1, 0), rc.backoff_max_s)

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once on drain."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)

    async def _run(self) -> None:
        last_depth = 0.0
        loop = asyncio.get_running_loop()
        while not self.stopping.is_set():
            msgs = await self.fetch(lambda: self._sub.fetch(8, timeout=0.5), log)
            if msgs is None:
                return
            if not msgs:  # none came in time, or a failed fetch was logged
                await self._queue_depth()
                continue
            for i, msg in enumerate(msgs):
                if self.stopping.is_set() or not await self._handle_guarded(msg):
                    for rest in msgs[i + 1:]:  # back to the queue untouched: tried after the pause
                        await rest.nak()
                    break
            if loop.time() - last_depth > 1.0:
                last_depth = loop.time()
                await self._queue_depth()
            if self._outage:
                delay = self._backoff(self._outage)
                log.warning("Transparency Service unavailable; pausing registration", retry_in_s=delay,
                            failures_in_a_row=self._outage)
                await self._pause(delay)

    async def register(self, statement: bytes) -> tuple[bytes, ReceiptInfo, bool]:
        """Register and verify: the receipt is returned only once it verifies; True if the TS held it already."""
        assert self.client is not None
        keys = await self._trusted_keys()
        # Draft -05 {#registration}, {#privacy}: the TS gets the registration statement only (the raw
        # capsule_id), never the capsule JSON that travels beside it on the bus.
        statement = capsule_v4.registration_statement(statement)
        try:
            receipt = await self.client.register(statement)
        except AlreadyRegistered as e:
            receipt, info = await self._existing_receipt(statement, keys, e)
            return receipt, info, True
        return receipt, verify_receipt(receipt, statement, keys, self.leaves), False

    async def _existing_receipt(self, statement: bytes, keys: dict[str, TsKey],
                                e: AlreadyRegistered) -> tuple[bytes, ReceiptInfo]:
        """The receipt of the entry the TS already holds (SCRAPI §2.1.4 Resolve Receipt).

        Where to look: the Location the refusal named, else the configuration's
        ``receipt_endpoint`` template, else ``/entries/{entry_id}``, with the
        entry id of each leaf construction (scittles: the hex SHA-256 of the
        payload). A receipt found is accepted only if it verifies for this statement.
        """
        assert self.client is not None
        urls = [e.location] if e.location else []
        template = f"{self.client.base}/entries/{{entry_id}}"
        try:
            doc = await self.client.configuration()
            if isinstance(doc.get("receipt_endpoint"), str) and "{entry_id}" in doc["receipt_endpoint"]:
                template = self.client.absolute(doc["receipt_endpoint"])
        except RegistrationError:
            pass
        for kind in self.leaves:
            try:
                urls.append(template.replace("{entry_id}", entry_hash(statement, kind).hex()))
            except CoseError:
                continue
        last: CoseError | None = None
        for url in dict.fromkeys(urls):
            receipt = await self.client.receipt_at(url)
            if receipt is None:
                continue
            try:
                return receipt, verify_receipt(receipt, statement, keys, self.leaves)
            except CoseError as err:
                last = err
        if last is not None:
            raise last
        # The TS says it holds the statement but serves no receipt for it yet: retried, never dead-lettered.
        raise RegistrationError(f"the TS answered {e.status} already registered but no receipt was found at "
                                f"{', '.join(dict.fromkeys(urls))}", e.status, transient=True)

    async def _handle_guarded(self, msg: Msg) -> bool:
        """``handle``, with any failure it does not settle itself (e.g. the dead-letter publish timing out
        while a node fails over) logged and the statement handed back: the loop must outlive it."""
        try:
            return await self.handle(msg)
        except Exception:
            log.exception("registering a statement failed; it is left for redelivery",
                          capsule_id=(msg.headers or {}).get("Pgw-Capsule-Id"))
            await hand_back([msg])
            return True

    async def handle(self, msg: Msg) -> bool:
        """Register one statement; False if the TS is unavailable (the caller pauses)."""
        hdrs = msg.headers or {}
        if not hdrs and not_written_by_us(msg.data):
            # An answer of the server's a party aimed at capsule.register (docs/security.md "Replies"): no
            # statement of the signer's (each carries Pgw-Capsule-Id), so nothing to register or dead-letter; it
            # was sent to the Transparency Service, and while the service was down it held the queue.
            log.warning("passed over an answer of the server's stored on capsule.register (no statement)",
                        seq=msg.metadata.sequence.stream if msg.metadata else None)
            with contextlib.suppress(Exception):
                await msg.term()
            return True
        with tracing.span("pgw.registrar.register", hdrs.get("traceparent"),
                          capsule_id=hdrs.get("Pgw-Capsule-Id") or ""):
            return await self._handle(msg, hdrs)

    async def _handle(self, msg: Msg, hdrs: dict[str, str]) -> bool:
        statement = msg.data
        payload = payload_of(statement)
        capsule_id = hdrs.get("Pgw-Capsule-Id") or (payload or {}).get("capsule_id")
        traceparent = hdrs.get("traceparent")
        try:
            receipt, info, existed = await self.register(statement)
        except (RegistrationError, UnsupportedTsKey, aiohttp.ClientError, TimeoutError, OSError) as e:
            # UnsupportedTsKey: the TS publishes no key we can verify with; a configuration problem,
            # not the statement's, so it waits (logged on every probe) instead of being dead-lettered.
            if isinstance(e, RegistrationError) and not e.transient:
                await self._refused(msg, capsule_id, e, traceparent)
                return True
            await self._unavailable(msg, capsule_id, e, traceparent)
            return False
        except (CoseError, ValueError) as e:
            await self._refused(msg, capsule_id, e, traceparent)
            return True
        if self._outage:
            log.info("Transparency Service answers again; registration resumed", after_failures=self._outage)
        self._outage = 0
        TS_UP.set(1)
        transparent = with_receipt(statement, receipt)
        headers = {
            "Nats-Msg-Id": str(capsule_id or info.root.hex()),
            "Pgw-Capsule-Id": str(capsule_id),
            "Pgw-Receipt-Kid": str(info.kid),
            "Pgw-Receipt-Leaf": info.leaf,
            "Pgw-Tree-Size": str(info.tree_size),
            "Pgw-Leaf-Index": str(info.leaf_index),
        }
        if traceparent:
            headers["traceparent"] = traceparent
        try:
            await self.js.publish(self.subjects.capsule_registered, transparent, headers=headers)
        except Exception:
            log.exception("publishing the transparent statement failed; will retry", capsule_id=capsule_id,
                          traceparent=traceparent)
            await msg.nak(delay=1.0)
            return True
        await msg.ack()
        self._refusals.pop(str(capsule_id), None)
        if existed:
            self.already_registered += 1
        self.registered += 1
        REGISTRATIONS.labels("already_registered" if existed else "registered").inc()
        RECEIPT_LEAVES.labels(info.leaf).inc()
        log.info("capsule anchored (receipt verified)", capsule_id=capsule_id, ts_kid=info.kid,
                 tree_size=info.tree_size, leaf_index=info.leaf_index, leaf=info.leaf,
                 already_registered=existed, traceparent=traceparent)
        return True

    async def _unavailable(self, msg: Msg, capsule_id: str | None, err: Exception, traceparent: str | None) -> None:
        """A transient failure: the statement goes back to the queue, however many times it takes."""
        self._outage += 1
        TS_UP.set(0)
        REGISTRATIONS.labels("retry").inc()
        log.warning("registration failed (transient); will retry", capsule_id=capsule_id,
                    attempt=msg.metadata.num_delivered, error=f"{type(err).__name__}: {err}",
                    traceparent=traceparent)
        await msg.nak()

    async def _refused(self, msg: Msg, capsule_id: str | None, err: Exception, traceparent: str | None) -> None:
        rc = self.config.registrar
        key = str(capsule_id or msg.metadata.sequence.stream)
        refusals = self._refusals[key] = self._refusals.get(key, 0) + 1
        why = f"{type(err).__name__}: {err}"
        if refusals >= rc.max_failures:
            record = DeadLetter(capsule_id, refusals, why, now_rfc3339(), rc.ts_url or "",
                                base64.b64encode(msg.data).decode())
            await self.js.publish(
                f"{self.subjects.prefix}.capsule.deadletter", msgspec.json.encode(record),
                headers={"Nats-Msg-Id": f"dlq:{capsule_id}:{msg.metadata.sequence.stream}"},
            )
            await msg.ack()
            self._refusals.pop(key, None)
            self.dead_lettered += 1
            REGISTRATIONS.labels("dead_lettered").inc()
            log.error("registration dead-lettered", capsule_id=capsule_id, attempts=refusals, error=why,
                      traceparent=traceparent)
            return
        delay = self._backoff(refusals)
        REGISTRATIONS.labels("refused").inc()
        log.warning("registration refused; retrying", capsule_id=capsule_id, attempt=refusals,
                    retry_in_s=delay, error=why, traceparent=traceparent)
        await msg.nak(delay=delay)
