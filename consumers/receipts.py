"""SCITT receipts: inclusion proofs over RFC 9162 trees, signed by a Transparency Service.

A receipt (draft-ietf-cose-merkle-tree-proofs, "COSE Receipts", RFC9162_SHA256)
is a COSE_Sign1 by the TS whose detached payload is the Merkle tree root; the
protected header names the verifiable data structure (label 395, value 1) and
the unprotected header carries the proof (label 396) as
``{-1: [bstr .cbor [tree_size, leaf_index, [hash, ...]]]}``. Verification
(§5.2 "Receipt of Inclusion") applies the proof to the entry's leaf, which
yields a root, then checks the TS signature over that root: both must hold.

**The leaf.** Neither draft fixes the bytes the TS puts in its tree: COSE
Receipts applies the proof to "possible entry (set member) bytes" and the
SCITT architecture leaves the receipt's contents to COSE Receipts and to the
TS. Two constructions are in use and both are verified here:

- ``statement``: leaf = SHA-256(0x00 || SHA-256(Signed Statement)), the
  statement encoded with its receipts removed (unprotected header empty).
  This is what the project's own test TS did and what a TS that logs the whole
  Signed Statement does.
- ``payload``: leaf = SHA-256(0x00 || SHA-256(payload)): scittles (its
  ``StatementValidator.extract_statement_hash`` for an embedded payload,
  added to the tree by ``MerkleTreeBuilder.add_leaf``). This binds the capsule
  bytes but not the issuer's signature over them.

``leaf="auto"`` tries ``statement`` then ``payload`` and reports which one
verified (``ReceiptInfo.leaf``); a configuration can pin one. Either way a
receipt is accepted only if the TS signature verifies over the root that our
own bytes produce, so trying both never lets a receipt for other bytes pass.

**The signature.** The key is found by the receipt's kid (a key configured
without a kid matches any kid); its algorithm is pinned (EdDSA, ES256 or
ES384, RFC 9053 §2.1-2.2) and checked against the protected ``alg`` before any
math; ``alg`` or ``crit`` in the unprotected header, or an unknown critical
label, is refused (RFC 9052 §3.1). Verification is done with ``cryptography``
directly (ECDSA signatures are the raw r||s of RFC 9053 §2.1).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import cbor2
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from consumers.cose import (
    RFC9162_SHA256,
    VDP,
    VDS,
    CoseError,
    Sign1,
    check_common_headers,
    decode_sign1,
    leaf_hash,
    root_from_path,
    sig_structure,
)
from consumers.ts_keys import ALG_NAMES, EDDSA, ES256, ES384

LeafKind = Literal["statement", "payload"]
LEAF_KINDS: tuple[LeafKind, ...] = ("statement", "payload")
LeafChoice = Literal["auto", "statement", "payload"]
INCLUSION = -1  # COSE Receipts: vdp map key of inclusion proofs
_HASHES = {ES256: (hashes.SHA256, 32), ES384: (hashes.SHA384, 48)}


@dataclass(frozen=True)
class ReceiptInfo:
    kid: str | None
    tree_size: int
    leaf_index: int
    root: bytes
    leaf: LeafKind = "statement"
    alg: int = EDDSA


def entry_hash(statement: bytes, kind: LeafKind) -> bytes:
    """The bytes the TS logs for ``statement`` under construction ``kind`` (before the 0x00 leaf prefix)."""
    msg = decode_sign1(statement)
    if kind == "statement":
        return hashlib.sha256(msg.statement_bytes()).digest()
    if msg.payload is None:
        raise CoseError("receipt_leaf_unavailable", "a detached-payload statement has no payload leaf")
    return hashlib.sha256(msg.payload).digest()


def statement_leaf(statement: bytes, kind: LeafKind = "statement") -> bytes:
    """RFC 9162 §2.1.1 leaf hash of ``statement`` under construction ``kind``."""
    return leaf_hash(entry_hash(statement, kind))


def leaf_kinds(choice: str) -> tuple[LeafKind, ...]:
    if choice == "auto":
        return LEAF_KINDS
    if choice in LEAF_KINDS:
        return (choice,)  # type: ignore[return-value]
    raise ValueError(f"receipt leaf must be auto, statement or payload, not {choice!r}")


def check_receipt_headers(r: Sign1, alg: int) -> None:
    """Header rules before any math (RFC 9052 §3.1): alg protected and pinned, no unprotected alg/crit."""
    got = check_common_headers(r, "receipt: ")
    if got not in ALG_NAMES:
        raise CoseError("receipt_alg_unsupported",
                        f"receipt alg {got!r} is not supported (EdDSA -8, ES256 -7, ES384 -35)")
    if got != alg:  # refused as unsupported for this key, before any math: not a bad signature
        raise CoseError("receipt_alg_unsupported",
                        f"receipt alg {ALG_NAMES[got]} is not the algorithm pinned for the key ({ALG_NAMES.get(alg, alg)})")


def signature_ok(public: Any, alg: int, signature: bytes, to_be_signed: bytes) -> bool:
    """One COSE signature check with the pinned algorithm (RFC 9053 §2.1 ECDSA r||s, §2.2 EdDSA)."""
    try:
        if alg == EDDSA and isinstance(public, Ed25519PublicKey):
            public.verify(signature, to_be_signed)
            return True
        if alg in _HASHES and isinstance(public, ec.EllipticCurvePublicKey):
            h, size = _HASHES[alg]
            if len(signature) != 2 * size or public.curve.key_size != size * 8:
                return False
            der = encode_dss_signature(int.from_bytes(signature[:size], "big"),
                                       int.from_bytes(signature[size:], "big"))
            public.verify(der, to_be_signed, ec.ECDSA(h()))
            return True
    except InvalidSignature:
        return False
    return False


def inclusion_proof(r: Sign1) -> tuple[int, int, list[bytes]]:
    """The first inclusion proof of a receipt (COSE Receipts §5.2 CDDL), checked for shape."""
    vdp = r.unprotected.get(VDP)
    proofs = vdp.get(INCLUSION) if isinstance(vdp, dict) else None
    if not isinstance(proofs, list) or not proofs:
        raise CoseError("receipt_proof_missing", "no inclusion proof in the receipt (label 396, key -1)")
    proof = proofs[0]
    if isinstance(proof, bytes):
        try:
            proof = cbor2.loads(proof)
        except Exception:  # noqa: BLE001 - cbor2 raises many types on garbage
            raise CoseError("receipt_proof_invalid", "inclusion proof is not CBOR") from None
    if not (isinstance(proof, list) and len(proof) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) for x in proof[:2])
            and isinstance(proof[2], list)):
        raise CoseError("receipt_proof_invalid", "inclusion proof must be [tree_size, leaf_index, [hashes]]")
    return proof[0], proof[1], proof[2]


def _candidate_keys(kid: str | None, keys: Mapping[str, Any]) -> list[Any]:
    if kid and kid in keys:
        return [keys[kid]]
    return [k for name, k in keys.items() if not name or getattr(k, "kid", None) is None]


def verify_receipt(receipt: bytes, statement: bytes, keys: Mapping[str, Any],
                   leaf: str | Sequence[LeafKind] = "auto") -> ReceiptInfo:
    """Verify ``receipt`` for ``statement`` against trusted TS keys; raise CoseError if it does not hold.

    ``keys`` maps kid to a key with ``.public`` and ``.alg`` (``TsKey`` or the
    verifier's ``TrustedKey``). ``leaf`` is ``auto``, one construction, or a
    sequence of them, tried in order.
    """
    r = decode_sign1(receipt)
    if r.protected.get(VDS) != RFC9162_SHA256:
        raise CoseError("receipt_vds_unsupported", f"verifiable data structure {r.protected.get(VDS)!r}")
    candidates = _candidate_keys(r.kid, keys)
    if not candidates:
        raise CoseError("receipt_key_untrusted", f"receipt kid {r.kid!r} is not a trusted TS key")
    size, index, path = inclusion_proof(r)
    kinds = leaf_kinds(leaf) if isinstance(leaf, str) else tuple(leaf)
    root_from_path(index, size, bytes(32), path)  # the proof's shape does not depend on the leaf
    header_error: CoseError | None = None
    for key in candidates:
        try:
            check_receipt_headers(r, key.alg)
        except CoseError as e:
            header_error = header_error or e
            continue
        for kind in kinds:
            try:
                root = root_from_path(index, size, statement_leaf(statement, kind), path)
            except CoseError:  # no payload to hash (detached): this construction does not apply
                continue
            if signature_ok(key.public, key.alg, r.signature, sig_structure(r.protected_bytes, root)):
                return ReceiptInfo(r.kid, size, index, root, kind, key.alg)
    if header_error is not None and len(candidates) == 1:
        raise header_error
    raise CoseError("receipt_signature_invalid",
                    f"the TS signature does not verify over the root of any leaf construction tried "
                    f"({', '.join(kinds)}) with {len(candidates)} trusted key(s)")
