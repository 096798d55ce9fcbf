"""TS keys and receipt verification (consumers.ts_keys, consumers.receipts): algorithms, leaves, refusals."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import cbor2
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from consumers.cose import CoseError, inclusion_path, merkle_root, sig_structure, sign_statement
from consumers.receipts import statement_leaf, verify_receipt
from consumers.ts_keys import (
    EDDSA,
    ES256,
    ES384,
    TsKey,
    UnsupportedTsKey,
    key_from_jwk,
    key_of_public,
    keys_from_jwks,
    load_ts_key,
    pinned_ts_keys_path,
    read_pinned_ts_keys,
    write_pinned_ts_keys,
)
from subjects.errors import PgwError

ISSUER = Ed25519PrivateKey.generate()


def statements(n: int) -> list[bytes]:
    return [sign_statement(json.dumps({"n": i}).encode(), ISSUER, "iss-kid", {1: "iss"}, "application/json")
            for i in range(n)]


def private(alg: int) -> Any:
    return {EDDSA: Ed25519PrivateKey.generate, ES256: lambda: ec.generate_private_key(ec.SECP256R1()),
            ES384: lambda: ec.generate_private_key(ec.SECP384R1())}[alg]()


def sign(key: Any, alg: int, tbs: bytes) -> bytes:
    if alg == EDDSA:
        return key.sign(tbs)
    h, size = (hashes.SHA256, 32) if alg == ES256 else (hashes.SHA384, 48)
    r, s = decode_dss_signature(key.sign(tbs, ec.ECDSA(h())))
    return r.to_bytes(size, "big") + s.to_bytes(size, "big")  # RFC 9053 §2.1: r || s


def receipt(key: Any, alg: int, sts: list[bytes], index: int, *, leaf: str = "payload", kid: str = "ts-key",
            protected: dict[Any, Any] | None = None, unprotected: dict[Any, Any] | None = None) -> bytes:
    """A receipt as a TS would issue it: detached root payload, proof in label 396 (COSE Receipts)."""
    leaves = [statement_leaf(s, leaf) for s in sts]  # type: ignore[arg-type]
    prot = cbor2.dumps({1: alg, 4: kid.encode(), 395: 1, **(protected or {})})
    root = merkle_root(leaves)
    proof = cbor2.dumps([len(leaves), index, inclusion_path(index, leaves)])
    unprot = {396: {-1: [proof]}, **(unprotected or {})}
    return cbor2.dumps(cbor2.CBORTag(18, [prot, unprot, None, sign(key, alg, sig_structure(prot, root))]))


@pytest.mark.parametrize("alg", [EDDSA, ES256, ES384])
@pytest.mark.parametrize("leaf", ["statement", "payload"])
def test_receipt_verifies_per_algorithm_and_leaf(alg: int, leaf: str) -> None:
    """EdDSA, ES256 and ES384 receipts verify over trees of 1..7 entries with either leaf construction,
    and the construction that verified is reported."""
    key = private(alg)
    ts = {"ts-key": key_of_public(key.public_key(), "ts-key")}
    for n in range(1, 8):
        sts = statements(n)
        for i in range(n):
            info = verify_receipt(receipt(key, alg, sts, i, leaf=leaf), sts[i], ts)
            assert (info.leaf, info.tree_size, info.leaf_index, info.alg) == (leaf, n, i, alg)


def test_receipt_for_another_statement_fails() -> None:
    """A valid receipt for one statement does not verify for its neighbour, under any leaf construction."""
    key = private(ES256)
    sts = statements(4)
    ts = {"ts-key": key_of_public(key.public_key(), "ts-key")}
    with pytest.raises(CoseError) as e:
        verify_receipt(receipt(key, ES256, sts, 1), sts[2], ts)
    assert e.value.code == "receipt_signature_invalid"


def test_pinned_leaf_refuses_the_other_construction() -> None:
    """With the leaf pinned to `statement`, a payload-leaf receipt does not verify."""
    key = private(EDDSA)
    sts = statements(3)
    ts = {"ts-key": key_of_public(key.public_key(), "ts-key")}
    r = receipt(key, EDDSA, sts, 0, leaf="payload")
    assert verify_receipt(r, sts[0], ts, "payload").leaf == "payload"
    with pytest.raises(CoseError):
        verify_receipt(r, sts[0], ts, "statement")


def test_algorithm_is_pinned_per_key() -> None:
    """A receipt whose protected alg differs from the key's pinned algorithm is refused before any math."""
    key = private(ES256)
    sts = statements(2)
    es384_key = {"ts-key": key_of_public(private(ES384).public_key(), "ts-key")}
    with pytest.raises(CoseError) as e:
        verify_receipt(receipt(key, ES256, sts, 0), sts[0], es384_key)
    assert e.value.code == "receipt_alg_unsupported"
    ed = Ed25519PrivateKey.generate()
    ts = {"ts-key": key_of_public(key.public_key(), "ts-key")}
    with pytest.raises(CoseError) as e:  # an EdDSA-labelled receipt against an ES256 key
        verify_receipt(receipt(ed, EDDSA, sts, 0), sts[0], ts)
    assert e.value.code == "receipt_alg_unsupported"


@pytest.mark.parametrize("alg", [-36, -37, -16, -47])  # ES512, PS256, SHA-256 (not a signature), ES256K
def test_unsupported_receipt_algorithm_is_refused_as_unsupported(alg: int) -> None:
    """An algorithm outside EdDSA/ES256/ES384 is refused as unsupported, not as a bad signature."""
    key = private(ES256)
    sts = statements(1)
    r = receipt(key, ES256, sts, 0, protected={1: alg})
    with pytest.raises(CoseError) as e:
        verify_receipt(r, sts[0], {"ts-key": key_of_public(key.public_key(), "ts-key")})
    assert e.value.code == "receipt_alg_unsupported"


@pytest.mark.parametrize(("where", "code"), [({1: ES256}, "cose_unprotected_alg"),
                                             ({2: [1]}, "cose_unprotected_crit")])
def test_unprotected_alg_or_crit_is_refused(where: dict[int, Any], code: str) -> None:
    """alg or crit in a receipt's unprotected header is refused (RFC 9052 §3.1), even if all else verifies."""
    key = private(ES256)
    sts = statements(2)
    r = receipt(key, ES256, sts, 1, unprotected=where)
    with pytest.raises(CoseError) as e:
        verify_receipt(r, sts[1], {"ts-key": key_of_public(key.public_key(), "ts-key")})
    assert e.value.code == code


def test_unknown_critical_label_is_refused() -> None:
    """A protected crit naming a label the verifier does not understand is refused."""
    key = private(EDDSA)
    sts = statements(1)
    r = receipt(key, EDDSA, sts, 0, protected={2: [999], 999: "x"})
    with pytest.raises(CoseError) as e:
        verify_receipt(r, sts[0], {"ts-key": key_of_public(key.public_key(), "ts-key")})
    assert e.value.code == "cose_crit_unknown"


def test_kid_matching() -> None:
    """A key with a kid answers only that kid; a key without one (scittles' JWK) answers any kid."""
    key = private(ES256)
    sts = statements(2)
    r = receipt(key, ES256, sts, 0, kid="ts-key")
    with pytest.raises(CoseError) as e:
        verify_receipt(r, sts[0], {"other": key_of_public(key.public_key(), "other")})
    assert e.value.code == "receipt_key_untrusted"
    assert verify_receipt(r, sts[0], {"": key_of_public(key.public_key())}).kid == "ts-key"


def test_tampered_proof_fails() -> None:
    """Changing one hash of the inclusion path breaks the receipt."""
    key = private(ES256)
    sts = statements(5)
    r = cbor2.loads(receipt(key, ES256, sts, 2))
    size, index, path = cbor2.loads(r.value[1][396][-1][0])
    path[0] = bytes(32)
    r.value[1][396][-1][0] = cbor2.dumps([size, index, path])
    with pytest.raises(CoseError):
        verify_receipt(cbor2.dumps(r), sts[2], {"ts-key": key_of_public(key.public_key(), "ts-key")})


# -- keys ----------------------------------------------------------------------------


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def test_jwk_algorithms_follow_the_curve() -> None:
    """OKP Ed25519 -> EdDSA, EC P-256 -> ES256, EC P-384 -> ES384; the JWK round-trips."""
    for alg, k in ((EDDSA, Ed25519PrivateKey.generate()), (ES256, private(ES256)), (ES384, private(ES384))):
        jwk = key_of_public(k.public_key(), "k1").to_jwk()
        back = key_from_jwk(jwk)
        assert (back.alg, back.kid, back.to_jwk()) == (alg, "k1", jwk)


@pytest.mark.parametrize("jwk", [
    {"kty": "RSA", "n": "AQAB", "e": "AQAB"},
    {"kty": "OKP", "crv": "Ed448", "x": _b64(ed448.Ed448PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw))},
    {"kty": "EC", "crv": "P-521", "x": "AA", "y": "AA"},
    {"kty": "EC", "crv": "P-256", "x": _b64(bytes(32)), "y": _b64(bytes(32))},  # not on the curve
])
def test_unsupported_jwks_are_refused_clearly(jwk: dict[str, str]) -> None:
    """RSA, Ed448, P-521 and an off-curve point are refused with UnsupportedTsKey naming what was found."""
    with pytest.raises(UnsupportedTsKey) as e:
        key_from_jwk(jwk)
    assert "supported: EdDSA/Ed25519, ES256/P-256, ES384/P-384" in str(e.value)


def test_jwk_alg_contradicting_its_curve_is_refused() -> None:
    """A P-256 JWK that says alg ES384 is refused, not trusted under either algorithm."""
    jwk = key_of_public(private(ES256).public_key()).to_jwk() | {"alg": "ES384"}
    with pytest.raises(UnsupportedTsKey, match="does not match"):
        key_from_jwk(jwk)


def test_jwks_skips_unusable_keys_but_needs_one() -> None:
    """A JWK Set with an RSA key beside a P-256 one yields the P-256 key; one with only RSA is refused."""
    good = key_of_public(private(ES256).public_key(), "a").to_jwk()
    assert list(keys_from_jwks({"keys": [{"kty": "RSA"}, good]})) == ["a"]
    with pytest.raises(UnsupportedTsKey, match="no usable key"):
        keys_from_jwks({"keys": [{"kty": "RSA"}]})


def test_load_ts_key_forms(tmp_path: Path) -> None:
    """Configured TS keys: Ed25519 hex, PEM (P-256, P-384, Ed25519), a JWK file, inline JWK/JWKS JSON;
    ts_key_id names a key that has no kid; an RSA PEM and a missing file are refused with the reason."""
    ed = Ed25519PrivateKey.generate().public_key()
    raw = ed.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    assert [k.alg for k in load_ts_key(raw).values()] == [EDDSA]
    for pub, alg in ((private(ES256).public_key(), ES256), (private(ES384).public_key(), ES384), (ed, EDDSA)):
        pem = tmp_path / f"k{alg}.pem"
        pem.write_bytes(pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        assert [(kid, k.alg) for kid, k in load_ts_key(str(pem)).items()] == [("", alg)]
        assert list(load_ts_key(str(pem), "ts-key")) == ["ts-key"]
    jwk = key_of_public(private(ES256).public_key(), "j").to_jwk()
    f = tmp_path / "k.json"
    f.write_text(json.dumps(jwk))
    assert list(load_ts_key(str(f))) == ["j"]
    assert list(load_ts_key(json.dumps({"keys": [jwk]}))) == ["j"]
    rsa_pem = tmp_path / "rsa.pem"
    rsa_pem.write_bytes(rsa.generate_private_key(65537, 2048).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    with pytest.raises(UnsupportedTsKey, match="RSA"):
        load_ts_key(str(rsa_pem))
    with pytest.raises(PgwError, match="not hex, JSON, or an existing file"):
        load_ts_key(str(tmp_path / "missing.pem"))


def test_pinned_file_round_trip_and_legacy_hex(tmp_path: Path) -> None:
    """Pinned keys are stored as JWKs with their algorithm; the older {kid: Ed25519 hex} file still reads."""
    keys = {"a": key_of_public(private(ES256).public_key(), "a"), "": key_of_public(private(ES384).public_key())}
    write_pinned_ts_keys(tmp_path, keys)
    back = read_pinned_ts_keys(tmp_path)
    assert {kid: (k.alg, k.to_jwk()) for kid, k in back.items()} == {kid: (k.alg, k.to_jwk()) for kid, k in keys.items()}
    ed = Ed25519PrivateKey.generate().public_key()
    pinned_ts_keys_path(tmp_path).write_text(json.dumps(
        {"old": ed.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()}))
    old = read_pinned_ts_keys(tmp_path)["old"]
    assert isinstance(old, TsKey) and old.alg == EDDSA


def test_the_documented_ts_configuration_loads() -> None:
    """docs/capsules.md's Transparency Service block is a valid configuration with those values."""
    import re
    import tomllib

    from pgwcore.config import load_config

    doc = (Path(__file__).resolve().parent.parent / "docs" / "capsules.md").read_text()
    block = re.search(r"### Configuring the Transparency Service.*?```toml\n(.*?)```", doc, re.S).group(1)
    reg = tomllib.loads(block)["registrar"]
    config = load_config(None, registrar=reg)
    assert config.registrar.ts_url == "https://ts.example" and config.registrar.ts_public_key == "ts-key.pem"


def test_a_ts_url_that_is_not_one_is_refused_at_start() -> None:
    """A registrar.ts_url that is no http(s) URL is a configuration error naming it; before, every
    registration failed as if the Transparency Service were down, and the registrar retried for ever."""
    from pgwcore.config import load_config
    from subjects.errors import ConfigError

    for bad in ("not a url", "ts.example", "ftp://ts.example", "https://"):
        with pytest.raises(ConfigError, match=r"registrar\.ts_url"):
            load_config(None, registrar={"ts_url": bad})
    assert load_config(None, registrar={"ts_url": "http://127.0.0.1:8080/"}).registrar.ts_url
