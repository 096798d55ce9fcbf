"""The notifier's VAPID key (RFC 8292) and the ES256 JWT that identifies it to push services.

One P-256 key pair per deployment, made on first start and kept like the
project's other keys (``pgwcore/keys.py``): a PEM file created 0600 in a 0700
folder, ``{data_dir}/keys/vapid/vapid.pem``, refused when group/world
readable, never logged. Browsers bind a push subscription to the public key
they were given (``applicationServerKey``), so the key is never rotated
silently: a new key means every subscription must be made again.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from pgwcore.identity import write_private
from pgwcore.keys import MissingKeyError
from subjects.errors import PgwError

VAPID_JWT_LIFETIME_S = 12 * 3600  # RFC 8292 §2: exp MUST NOT be more than 24 hours ahead


class VapidKeyError(PgwError):
    """The VAPID key file is unreadable, not P-256 or not private."""


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64url_decode(text: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError("not a string")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def vapid_key_path(data_dir: Path, keys_dir: Path | None = None) -> Path:
    return (Path(keys_dir) if keys_dir else Path(data_dir) / "keys") / "vapid" / "vapid.pem"


@dataclass(frozen=True)
class VapidKey:
    private: ec.EllipticCurvePrivateKey
    path: Path

    @property
    def public_raw(self) -> bytes:
        """The uncompressed P-256 point (65 bytes): the browser's ``applicationServerKey``."""
        return self.private.public_key().public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)

    @property
    def public_b64url(self) -> str:
        return b64url(self.public_raw)

    def __repr__(self) -> str:  # never print the private key
        return f"VapidKey(public={self.public_b64url!r}, path={str(self.path)!r})"

    def authorization(self, endpoint: str, subject: str, *, now: float | None = None) -> str:
        """The ``Authorization`` header for a push to ``endpoint`` (RFC 8292 §3.1 ``vapid`` scheme).

        The JWT (RFC 8292 §2): ES256, ``aud`` = the push resource's origin,
        ``exp`` 12 h ahead (at most 24 h allowed), ``sub`` = a contact URI.
        """
        parts = urlsplit(endpoint)
        aud = f"{parts.scheme}://{parts.netloc}"
        claims = {"aud": aud, "exp": int((now or time.time()) + VAPID_JWT_LIFETIME_S), "sub": subject}
        token = jwt.encode(claims, self.private, algorithm="ES256", headers={"typ": "JWT"})
        return f"vapid t={token}, k={self.public_b64url}"


def load_or_create_vapid_key(data_dir: Path, *, create: bool = True, keys_dir: Path | None = None) -> VapidKey:
    """The deployment's VAPID key, created on first use (when ``create``) and reused afterwards."""
    path = vapid_key_path(data_dir, keys_dir)
    if not path.exists():
        if not create:
            raise MissingKeyError("the VAPID key", path)
        key = ec.generate_private_key(ec.SECP256R1())
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        write_private(path, pem.decode())
    try:
        mode = path.stat().st_mode & 0o777
        data = path.read_bytes()
    except OSError as e:
        raise VapidKeyError(f"VAPID key {path}: cannot read ({e.strerror})") from e
    if mode & 0o077:
        raise VapidKeyError(f"VAPID key {path} has mode {mode:o}; it must be 0600 (chmod 600 {path})")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except ValueError as e:
        raise VapidKeyError(f"VAPID key {path} is not a PEM private key") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != "secp256r1":
        raise VapidKeyError(f"VAPID key {path} is not a P-256 key (RFC 8292 §3.2)")
    return VapidKey(key, path)
