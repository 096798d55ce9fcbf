"""Capsule format "4" (draft-mih-scitt-agent-action-capsule-05) against a real NATS and the newest reference.

The reference verifier is the spec authors' own code from PyPI
(tests/refverifier.py installs it side by side per version); its public
format-4 vectors are vendored in tests/data/aac_vectors (SOURCE.json names
their commits and licence) and go through ``pgw verify`` as files.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import cbor2
import msgspec
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import capsule_v4 as v4
from consumers.capsule import GENESIS_HASH, ledger_entry_hash
from consumers.cose import CoseError, TrustedKey, decode_sign1, sig_structure, sign_statement
from consumers.signer import LEDGER_STREAM, LedgerEntry, Signer
from consumers.verifier import Result, payload_of, verify_many, verify_statement
from consumers.verify_v4 import check_envelope
from gateway.app import Gateway
from pgwcore.config import load_config
from pgwcore.publish import Publisher
from tests import refverifier
from tests.stored import stored_msgs
from tests.test_capsule_model import design_rows, verdict, vid
from tests.test_capsule_signer import kill9_signer_run, signer_keys, stream_items, wait_count

NEWEST = "0.12.0"  # the newest agent-action-capsule on PyPI when this was written (format "4", draft -05)
VECTORS = Path(__file__).parent / "data" / "aac_vectors"
REPO = Path(__file__).resolve().parent.parent
# Vectors where pgw verify and the reference may differ, with the draft section that allows it. Empty today.
KNOWN_DISAGREEMENTS: dict[str, str] = {}


def format4(make_config: Any, **kw: Any) -> Any:
    return make_config(signer={"capsule_format": "4", **kw})


async def format4_run(nc: Any, config: Any, tag: str = "f4-") -> list[tuple[str, bytes, dict[str, str]]]:
    """Statements of every verdict class from the real gateway (a blocked envelope) and the signer."""
    js = nc.jetstream()
    rows = design_rows(tag)
    async with Gateway(config, nc), Signer(config, nc):
        await js.publish(config.subjects.envelope("bot"), b'{"type": "error", "nonsense": 1}',
                         headers={"Nats-Msg-Id": f"bot:{tag}bad-1"})
        await wait_count(js, "PGW_REGISTRATION", 1)
        pub = Publisher(js, config.subjects)
        for v in rows:
            await pub.verdict(v)
        await wait_count(js, "PGW_REGISTRATION", len(rows) + 1)
    items = await stream_items(js, "PGW_REGISTRATION")
    assert len(items) == len(rows) + 1
    return items


def _errors(r: Result) -> list[tuple[str, str]]:
    return [(f.code, f.message) for f in r.findings if f.severity == "error"]


def run_reference_envelopes(pairs: list[tuple[str, bytes]]) -> list[dict[str, Any]]:
    """The reference's own Producer Envelope check (its [envelope] extra) over (capsule_id, envelope) pairs."""
    home = refverifier.install(NEWEST, extras=["envelope"])
    script = (
        "import json, sys\n"
        "from agent_action_capsule.producer_envelope import verify_producer_envelope\n"
        "out = []\n"
        "for cid, env in json.load(sys.stdin):\n"
        "    r = verify_producer_envelope(cid, bytes.fromhex(env))\n"
        "    out.append({'ok': r.ok, 'findings': [f.code for f in r.findings],\n"
        "                'key': r.public_key.hex() if r.public_key else None})\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(home)}
    proc = subprocess.run([sys.executable, "-s", "-c", script], input=json.dumps([(c, e.hex()) for c, e in pairs]),
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


async def test_real_run_every_verdict_class_accepted_by_newest_reference(nc: Any, make_config: Any,
                                                                        tmp_path: Path) -> None:
    """Every capsule of a real format-4 run passes pgw verify (profile 4) and the newest reference, no errors."""
    config = format4(make_config)
    items = await format4_run(nc, config)
    results = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(config))
    assert all(r.ok and r.profile == "4" for r in results), [(r.source, _errors(r)) for r in results if not r.ok]
    payloads = [payload_of(d) for _, d, _ in items]
    classes = Counter(p["disposition"].get("verdict_class", "executed") for p in payloads)
    assert set(classes) >= {"blocked", "denied", "hitl_dispatched", "resolved", "timeout", "executed",
                            "errored", "engine_failure"}, classes
    for (_, d, h), p in zip(items, payloads, strict=True):
        assert p["format_version"] == "4" and p["canonicalization_id"] == "jcs"
        assert h["Nats-Msg-Id"] == p["capsule_id"]
        msg = decode_sign1(d)
        assert msg.protected[3] == v4.ID_MEDIA_TYPE and msg.payload == bytes.fromhex(p["capsule_id"])
        assert set(msg.cwt_claims) == {1, 2}  # RFC 9943 iss and sub ({#registration})
        assert all("." in c["check_type"] for c in p.get("constraints", []))  # {#namespacing}
    assert any(p.get("constraints") for p in payloads)
    # the newest reference, over the whole set as its store
    ref = refverifier.run(payloads, version=NEWEST)
    bad = [(r.capsule_id, [(f.code, f.detail) for f in r.errors]) for r in ref if not r.ok or r.errors]
    assert not bad, json.dumps(bad, indent=1)
    over = [(r.capsule_id, f.code) for r in ref for f in r.findings if "overclaim" in f.code]
    assert not over, over  # not even an informational one ({#assurance})
    assert [r.recomputed for r in ref] == [p["capsule_id"] for p in payloads]
    # its derived modes are ours
    ours = {r.capsule_id: r.assurance for r in results}
    for r in ref:
        assert {k: r.derived[k] for k in ("effect_mode", "ledger_mode")} == \
            {k: ours[r.capsule_id][k] for k in ("effect_mode", "ledger_mode")}
    # every Producer Envelope passes the reference's own envelope check, under the signer's key
    envs = [(p["capsule_id"], decode_sign1(d).unprotected[v4.ENVELOPE_LABEL]) for (_, d, _), p in zip(items, payloads, strict=True)]
    checked = run_reference_envelopes(envs)
    keys = {k.public.public_bytes_raw().hex() for k in signer_keys(config).values()}
    assert all(c["ok"] and c["key"] in keys for c in checked), checked
    print(f"reference {NEWEST}:", refverifier.summary(ref), dict(classes),  # counts for docs/capsules.md
          "envelopes ok:", sum(c["ok"] for c in checked), "of", len(checked))
    # the reference's own substrate path (--transparent, scitt-cose) over a registration statement
    key = next(iter(signer_keys(config).values())).public
    pem = tmp_path / "issuer.pem"
    pem.write_bytes(key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    for _, d, _ in items[:3]:
        st = tmp_path / "statement.cose"
        st.write_bytes(d)
        t = ref_cli("--transparent", "--issuer-key", str(pem), str(st))
        assert t["ok"] and t["signature_verified"] and t["authenticated_capsule_id"] == payload_of(d)["capsule_id"], t


async def test_in_batch_supersedes_parent_is_committed_in_the_child_identity(nc: Any, make_config: Any) -> None:
    """A resolution signed in the same batch as its dispatch chains to the dispatch's final capsule_id."""
    config = format4(make_config)
    items = await format4_run(nc, config, tag="f4b-")
    by_vid = {payload_of(d)["pgw"]["verdict_id"]: payload_of(d) for _, d, _ in items}
    child, parent = by_vid[vid("f4b-resolved")], by_vid[vid("f4b-dispatch")]
    assert child["chain"] == {"parent_capsule_id": parent["capsule_id"], "relation": "supersedes"}
    assert child["assurance"]["ledger_mode"] == "chained" and parent["assurance"]["ledger_mode"] == "standalone"
    # chain is inside the format-4 preimage: a changed parent no longer recomputes
    tampered = dict(child, chain={"parent_capsule_id": "a" * 64, "relation": "supersedes"})
    r = verify_statement(json.dumps(tampered).encode(), keys={})
    assert "capsule_id_mismatch" in [f.code for f in r.findings]


async def test_redelivered_verdict_gives_one_identical_format4_capsule(nc: Any, make_config: Any) -> None:
    """A verdict signed twice (a redelivery) yields the same capsule_id and statement, stored once."""
    config = format4(make_config)
    js = nc.jetstream()
    v = verdict("f4-redeliver", "denied")
    async with Signer(config, nc) as signer:
        first, cid1, status1 = await signer.sign_verdict(v)
        again, cid2, status2 = await signer.sign_verdict(v)
    assert (status1, status2) == ("new", "replayed")
    assert cid1 == cid2 and first == again
    pub = Publisher(js, config.subjects)
    await pub.verdict(v)
    await pub.verdict(v)  # the same verdict reaches the stream twice
    async with Signer(config, nc):
        await wait_count(js, "PGW_REGISTRATION", 1)
    items = await stream_items(js, "PGW_REGISTRATION")
    assert [payload_of(d)["capsule_id"] for _, d, _ in items] == [cid1]


async def test_signer_ledger_detects_removed_and_reordered_format4_capsules(nc: Any, make_config: Any) -> None:
    """The store-level hash chain over format-4 capsule ids breaks when a link is removed or two are swapped."""
    config = format4(make_config)
    await format4_run(nc, config, tag="f4l-")
    entries = [msgspec.json.decode(m.data, type=LedgerEntry) for m in await stored_msgs(nc.jetstream(), LEDGER_STREAM)]

    def intact(chain: list[Any]) -> bool:
        prev = GENESIS_HASH
        for e in chain:
            body = json.loads(e.payload)
            if v4.compute_capsule_id(body) != e.capsule_id or e.prev_hash != prev:
                return False
            if ledger_entry_hash(e.position, e.capsule_id, body.get("chain"), prev) != e.hash:
                return False
            prev = e.hash
        return True

    assert intact(entries)
    renumber = [msgspec.structs.replace(e, position=i + 1) for i, e in enumerate(entries[:3] + entries[4:])]
    assert not intact(renumber)
    swapped = [*entries[:2], entries[3], entries[2], *entries[4:]]
    assert not intact(swapped)


def _vector_cases() -> list[Path]:
    return sorted(p for p in VECTORS.iterdir() if p.is_dir())


def ref_cli(*args: str) -> dict[str, Any]:
    """One run of the newest reference's own CLI (``verify ... --json``); its JSON answer."""
    home = refverifier.install(NEWEST, extras=["envelope"])
    proc = subprocess.run([sys.executable, "-s", "-m", "agent_action_capsule.cli", "verify", "--json", *args],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(home)})
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return json.loads(proc.stdout)


def pgw_verify_one(path: Path, tmp_path: Path) -> dict[str, Any]:
    """``pgw verify --json FILE`` (one statement or capsule file, so no store), as a user runs it."""
    proc = subprocess.run([str(Path(sys.executable).parent / "pgw"), "verify", "--json", str(path)],
                          capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("{")), None)
    assert line is not None, proc.stdout + proc.stderr
    return json.loads(line)


def test_reference_vectors_through_pgw_verify_agree_with_the_newest_reference(tmp_path: Path) -> None:
    """Each vendored reference vector, verified alone, gets the same ok, capsule_id and modes from both sides."""
    cases = sorted(p for p in VECTORS.iterdir() if p.is_dir())
    assert len(cases) == 13
    disagree, accepted = {}, 0
    for case in cases:
        o = pgw_verify_one(case / "input.json", tmp_path)
        r = ref_cli(str(case / "input.json"))
        same = o["ok"] == r["ok"]
        if r["capsule_id_recomputed"] is not None:
            same = same and r["capsule_id_recomputed"] == o.get("capsule_id")
        if r["ok"]:
            same = same and all(o["assurance"][k] == r["derived"][k] for k in ("effect_mode", "ledger_mode"))
        if not same:
            disagree[case.name] = (o, r)
        accepted += o["ok"]
    assert set(disagree) == set(KNOWN_DISAGREEMENTS), json.dumps(disagree, indent=1)[:4000]
    print(f"vectors: {len(cases)} run, {len(cases) - len(disagree)} agree, {accepted} accepted")  # docs counts
    assert accepted == 4  # the three canonical-* cases and pos-v05-reference-counterparty-inclusion


def test_format4_envelope_profile_is_exact() -> None:
    """An extra protected label, a non-empty unprotected map or another payload makes the envelope fail."""
    k = Ed25519PrivateKey.generate()
    cid = "ab" * 32
    env = v4.producer_envelope(cid, k)
    assert check_envelope(env, cid) == k.public_key().public_bytes_raw()
    tag = cbor2.loads(env)
    prot, _, payload, sig = tag.value
    with_extra = cbor2.dumps(cbor2.CBORTag(18, [cbor2.dumps({**cbor2.loads(prot), 15: {1: "x"}}), {}, payload, sig]))
    unprot = cbor2.dumps(cbor2.CBORTag(18, [prot, {4: b"x"}, payload, sig]))
    for bad, code in ((with_extra, "envelope_protected_headers"), (unprot, "envelope_unprotected_not_empty")):
        with pytest.raises(CoseError) as e:
            check_envelope(bad, cid)
        assert e.value.code == code
    with pytest.raises(CoseError) as e:
        check_envelope(env, "cd" * 32)
    assert e.value.code == "envelope_payload_mismatch"


async def _pgw_verify(config: Any, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pgwcli.commands.capsules", "--server", config.nats_url, "--data-dir", config.data_dir,
        "verify", *args, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode() + err.decode()


async def test_pgw_verify_ledger_finds_a_removed_format4_capsule(nc: Any, make_config: Any) -> None:
    """pgw verify --ledger passes a whole format-4 run and fails once one of its capsules is deleted."""
    config = format4(make_config)
    items = await format4_run(nc, config, tag="f4v-")
    rc, out = await _pgw_verify(config, "--stream", "PGW_REGISTRATION", "--ledger")
    assert rc == 0, out
    assert f"OK   ledger {LEDGER_STREAM}: {len(items)} link(s)" in out and "format=4" in out
    gone = payload_of(items[4][1])["capsule_id"]
    await nc.jetstream().delete_msg("PGW_REGISTRATION", int(items[4][0].split("#")[1]))
    rc, out = await _pgw_verify(config, "--stream", "PGW_REGISTRATION", "--ledger")
    assert rc == 1 and f"capsule_missing: capsule {gone}" in out, out


@pytest.mark.slow
async def test_kill9_mid_batch_format4_every_verdict_exactly_one_capsule(nc: Any, make_config: Any) -> None:
    """SIGKILL of a format-4 `pgw signer` mid-batch, then restart: one capsule per verdict, ledger intact."""
    config = format4(make_config)
    n = 300
    verdicts, items, _ = await kill9_signer_run(nc, config, "4", "k4-", n)
    by_verdict = Counter(payload_of(d)["pgw"]["verdict_id"] for _, d, _ in items)
    assert len(items) == n and set(by_verdict.values()) == {1}
    assert set(by_verdict) == {v.verdict_id for v in verdicts}
    results = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(config))
    assert all(r.ok and r.profile == "4" for r in results)
    rc, out = await _pgw_verify(config, "--stream", "PGW_REGISTRATION", "--ledger")
    assert rc == 0 and f"{n} link(s)" in out, out[-2000:]


def test_the_docs_tell_how_to_pick_format_2(tmp_path: Path) -> None:
    """docs/capsules.md's TOML for format "2" loads and selects it; without it the default is format "4"."""
    text = (REPO / "docs" / "capsules.md").read_text().split('## Profiles: format "2" or "4"', 1)[1]
    block = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    toml = tmp_path / "pgw.toml"
    toml.write_text(block)
    assert load_config(toml).signer.capsule_format == "2"
    assert load_config(None).signer.capsule_format == "4"


def _statement_parts(st: bytes) -> tuple[bytes, dict[Any, Any], bytes, bytes]:
    prot, unprot, payload, sig = cbor2.loads(st).value
    return prot, unprot, payload, sig


def test_format4_statement_rules_each_fail_when_broken() -> None:
    """A changed capsule, a re-pointed capsule_id, an untrusted envelope key and missing CWT claims each fail."""
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    keys = {"k1": TrustedKey("k1", key.public_key())}
    b = v4.from_verdict(design_rows()[1], operator="acme", salt="00" * 32)
    good = v4.statement(b.body, b.payload, key, "k1")
    assert verify_statement(good, keys=keys).ok

    def codes(st: bytes) -> list[str]:
        r = verify_statement(st, keys=keys)
        assert not r.ok and r.profile == "4"
        return [f.code for f in r.findings if f.severity == "error"]

    prot, unprot, payload, sig = _statement_parts(good)
    changed = dict(b.body, operator="mallory")  # capsule edited, id kept
    st = cbor2.dumps(cbor2.CBORTag(18, [prot, {**unprot, v4.CAPSULE_LABEL: json.dumps(changed).encode()}, payload, sig]))
    assert "capsule_id_mismatch" in codes(st)
    resealed = v4.seal(changed)  # capsule edited and re-sealed: its id is no longer the signed one
    st = cbor2.dumps(cbor2.CBORTag(18, [prot, {**unprot, v4.CAPSULE_LABEL: resealed.payload}, payload, sig]))
    assert "statement_capsule_id_mismatch" in codes(st)
    st = cbor2.dumps(cbor2.CBORTag(18, [prot, {**unprot, v4.ENVELOPE_LABEL: v4.producer_envelope(b.capsule_id, other)},
                                        payload, sig]))
    assert "envelope_key_untrusted" in codes(st)
    bare = cbor2.dumps({1: -8, 4: b"k1", 3: v4.ID_MEDIA_TYPE})
    st = cbor2.dumps(cbor2.CBORTag(18, [bare, unprot, payload, key.sign(sig_structure(bare, payload))]))
    assert "cwt_claims_missing" in codes(st)
    # a chained claim without a chain block is an (informational) overclaim, as {#verification} check 7 says
    over = v4.seal({**b.body, "assurance": {**b.body["assurance"], "ledger_mode": "chained"}})
    r = verify_statement(v4.statement(over.body, over.payload, key, "k1"), keys=keys)
    assert r.ok and "ledger_overclaim" in [f.code for f in r.findings]


def test_a_format4_capsule_signed_as_json_is_not_the_draft_envelope() -> None:
    """A COSE_Sign1 over a format-4 capsule's JSON (the format-2 shape) is refused; its Class 1 checks still run."""
    key = Ed25519PrivateKey.generate()
    b = v4.from_verdict(design_rows()[1], operator="acme", salt="00" * 32)
    st = sign_statement(b.payload, key, "k1", v4.claims_for(b.body), "application/agent-action-capsule+json")
    r = verify_statement(st, keys={"k1": TrustedKey("k1", key.public_key())})
    assert not r.ok and r.profile == "4"
    assert [f.code for f in r.findings if f.severity == "error"] == ["statement_payload_invalid"]
    assert r.assurance == {"attestation_mode": "self_attested", "effect_mode": "not_applicable",
                           "ledger_mode": "standalone"}


_FUZZ_KEY = Ed25519PrivateKey.generate()
_FUZZ_B = v4.from_verdict(design_rows()[8], operator="acme", salt="00" * 32)
_FUZZ_GOOD = v4.statement(_FUZZ_B.body, _FUZZ_B.payload, _FUZZ_KEY, "k1")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_FUZZ_GOOD) - 1), st.integers(0, 255)), min_size=1, max_size=6),
       st.sampled_from([None, b"{", b"{\"format_version\": \"4\", \"canonicalization_id\": \"jcs\"}"]))
def test_format4_verification_never_throws_on_damaged_statements(edits: list[tuple[int, int]],
                                                                  head: bytes | None) -> None:
    """Any byte edits of a format-4 statement (or a JSON-looking prefix) give a result, never an exception."""
    data = bytearray(_FUZZ_GOOD)
    for i, b in edits:
        data[i] = b
    blob = bytes(data) if head is None else head + bytes(data[:40])
    r = verify_statement(blob, keys={"k1": TrustedKey("k1", _FUZZ_KEY.public_key())})
    assert isinstance(r.ok, bool)
    assert not any(f.code == "verifier_internal_error" for f in r.findings), r.findings


@pytest.mark.parametrize("body", [
    {"a": {"capsule_id": "0" * 64}, "pgw": {"capsule_id": "0" * 64}},  # the mark's member nested too: encoded twice
    {"action_id": "a", "chain": {"parent_capsule_id": "1" * 64, "relation": "supersedes"}, "z": [None, "0" * 64]},
    {"z\U0001f600": "key above U+D800 (the reference's sort)", "a": {"capsule_id": "x"}},
    {},
])
def test_one_encode_gives_the_id_and_payload_of_two(body: dict[str, Any]) -> None:
    """seal() encodes the preimage once, with a mark where capsule_id goes ({#identity}): the id is SHA-256 of
    the plain JCS of the preimage and the payload the JCS of the preimage with the id, as two encodes give."""
    import hashlib

    import rfc8785

    built = v4.seal(body)
    pre = {**{k: v for k, v in body.items() if k != "capsule_id"}, "spec_version": v4.SPEC_VERSION,
           "format_version": v4.FORMAT, "canonicalization_id": v4.CANONICALIZATION_ID}
    assert built.capsule_id == hashlib.sha256(rfc8785.dumps(pre)).hexdigest()
    assert built.payload == rfc8785.dumps({**pre, "capsule_id": built.capsule_id})
    assert built.body == {**pre, "capsule_id": built.capsule_id}
