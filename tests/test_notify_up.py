"""`pgw up` runs the notifier (issue 17): with isolation on (the default), alice's own credentials get the VAPID key."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess

import pytest

from pgwcore.connect import connect
from tests.test_up import PGW, read_until


async def push_key(url: str, creds: str) -> dict:
    nc = await connect(url, creds=creds, name="alice", once=True)
    try:
        return json.loads((await nc.request("pgw.principal.alice.push.key", b"{}", timeout=10)).data)
    finally:
        await nc.close()


@pytest.mark.slow
def test_pgw_up_answers_push_key_for_the_principal(tmp_path) -> None:
    cfg = tmp_path / "pgw.toml"
    cfg.write_text("open = true\n[server]\nport = -1\nmonitor_port = -1\nwebsocket_port = -1\n")
    data = tmp_path / "data"
    env = {**os.environ, "PGW_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen([PGW, "--config", str(cfg), "--data-dir", str(data), "--log-format", "json", "up"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        out, _ = read_until(proc, r"services\s+[^\n]*notifier")
        url = re.search(r"NATS\s+(nats://127\.0\.0\.1:\d+)", out).group(1)
        reply = asyncio.run(push_key(url, str(data / "creds" / "principal-alice.creds")))
        assert reply["ok"] is True and len(reply["vapid_public_key"]) == 87  # 65 bytes, base64url
        assert (data / "keys" / "vapid" / "vapid.pem").stat().st_mode & 0o777 == 0o600
        assert (data / "creds" / "service-notifier.creds").exists(), "the notifier has its own identity"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:  # a failed check: stop it as Ctrl-C would, so its nats-server goes too
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
