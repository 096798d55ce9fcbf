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
