"""The event log's head anchored outside the log (gateway/kernel/checkpoint.py) and `pgw log verify` against it."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from gateway.kernel.checkpoint import read_anchor_file
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams
from subjects.checkpoint import CHECKPOINT_STREAM as CHECKPOINTS
from subjects.idp import log_event_decoder
from subjects.names import Subjects
from tests.filestore import records, stream_dir, truncate_last
from tests.kernel_support import Issuer, idp, kernel_config, policy_dir, request, running_gateway

PGW = str(Path(sys.executable).parent / "pgw")
AGENT = "bot"


async def _verify(url: str, data_dir: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    proc = await asyncio.create_subprocess_exec(
        PGW, "--server", url, "--data-dir", str(data_dir), "--log-format", "json", "log", "verify", *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, json.loads(out.decode()), err.decode()


async def _fill_log(url: str, make_config: Any, tmp_path: Path, steps: int) -> Any:
    issuer = Issuer(tmp_path / "issuer")
    cfg = kernel_config(make_config, issuer, policy_dir(tmp_path), checkpoint_interval_s=0)
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent=AGENT, so_id=so)
    nc = await connect(url, name="test-fill")
    try:
        await ensure_streams(nc.jetstream(), Subjects())
        async with running_gateway(cfg, nc):
            for step in range(1, steps + 1):
                await request(nc, AGENT, {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=step, action="CloseBooking")})
    finally:
        await nc.drain()
    return cfg


@pytest.fixture
async def own_server(tmp_path: Path) -> Any:
    """A server this test stops and restarts on the same store (the shared fixture cannot)."""
    servers: list[EmbeddedServer] = []

    async def start() -> EmbeddedServer:
        s = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1)
        await s.start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        await s.stop()


async def test_truncated_log_on_disk_is_reported_at_the_first_missing_seq(own_server: Any, tmp_path: Path) -> None:
    """The last three records of PGW_EVENTLOG cut from its file store (and its index), server restarted:
    `pgw log verify` reports the first cut sequence against the head anchored at shutdown, with no traceback."""
    from pgwcore.config import load_config

    server = await own_server()

    def make_config(**over: Any) -> Any:
        return load_config(None, data_dir=str(tmp_path / "data"), nats_url=server.client_url, **over)

    cfg = await _fill_log(server.client_url, make_config, tmp_path, steps=4)
    anchored = read_anchor_file(cfg.data_path)
    assert anchored is not None and anchored.seq >= 8  # 4 x (IDP_SUBMITTED + CEDAR_*_RECORDED)
    rc, out, err = await _verify(server.client_url, cfg.data_path)
    assert rc == 0 and out["ok"] and out["anchor"]["seq"] == anchored.seq, (out, err)

    await server.stop()
    store = tmp_path / "nats" / "jetstream"
    cut = truncate_last(store, "PGW_EVENTLOG", 3)
    assert cut == [anchored.seq - 2, anchored.seq - 1, anchored.seq]
    server = await own_server()
    rc, out, err = await _verify(server.client_url, cfg.data_path)
    assert rc == 1 and not out["ok"], out
    assert out["last_seq"] == anchored.seq - 3 and out["first_break"]["seq"] == anchored.seq - 2, out
    assert "truncated" in out["first_break"]["problem"]
    assert "Traceback" not in err and "never retrieved" not in err, err

    # The anchor in the checkpoint stream alone (another verifier, no data folder) says the same.
    rc, out, _err = await _verify(server.client_url, tmp_path / "elsewhere", "--pubkey", str(_kernel_pem(cfg)))
    assert rc == 1 and out["first_break"]["seq"] == anchored.seq - 2 and out["anchor"]["source"] == CHECKPOINTS, out

    # An anchor kept elsewhere is checked too: a copy whose digest was changed is refused, not trusted.
    forged = json.loads((cfg.data_path / "kernel" / "eventlog-anchor.json").read_text())
    forged["digest"] = "0" * 64
    (tmp_path / "kept.json").write_text(json.dumps(forged))
    rc, out, _err = await _verify(server.client_url, cfg.data_path, "--anchor", str(tmp_path / "kept.json"))
    assert rc == 1 and "signature does not verify" in out["first_break"]["problem"], out


def _kernel_pem(cfg: Any) -> Path:
    from cryptography.hazmat.primitives import serialization

    from pgwcore.keys import load_or_create

    key = load_or_create(cfg.data_path, "kernel")
    p = cfg.data_path / "kernel.pub.pem"
    p.write_bytes(key.public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return p


async def test_same_length_edit_on_disk_is_reported_at_the_edited_seq(own_server: Any, tmp_path: Path) -> None:
    """One byte of seq 3's payload changed in the file store (same length): the break is seq 3, not seq 4."""
    from pgwcore.config import load_config

    server = await own_server()

    def make_config(**over: Any) -> Any:
        return load_config(None, data_dir=str(tmp_path / "data"), nats_url=server.client_url, **over)

    cfg = await _fill_log(server.client_url, make_config, tmp_path, steps=3)
    await server.stop()
    msgs = stream_dir(tmp_path / "nats" / "jetstream", "PGW_EVENTLOG") / "msgs"
    blk = next(msgs.glob("*.blk"))
    off, n, _seq = next(r for r in records(blk) if r[2] == 3)
    data = bytearray(blk.read_bytes())
    rec = bytes(data[off:off + n])
    i = rec.index(b'"ts":"') + len(b'"ts":"20')
    data[off + i] = ord("3") if data[off + i] != ord("3") else ord("4")  # the year of seq 3's timestamp
    blk.write_bytes(bytes(data))
    server = await own_server()
    rc, out, err = await _verify(server.client_url, cfg.data_path)
    assert rc == 1 and out["first_break"]["seq"] == 3, out
    assert "Traceback" not in err and "never retrieved" not in err, err


async def test_a_rolled_back_log_is_not_re_anchored(setup_kernel: Any) -> None:
    """After the log was cut below its anchor, the kernel refuses to anchor the shorter head."""
    cfg, nc, token, jti, so = setup_kernel
    from gateway.kernel.service import KernelService

    async with running_gateway(cfg, nc) as gw:
        kernel = next(p for p in gw.parts if isinstance(p, KernelService))
        await request(nc, AGENT, {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")})
        first = await kernel.checkpoints.anchor()
        assert first is not None and first.seq == 2
        # Pretend the anchor was taken when the log was longer, with another event at its head.
        kernel.checkpoints.last = type(first)(stream=first.stream, seq=first.seq, digest="0" * 64, ts=first.ts, kid=first.kid)
        await request(nc, AGENT, {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=2, action="CloseBooking")})
        assert await kernel.checkpoints.anchor() is None
    raw = await nc.jetstream().get_last_msg(CHECKPOINTS, "pgw.checkpoint.eventlog")
    assert json.loads(raw.data)["seq"] == 2
    stored = log_event_decoder.decode((await nc.jetstream().get_msg("PGW_EVENTLOG", 2)).data)
    assert stored.digest() == json.loads(raw.data)["digest"]


@pytest.fixture
def setup_kernel(make_config: Any, tmp_path: Path, nc: Any) -> Any:
    issuer = Issuer(tmp_path / "issuer")
    cfg = kernel_config(make_config, issuer, policy_dir(tmp_path), checkpoint_interval_s=0)
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent=AGENT, so_id=so)
    return cfg, nc, token, jti, so


async def test_a_forked_log_is_reported_after_the_last_anchor_it_matches(own_server: Any, tmp_path: Path) -> None:
    """Anchors at 2, 4 and 6; the log rolled back on disk to 4 and appended anew with the kernel key (a chain that
    verifies on its own): `pgw log verify` reports the break at 5, the first sequence after the last anchor held."""
    from gateway.kernel.eventlog import EventLog
    from pgwcore.config import load_config
    from pgwcore.keys import load_or_create

    server = await own_server()
    issuer = Issuer(tmp_path / "issuer")
    cfg = kernel_config(lambda **o: load_config(None, data_dir=str(tmp_path / "data"), nats_url=server.client_url, **o),
                        issuer, policy_dir(tmp_path), checkpoint_interval_s=0)
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent=AGENT, so_id=so)
    nc = await connect(server.client_url, name="test-fork")
    try:
        await ensure_streams(nc.jetstream(), Subjects())
        async with running_gateway(cfg, nc) as gw:
            from gateway.kernel.service import KernelService

            kernel = next(p for p in gw.parts if isinstance(p, KernelService))
            anchored = []
            for step in (1, 2, 3):
                await request(nc, AGENT, {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=step, action="CloseBooking")})
                anchored.append((await kernel.checkpoints.anchor()).seq)  # type: ignore[union-attr]
        assert anchored == [2, 4, 6]
    finally:
        await nc.drain()
    await server.stop()
    assert truncate_last(tmp_path / "nats" / "jetstream", "PGW_EVENTLOG", 2) == [5, 6]
    server = await own_server()
    nc = await connect(server.client_url, name="test-fork-2")
    try:
        forger = EventLog(nc, Subjects(), load_or_create(cfg.data_path, "kernel"))
        for i in range(3):
            await forger.append("CEDAR_PERMIT_RECORDED", {"idp_id": f"rewritten-{i}"}, msg_id=f"fork-{i}")
    finally:
        await nc.drain()
    rc, out, err = await _verify(server.client_url, cfg.data_path)
    assert rc == 1 and out["checked"] == 7 and out["first_break"]["seq"] == 5, out  # the chain alone is intact
    assert "altered" in out["first_break"]["problem"] and "up to 4" in out["first_break"]["problem"]
    assert "Traceback" not in err


async def test_the_head_is_anchored_while_running(setup_kernel: Any) -> None:
    """With kernel.checkpoint_interval_s set, the head is anchored while the gateway runs, not only at shutdown."""
    from tests.polling import until

    cfg, nc, token, jti, so = setup_kernel
    import msgspec

    cfg = msgspec.structs.replace(cfg, kernel=msgspec.structs.replace(cfg.kernel, checkpoint_interval_s=0.2))
    async with running_gateway(cfg, nc):
        await request(nc, AGENT, {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")})

        async def anchored() -> Any:
            cp = read_anchor_file(cfg.data_path)
            return cp if cp is not None and cp.seq >= 2 else None

        cp = await until(anchored, timeout=10, what="an anchor of the running gateway's log")
        raw = await nc.jetstream().get_last_msg(CHECKPOINTS, "pgw.checkpoint.eventlog")
        assert json.loads(raw.data)["seq"] >= cp.seq
