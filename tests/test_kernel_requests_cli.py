"""`pgw mandate revoke` and `pgw audit` with nobody to answer: a clear error and exit 1, never a traceback."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from gateway.security import Party, embedded_auth
from pgwcore.config import load_config
from pgwcore.server import EmbeddedServer

PGW = str(Path(sys.executable).parent / "pgw")


async def _pgw(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(PGW, "--log-format", "json", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, err.decode()


async def test_a_revocation_with_no_gateway_running_says_so(nats_server, tmp_path: Path) -> None:
    rc, err = await _pgw("--server", nats_server.client_url, "--data-dir", str(tmp_path / "d"),
                         "mandate", "revoke", "jti-1", "--reason", "test")
    assert rc == 1
    assert "no gateway answers on pgw.kernel.revoke" in err and "pgw up" in err
    assert "Traceback" not in err


async def test_a_request_these_credentials_may_not_send_names_who_may(tmp_path: Path) -> None:
    """On a server that enforces per-party permissions (as `pgw up` starts it), an agent's credentials
    cannot publish `kernel.revoke` or another auditor's audit subject: the server drops the publish, the
    request times out, and the error says who may send it."""
    config = load_config(None, data_dir=str(tmp_path / "d"), agents={"a1": {"principals": ["p1"]}})
    auth = embedded_auth(config)
    agent_creds = str(auth.party_creds_dir / Party("agent", "a1").filename)
    async with EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=None, websocket_port=None,
                              authorization=auth.server_block) as server:
        common = ("--server", server.client_url, "--data-dir", str(tmp_path / "d"), "--creds", agent_creds)
        rc, err = await _pgw(*common, "mandate", "revoke", "jti-1", "--timeout", "1")
        assert rc == 1 and "Traceback" not in err
        assert "no answer on pgw.kernel.revoke within 1 s" in err and "ops users may send revocations" in err
        rc, err = await _pgw(*common, "audit", "session", "s-1", "--agent", "a1", "--auditor", "carol", "--timeout", "1")
        assert rc == 1 and "Traceback" not in err
        assert "no answer on pgw.kernel.audit.carol within 1 s" in err and "audit-carol.creds" in err
