"""The registrar against the real scittles Transparency Service (issue 14, spec 004 §3.2).

scittles runs from its own source (``../shared/peers/scittles``) in a venv of
its own (``tests/scittles_peer.py``): its ES256 key comes from ``jwks_uri``,
its Merkle leaf is built from the payload hash, and it answers ``400 Already
Registered`` to a statement it holds. One scittles serves the session, so
each test registers capsules of its own (a unique tag in every verdict id).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from consumers.cose import decode_sign1, inclusion_path, leaf_hash, merkle_root, root_from_path
from consumers.receipts import statement_leaf
from consumers.registrar import DLQ_STREAM, Registrar
from consumers.signer import Signer
from consumers.ts_keys import keys_from_jwks, pinned_ts_keys_path, read_pinned_ts_keys
from consumers.verifier import payload_of, verify_many
from pgwcli.commands import capsules as cli
from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.metrics import REGISTRY
from pgwcore.publish import Publisher
from subjects.names import VERDICT_CLASSES
from tests.scittles_peer import Scittles, run_in_peer
from tests.test_capsule_model import design_rows
from tests.test_capsule_registrar import counted
from tests.test_capsule_signer import signer_keys, stream_items, wait_count

PGW = str(Path(sys.executable).parent / "pgw")


def _config(make_config: Any, ts: Scittles, **registrar: object) -> Config:
    reg: dict[str, object] = {"ts_url": ts.url, "backoff_base_s": 0.05, "backoff_max_s": 0.2,
                              "http_timeout_s": 5.0, "poll_timeout_s": 5.0}
    reg.update(registrar)
    return make_config(registrar=reg)


async def _signed(nc: Any, config: Config, rows: list[Any]) -> list[bytes]:
    js = nc.jetstream()
    pub = Publisher(js, config.subjects)
    for v in rows:
        await pub.verdict(v)
    async with Signer(config, nc):
        await wait_count(js, "PGW_REGISTRATION", len(rows))
    return [d for _, d, _ in await stream_items(js, "PGW_REGISTRATION")]


def _jwks(ts: Scittles) -> Any:
    import urllib.request

    with urllib.request.urlopen(f"{ts.url}/jwks", timeout=5) as r:
        return json.loads(r.read())


def _ts_entries(ts: Scittles) -> int:
    with sqlite3.connect(ts.data / "ts.db") as db:
        return db.execute("select count(*) from entries").fetchone()[0]


async def test_keys_from_jwks_uri_pinned_and_anchored(scittles: Scittles, nc: Any, make_config: Any,
                                                      capsys: Any) -> None:
    """With no configured key, the ES256 key scittles publishes at jwks_uri is pinned on first use; every
    capsule is anchored with a payload-leaf receipt, and `pgw verify --stream` reports each one anchored."""
    rows = design_rows(f"jw{uuid.uuid4().hex[:8]}-")
    config = _config(make_config, scittles)
    await _signed(nc, config, rows)
    before = _ts_entries(scittles)
    js = nc.jetstream()
    async with Registrar(config, nc) as reg:
        await wait_count(js, "PGW_CAPSULES", len(rows))
        await counted(reg, len(rows))
        assert reg.registered == len(rows) and reg.already_registered == 0
    assert _ts_entries(scittles) == before + len(rows)  # each statement in the TS's log once
    pinned = json.loads(pinned_ts_keys_path(config.data_path).read_text())
    assert [(j["kty"], j["crv"], j["alg"]) for j in pinned.values()] == [("EC", "P-256", "ES256")]
    items = await stream_items(js, "PGW_CAPSULES")
    assert {h["Pgw-Receipt-Leaf"] for _, _, h in items} == {"payload"}
    assert {h["Nats-Msg-Id"] for _, _, h in items} == {payload_of(d)["capsule_id"] for _, d, _ in items}
    capsys.readouterr()
    args = argparse.Namespace(paths=[], stream=["PGW_CAPSULES"], key=[], ts_key=[], store=[], json=True)
    assert await cli.handle_verify(args, config) == 0
    results = [msgspec.json.decode(line) for line in capsys.readouterr().out.splitlines()]
    assert len(results) == len(rows) and all(r["ok"] for r in results)
    assert {r["assurance"]["attestation_mode"] for r in results} == {"anchored"}
    # the open items are still computed over the anchored capsules
    assert await cli.handle_open_items(argparse.Namespace(paths=[], stream=["PGW_CAPSULES"], json=True),
                                       config) == 0
    open_rows = [msgspec.json.decode(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["verdict_class"] for r in open_rows] == ["blocked"]


async def test_already_registered_after_a_crash_is_finished(scittles: Scittles, nc: Any, make_config: Any,
                                                            tmp_path: Path) -> None:
    """A statement scittles already holds (POSTed before a crash, never acked) is answered 400 Already
    Registered; the registrar fetches the existing entry's receipt, verifies it and anchors the capsule:
    nothing dead-lettered, nothing logged twice by the TS."""
    import urllib.request

    rows = design_rows(f"ar{uuid.uuid4().hex[:8]}-")[:4]
    config = _config(make_config, scittles)
    statements = await _signed(nc, config, rows)
    def post(st: bytes) -> int:
        req = urllib.request.Request(f"{scittles.url}/entries", data=st, headers={"Content-Type": "application/cose"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status

    for st in statements[:2]:  # the crash: the TS took these, the registrar never acked them
        assert await asyncio.to_thread(post, st) == 201
    before = _ts_entries(scittles)
    js = nc.jetstream()
    metric = {r: REGISTRY.get_sample_value("pgw_registrar_statements_total", {"result": r}) or 0.0
              for r in ("registered", "already_registered")}
    with structlog.testing.capture_logs() as logs:
        async with Registrar(config, nc) as reg:
            await wait_count(js, "PGW_CAPSULES", len(rows))
            await counted(reg, len(rows))
            assert reg.already_registered == 2 and reg.dead_lettered == 0
    assert _ts_entries(scittles) == before + 2
    assert (await js.stream_info(DLQ_STREAM)).state.messages == 0
    anchored = [e for e in logs if e["event"].startswith("capsule anchored")]
    assert sorted(e["already_registered"] for e in anchored) == [False, False, True, True]
    after = {r: REGISTRY.get_sample_value("pgw_registrar_statements_total", {"result": r}) for r in metric}
    assert (after["registered"] - metric["registered"], after["already_registered"] - metric["already_registered"]) \
        == (2, 2)
    ts_keys = read_pinned_ts_keys(config.data_path)
    items = await stream_items(js, "PGW_CAPSULES")
    results = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(config), ts_keys=ts_keys)
    assert all(r.ok and r.assurance["attestation_mode"] == "anchored" for r in results), results


@pytest.mark.parametrize("form", ["pem", "jwk"])
async def test_pinned_key_in_configuration(scittles: Scittles, nc: Any, make_config: Any, tmp_path: Path,
                                           form: str) -> None:
    """scittles' P-256 key pinned in configuration as a PEM file or a JWK file anchors capsules; a different
    P-256 key pinned instead never lets a receipt through: nothing anchored, the statements dead-lettered."""
    (key,) = keys_from_jwks(_jwks(scittles)).values()
    good = tmp_path / f"ts.{form}"
    if form == "pem":
        good.write_bytes(key.public.public_bytes(serialization.Encoding.PEM,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo))
    else:
        good.write_text(json.dumps(key.to_jwk()))
    rows = design_rows(f"pk{form}{uuid.uuid4().hex[:8]}-")[:2]
    config = _config(make_config, scittles, ts_public_key=str(good))
    await _signed(nc, config, rows)
    js = nc.jetstream()
    async with Registrar(config, nc):
        await wait_count(js, "PGW_CAPSULES", len(rows))
    assert not pinned_ts_keys_path(config.data_path).exists()  # configured keys are not re-pinned


async def test_wrong_pinned_key_is_never_anchored(scittles: Scittles, nc: Any, make_config: Any,
                                                  tmp_path: Path) -> None:
    """A P-256 key that is not scittles' pinned in configuration: its receipts never verify, so nothing
    reaches capsule.registered and the statements end in the dead-letter stream with the reason."""
    other = ec.generate_private_key(ec.SECP256R1()).public_key()
    pem = tmp_path / "other.pem"
    pem.write_bytes(other.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    rows = design_rows(f"wk{uuid.uuid4().hex[:8]}-")[:2]
    config = _config(make_config, scittles, ts_public_key=str(pem), max_failures=2)
    await _signed(nc, config, rows)
    js = nc.jetstream()
    async with Registrar(config, nc):
        await wait_count(js, DLQ_STREAM, len(rows))
    assert (await js.stream_info("PGW_CAPSULES")).state.messages == 0
    records = [json.loads(d) for _, d, _ in await stream_items(js, DLQ_STREAM)]
    assert all("receipt_signature_invalid" in r["last_error"] for r in records)


async def test_traceparent_reaches_registered_statements(scittles: Scittles, nc: Any, make_config: Any) -> None:
    """A verdict's traceparent is on its registered Transparent Statement and on the registrar's log line."""
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    rows = [msgspec.structs.replace(v, traceparent=trace) for v in design_rows(f"tp{uuid.uuid4().hex[:8]}-")[:2]]
    config = _config(make_config, scittles)
    js = nc.jetstream()
    with structlog.testing.capture_logs() as logs:
        await _signed(nc, config, rows)
        async with Registrar(config, nc):
            await wait_count(js, "PGW_CAPSULES", len(rows))
    registered = await stream_items(js, "PGW_CAPSULES")
    assert [h.get("traceparent") for _, _, h in registered] == [trace] * len(rows)
    anchored = [e for e in logs if e["event"].startswith("capsule anchored")]
    assert len(anchored) == len(rows) and all(e["traceparent"] == trace for e in anchored)
    for _, d, _ in registered:  # the receipt really is over this statement's payload leaf
        assert len(decode_sign1(d).receipts()) == 1
        assert statement_leaf(d, "payload") != statement_leaf(d, "statement")


async def _read_banner(proc: asyncio.subprocess.Process, timeout: float = 60.0) -> str:
    """The NATS URL from `pgw up`'s banner (printed once everything is started)."""
    import re

    buf = b""
    assert proc.stdout is not None
    async with asyncio.timeout(timeout):
        while not (m := re.search(rb"NATS\s+(nats://127\.0\.0\.1:\d+)", buf)) or b"Ctrl-C" not in buf:
            line = await proc.stdout.readline()
            if not line:
                raise AssertionError(f"pgw up exited without a banner:\n{buf.decode(errors='replace')}")
            buf += line
    return m.group(1).decode()


@pytest.mark.slow
async def test_every_verdict_class_anchored_through_pgw_up(scittles: Scittles, tmp_path: Path) -> None:
    """`pgw up` with registrar.ts_url = scittles: a capsule of every verdict class is registered by its
    registrar, and `pgw verify --stream PGW_CAPSULES` reports every one OK and anchored."""
    cfg = tmp_path / "pgw.toml"
    cfg.write_text("open = true\n[server]\nport = -1\nmonitor_port = -1\nwebsocket_port = -1\n\n"
                   "[security]\nenabled = false\n\n"  # isolation is tested elsewhere; publish verdicts directly
                   f'[registrar]\nts_url = "{scittles.url}"\n')
    data = tmp_path / "data"
    env = {**os.environ, "PGW_LOG_LEVEL": "WARNING"}
    base = [PGW, "--config", str(cfg), "--data-dir", str(data)]
    proc = await asyncio.create_subprocess_exec(*base, "--log-format", "json", "up", stdout=subprocess.PIPE,
                                                stderr=subprocess.DEVNULL, env=env)
    try:
        url = await _read_banner(proc)
        rows = design_rows(f"up{uuid.uuid4().hex[:8]}-")
        nc = await connect(url, name="test-up")
        try:
            pub = Publisher(nc.jetstream(), Config().subjects)
            for v in rows:
                await pub.verdict(v)
            await wait_count(nc.jetstream(), "PGW_CAPSULES", len(rows), timeout=60)
        finally:
            await nc.drain()
        out = await asyncio.to_thread(
            subprocess.run, [*base, "--server", url, "verify", "--stream", "PGW_CAPSULES", "--json"],
            capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        results = [json.loads(line) for line in out.stdout.splitlines()]
        assert len(results) == len(rows)
        assert all(r["ok"] and r["assurance"]["attestation_mode"] == "anchored" for r in results)
        # every class the bus carries; "expired" only in verdicts stored before an unanswered moment
        # became a timeout (spec 004 §5.4.1)
        assert {v.verdict_class for v in rows} == set(VERDICT_CLASSES) - {"expired"}
        assert {r.get("verdict_class") for r in results} - {None} <= set(VERDICT_CLASSES)
        status = await asyncio.to_thread(
            subprocess.run, [*base, "--server", url, "capsules", "status", "--json"],
            capture_output=True, text=True, timeout=30, env=env)
        p = json.loads(status.stdout)
        assert (p["waiting"], p["registered"], p["failed"]) == (0, len(rows), 0)
        plain = await asyncio.to_thread(subprocess.run, [*base, "--server", url, "capsules"],
                                        capture_output=True, text=True, timeout=30, env=env)
        lines = {ln.split()[0]: ln.split()[1] for ln in plain.stdout.splitlines()[1:] if ln.strip()}
        assert lines == {"waiting": "0", "retrying": "0", "registered": str(len(rows)), "failed": "0"}
        assert scittles.url in plain.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()


PEER_TREE = """
import hashlib, json
from src.core.merkle import MerkleTreeBuilder
b, out = MerkleTreeBuilder(), []
for n in range(1, N + 1):
    b._add_leaf_internal(hashlib.sha256(b"entry %d" % n).digest())
    out.append([b.get_root_sync().hex(), [[h.hex() for h in b.get_inclusion_proof_sync(i, n)] for i in range(n)]])
print(json.dumps(out))
"""


def test_scittles_tree_is_rfc9162() -> None:
    """scittles' own Merkle code (pairwise, odd node promoted) gives the RFC 9162 §2.1 root and inclusion path
    of every leaf of every tree size up to 70, so receipts verify with the RFC's algorithm."""
    n = 70
    peer = json.loads(run_in_peer(PEER_TREE.replace("N + 1", str(n + 1))))
    entries = [hashlib.sha256(b"entry %d" % k).digest() for k in range(1, n + 1)]
    leaves = [leaf_hash(e) for e in entries]
    for size, (root_hex, proofs) in enumerate(peer, start=1):
        root = merkle_root(leaves[:size])
        assert root.hex() == root_hex, size
        for i, proof in enumerate(proofs):
            assert [h.hex() for h in inclusion_path(i, leaves[:size])] == proof, (size, i)
            assert root_from_path(i, size, leaves[i], [bytes.fromhex(h) for h in proof]) == root
