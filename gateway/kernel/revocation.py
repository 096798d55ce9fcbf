"""Live mandate revocation: a revocation list in the bus, honoured by every gateway at once.

``kernel.revoked_jtis`` (TOML) still works, but takes a restart of every
gateway. The live list is the KV bucket ``PGW_REVOKED``: one key per revoked
jti (its digest; the value holds the jti, who revoked it, when and why).

* ``pgw mandate revoke JTI`` sends a ``RevokeRequest`` to
  ``{prefix}.kernel.revoke``. Its token is a compact JWS (EdDSA or ES256)
  signed by a key the kernel trusts: a mandate issuer (``kernel.issuers``,
  the dev issuer) or a configured revoker (``kernel.revokers``), with claims
  ``{"revoke_jti", "iat", "reason"?}``; a token older than
  ``kernel.clock_skew_s`` + 300 s is refused (a replayed request revokes
  nothing new anyway). Who revoked is the signing key's kid, and the token
  itself is kept.
* The kernel that takes the request logs ``MANDATE_REVOKED`` (signed,
  chained; ``Nats-Msg-Id`` by jti, so revoking twice logs once), writes the
  bucket, and only then answers.
* Every kernel watches the bucket (a KV watch is pushed by the server, well
  under a second) and adds each jti to its verifier's live set; the verifier
  answers ``MANDATE_REVOKED`` for it from then on (gateway/kernel/mandate.py).

The bucket is the fast path between instances; the signed, hash-chained event
log is the authority (spec 003 §8.2: only the kernel writes it, and signs
what it writes). A KV bucket is state a single publish can change: a
message with ``KV-Operation: PURGE`` (with or without ``Nats-Rollup``) on a
key, or a plain delete, removes a revocation from it. So at start each kernel
reads the kernel's own ``MANDATE_REVOKED`` events through the log's one walk
(``eventlog.walk_log``; a foreign record on that subject is reported and not
trusted) and holds every one of those jtis revoked whatever the bucket says.
A revocation the log holds and the bucket does not (absent, deleted, purged,
overwritten), at start or while watching, is logged as a security warning and
written back, so instances and tools that read the bucket see it again. No
bucket change ever takes a jti out of the live set; a revocation only in the
bucket is still honoured (refusing is the safe side).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import jwt
import msgspec
from cryptography.hazmat.primitives.asymmetric import ed25519
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KV_DEL, KV_PURGE

from gateway.kernel.eventlog import walk_log
from pgwcore.kvread import kv_last_seq
from pgwcore.logs import get_logger
from pgwcore.streams import ensure_kv, retrying
from subjects.kernelops import RevokeReply, revoke_request_decoder, revoke_subject
from subjects.util import now_rfc3339, stable_id
from subjects.wire import Refusal

log = get_logger("pgw.kernel.revocation")

BUCKET = "PGW_REVOKED"
EVENT = "MANDATE_REVOKED"
MAX_AGE_S = 300


class Revoked(msgspec.Struct, kw_only=True):
    jti: str
    revoked_by: str
    ts: str
    reason: str | None = None
    event_seq: int | None = None


def revocation_key(jti: str) -> str:
    return stable_id("revoked", jti)


def sign_revocation(private_key: Any, kid: str, jti: str, *, reason: str | None = None, now: float | None = None) -> str:
    claims: dict[str, Any] = {"revoke_jti": jti, "iat": int(now if now is not None else time.time())}
    if reason:
        claims["reason"] = reason
    alg = "EdDSA" if isinstance(private_key, ed25519.Ed25519PrivateKey) else "ES256"
    return jwt.encode(claims, private_key, algorithm=alg, headers={"kid": kid, "typ": "pgw-revocation"})


class RevocationError(Exception):
    def __init__(self, code: str, reason: str) -> None:
        self.code, self.reason = code, reason
        super().__init__(f"{code}: {reason}")


class Revocations:
    """The live revocation list of one kernel: the bucket's watcher and the revoke endpoint."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.verifier = kernel.mandates
        self.kv: Any = None
        self._watcher: Any = None
        self._task: asyncio.Task[None] | None = None
        self._sub: Any = None
        # bucket key -> the revocation the kernel holds (the log's, its own, or the bucket's)
        self._known: dict[str, Revoked] = {}
        self._in_bucket: set[str] = set()  # known keys the bucket was last seen to hold
        self._upto = 0  # the bucket's last sequence when the watch began (0: it held nothing)

    async def start(self, queue: str) -> None:
        self.kv = await ensure_kv(self.kernel.js, BUCKET)
        # Read like a stream being opened: asked again while JetStream does not answer (a cluster electing
        # its leaders after a node's restart), not a failed start.
        for rec in (await retrying(self.logged, "the revocations in the event log", 60.0)).values():
            self._hold(rec)
        # nats-py's watcher may signal "initial values done" before an entry already delivered reaches it,
        # so the kernel is ready when the bucket's last entry as it stood before the watch has been seen.
        # The bucket's last entry, not the stream's last message: one stored under another subject (a party's
        # outcome the server delivered to a reply subject in the bucket, pgwcore.msgget.outside) never reaches
        # the watch, and every later start failed waiting for it (found by a docs-only attack).
        # Asked again while the stream's leader is elected (a node restarted): as the log's read above.
        self._upto = await retrying(lambda: kv_last_seq(self.kernel.js, BUCKET),
                                    "the revocation bucket's last entry", 60.0)
        self._watcher = await self.kv.watchall()
        ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._watch(ready), name="kernel-revocations")
        # Every revocation already in the bucket is applied before the kernel takes a request.
        await asyncio.wait_for(ready, 30)
        for key, rec in list(self._known.items()):
            if key not in self._in_bucket:  # not even a marker: gone with a rollup, or never written
                await self._restore(key, rec, None, "absent")
        self._sub = await self.kernel.gw.rnc.subscribe(revoke_subject(self.kernel.subjects.prefix), queue=queue, cb=self._on_request)

    async def logged(self) -> dict[str, Revoked]:
        """Every revocation the kernel's own ``MANDATE_REVOKED`` events hold, by jti (the first event of each)."""
        el = self.kernel.eventlog
        out: dict[str, Revoked] = {}
        async for rec in walk_log(el.js, el.subjects, el.keys, stream=el.stream, subject=el.subjects.log(EVENT)):
            if rec.problem is not None or rec.event is None:
                el.report_foreign(rec, "the revocations of the event log")
                continue
            b = rec.event.body
            jti = b.get("jti")
            if isinstance(jti, str) and jti and jti not in out:
                reason = b.get("reason")
                out[jti] = Revoked(jti=jti, revoked_by=str(b.get("revoked_by") or ""), ts=rec.event.ts,
                                   reason=reason if isinstance(reason, str) else None, event_seq=rec.seq)
        log.info("revocations read from the event log", revoked=len(out))
        return out

    def _hold(self, rec: Revoked) -> None:
        self._known.setdefault(revocation_key(rec.jti), rec)
        if rec.jti not in self.verifier.live_revoked:
            self.verifier.live_revoked.add(rec.jti)
            log.info("mandate revoked", jti=rec.jti, revoked_by=rec.revoked_by)

    async def _watch(self, ready: asyncio.Future[None]) -> None:
        async for entry in self._watcher:
            if entry is None:  # "initial values done": trusted only for a bucket that held nothing
                if not ready.done() and not self._upto:
                    ready.set_result(None)
                continue
            try:
                await self._seen(entry)
            except Exception:  # the watch must go on: one entry is logged, not the end of revocations
                log.exception("could not handle a revocation bucket entry", key=entry.key)
            if not ready.done() and entry.revision >= self._upto:
                ready.set_result(None)
        if not ready.done():
            ready.set_result(None)

    async def _seen(self, entry: Any) -> None:
        key = entry.key
        rec: Revoked | None = None
        if entry.value and entry.operation not in (KV_DEL, KV_PURGE):
            try:
                rec = msgspec.json.decode(entry.value, type=Revoked)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.error("unreadable revocation entry", key=key)
        if rec is not None and revocation_key(rec.jti) == key:
            self._hold(rec)
            self._in_bucket.add(key)
            return
        if rec is not None:  # a jti stored under another jti's key: revoked all the same (the safe side)
            self._hold(rec)
        held = self._known.get(key)
        if held is None:
            return
        self._in_bucket.add(key)
        what = entry.operation if entry.operation in (KV_DEL, KV_PURGE) else "overwritten"
        await self._restore(key, held, entry.revision, what)

    async def _restore(self, key: str, rec: Revoked, revision: int | None, what: str) -> None:
        """Write back a revocation the bucket lost; the mandate stayed revoked all along."""
        log.warning(
            "security: the revocation bucket lost a revocation the event log holds; the mandate stays revoked "
            "and the key is written back", jti=rec.jti, key=key, bucket=what, event_seq=rec.event_seq,
            alert_trigger="REVOCATION_BUCKET_TAMPERED",
        )
        data = msgspec.json.encode(rec)
        try:
            if revision is None:
                await self.kv.put(key, data)
            else:  # only over what was seen: of several kernels watching, one writes it back
                await self.kv.update(key, data, last=revision)
        except KeyWrongLastSequenceError:
            pass
        except Exception:
            log.exception("could not write a revocation back to the bucket; it is still honoured here", jti=rec.jti)

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _on_request(self, msg: Any) -> None:
        if not self.kernel.responder.admits(msg):
            return
        try:
            reply = await self.revoke(msg.data)
        except RevocationError as e:
            reply = RevokeReply(ok=False, refusal=Refusal(code=e.code, reason=e.reason))
        except Exception:
            log.exception("revocation failed")
            reply = RevokeReply(ok=False, refusal=Refusal(code="KERNEL_UNAVAILABLE", reason="the revocation was not recorded"))
        await self.kernel.responder.answer(msg, msgspec.json.encode(reply))

    def _verify(self, token: str) -> tuple[str, dict[str, Any]]:
        keys = {**self.verifier.keys, **self.verifier.revoker_keys}
        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise RevocationError("REVOCATION_INVALID", "the revocation is not a well-formed JWS") from None
        kid, alg = header.get("kid"), header.get("alg")
        key = keys.get(kid) if isinstance(kid, str) else None
        if key is None:
            raise RevocationError("REVOCATION_UNAUTHORIZED", "the revocation is not signed by a trusted issuer or revoker")
        if alg not in ("EdDSA", "ES256") or (alg == "EdDSA") != isinstance(key, ed25519.Ed25519PublicKey):
            raise RevocationError("REVOCATION_INVALID", "the revocation algorithm does not match the signer's key")
        try:
            # iat is checked below, with kernel.clock_skew_s of grace both ways; PyJWT's own iat
            # check has none, and refused a revoker whose clock ran a second ahead.
            claims = jwt.decode(token, key, algorithms=[alg], leeway=self.kernel.cfg.clock_skew_s,
                                options={"verify_aud": False, "verify_iat": False, "require": ["revoke_jti", "iat"]})
        except jwt.InvalidTokenError as e:
            raise RevocationError("REVOCATION_INVALID", f"the revocation does not verify: {e}") from None
        jti, iat = claims.get("revoke_jti"), claims.get("iat")
        if not isinstance(jti, str) or not jti or len(jti) > 256:
            raise RevocationError("REVOCATION_INVALID", "revoke_jti must be a non-empty string of at most 256 characters")
        if not isinstance(iat, int | float) or isinstance(iat, bool) or abs(time.time() - iat) > MAX_AGE_S + self.kernel.cfg.clock_skew_s:
            raise RevocationError("REVOCATION_INVALID", "the revocation's iat is too old or in the future")
        return kid, claims

    async def revoke(self, data: bytes) -> RevokeReply:
        try:
            req = revoke_request_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise RevocationError("REQUEST_MALFORMED", f"a revocation request is {{\"token\": JWS}}: {e}") from None
        kid, claims = self._verify(req.token)
        jti = claims["revoke_jti"]
        reason = claims.get("reason") if isinstance(claims.get("reason"), str) else None
        body = {"jti": jti, "revoked_by": kid, "reason": reason, "token": req.token}
        # spec 002 SR-1: MANDATE_REVOKED is kept for good (the log denies delete), the bucket and the start's
        # log line name the jti: a secret in the jti or the reason (or so in the signed token) is refused.
        if (await self.kernel.gw.stage_state.get()).redactor.holding(body):
            raise RevocationError("REVOCATION_INVALID", "the revocation's jti or reason holds a secret (a configured "
                                  "secret or a secret: token); the log keeps it for good: sign it again without it")
        ev = await self.kernel.eventlog.append(EVENT, body, msg_id=stable_id(EVENT, jti))
        rec = Revoked(jti=jti, revoked_by=kid, ts=now_rfc3339(), reason=reason, event_seq=ev.seq)
        self._hold(rec)
        await self.kv.put(revocation_key(jti), msgspec.json.encode(rec))
        log.info("mandate revocation recorded", jti=jti, revoked_by=kid, event_seq=ev.seq, duplicate=ev.duplicate)
        return RevokeReply(ok=True, jti=jti, event_seq=ev.seq, already=ev.duplicate)
