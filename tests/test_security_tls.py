"""TLS to NATS (pgwcore/tls.py) against a real nats-server that requires client certificates."""

from __future__ import annotations

from pathlib import Path

import pytest

from pgwcore.config import load_config
from pgwcore.connect import ConnectError, connect
from pgwcore.server import EmbeddedServer
from pgwcore.tls import TlsError, TlsFiles, make_dev_ca
from subjects.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
async def mtls_server(tmp_path: Path):
    """An embedded nats-server with mutual TLS on its client port, certificates from a fresh development CA."""
    ca = make_dev_ca(tmp_path / "tls")
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=None, websocket_port=-1,
                            tls_cert=str(ca.server_cert), tls_key=str(ca.server_key), tls_ca=str(ca.ca),
                            health_client_cert=str(ca.client_cert), health_client_key=str(ca.client_key))
    await server.start()
    try:
        yield server, ca
    finally:
        await server.stop()


async def test_client_certificate_required_and_accepted(mtls_server) -> None:
    """Without a client certificate the server refuses the connection; with the CA and the pair, JetStream answers."""
    server, ca = mtls_server
    with pytest.raises(ConnectError):
        await connect(server.client_url, name="no-cert", once=True, tls=TlsFiles(str(ca.ca)))
    nc = await connect(server.client_url, name="with-cert", once=True, tls=ca.client_files())
    try:
        info = await nc.jetstream().account_info()
        assert info.limits is not None
        assert nc.connected_url is not None
    finally:
        await nc.close()


def test_dev_ca_files_are_private_and_reused(tmp_path: Path) -> None:
    """make_dev_ca writes 0600 files and returns the same ones on a second call (no silent re-issue)."""
    first = make_dev_ca(tmp_path / "tls")
    before = first.ca.read_bytes()
    again = make_dev_ca(tmp_path / "tls")
    assert again.ca.read_bytes() == before
    for p in (first.ca, first.server_key, first.client_key, tmp_path / "tls" / "ca-key.pem"):
        assert p.stat().st_mode & 0o777 == 0o600


def test_half_a_client_pair_is_refused(tmp_path: Path) -> None:
    """A certificate without its key (or the reverse) fails at start with the fields named."""
    with pytest.raises(ConfigError, match="cert and key go together"):
        load_config(None, tls={"cert": "/x.pem"})
    with pytest.raises(TlsError, match="go together"):
        TlsFiles(cert="/x.pem").client_context()
    with pytest.raises(TlsError, match="no such file"):
        TlsFiles(ca=str(tmp_path / "missing.pem")).client_context()


async def test_pgw_commands_take_tls_flags_and_nats_cli_variables(mtls_server, tmp_path: Path) -> None:
    """`pgw streams` reaches a mutual-TLS server with --tls-* flags, or with NATS_CA/NATS_CERT/NATS_KEY; without, it fails."""
    import asyncio
    import os
    import sys

    server, ca = mtls_server
    base = [sys.executable, "-m", "pgwcli", "--server", server.client_url, "--data-dir", str(tmp_path / "d")]

    async def run(args: list[str], env: dict[str, str]) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(*base, *args, "streams", cwd=str(REPO), env=env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode()

    clean = {k: v for k, v in os.environ.items() if k not in ("NATS_CA", "NATS_CERT", "NATS_KEY")}
    code, out = await run(["--tls-ca", str(ca.ca), "--tls-cert", str(ca.client_cert), "--tls-key", str(ca.client_key)], clean)
    assert code == 0, out
    code, out = await run([], {**clean, "NATS_CA": str(ca.ca), "NATS_CERT": str(ca.client_cert), "NATS_KEY": str(ca.client_key)})
    assert code == 0, out
    code, out = await run(["--tls-ca", str(ca.ca)], clean)  # no client certificate: the server refuses
    assert code != 0 and "cannot connect" in out, out
