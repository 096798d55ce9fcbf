"""Web Push: RFC 8291 message encryption (``aes128gcm``, RFC 8188) and the RFC 8030 request.

Written on ``cryptography`` directly, step by step as RFC 8291 §3.3-3.4 and
RFC 8188 §2 state them, so that the test suite can prove it against an
independent implementation (Martin Thomson's reference ``http_ece`` for
Node.js decrypts what this module encrypts: tests/ece_peer.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

import aiohttp
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from consumers.notify.vapid import VapidKey, b64url_decode

RECORD_SIZE = 4096  # RFC 8291 §4: push services must accept at least 4096 bytes of payload
MAX_PLAINTEXT = RECORD_SIZE - 16 - 1 - 86  # one record: tag, delimiter, header (RFC 8291 §4: 3993)


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def encrypt(plaintext: bytes, ua_public: bytes, auth_secret: bytes, *,
            as_private: ec.EllipticCurvePrivateKey | None = None, salt: bytes | None = None) -> bytes:
    """The ``aes128gcm`` body of a push message for the user agent's keys (RFC 8291 §3-4).

    ``as_private`` and ``salt`` are fresh per message unless given (tests only).
    """
    if len(plaintext) > MAX_PLAINTEXT:
        raise ValueError(f"push payload of {len(plaintext)} bytes exceeds {MAX_PLAINTEXT} (RFC 8291 §4)")
    as_private = as_private or ec.generate_private_key(ec.SECP256R1())
    salt = salt or os.urandom(16)
    ua_key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), ua_public)
    as_public = as_private.public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    ecdh_secret = as_private.exchange(ec.ECDH(), ua_key)
    # RFC 8291 §3.4: combine the ECDH secret with the auth secret.
    prk_key = _hmac(auth_secret, ecdh_secret)
    key_info = b"WebPush: info\x00" + ua_public + as_public
    ikm = _hmac(prk_key, key_info + b"\x01")
    # RFC 8188 §2.2-2.3: content-encryption key and nonce from the salt.
    prk = _hmac(salt, ikm)
    cek = _hmac(prk, b"Content-Encoding: aes128gcm\x00\x01")[:16]
    nonce = _hmac(prk, b"Content-Encoding: nonce\x00\x01")[:12]
    # One record, the last: plaintext then the delimiter 0x02 (RFC 8188 §2, RFC 8291 §4), no padding.
    ciphertext = AESGCM(cek).encrypt(nonce, plaintext + b"\x02", None)
    # RFC 8188 §2.1 header: salt(16) | rs(uint32) | idlen(1) | keyid (= as_public, RFC 8291 §4).
    header = salt + struct.pack("!IB", RECORD_SIZE, len(as_public)) + as_public
    return header + ciphertext


@dataclass(frozen=True)
class PushResult:
    """``sent``; ``gone`` (404/410: drop the subscription); ``retry``; ``failed`` (permanent)."""

    outcome: str
    status: int | None
    detail: str
    retry_after_s: float | None = None


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None  # an HTTP date: the back-off decides


async def send(session: aiohttp.ClientSession, *, endpoint: str, p256dh: str, auth: str, payload: bytes,
               vapid: VapidKey, subject: str, ttl_s: int, topic: str | None, timeout_s: float) -> PushResult:
    """POST one encrypted message to the push resource (RFC 8030 §5) with VAPID (RFC 8292 §3)."""
    body = encrypt(payload, b64url_decode(p256dh), b64url_decode(auth))
    headers = {
        "TTL": str(ttl_s),  # RFC 8030 §5.2
        "Urgency": "high",  # RFC 8030 §5.3: a person is waiting on this
        "Content-Encoding": "aes128gcm",  # RFC 8291 §4
        "Content-Type": "application/octet-stream",
        "Authorization": vapid.authorization(endpoint, subject),
    }
    if topic:
        headers["Topic"] = topic  # RFC 8030 §5.4: a repeat replaces the undelivered one
    try:
        async with session.post(endpoint, data=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s), allow_redirects=False) as r:
            text = (await r.text(errors="replace"))[:300]
            status = r.status
            retry_after = _retry_after(r.headers.get("Retry-After"))
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return PushResult("retry", None, f"{type(e).__name__}: {e}"[:300])
    if 200 <= status < 300:
        return PushResult("sent", status, "")
    if status in (404, 410):  # RFC 8030 §7.3: the subscription has expired or was removed
        return PushResult("gone", status, text)
    if status in (408, 425, 429) or status >= 500:
        return PushResult("retry", status, text, retry_after)
    return PushResult("failed", status, text)  # 400, 401/403 (VAPID), 413 (too large): not better later
