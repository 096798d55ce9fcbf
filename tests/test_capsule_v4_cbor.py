"""The hand-written CBOR of consumers.capsule_v4's signing path is cbor2's, byte for byte."""

from __future__ import annotations

import os

import cbor2
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from consumers import capsule_v4 as v4
from consumers.cose import sig_structure


@pytest.mark.parametrize("n", [0, 1, 23, 24, 255, 256, 65535, 65536, 70000])
def test_bstr_and_sig_structure_match_cbor2(n: int) -> None:
    b = os.urandom(n)
    assert v4._bstr(b) == cbor2.dumps(b)
    payload = os.urandom(32)
    assert v4._sig_structure(b, payload) == sig_structure(b, payload)


def test_producer_envelope_matches_cbor2() -> None:
    key = Ed25519PrivateKey.generate()
    cid = os.urandom(32).hex()
    env = v4.producer_envelope(cid, key)
    tag = cbor2.loads(env)
    assert tag.tag == 18
    protected, unprotected, payload, signature = tag.value
    assert unprotected == {} and payload == bytes.fromhex(cid)
    assert env == cbor2.dumps(cbor2.CBORTag(18, [protected, {}, payload, signature]))
    key.public_key().verify(signature, sig_structure(protected, payload))


def _statement_by_cbor2(body: dict, payload_json: bytes, key: Ed25519PrivateKey, kid: str) -> bytes:
    """The registration statement as cbor2 writes it (the form consumers.capsule_v4.statement had)."""
    raw_id = bytes.fromhex(body["capsule_id"])
    protected = cbor2.dumps({1: -8, 4: kid.encode("ascii"), 3: v4.ID_MEDIA_TYPE, 15: v4.claims_for(body)})
    signature = key.sign(sig_structure(protected, raw_id))
    unprotected = {v4.CAPSULE_LABEL: payload_json, v4.ENVELOPE_LABEL: v4.producer_envelope(body["capsule_id"], key)}
    return cbor2.dumps(cbor2.CBORTag(18, [protected, unprotected, raw_id, signature]))


@pytest.mark.parametrize(("developer", "action_id", "size"), [
    ("principal-gateway", "bench:1", 10),
    ("d" * 23, "a" * 24, 300),  # the heads of short strings and the first one-byte length
    ("dév-é✓", "ação:" + "x" * 300, 70000),  # non-ASCII text, two- and four-byte lengths
])
def test_registration_statement_matches_cbor2(developer: str, action_id: str, size: int) -> None:
    """The statement's hand-written protected map and container are cbor2's bytes for any claims and payload size."""
    key = Ed25519PrivateKey.generate()
    body = {"capsule_id": os.urandom(32).hex(), "developer": developer, "operator": "op", "action_id": action_id}
    payload_json = b'{"x":"' + b"y" * size + b'"}'
    for kid in ("k1", "0123456789abcdef"):
        assert v4.statement(body, payload_json, key, kid) == _statement_by_cbor2(body, payload_json, key, kid)
