"""The event log's head anchored at the real scittles Transparency Service (issue 20, item 2)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import msgspec

from consumers.cose import decode_sign1
from consumers.registrar import Registrar
from consumers.signer import Signer
from gateway.kernel.checkpoint import read_anchor_file
from pgwcli.commands import capsules as cli
from pgwcore.connect import connect
from tests.filestore import truncate_last
from tests.polling import until
from tests.scittles_peer import Scittles
from tests.test_capsule_signer import stream_items
from tests.test_kernel_anchor import _fill_log, _verify, own_server  # noqa: F401 - own_server is a fixture

CHECKPOINT_TYPE = "application/vnd.pgw.eventlog-checkpoint+json"


async def test_truncation_is_found_against_the_head_the_ts_holds(own_server: Any, scittles: Scittles,  # noqa: F811
                                                                   tmp_path: Path, capsys: Any) -> None:
    """The kernel's checkpoint is signed as a statement and registered with scittles (`pgw verify` accepts it,
    anchored); with PGW_EVENTLOG cut on disk and every local anchor gone too (PGW_CHECKPOINTS, the data folder's
    file), `pgw log verify` reports the first cut sequence against the TS-anchored head and names it; with
    PGW_CAPSULES cut as well, the Transparent Statement kept elsewhere (--anchor) still does."""
    from pgwcore.config import load_config

    server = await own_server()
    reg = {"ts_url": scittles.url, "backoff_base_s": 0.05, "backoff_max_s": 0.2}

    def make_config(**over: Any) -> Any:
        return load_config(None, data_dir=str(tmp_path / "data"), nats_url=server.client_url, registrar=reg, **over)

    cfg = await _fill_log(server.client_url, make_config, tmp_path, steps=3)
    anchored = read_anchor_file(cfg.data_path)
    assert anchored is not None and anchored.seq >= 6
    nc = await connect(server.client_url, name="test-anchor-ts")
    try:
        js = nc.jetstream()

        async def registered() -> Any:
            items = await stream_items(js, "PGW_CAPSULES")
            return [d for _s, d, _h in items if decode_sign1(d).protected.get(3) == CHECKPOINT_TYPE] or None

        async with Signer(cfg, nc), Registrar(cfg, nc):
            [statement] = await until(registered, timeout=30, what="the checkpoint statement in PGW_CAPSULES")
        assert msgspec.json.decode(decode_sign1(statement).payload)["seq"] == anchored.seq
        # Delivered again from the start (the signer's durable gone): the same statement, still held once.
        await js.delete_consumer("PGW_CHECKPOINTS", "pgw-signer-checkpoints")
        async with Signer(cfg, nc) as signer, Registrar(cfg, nc):
            await until(lambda: _signed(signer), timeout=30, what="the checkpoint signed again")
            await until(_drained(js), timeout=30, what="the registration queue drained")
        assert await registered() == [statement]
        capsys.readouterr()
        args = argparse.Namespace(paths=[], stream=["PGW_CAPSULES"], key=[], ts_key=[], store=[], json=True)
        assert await cli.handle_verify(args, cfg) == 0
        results = [msgspec.json.decode(line) for line in capsys.readouterr().out.splitlines()]
        [checked] = [r for r in results if r.get("statement_type") == "checkpoint"]
        assert checked["ok"] and checked["assurance"] == {"attestation_mode": "anchored"}, checked
        assert not checked.get("findings"), checked  # the kernel's signature inside was checked too
        capsules = (await js.stream_info("PGW_CAPSULES")).state.messages
    finally:
        await nc.drain()

    await server.stop()
    store = tmp_path / "nats" / "jetstream"
    assert truncate_last(store, "PGW_EVENTLOG", 3) == [anchored.seq - 2, anchored.seq - 1, anchored.seq]
    truncate_last(store, "PGW_CHECKPOINTS", 1)
    (cfg.data_path / "kernel" / "eventlog-anchor.json").unlink()
    server = await own_server()
    rc, out, err = await _verify(server.client_url, cfg.data_path)
    assert rc == 1 and out["first_break"]["seq"] == anchored.seq - 2 and "truncated" in out["first_break"]["problem"], out
    anchor = out["anchor"]
    assert anchor["source"] == "PGW_CAPSULES" and anchor["sources"] == {"PGW_CAPSULES": anchored.seq}, anchor
    assert anchor["receipt"]["leaf"] == "payload" and anchor["receipt"]["tree_size"] >= 1, anchor
    assert "Traceback" not in err, err

    # PGW_CAPSULES cut too: the Transparent Statement an auditor kept elsewhere still finds the cut.
    (tmp_path / "kept.cose").write_bytes(statement)
    await server.stop()
    truncate_last(store, "PGW_CAPSULES", capsules)
    server = await own_server()
    rc, out, _err = await _verify(server.client_url, cfg.data_path)
    assert rc == 0 and out["anchor"] is None, out  # nothing left on this host says how long the log was
    rc, out, _err = await _verify(server.client_url, cfg.data_path, "--anchor", str(tmp_path / "kept.cose"))
    assert rc == 1 and out["first_break"]["seq"] == anchored.seq - 2, out
    assert out["anchor"]["source"] == str(tmp_path / "kept.cose") and "receipt" in out["anchor"], out


async def _signed(signer: Signer) -> bool | None:
    return (signer.checkpoints is not None and signer.checkpoints.signed >= 1) or None


def _drained(js: Any) -> Any:
    async def empty() -> bool | None:
        return (await js.stream_info("PGW_REGISTRATION")).state.messages == 0 or None
    return empty


def test_pgw_verify_names_what_is_wrong_with_a_checkpoint_statement(tmp_path: Path) -> None:
    """A checkpoint statement verifies under the signer key with the kernel's signature inside; one whose
    checkpoint was re-signed by another key, or whose payload is no checkpoint, fails with its own code."""
    from consumers import checkpoint_statement as cps
    from consumers.cose import TrustedKey, sign_statement
    from consumers.verifier import verify_statement
    from pgwcore.keys import load_or_create
    from subjects.checkpoint import Checkpoint
    from subjects.idp import b64url

    signer, kernel, other = (load_or_create(tmp_path / r, r) for r in ("signer", "kernel", "other"))
    keys = {signer.kid: TrustedKey(signer.kid, signer.public, role="signer")}

    def checkpoint(by: Any) -> Checkpoint:
        cp = Checkpoint(stream="PGW_EVENTLOG", seq=7, digest="ab" * 32, ts="2026-01-01T00:00:00Z", kid=kernel.kid)
        cp.sig = b64url(by.private.sign(cp.signing_bytes()))
        return cp

    def check(statement: bytes) -> Any:
        return verify_statement(statement, keys=keys, kernel_keys={kernel.kid: kernel.public})

    good = check(cps.sign(checkpoint(kernel), signer, operator="acme", developer="pgw")[0])
    assert good.ok and good.statement_type == "checkpoint" and not good.findings, good
    forged = check(cps.sign(checkpoint(other), signer, operator="acme", developer="pgw")[0])
    assert not forged.ok and [f.code for f in forged.findings] == ["checkpoint_signature"], forged
    junk = sign_statement(b'{"seq": 7}', signer.private, signer.kid, {1: "pgw", 2: "urn:pgw:eventlog:acme:x"},
                          cps.MEDIA_TYPE)
    assert [f.code for f in check(junk).findings] == ["checkpoint_malformed"]
