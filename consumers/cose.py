"""COSE_Sign1 Signed Statements for capsules (spec 004 §3.1) and SCITT receipts.

Signing builds the COSE_Sign1 directly (byte-identical to pycose's, which is
kept as the reference it is tested against). Verification goes through pycose,
pins the algorithm per key (EdDSA for our Ed25519 keys) and never lets pycose
pick it: pycose falls back to an ``alg``
in the *unprotected* header when the protected one has none, so
:func:`verify_sign1` rejects ``alg`` or ``crit`` in the unprotected header,
any critical label it does not understand, and a protected ``alg`` other than
the one pinned for the key, before the signature is checked.

Receipts (draft-ietf-cose-merkle-tree-proofs, verifiable data structure
RFC9162_SHA256): a receipt is a COSE_Sign1 by the Transparency Service with a
detached payload, the Merkle tree root; the inclusion proof
``[tree_size, leaf_index, [hashes...]]`` sits in unprotected label 396 under
key -1. The leaf is ``SHA-256(0x00 || SHA-256(statement))`` where statement is
the Signed Statement encoded with an empty unprotected header. Transparent
Statements carry receipts in unprotected label 394.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

import cbor2
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pycose.algorithms import EdDSA
from pycose.headers import KID, Algorithm, ContentType
from pycose.keys import OKPKey
from pycose.keys.curves import Ed25519
from pycose.messages import Sign1Message

from subjects.errors import PgwError

ALG = 1
CRIT = 2
CONTENT_TYPE = 3
KID_LABEL = 4
CWT_CLAIMS = 15
RECEIPTS = 394
VDS = 395
VDP = 396
EDDSA = -8
# Names of algorithms a statement may name (IANA "COSE Algorithms"), for clear refusals.
ALG_NAMES = {-8: "EdDSA", -19: "Ed25519", -53: "Ed448", -7: "ES256", -35: "ES384", -36: "ES512",
             -37: "PS256", -257: "RS256"}
ED448_SIGNATURE_LEN = 114  # RFC 8032 §5.2.6: an EdDSA signature over Ed448
RFC9162_SHA256 = 1
COSE_SIGN1_TAG = 18
# Labels this verifier understands, so they may be listed as critical.
UNDERSTOOD = frozenset({ALG, CONTENT_TYPE, KID_LABEL, CWT_CLAIMS, VDS})


class CoseError(PgwError, ValueError):
    """A COSE structure is malformed or does not verify; ``code`` names the finding."""

    def __init__(self, code: str, why: str) -> None:
        self.code = code
        self.why = why
        super().__init__(f"{code}: {why}")


def raw_private(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


@dataclass(frozen=True)
class TrustedKey:
    """A verification key with its pinned algorithm (EdDSA for Ed25519)."""

    kid: str
    public: Ed25519PublicKey
    alg: int = EDDSA
    role: str = ""


@dataclass
class Sign1:
    """A decoded COSE_Sign1: the raw protected bytes are kept for Sig_structure."""

    protected_bytes: bytes
    protected: dict[Any, Any]
    unprotected: dict[Any, Any]
    payload: bytes | None
    signature: bytes
    tagged: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def kid(self) -> str | None:
        k = self.protected.get(KID_LABEL)
        if isinstance(k, bytes):
            try:
                return k.decode("ascii")
            except UnicodeDecodeError:
                return k.hex()
        return k if isinstance(k, str) else None

    @property
    def cwt_claims(self) -> dict[Any, Any]:
        c = self.protected.get(CWT_CLAIMS)
        return c if isinstance(c, dict) else {}

    def receipts(self) -> list[bytes]:
        r = self.unprotected.get(RECEIPTS)
        return [x for x in r if isinstance(x, bytes)] if isinstance(r, list) else []

    def encode(self, unprotected: dict[Any, Any] | None = None) -> bytes:
        body = [self.protected_bytes, self.unprotected if unprotected is None else unprotected,
                self.payload, self.signature]
        return cbor2.dumps(cbor2.CBORTag(COSE_SIGN1_TAG, body) if self.tagged else body)

    def statement_bytes(self) -> bytes:
        """The Signed Statement as registered: receipts stripped from the unprotected header."""
        return self.encode({k: v for k, v in self.unprotected.items() if k != RECEIPTS})


def sign_statement(payload: bytes, key: Ed25519PrivateKey, kid: str, claims: dict[Any, Any],
                   content_type: str) -> bytes:
    """A tagged COSE_Sign1 with protected alg EdDSA, kid, content_type and CWT claims (label 15).

    Built directly (RFC 9052 §4.2, §4.4: Sig_structure ["Signature1",
    protected, external_aad = h'', payload]) instead of through pycose's
    message objects, which cost more than the signature itself on the
    signer's hot path. The bytes are identical to pycose's
    ``Sign1Message.encode(tag=True)`` (Ed25519 is deterministic);
    tests/test_capsule_cose.py holds the two to that, and verification still
    goes through pycose with the algorithm pinned (``verify_sign1``).
    """
    protected = cbor2.dumps({ALG: EDDSA, KID_LABEL: kid.encode("ascii"), CONTENT_TYPE: content_type,
                             CWT_CLAIMS: claims})
    signature = key.sign(sig_structure(protected, payload))
    return cbor2.dumps(cbor2.CBORTag(COSE_SIGN1_TAG, [protected, {}, payload, signature]))


def pycose_sign_statement(payload: bytes, key: Ed25519PrivateKey, kid: str, claims: dict[Any, Any],
                          content_type: str) -> bytes:
    """The same statement through pycose: the reference ``sign_statement`` is checked against."""
    msg = Sign1Message(
        phdr={Algorithm: EdDSA, KID: kid.encode("ascii"), ContentType: content_type, CWT_CLAIMS: claims},
        uhdr={},
        payload=payload,
    )
    msg.key = OKPKey(crv=Ed25519, d=raw_private(key), x=raw_public(key.public_key()))
    return msg.encode(tag=True)


def decode_sign1(data: bytes) -> Sign1:
    """Parse COSE_Sign1 bytes without trusting anything; raise CoseError on any malformation."""
    if not isinstance(data, (bytes, bytearray)):
        raise CoseError("cose_malformed", "input is not bytes")
    try:
        obj = cbor2.loads(bytes(data))
    except Exception as e:  # noqa: BLE001 - cbor2 raises many types on garbage
        raise CoseError("cose_malformed", f"not CBOR: {type(e).__name__}") from None
    tagged = False
    if isinstance(obj, cbor2.CBORTag):
        if obj.tag != COSE_SIGN1_TAG:
            raise CoseError("cose_malformed", f"CBOR tag {obj.tag} is not COSE_Sign1 (18)")
        obj, tagged = obj.value, True
    if not isinstance(obj, list) or len(obj) != 4:
        raise CoseError("cose_malformed", "COSE_Sign1 must be an array of four items")
    prot_b, unprot, payload, sig = obj
    if not isinstance(prot_b, bytes):
        raise CoseError("cose_malformed", "protected header must be a byte string")
    if not isinstance(unprot, dict):
        raise CoseError("cose_malformed", "unprotected header must be a map")
    if payload is not None and not isinstance(payload, bytes):
        raise CoseError("cose_malformed", "payload must be a byte string or nil")
    if not isinstance(sig, bytes):
        raise CoseError("cose_malformed", "signature must be a byte string")
    if prot_b:
        try:
            prot = cbor2.loads(prot_b)
        except Exception:  # noqa: BLE001
            raise CoseError("cose_malformed", "protected header is not CBOR") from None
        if not isinstance(prot, dict):
            raise CoseError("cose_malformed", "protected header must encode a map")
    else:
        prot = {}
    return Sign1(prot_b, prot, unprot, payload, sig, tagged)


def check_common_headers(msg: Sign1, where: str = "") -> Any:
    """The header rules every COSE_Sign1 here obeys, before any signature math (RFC 9052 §3.1, §4.4):
    no ``alg`` or ``crit`` in the unprotected header, ``crit`` a non-empty array of understood labels,
    ``alg`` present in the protected header. Returns that ``alg``; ``where`` prefixes the messages."""
    if ALG in msg.unprotected:
        raise CoseError("cose_unprotected_alg", f"{where}alg must not appear in the unprotected header")
    if CRIT in msg.unprotected:
        raise CoseError("cose_unprotected_crit", f"{where}crit must not appear in the unprotected header")
    crit = msg.protected.get(CRIT)
    if crit is not None:
        if not isinstance(crit, list) or not crit:
            raise CoseError("cose_crit_malformed", f"{where}crit must be a non-empty array")
        unknown = [c for c in crit if c not in UNDERSTOOD]
        if unknown:
            raise CoseError("cose_crit_unknown", f"{where}unknown critical labels {unknown!r}")
    alg = msg.protected.get(ALG)
    if alg is None:
        raise CoseError("cose_alg_missing", f"{where}alg must be in the protected header")
    return alg


def check_headers(msg: Sign1, key: TrustedKey) -> None:
    """Header rules checked before any signature math (RFC 9052 §3.1, §4.4), the alg pinned to ``key``."""
    alg = check_common_headers(msg)
    if alg != key.alg:
        # Refused before any signature math: an algorithm the key is not pinned to is unsupported
        # here, which is not the same finding as a signature that does not verify.
        raise CoseError("cose_alg_unsupported",
                        f"alg {alg!r} ({_alg_name(alg)}) is not supported for key {key.kid}, "
                        f"which is pinned to {key.alg} ({ALG_NAMES.get(key.alg, 'unknown')})")
    if alg == EDDSA and len(msg.signature) == ED448_SIGNATURE_LEN:
        # RFC 9053 §2.2: EdDSA (-8) names the family; the curve is the key's. Ours are Ed25519.
        raise CoseError("cose_alg_unsupported",
                        f"an EdDSA signature of {ED448_SIGNATURE_LEN} bytes is Ed448, which is not supported "
                        f"(key {key.kid} is Ed25519)")


def _alg_name(alg: Any) -> str:
    """A name for a hostile header value too (a map or a list is unhashable)."""
    return ALG_NAMES.get(alg, "unknown") if isinstance(alg, (int, str)) else "unknown"


def verify_sign1(msg: Sign1, key: TrustedKey, *, detached: bytes | None = None) -> None:
    """Verify ``msg`` against ``key`` with the algorithm pinned; raise CoseError if not valid."""
    check_headers(msg, key)
    payload = detached if detached is not None else msg.payload
    if payload is None:
        raise CoseError("cose_payload_missing", "no payload to verify")
    try:
        # pycose decodes again from bytes; the alg it uses is the protected one we pinned above.
        # It only decodes the tagged form, so an untagged statement (RFC 9052 §2: the tag is
        # optional where the context knows the type) is handed over tagged; the signature does
        # not cover the tag.
        pm = Sign1Message.decode(replace(msg, tagged=True).encode({}))
        if detached is not None:
            pm.payload = detached
        pm.key = OKPKey(crv=Ed25519, x=raw_public(key.public))
        ok = pm.verify_signature()
    except Exception as e:  # noqa: BLE001 - pycose raises assorted errors on hostile input
        raise CoseError("cose_signature_invalid", f"signature check failed: {type(e).__name__}") from None
    if not ok:
        raise CoseError("cose_signature_invalid", "signature does not verify")


def sig_structure(protected_bytes: bytes, payload: bytes) -> bytes:
    """RFC 9052 §4.4 Sig_structure for COSE_Sign1, built by hand."""
    return cbor2.dumps(["Signature1", protected_bytes, b"", payload])


def verify_raw(msg: Sign1, public: Ed25519PublicKey, detached: bytes | None = None) -> bool:
    """A second, pycose-free signature path (cbor2 + cryptography)."""
    payload = detached if detached is not None else msg.payload
    try:
        public.verify(msg.signature, sig_structure(msg.protected_bytes, payload or b""))
    except InvalidSignature:
        return False
    return True


# ---------------------------------------------------------------------------
# Merkle tree (RFC 9162 §2.1) and receipts
# ---------------------------------------------------------------------------


def leaf_hash(entry: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + entry).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def statement_leaf(statement: bytes) -> bytes:
    """The log leaf of a Signed Statement (receipts stripped first)."""
    return leaf_hash(hashlib.sha256(decode_sign1(statement).statement_bytes()).digest())


def merkle_root(leaves: list[bytes]) -> bytes:
    """RFC 9162 MTH over leaf hashes."""
    n = len(leaves)
    if n == 0:
        return hashlib.sha256(b"").digest()
    if n == 1:
        return leaves[0]
    k = 1
    while k * 2 < n:
        k *= 2
    return node_hash(merkle_root(leaves[:k]), merkle_root(leaves[k:]))


def inclusion_path(index: int, leaves: list[bytes]) -> list[bytes]:
    """RFC 9162 §2.1.3.1 PATH(m, D[n])."""
    n = len(leaves)
    if n <= 1:
        return []
    k = 1
    while k * 2 < n:
        k *= 2
    if index < k:
        return [*inclusion_path(index, leaves[:k]), merkle_root(leaves[k:])]
    return [*inclusion_path(index - k, leaves[k:]), merkle_root(leaves[:k])]


def root_from_path(index: int, size: int, leaf: bytes, path: list[bytes]) -> bytes:
    """RFC 9162 §2.1.3.2: recompute the root from an inclusion proof; CoseError if malformed."""
    if not (0 <= index < size):
        raise CoseError("receipt_proof_invalid", "leaf index out of range")
    fn, sn, r = index, size - 1, leaf
    for p in path:
        if not isinstance(p, bytes) or len(p) != 32:
            raise CoseError("receipt_proof_invalid", "proof hash is not 32 bytes")
        if sn == 0:
            raise CoseError("receipt_proof_invalid", "proof too long")
        if fn % 2 == 1 or fn == sn:
            r = node_hash(p, r)
            if fn % 2 == 0:
                while fn % 2 == 0 and fn != 0:
                    fn >>= 1
                    sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise CoseError("receipt_proof_invalid", "proof too short")
    return r


def sign_receipt(key: Ed25519PrivateKey, kid: str, tree_size: int, leaf_index: int, path: list[bytes],
                 root: bytes) -> bytes:
    """A receipt as the test Transparency Service issues it (detached root payload)."""
    prot = cbor2.dumps({ALG: EDDSA, KID_LABEL: kid.encode("ascii"), VDS: RFC9162_SHA256})
    sig = key.sign(sig_structure(prot, root))
    proof = cbor2.dumps([tree_size, leaf_index, path])
    return cbor2.dumps(cbor2.CBORTag(COSE_SIGN1_TAG, [prot, {VDP: {-1: [proof]}}, None, sig]))


def with_receipt(statement: bytes, receipt: bytes) -> bytes:
    """The Transparent Statement: the receipt added to the unprotected header (label 394)."""
    msg = decode_sign1(statement)
    unprot = dict(msg.unprotected)
    unprot[RECEIPTS] = [*msg.receipts(), receipt]
    return msg.encode(unprot)
