"""COSE_Sign1 statements and receipts (spec 004 §3), checked also without pycose."""

from __future__ import annotations

import hashlib
import json

import cbor2
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import capsule as capm
from consumers import capsule_map
from consumers.capsule import MEDIA_TYPE
from consumers.cose import (
    CoseError,
    TrustedKey,
    decode_sign1,
    inclusion_path,
    merkle_root,
    pycose_sign_statement,
    root_from_path,
    sign_receipt,
    sign_statement,
    statement_leaf,
    verify_sign1,
    with_receipt,
)
from consumers.receipts import verify_receipt
from consumers.signer import Signer, _Head, _Job, claims_for, sign_payload
from pgwcore.keys import SigningKey, kid_of
from tests.test_capsule_model import design_rows, make


def signing_key() -> SigningKey:
    priv = Ed25519PrivateKey.generate()
    return SigningKey("signer", kid_of(priv.public_key()), priv)


def trusted(k: SigningKey) -> TrustedKey:
    return TrustedKey(k.kid, k.public)


def resign(statement: bytes, key: SigningKey, *, protected: dict | None = None,
           unprotected: dict | None = None) -> bytes:
    """Rebuild a COSE_Sign1 with altered headers and a fresh valid signature (hand-made, no pycose)."""
    obj = cbor2.loads(statement).value
    prot = cbor2.loads(obj[0])
    if protected is not None:
        prot = protected(prot) if callable(protected) else protected
    pb = cbor2.dumps(prot)
    sig = key.sign(cbor2.dumps(["Signature1", pb, b"", obj[2]]))
    return cbor2.dumps(cbor2.CBORTag(18, [pb, unprotected if unprotected is not None else obj[1], obj[2], sig]))


def test_statement_verifies_independently_of_pycose() -> None:
    """A signed capsule verifies through cbor2 + cryptography with a hand-built Sig_structure."""
    key = signing_key()
    for v in design_rows():
        payload = make(v).to_json()
        stmt = sign_payload(payload, key)
        tag = cbor2.loads(stmt)
        assert isinstance(tag, cbor2.CBORTag) and tag.tag == 18
        prot_b, unprot, body, sig = tag.value
        prot = cbor2.loads(prot_b)
        assert prot[1] == -8 and prot[4] == key.kid.encode() and unprot == {}
        assert prot[3] == "application/agent-action-capsule+json"
        p = json.loads(body)
        claims = prot[15]
        assert claims[1] == p["developer"]
        assert claims[2] == f"urn:agent-action-capsule:acme:{p['action_id']}"
        assert claims["capsule_statement_type"] == "agent_action"
        assert claims["capsule_action_type"] == p["action_type"]
        assert claims["capsule_decision_id"] == p["decision_id"]
        to_be_signed = cbor2.dumps(["Signature1", prot_b, b"", body])
        key.public.verify(sig, to_be_signed)  # raises if invalid
        with pytest.raises(InvalidSignature):
            key.public.verify(sig, cbor2.dumps(["Signature1", prot_b, b"", body + b" "]))
        verify_sign1(decode_sign1(stmt), trusted(key))  # and the production (pycose) path agrees


def test_direct_signing_matches_pycose_byte_for_byte() -> None:
    """sign_statement (hand-built Sig_structure) and pycose's Sign1Message give identical bytes."""
    key = signing_key()
    for v in design_rows():
        payload = make(v).to_json()
        claims = claims_for(json.loads(payload))
        ours = sign_statement(payload, key.private, key.kid, claims, MEDIA_TYPE)
        assert ours == pycose_sign_statement(payload, key.private, key.kid, claims, MEDIA_TYPE)
        assert ours == sign_payload(payload, key)
        verify_sign1(decode_sign1(ours), trusted(key))


def test_signing_is_deterministic() -> None:
    """The same payload and key give the same statement bytes (Ed25519 is deterministic)."""
    key = signing_key()
    payload = make(design_rows()[0]).to_json()
    assert sign_payload(payload, key) == sign_payload(payload, key)


def test_signing_from_the_built_body_gives_the_same_statement() -> None:
    """The signer hands sign_payload the body it encoded the payload from: same bytes as decoding it."""
    key = signing_key()
    head = _Head(0, capm.GENESIS_HASH, None)
    for v in design_rows():
        built = capsule_map.capsule_from_verdict_checked(v, operator="op", salt="00" * 32)
        entry, head = Signer._link(head, _Job(None, v, built=built), {})
        payload = entry.payload.encode()
        assert sign_payload(payload, key, built.body) == sign_payload(payload, key)


def test_header_rules() -> None:
    """Unprotected alg/crit, unknown critical labels, an unpinned alg and tampering are all rejected."""
    key = signing_key()
    stmt = sign_payload(make(design_rows()[0]).to_json(), key)
    tk = trusted(key)
    verify_sign1(decode_sign1(stmt), tk)
    cases = {
        "cose_unprotected_alg": resign(stmt, key, unprotected={1: -8}),
        "cose_unprotected_crit": resign(stmt, key, unprotected={2: [4]}),
        "cose_crit_unknown": resign(stmt, key, protected=lambda p: {**p, 2: [99]}),
        "cose_alg_unsupported": resign(stmt, key, protected=lambda p: {**p, 1: -7}),
        "cose_alg_missing": resign(stmt, key, protected=lambda p: {k: v for k, v in p.items() if k != 1},
                                   unprotected={}),
    }
    for code, bad in cases.items():
        with pytest.raises(CoseError) as e:
            verify_sign1(decode_sign1(bad), tk)
        assert e.value.code == code
    # alg only in the unprotected header (the pycose fallback) is refused too.
    no_prot_alg = resign(stmt, key, protected=lambda p: {k: v for k, v in p.items() if k != 1},
                         unprotected={1: -8})
    with pytest.raises(CoseError, match="unprotected"):
        verify_sign1(decode_sign1(no_prot_alg), tk)
    crit_known = resign(stmt, key, protected=lambda p: {**p, 2: [15]})
    verify_sign1(decode_sign1(crit_known), tk)
    obj = cbor2.loads(stmt).value
    tampered = cbor2.dumps(cbor2.CBORTag(18, [obj[0], obj[1], obj[2].replace(b"acme", b"acmf"), obj[3]]))
    with pytest.raises(CoseError, match="signature"):
        verify_sign1(decode_sign1(tampered), tk)
    with pytest.raises(CoseError, match="signature"):
        verify_sign1(decode_sign1(stmt), trusted(signing_key()))


@pytest.mark.parametrize("data", [b"", b"\x00", b"garbage", cbor2.dumps(5), cbor2.dumps([1, 2, 3, 4]),
                                  cbor2.dumps(cbor2.CBORTag(98, [])), cbor2.dumps([b"\xff", {}, b"", b""])])
def test_decode_rejects_malformed(data: bytes) -> None:
    """Malformed COSE input raises CoseError, never anything else."""
    with pytest.raises(CoseError):
        decode_sign1(data)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.data())
def test_merkle_inclusion_proofs(size: int, data: st.DataObject) -> None:
    """RFC 9162 inclusion paths recompute the root for every leaf, and fail for another leaf."""
    leaves = [hashlib.sha256(bytes([i])).digest() for i in range(size)]
    root = merkle_root(leaves)
    i = data.draw(st.integers(0, size - 1))
    assert root_from_path(i, size, leaves[i], inclusion_path(i, leaves)) == root
    if size > 1:
        j = (i + 1) % size
        assert root_from_path(i, size, leaves[j], inclusion_path(i, leaves)) != root


def test_receipt_verification() -> None:
    """A receipt verifies for its statement under the TS key, and not for another statement or key."""
    key, ts = signing_key(), signing_key()
    stmts = [sign_payload(make(v).to_json(), key) for v in design_rows()[:5]]
    leaves = [statement_leaf(s) for s in stmts]
    root = merkle_root(leaves)
    receipt = sign_receipt(ts.private, ts.kid, len(leaves), 2, inclusion_path(2, leaves), root)
    info = verify_receipt(receipt, stmts[2], {ts.kid: trusted(ts)})
    assert (info.tree_size, info.leaf_index, info.root) == (5, 2, root)
    transparent = with_receipt(stmts[2], receipt)
    assert decode_sign1(transparent).receipts() == [receipt]
    assert decode_sign1(transparent).statement_bytes() == stmts[2]
    verify_receipt(receipt, transparent, {ts.kid: trusted(ts)})  # receipts are stripped for the leaf
    with pytest.raises(CoseError):
        verify_receipt(receipt, stmts[3], {ts.kid: trusted(ts)})
    with pytest.raises(CoseError, match=r"untrusted|signature"):
        verify_receipt(receipt, stmts[2], {ts.kid: trusted(signing_key())})
    with pytest.raises(CoseError, match="trusted"):
        verify_receipt(receipt, stmts[2], {})
