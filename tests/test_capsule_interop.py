"""Smaller findings of the outside check (issue 14): COSE tagging, algorithms, kids, namespacing."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import cbor2
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed448 import Ed448PrivateKey

from consumers import capsule as capm
from consumers.cose import sig_structure
from consumers.signer import claims_for
from consumers.verifier import verify_statement
from pgwcli.commands import capsules as cli
from pgwcore.config import load_config
from tests.test_capsule_cose import signing_key, trusted
from tests.test_capsule_model import design_rows, make

KEY = signing_key()
KEYS = {KEY.kid: trusted(KEY)}


def statement(sign: Any, *, alg: int = -8, kid: str = KEY.kid, tagged: bool = True) -> bytes:
    """A capsule statement with a chosen alg and kid, signed by ``sign`` (hand-built, RFC 9052 §4.4)."""
    cap = make(design_rows()[1])
    payload = cap.to_json()
    prot = cbor2.dumps({1: alg, 4: kid.encode(), 3: capm.MEDIA_TYPE, 15: claims_for(cap.to_dict())})
    body = [prot, {}, payload, sign(sig_structure(prot, payload))]
    return cbor2.dumps(cbor2.CBORTag(18, body) if tagged else body)


def errors(data: bytes, **kw: Any) -> list[str]:
    return [f.code for f in verify_statement(data, keys=KEYS, **kw).findings if f.severity == "error"]


def test_untagged_sign1_is_accepted() -> None:
    """A valid untagged COSE_Sign1 verifies (RFC 9052 §2: the tag is optional), with an info finding."""
    res = verify_statement(statement(KEY.private.sign, tagged=False), keys=KEYS)
    assert res.ok, res.findings
    assert [(f.code, f.severity) for f in res.findings] == [("cose_untagged", "info")]


def test_unsupported_algorithms_are_refused_as_unsupported() -> None:
    """Ed448 (alg -8 with a 114-byte signature, or alg -53) and ES256 under an EdDSA key: unsupported,
    not a bad signature."""
    ed448 = Ed448PrivateKey.generate()
    p256 = ec.generate_private_key(ec.SECP256R1())
    es256 = statement(lambda m: p256.sign(m, ec.ECDSA(hashes.SHA256())), alg=-7)
    assert errors(statement(ed448.sign)) == ["cose_alg_unsupported"]
    assert errors(statement(ed448.sign, alg=-53)) == ["cose_alg_unsupported"]
    assert errors(es256) == ["cose_alg_unsupported"]
    # a genuinely bad signature is still that
    assert errors(statement(signing_key().private.sign)) == ["cose_signature_invalid"]


async def test_producer_chosen_kid_verifies_under_an_explicit_key(tmp_path: Path, capsys: Any) -> None:
    """`pgw verify --key PEM` trusts that key whatever kid the producer chose; another key still fails."""
    data = statement(KEY.private.sign, kid="producer-key-2026")
    assert errors(data) == ["cose_key_untrusted"]
    f = tmp_path / "c.cose"
    f.write_bytes(data)
    pem = tmp_path / "signer.pem"
    pem.write_bytes(KEY.public.public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo))
    config = load_config(None, data_dir=str(tmp_path / "data"))

    async def verify(*keys: str) -> int:
        args = argparse.Namespace(paths=[str(f)], stream=[], key=list(keys), ts_key=[], store=[], json=False)
        return await cli.handle_verify(args, config)

    assert await verify(str(pem)) == 0
    assert "cose_kid_explicit_key" in capsys.readouterr().out
    other = signing_key().public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    assert await verify(other) == 1
    assert "cose_signature_invalid" in capsys.readouterr().out


def test_constraint_check_type_is_namespaced() -> None:
    """Constraint ids and check_type values carry the io.pgw. prefix (spec 004 §8.1, §9.1)."""
    caps = [make(v).to_dict() for v in design_rows()]
    records = [c for cap in caps for c in cap.get("constraints", [])]
    assert records
    for c in records:
        assert c["id"].startswith("io.pgw.") and c["check_type"].startswith("io.pgw."), c
