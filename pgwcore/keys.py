"""Ed25519 signing keys kept as files in the data folder (DESIGN §7), and the digest key.

Each key role (``kernel``, ``signer``) has one active key and any number of
retired ones. Private keys are PEM files created with mode 0600 and never
logged; ``kid`` is the first 16 hex digits of SHA-256 over the raw public key.
Rotation creates a new active key and keeps the old ones, so statements
signed before the rotation stay verifiable.

Layout: ``{data}/keys/{role}/{kid}.pem`` and ``{data}/keys/{role}/active``
(the active kid).

The digest key (role ``digest``, :class:`DigestKey`) is a secret HMAC-SHA256
key, not a signing key: every digest the contract keeps of a principal's text
or of a secret is keyed with it, so a dictionary of guesses does not reverse
it (spec 000 §13: the digest stands for the text; docs/security.md "Data at
rest"). Layout: ``{keys}/digest/{kid}.key`` (32 random bytes as hex, 0600)
and ``{keys}/digest/active``; ``pgw keys --rotate digest`` makes a new active
key and keeps the old ones, so every earlier digest stays checkable.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from subjects.errors import PgwError


class KeyFileError(PgwError):
    """A key file is missing, unreadable, or has unsafe permissions."""


NOT_ED25519 = frozenset({"vapid", "digest"})  # key folders under {data}/keys that hold another kind of key


def read_ed25519_public(path: str | Path) -> Ed25519PublicKey:
    """The Ed25519 public key in PEM file ``path``; KeyFileError naming the file and what is wrong."""
    try:
        loaded = serialization.load_pem_public_key(Path(path).expanduser().read_bytes())
    except (OSError, ValueError) as e:
        raise KeyFileError(f"{path} is not a readable PEM public key: {e}") from None
    if not isinstance(loaded, Ed25519PublicKey):
        raise KeyFileError(f"{path} is not an Ed25519 public key ({type(loaded).__name__})")
    return loaded


def kid_of(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class PublicKeyInfo:
    role: str
    kid: str
    public: Ed25519PublicKey
    active: bool

    @property
    def raw_hex(self) -> str:
        return self.public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()

    @property
    def pem(self) -> str:
        return self.public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ).decode()


@dataclass(frozen=True)
class SigningKey:
    role: str
    kid: str
    private: Ed25519PrivateKey

    @property
    def public(self) -> Ed25519PublicKey:
        return self.private.public_key()

    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)

    def __repr__(self) -> str:  # never print key material
        return f"SigningKey(role={self.role!r}, kid={self.kid!r})"


def _role_dir(data_dir: Path, role: str, keys_dir: Path | None = None) -> Path:
    if not role.isidentifier():
        raise KeyFileError(f"invalid key role {role!r}")
    return (Path(keys_dir) if keys_dir else Path(data_dir) / "keys") / role


def _write_new(d: Path) -> SigningKey:
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    priv = Ed25519PrivateKey.generate()
    kid = kid_of(priv.public_key())
    pem = priv.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path = d / f"{kid}.pem"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    tmp = d / "active.tmp"
    tmp.write_text(kid)
    tmp.replace(d / "active")
    return SigningKey(d.name, kid, priv)


def _read(path: Path, role: str) -> SigningKey:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise KeyFileError(f"key file {path} has mode {mode:o}; it must be 0600 (chmod 600 {path})")
    priv = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(priv, Ed25519PrivateKey):
        raise KeyFileError(f"key file {path} is not an Ed25519 private key")
    return SigningKey(role, kid_of(priv.public_key()), priv)


class MissingKeyError(KeyFileError):
    """A key that must already exist (``keys.create = false``) is not there."""

    def __init__(self, what: str, path: Path) -> None:
        self.path = path
        super().__init__(
            f"{what} is missing at {path} and keys.create is false: restore the key volume (is it mounted at "
            f"this path?) or set keys.create = true to make a new key on purpose"
        )


def load_or_create(data_dir: Path, role: str, *, create: bool = True, keys_dir: Path | None = None) -> SigningKey:
    """The active key of ``role``, created (0600) on first use when ``create`` (else MissingKeyError).

    ``keys_dir`` (``keys.dir``, ``Config.keys_path``) replaces ``{data_dir}/keys``."""
    d = _role_dir(data_dir, role, keys_dir)
    active = d / "active"
    if not active.exists():
        if not create:
            raise MissingKeyError(f"the {role} signing key", active)
        return _write_new(d)
    kid = active.read_text().strip()
    return _read(d / f"{kid}.pem", role)


def load_kid(data_dir: Path, role: str, kid: str, *, keys_dir: Path | None = None) -> SigningKey:
    """The key ``kid`` of ``role`` read from its own file (``{kid}.pem``), whichever key is active now.

    For a second process that must sign with exactly the key its parent loaded
    (the signer's signing workers): a rotation in between cannot swap it."""
    key = _read(_role_dir(data_dir, role, keys_dir) / f"{kid}.pem", role)
    if key.kid != kid:
        raise KeyFileError(f"key file {kid}.pem of {role} holds the key {key.kid}")
    return key


def rotate(data_dir: Path, role: str, *, keys_dir: Path | None = None) -> SigningKey | DigestKey:
    """Make a new active key for ``role``; the previous keys stay for verification (digests: for checking)."""
    if role == DIGEST_ROLE:
        return _write_digest_key(_role_dir(data_dir, role, keys_dir))
    return _write_new(_role_dir(data_dir, role, keys_dir))


def public_keys(data_dir: Path, role: str | None = None, *, keys_dir: Path | None = None) -> list[PublicKeyInfo]:
    """Every public key (active and retired) under the data folder (or ``keys_dir``)."""
    base = Path(keys_dir) if keys_dir else Path(data_dir) / "keys"
    # Ed25519 signing roles only: the notifier's VAPID key (P-256, keys/vapid/) is listed by its own module.
    roles = [role] if role else sorted(p.name for p in base.iterdir() if p.is_dir() and p.name not in NOT_ED25519) \
        if base.exists() else []
    out: list[PublicKeyInfo] = []
    for r in roles:
        d = _role_dir(data_dir, r, keys_dir)
        if not d.exists():
            continue
        active = (d / "active").read_text().strip() if (d / "active").exists() else ""
        for pem in sorted(d.glob("*.pem")):
            k = _read(pem, r)
            out.append(PublicKeyInfo(r, k.kid, k.public, k.kid == active))
    return out


# -- the digest key (HMAC-SHA256) ------------------------------------------------

DIGEST_ROLE = "digest"
DIGEST_SCHEME = "hmac-sha256"
# The MAC covers this label too: a digest of no other kind (a token, a signature) is ever equal to one.
_DIGEST_DOMAIN = b"pgw-text-digest/v1\n"


def _digest_kid(key: bytes) -> str:
    return hashlib.sha256(b"pgw-digest-kid\n" + key).hexdigest()[:16]


class DigestKey:
    """The per-deployment key of every digest of a principal's text or of a secret the contract keeps.

    A plain sha256 of a short answer ("yes", "pay it tomorrow") is reversed by
    hashing guesses; an HMAC under a key kept with the signing keys is checked
    by its holder (``matches``) and by nobody else. A digest names its key
    (``hmac-sha256:{kid}:{hex}``), so a rotation (``pgw keys --rotate digest``)
    keeps every earlier digest checkable with the retired key, and a bare sha256
    written before keyed digests existed is still recognised.
    """

    def __init__(self, active: str, keys: dict[str, bytes]) -> None:
        if active not in keys:
            raise KeyFileError(f"the active digest key {active} has no key file")
        self.kid = active
        self._keys = dict(keys)

    @classmethod
    def ephemeral(cls) -> DigestKey:
        """A key of this process alone (a moment desk built without the deployment's key): once the
        process ends, nobody can check its digests."""
        key = os.urandom(32)
        return cls(_digest_kid(key), {_digest_kid(key): key})

    def digest(self, text: str) -> str:
        """``hmac-sha256:{kid}:{hex}`` of ``text`` under the active key."""
        return f"{DIGEST_SCHEME}:{self.kid}:{self._hex(self._keys[self.kid], text)}"

    def matches(self, text: str, digest: str) -> bool:
        """Whether ``digest`` (keyed under any key of this deployment, or a legacy bare sha256) is of ``text``."""
        scheme, _, rest = digest.partition(":")
        if scheme == DIGEST_SCHEME:
            kid, _, mac = rest.partition(":")
            key = self._keys.get(kid)
            return key is not None and hmac.compare_digest(mac, self._hex(key, text))
        legacy = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        return hmac.compare_digest(digest.removeprefix("sha256 "), legacy)

    @staticmethod
    def _hex(key: bytes, text: str) -> str:
        return hmac.new(key, _DIGEST_DOMAIN + text.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()

    def __repr__(self) -> str:  # never print key material
        return f"DigestKey(kid={self.kid!r}, keys={len(self._keys)})"


def _write_digest_key(d: Path) -> DigestKey:
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    key = os.urandom(32)
    kid = _digest_kid(key)
    fd = os.open(d / f"{kid}.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    tmp = d / "active.tmp"
    tmp.write_text(kid)
    tmp.replace(d / "active")
    return _read_digest_keys(d)


def _read_digest_keys(d: Path) -> DigestKey:
    keys: dict[str, bytes] = {}
    for path in sorted(d.glob("*.key")):
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise KeyFileError(f"key file {path} has mode {mode:o}; it must be 0600 (chmod 600 {path})")
        try:
            key = bytes.fromhex(path.read_text().strip())
        except ValueError as e:
            raise KeyFileError(f"key file {path} does not hold a hex key") from e
        if len(key) < 32 or _digest_kid(key) != path.stem:
            raise KeyFileError(f"key file {path} does not hold the 32-byte digest key {path.stem}")
        keys[path.stem] = key
    return DigestKey((d / "active").read_text().strip(), keys)


def load_or_create_digest_key(data_dir: Path, *, create: bool = True, keys_dir: Path | None = None) -> DigestKey:
    """The digest keys (active and retired) of ``{keys}/digest``, the first made (0600) when ``create``."""
    d = _role_dir(data_dir, DIGEST_ROLE, keys_dir)
    if not (d / "active").exists():
        if not create:
            raise MissingKeyError("the digest key", d / "active")
        return _write_digest_key(d)
    return _read_digest_keys(d)
