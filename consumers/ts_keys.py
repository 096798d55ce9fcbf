"""Transparency Service receipt keys: EdDSA, ES256 and ES384, each pinned to its algorithm.

Where a TS key comes from (the registrar's order, first that yields a key):

1. ``registrar.ts_public_key`` in configuration: raw Ed25519 hex (64 digits),
   a PEM public key file, a JWK file (``.json``) or an inline JWK / JWKS JSON
   text; ``registrar.ts_key_id`` names its kid when the source has none;
2. the keys pinned earlier to ``{data_dir}/registrar/ts_keys.json``;
3. the TS's transparency configuration (draft-ietf-scitt-scrapi §2.1.1): an
   inline ``jwks`` or a ``jwks_uri`` fetched once; the keys found are pinned
   to the file above (trust on first use) and never replaced silently.

Every key carries the one COSE algorithm it may verify (RFC 9053 §2.1, §2.2):
EdDSA for Ed25519, ES256 for P-256, ES384 for P-384. A JWK whose ``alg``
disagrees with its curve, and any other key type (RSA, Ed448, P-521, ...), is
refused with :class:`UnsupportedTsKey` naming what was found.

A key without a kid (PEM, a JWK without ``kid`` or with an empty one) matches
a receipt of any kid, with its algorithm still pinned: scittles publishes its
JWK with ``kid: ""`` and signs receipts with kid ``ts-key``.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from subjects.errors import PgwError

EDDSA = -8
ES256 = -7
ES384 = -35
ALG_NAMES = {EDDSA: "EdDSA", ES256: "ES256", ES384: "ES384"}
_JOSE_ALGS = {"EdDSA": EDDSA, "Ed25519": EDDSA, "ES256": ES256, "ES384": ES384}
_CURVES = {"P-256": (ec.SECP256R1, ES256, 32), "P-384": (ec.SECP384R1, ES384, 48)}


class UnsupportedTsKey(PgwError):
    """A TS key of a type or algorithm the registrar does not verify receipts with."""

    def __init__(self, why: str) -> None:
        self.why = why
        super().__init__(f"unsupported Transparency Service key: {why} (supported: EdDSA/Ed25519, "
                         "ES256/P-256, ES384/P-384)")


@dataclass(frozen=True)
class TsKey:
    """A TS public key with its pinned COSE algorithm; ``kid`` None matches any receipt kid."""

    kid: str | None
    public: Any  # Ed25519PublicKey | ec.EllipticCurvePublicKey
    alg: int
    role: str = "ts"

    @property
    def alg_name(self) -> str:
        return ALG_NAMES.get(self.alg, str(self.alg))

    def to_jwk(self) -> dict[str, str]:
        """The public JWK (RFC 7517, RFC 8037 for OKP) with ``alg`` and ``kid``."""
        if isinstance(self.public, Ed25519PublicKey):
            raw = self.public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            jwk = {"kty": "OKP", "crv": "Ed25519", "x": _b64(raw)}
        else:
            nums = self.public.public_numbers()
            size = (self.public.curve.key_size + 7) // 8
            crv = "P-256" if isinstance(self.public.curve, ec.SECP256R1) else "P-384"
            jwk = {"kty": "EC", "crv": crv, "x": _b64(nums.x.to_bytes(size, "big")),
                   "y": _b64(nums.y.to_bytes(size, "big"))}
        jwk["alg"] = self.alg_name
        if self.kid:
            jwk["kid"] = self.kid
        return jwk


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def _unb64(s: Any, what: str) -> bytes:
    if not isinstance(s, str):
        raise UnsupportedTsKey(f"JWK member {what} must be a base64url string")
    try:
        return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))
    except ValueError:
        raise UnsupportedTsKey(f"JWK member {what} is not base64url") from None


def key_of_public(public: Any, kid: str | None = None) -> TsKey:
    """A TsKey from a ``cryptography`` public key object; its algorithm follows from the key."""
    if isinstance(public, Ed25519PublicKey):
        return TsKey(kid, public, EDDSA)
    if isinstance(public, ec.EllipticCurvePublicKey):
        for cls, alg, _ in _CURVES.values():
            if isinstance(public.curve, cls):
                return TsKey(kid, public, alg)
        raise UnsupportedTsKey(f"EC curve {public.curve.name}")
    raise UnsupportedTsKey(type(public).__name__)


def key_from_jwk(jwk: Any) -> TsKey:
    """A TsKey from one public JWK; refuses other key types and an ``alg`` that contradicts the curve."""
    if not isinstance(jwk, dict):
        raise UnsupportedTsKey("a JWK must be a JSON object")
    kty, crv, kid = jwk.get("kty"), jwk.get("crv"), jwk.get("kid") or None
    if kid is not None and not isinstance(kid, str):
        raise UnsupportedTsKey("JWK kid must be a string")
    if kty == "OKP" and crv == "Ed25519":
        x = _unb64(jwk.get("x"), "x")
        if len(x) != 32:
            raise UnsupportedTsKey("Ed25519 x must be 32 bytes")
        key = TsKey(kid, Ed25519PublicKey.from_public_bytes(x), EDDSA)
    elif kty == "EC" and crv in _CURVES:
        cls, alg, size = _CURVES[crv]
        x, y = _unb64(jwk.get("x"), "x"), _unb64(jwk.get("y"), "y")
        if len(x) != size or len(y) != size:
            raise UnsupportedTsKey(f"{crv} coordinates must be {size} bytes")
        try:
            pub = ec.EllipticCurvePublicNumbers(int.from_bytes(x, "big"), int.from_bytes(y, "big"),
                                                cls()).public_key()
        except ValueError:
            raise UnsupportedTsKey(f"{crv} point is not on the curve") from None
        key = TsKey(kid, pub, alg)
    else:
        raise UnsupportedTsKey(f"kty {kty!r} crv {crv!r}")
    declared = jwk.get("alg")
    if declared is not None and _JOSE_ALGS.get(declared) != key.alg:
        raise UnsupportedTsKey(f"JWK alg {declared!r} does not match its {crv} key ({key.alg_name})")
    return key


def keys_from_jwks(jwks: Any) -> dict[str, TsKey]:
    """Every supported key of a JWK Set, by kid ('' for a key without one).

    A key of another type in the set is skipped, not fatal: a TS may publish
    keys for other uses. :class:`UnsupportedTsKey` if no key is usable.
    """
    keys = jwks.get("keys") if isinstance(jwks, dict) else None
    if not isinstance(keys, list):
        raise UnsupportedTsKey("a JWK Set must be an object with a 'keys' array")
    out: dict[str, TsKey] = {}
    refused: list[str] = []
    for jwk in keys:
        try:
            k = key_from_jwk(jwk)
        except UnsupportedTsKey as e:
            refused.append(e.why)
            continue
        out[k.kid or ""] = k
    if not out:
        raise UnsupportedTsKey("no usable key in the JWK Set" + (f" ({'; '.join(refused)})" if refused else ""))
    return out


def load_ts_key(spec: str, kid: str | None = None) -> dict[str, TsKey]:
    """Keys from a configured value: Ed25519 hex, a PEM file, a JWK/JWKS file, or inline JWK/JWKS JSON."""
    s = spec.strip()
    if len(s) == 64 and all(c in "0123456789abcdefABCDEF" for c in s):
        from pgwcore.keys import kid_of  # the project's kid for its own raw Ed25519 keys

        pub = Ed25519PublicKey.from_public_bytes(bytes.fromhex(s))
        return {(kid or kid_of(pub)): TsKey(kid or kid_of(pub), pub, EDDSA)}
    if s.startswith("{"):
        text = s
    else:
        path = Path(s).expanduser()
        if not path.is_file():
            raise PgwError(f"TS key {s!r}: not hex, JSON, or an existing file")
        data = path.read_bytes()
        if b"-----BEGIN" in data:
            try:
                pub = serialization.load_pem_public_key(data)
            except ValueError as e:
                raise PgwError(f"TS key file {s}: not a PEM public key ({e})") from None
            k = key_of_public(pub, kid)
            return {k.kid or "": k}
        text = data.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
    except ValueError:
        raise PgwError(f"TS key {s!r}: not valid JSON") from None
    keys = keys_from_jwks(obj) if isinstance(obj, dict) and "keys" in obj else None
    if keys is None:
        k = key_from_jwk(obj)
        keys = {k.kid or "": k}
    if kid is not None:
        if len(keys) != 1:
            raise PgwError(f"TS key {s!r}: a kid ({kid!r}) can name one key, not a set of {len(keys)}")
        (k,) = keys.values()
        keys = {kid: TsKey(kid, k.public, k.alg)}
    return keys


# -- the pinned file -----------------------------------------------------------------


def pinned_ts_keys_path(data_dir: Path) -> Path:
    return Path(data_dir) / "registrar" / "ts_keys.json"


def read_pinned_ts_keys(data_dir: Path) -> dict[str, TsKey]:
    """The pinned keys: ``{kid: JWK}`` (older files: ``{kid: Ed25519 hex}``, still read)."""
    p = pinned_ts_keys_path(data_dir)
    if not p.exists():
        return {}
    out: dict[str, TsKey] = {}
    for kid, v in json.loads(p.read_text()).items():
        if isinstance(v, str):
            out[kid] = TsKey(kid, Ed25519PublicKey.from_public_bytes(bytes.fromhex(v)), EDDSA)
        else:
            k = key_from_jwk(v)
            out[kid] = TsKey(k.kid, k.public, k.alg)
    return out


def write_pinned_ts_keys(data_dir: Path, keys: dict[str, TsKey]) -> Path:
    p = pinned_ts_keys_path(data_dir)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({kid: k.to_jwk() for kid, k in keys.items()}, indent=2))
    os.chmod(tmp, 0o644)
    tmp.replace(p)
    return p
