"""``pgw replay`` and ``pgw tail`` as a user runs them (subprocesses against a real server)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

PGW = str(Path(sys.executable).parent / "pgw")


async def _pgw(url: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        PGW, "--server", url, "--log-format", "json", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_replay_dry_run_lists_and_publishes_nothing(nats_server, nc) -> None:
    """`pgw replay --dry-run` prints one line per message and a summary, and the stream is unchanged."""
    js = nc.jetstream()
    for i in range(3):
        await js.publish("pgw.agent.cli.envelope", json.dumps({"envelopeId": f"e{i}", "correlationId": f"c{i}",
                                                               "type": "error"}).encode(),
                         headers={"Nats-Msg-Id": f"cli:e{i}"})
    rc, out, err = await _pgw(nats_server.client_url, "replay", "--subject", "pgw.agent.cli.envelope",
                              "--to", "gateway", "--fresh-msg-id", "--dry-run")
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith("#1 pgw.agent.cli.envelope -> would republish to pgw.agent.cli.envelope")
    assert "correlationId=c0" in lines[0]
    assert lines[-1] == "dry run: 3 message(s) from PGW_INBOUND (republish: 3)"
    assert (await js.stream_info("PGW_INBOUND")).state.messages == 3


async def test_replay_refusal_is_a_clear_error(nats_server, nc) -> None:
    """Replaying into a gateway output subject exits 2 with the reason, not a traceback."""
    await nc.jetstream().publish("pgw.agent.cli.envelope", b"{}", headers={"Nats-Msg-Id": "x"})
    rc, _out, err = await _pgw(nats_server.client_url, "replay", "--stream", "PGW_INBOUND",
                               "--to", "pgw.verdict.blocked")
    assert rc == 2 and "forge" in err and "Traceback" not in err


async def test_tail_last_json_redacts(nats_server, nc) -> None:
    """`pgw tail --last 1 --count 1 --json` prints the stored message with secrets redacted."""
    await nc.jetstream().publish("pgw.verdict.blocked", json.dumps({"reason": "key secret:abc123"}).encode(),
                                 headers={"Nats-Msg-Id": "v1"})
    rc, out, err = await _pgw(nats_server.client_url, "tail", "pgw.verdict.>", "--last", "1", "--count", "1",
                              "--json")
    assert rc == 0, err
    line = json.loads(out.strip())
    assert line["subject"] == "pgw.verdict.blocked" and "abc123" not in out and "REDACTED" in out
