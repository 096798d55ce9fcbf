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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import jwt
import msgspec
from cryptography.hazmat.primitives.asymmetric import ed25519

from pgwcore.logs import get_logger
from pgwcore.streams import ensure_kv
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

    async def start(self, queue: str) -> None:
        self.kv = await ensure_kv(self.kernel.js, BUCKET)
        self._watcher = await self.kv.watchall()
        ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._watch(ready), name="kernel-revocations")
        # Every revocation already in the bucket is applied before the kernel takes a request.
        await asyncio.wait_for(ready, 30)
        self._sub = await self.kernel.nc.subscribe(revoke_subject(self.kernel.subjects.prefix), queue=queue, cb=self._on_request)

    async def _watch(self, ready: asyncio.Future[None]) -> None:
        async for entry in self._watcher:
            if entry is None:  # the initial values are all delivered
                if not ready.done():
                    ready.set_result(None)
                continue
            if not entry.value:
                continue
            try:
                rec = msgspec.json.decode(entry.value, type=Revoked)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.error("unreadable revocation entry", key=entry.key)
                continue
            if rec.jti not in self.verifier.live_revoked:
                self.verifier.live_revoked.add(rec.jti)
                log.info("mandate revoked", jti=rec.jti, revoked_by=rec.revoked_by)
        if not ready.done():
            ready.set_result(None)

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
        ev = await self.kernel.eventlog.append(EVENT, body, msg_id=stable_id(EVENT, jti))
        rec = Revoked(jti=jti, revoked_by=kid, ts=now_rfc3339(), reason=reason, event_seq=ev.seq)
        await self.kv.put(revocation_key(jti), msgspec.json.encode(rec))
        self.verifier.live_revoked.add(jti)
        log.info("mandate revocation recorded", jti=jti, revoked_by=kid, event_seq=ev.seq, duplicate=ev.duplicate)
        return RevokeReply(ok=True, jti=jti, event_seq=ev.seq, already=ev.duplicate)
        if not self.kernel.responder.admits(msg):
            return
