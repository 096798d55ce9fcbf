"""The registrar: registers queued capsules with a SCITT Transparency Service (spec 004 §3.2).

A durable pull consumer on ``PGW_REGISTRATION`` (work queue). For each Signed
Statement it speaks SCRAPI (draft-ietf-scitt-scrapi):

- ``GET /.well-known/transparency-configuration`` once, to learn the service;
- ``POST /entries`` with ``Content-Type: application/cose``; a ``201`` carries
  the receipt, a ``202`` or ``303`` names a ``Location`` that is polled
  (``Retry-After`` honoured, capped) until it yields the receipt;
- the receipt is verified (inclusion proof + TS signature, pinned key)
  BEFORE anything is reported anchored; the Transparent Statement (receipt in
  unprotected label 394) goes to ``capsule.registered`` with ``Nats-Msg-Id`` =
  capsule_id, and only then is the queue message acked.

A failed attempt is nak'ed with exponential backoff; after
``registrar.max_failures`` deliveries the statement is written to the
dead-letter stream ``PGW_REGISTRATION_DLQ`` (``{prefix}.capsule.deadletter``)
with the last error, and acked off the queue.

With no ``registrar.ts_url`` the registrar starts, consumes nothing, and says
so: capsules wait in ``capsule.register`` until a TS is configured.

Trusting the TS key: ``registrar.ts_public_key`` (raw hex or a PEM file)
pins it. Without it, the key published in the TS's configuration document is
trusted on first use and pinned to ``{data_dir}/registrar/ts_keys.json``
(``pgw verify`` reads it); later runs use the pinned key, never a new one.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import cbor2
import msgspec
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from consumers.cose import CoseError, ReceiptInfo, TrustedKey, verify_receipt, with_receipt
from consumers.verifier import payload_of
from gateway import micro
from gateway.keys import kid_of
from gateway.logs import get_logger
from gateway.service import stop_pull_loop
from gateway.streams import cluster_replicas
from subjects.errors import PgwError
from subjects.util import now_rfc3339

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from gateway.config import Config

log = get_logger("pgw.registrar")

REGISTRATION_STREAM = "PGW_REGISTRATION"
DLQ_STREAM = "PGW_REGISTRATION_DLQ"
COSE = "application/cose"


class RegistrationError(PgwError):
    """The Transparency Service did not register the statement; ``status`` if it answered."""

    def __init__(self, why: str, status: int | None = None) -> None:
        self.why = why
        self.status = status
        super().__init__(f"registration failed: {why}")


class DeadLetter(msgspec.Struct, omit_defaults=True):
    """What the dead-letter stream keeps for a statement that could not be registered."""

    capsule_id: str | None
    attempts: int
    last_error: str
    ts: str
    ts_url: str
    statement_b64: str


def load_ts_key(spec: str) -> TrustedKey:
    """A TS public key from raw hex (64 digits) or a PEM file path."""
    s = spec.strip()
    if len(s) == 64 and all(c in "0123456789abcdefABCDEF" for c in s):
        pub = Ed25519PublicKey.from_public_bytes(bytes.fromhex(s))
    else:
        loaded = serialization.load_pem_public_key(Path(s).expanduser().read_bytes())
        if not isinstance(loaded, Ed25519PublicKey):
            raise PgwError(f"TS key {s} is not an Ed25519 public key")
        pub = loaded
    return TrustedKey(kid_of(pub), pub, role="ts")


def pinned_ts_keys_path(data_dir: Path) -> Path:
    return Path(data_dir) / "registrar" / "ts_keys.json"


def read_pinned_ts_keys(data_dir: Path) -> dict[str, TrustedKey]:
    p = pinned_ts_keys_path(data_dir)
    if not p.exists():
        return {}
    out = {}
    for kid, hexkey in json.loads(p.read_text()).items():
        out[kid] = TrustedKey(kid, Ed25519PublicKey.from_public_bytes(bytes.fromhex(hexkey)), role="ts")
    return out


def _write_pinned(data_dir: Path, keys: dict[str, TrustedKey]) -> None:
    p = pinned_ts_keys_path(data_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    raw = {
        k: v.public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
        for k, v in keys.items()
    }
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(raw, indent=2))
    os.chmod(tmp, 0o644)
    tmp.replace(p)


def keys_from_configuration(doc: Any) -> dict[str, TrustedKey]:
    """Ed25519 keys from a transparency-configuration document's ``jwks``."""
    out: dict[str, TrustedKey] = {}
    jwks = doc.get("jwks") if isinstance(doc, dict) else None
    for jwk in (jwks or {}).get("keys", []) if isinstance(jwks, dict) else []:
        if not isinstance(jwk, dict) or jwk.get("kty") != "OKP" or jwk.get("crv") != "Ed25519":
            continue
        x = jwk.get("x", "")
        pub = Ed25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(x + "=" * (-len(x) % 4)))
        kid = jwk.get("kid") or kid_of(pub)
        out[kid] = TrustedKey(kid, pub, role="ts")
    return out


class ScrapiClient:
    """The SCRAPI calls the registrar needs, over one aiohttp session."""

    def __init__(self, base_url: str, *, timeout_s: float, poll_timeout_s: float) -> None:
        self.base = base_url.rstrip("/")
        self.poll_timeout_s = poll_timeout_s
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def close(self) -> None:
        await self.session.close()

    async def configuration(self) -> Any:
        async with self.session.get(f"{self.base}/.well-known/transparency-configuration",
                                    headers={"Accept": "application/cbor, application/json"}) as r:
            if r.status != 200:
                raise RegistrationError(f"transparency-configuration answered {r.status}", r.status)
            body = await r.read()
            if "json" in r.headers.get("Content-Type", ""):
                return json.loads(body)
            return cbor2.loads(body)

    async def register(self, statement: bytes) -> bytes:
        """POST /entries; return the receipt bytes (following 202/303 by polling)."""
        async with self.session.post(f"{self.base}/entries", data=statement,
                                     headers={"Content-Type": COSE, "Accept": COSE},
                                     allow_redirects=False) as r:
            body = await r.read()
            if r.status == 201 and body:
                return body
            if r.status in (201, 202, 303) and r.headers.get("Location"):
                return await self._poll(self._abs(r.headers["Location"]), _retry_after(r))
            raise RegistrationError(f"POST /entries answered {r.status}: {_short(body)}", r.status)

    def _abs(self, loc: str) -> str:
        return loc if loc.startswith(("http://", "https://")) else f"{self.base}/{loc.lstrip('/')}"

    async def _poll(self, url: str, wait: float) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.poll_timeout_s
        while True:
            await asyncio.sleep(min(wait, 5.0))
            if loop.time() > deadline:
                raise RegistrationError(f"no receipt from {url} within {self.poll_timeout_s}s")
            async with self.session.get(url, headers={"Accept": COSE}, allow_redirects=False) as r:
                body = await r.read()
                if r.status in (200, 201) and r.headers.get("Content-Type", "").startswith(COSE) and body:
                    return body
                if r.status in (301, 302, 303, 307) and r.headers.get("Location"):
                    url, wait = self._abs(r.headers["Location"]), 0.0
                    continue
                if r.status in (200, 202, 404):  # still running (404: entry not yet visible)
                    wait = _retry_after(r)
                    continue
                raise RegistrationError(f"polling {url} answered {r.status}: {_short(body)}", r.status)


def _retry_after(r: aiohttp.ClientResponse) -> float:
    try:
        return max(0.0, float(r.headers.get("Retry-After", "0.2")))
    except ValueError:
        return 0.2


def _short(body: bytes) -> str:
    return body[:200].decode("utf-8", "replace")


class Registrar:
    """The registrar service: an async context manager with an idempotent ``drain()``."""

    name = "registrar"

    def __init__(self, config: Config, nc: Client) -> None:
        self.config = config
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = config.subjects
        self.client: ScrapiClient | None = None
        self.ts_keys: dict[str, TrustedKey] = {}
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.registered = 0
        self.dead_lettered = 0
        self.waiting: int | None = None

    async def __aenter__(self) -> Registrar:
        self._micro = await micro.register(self.nc, "registrar", self.config)  # nats micro ls (issue 8)
        rc = self.config.registrar
        if not rc.ts_url:
            self.waiting = await self._queue_depth()
            log.warning(
                "registrar idle: no Transparency Service configured (set registrar.ts_url); "
                "capsules wait in capsule.register",
                waiting=self.waiting,
            )
            return self
        self.client = ScrapiClient(rc.ts_url, timeout_s=rc.http_timeout_s, poll_timeout_s=rc.poll_timeout_s)
        if rc.ts_public_key:
            k = load_ts_key(rc.ts_public_key)
            self.ts_keys = {k.kid: k}
        else:
            self.ts_keys = read_pinned_ts_keys(self.config.data_path)
        await self._ensure_dlq()
        self._sub = await self.js.pull_subscribe(
            self.subjects.capsule_register,
            durable=rc.durable,
            stream=REGISTRATION_STREAM,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=rc.http_timeout_s + rc.poll_timeout_s + 10.0,
                max_deliver=-1,  # the dead-letter decision is ours, after max_failures
            ),
        )
        self._task = asyncio.create_task(self._run(), name="pgw-registrar")
        log.info("registrar started", ts_url=rc.ts_url, pinned_keys=sorted(self.ts_keys))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()

    async def drain(self) -> None:
        """Stop fetching, finish the statement in hand, close HTTP. Idempotent."""
        await micro.unregister(getattr(self, "_micro", None))
        self._micro = None
        task, self._task = self._task, None
        sub, self._sub = self._sub, None
        await stop_pull_loop(self._stopping, task, sub)
        client, self.client = self.client, None
        if client is not None:
            await client.close()

    async def _queue_depth(self) -> int | None:
        try:
            return (await self.js.stream_info(REGISTRATION_STREAM)).state.messages
        except Exception:  # noqa: BLE001 - only informational
            return None

    async def _ensure_dlq(self) -> None:
        try:
            await self.js.stream_info(DLQ_STREAM)
        except NotFoundError:
            await self.js.add_stream(StreamConfig(
                name=DLQ_STREAM, subjects=[f"{self.subjects.prefix}.capsule.deadletter"],
                storage=StorageType.FILE, retention=RetentionPolicy.LIMITS,
                num_replicas=await cluster_replicas(self.js),  # R3 in a cluster, like the rest
            ))

    async def _trusted_keys(self) -> dict[str, TrustedKey]:
        if self.ts_keys:
            return self.ts_keys
        assert self.client is not None
        doc = await self.client.configuration()
        keys = keys_from_configuration(doc)
        if not keys:
            raise RegistrationError("the TS configuration publishes no Ed25519 key and none is configured")
        _write_pinned(self.config.data_path, keys)
        log.warning("trusting the TS's published key on first use; pinned",
                    kids=sorted(keys), file=str(pinned_ts_keys_path(self.config.data_path)))
        self.ts_keys = keys
        return keys

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                msgs = await self._sub.fetch(8, timeout=0.5)
            except (TimeoutError, NatsTimeoutError):
                continue
            except Exception:
                if self._stopping.is_set() or self.nc.is_closed:
                    return
                log.exception("fetch failed; retrying")
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await self.handle(msg)

    async def register(self, statement: bytes) -> tuple[bytes, ReceiptInfo]:
        """Register and verify: the receipt is returned only once it verifies."""
        assert self.client is not None
        keys = await self._trusted_keys()
        receipt = await self.client.register(statement)
        info = verify_receipt(receipt, statement, keys)
        return receipt, info

    async def handle(self, msg: Msg) -> None:
        statement = msg.data
        hdrs = msg.headers or {}
        payload = payload_of(statement)
        capsule_id = hdrs.get("Pgw-Capsule-Id") or (payload or {}).get("capsule_id")
        try:
            receipt, info = await self.register(statement)
        except (RegistrationError, CoseError, aiohttp.ClientError, TimeoutError, ValueError) as e:
            await self._failed(msg, capsule_id, e, hdrs.get("traceparent"))
            return
        transparent = with_receipt(statement, receipt)
        headers = {
            "Nats-Msg-Id": str(capsule_id or info.root.hex()),
            "Pgw-Capsule-Id": str(capsule_id),
            "Pgw-Receipt-Kid": str(info.kid),
            "Pgw-Tree-Size": str(info.tree_size),
            "Pgw-Leaf-Index": str(info.leaf_index),
        }
        if hdrs.get("traceparent"):
            headers["traceparent"] = hdrs["traceparent"]
        try:
            await self.js.publish(self.subjects.capsule_registered, transparent, headers=headers)
        except Exception:
            log.exception("publishing the transparent statement failed; will retry", capsule_id=capsule_id,
                          traceparent=hdrs.get("traceparent"))
            await msg.nak(delay=1.0)
            return
        await msg.ack()
        self.registered += 1
        log.info("capsule anchored (receipt verified)", capsule_id=capsule_id, ts_kid=info.kid,
                 tree_size=info.tree_size, leaf_index=info.leaf_index, traceparent=hdrs.get("traceparent"))

    async def _failed(self, msg: Msg, capsule_id: str | None, err: Exception, traceparent: str | None) -> None:
        rc = self.config.registrar
        attempts = msg.metadata.num_delivered
        why = f"{type(err).__name__}: {err}"
        if attempts >= rc.max_failures:
            record = DeadLetter(capsule_id, attempts, why, now_rfc3339(), rc.ts_url or "",
                                base64.b64encode(msg.data).decode())
            await self.js.publish(
                f"{self.subjects.prefix}.capsule.deadletter", msgspec.json.encode(record),
                headers={"Nats-Msg-Id": f"dlq:{capsule_id}:{msg.metadata.sequence.stream}"},
            )
            await msg.ack()
            self.dead_lettered += 1
            log.error("registration dead-lettered", capsule_id=capsule_id, attempts=attempts, error=why,
                      traceparent=traceparent)
            return
        delay = min(rc.backoff_base_s * 2 ** (attempts - 1), rc.backoff_max_s)
        log.warning("registration failed; retrying", capsule_id=capsule_id, attempt=attempts,
                    retry_in_s=delay, error=why, traceparent=traceparent)
        await msg.nak(delay=delay)
