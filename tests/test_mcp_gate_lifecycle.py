"""The MCP gate's life as a host lives with it (integrations/mcp_gate.py, pgwcli/commands/mcp_gate.py, docs/gate.md
"What a host meets"): `pgw mcp-gate` as a subprocess, spoken to over its stdin and stdout (raw JSON-RPC where the
test is about the pipe itself, the real `mcp` client otherwise), with the reference filesystem server upstream.

Most run with no gateway: the states before one is reached (a bus that is not there, a file that is wrong).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from tests.kernel_support import Issuer
from tests.mcp_peers import filesystem_upstream
from tests.test_mcp_gate import AGENT, PGW, REPO, GateEnv, _toml, gate_env

__all__ = ["gate_env"]


def dead_url() -> str:
    """A NATS URL nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"nats://127.0.0.1:{s.getsockname()[1]}"


def gate_file(tmp: Path, folder: Path, **over: Any) -> Path:
    """deploy/mcp-gate.toml with the cached filesystem server on ``folder`` and a mandate of the test's issuer."""
    raw = tomllib.loads((REPO / "deploy" / "mcp-gate.toml").read_text())
    raw.pop("mandate_file")
    raw["mandate"], _ = Issuer(tmp / "issuer").mandate(agent=AGENT, so_id=str(uuid.uuid4()), actions=["ReadFile"])
    raw["upstreams"]["fs"] = filesystem_upstream(folder)
    raw.update(over)
    path = tmp / "gate.toml"
    path.write_text(_toml(raw))
    return path


class Pipe:
    """`pgw mcp-gate` with its stdin and stdout as the host holds them: one JSON-RPC message a line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.next_id = 0

    async def send(self, method: str, params: dict[str, Any] | None = None, *, notify: bool = False,
                   wait: bool = True) -> Any:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params or {}}
        if not notify:
            self.next_id += 1
            msg["id"] = self.next_id
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        await self.proc.stdin.drain()
        if notify or not wait:
            return None
        while True:
            line = await self.proc.stdout.readline()
            assert line, "the gate closed its stdout"
            answer = json.loads(line)
            if answer.get("id") == msg["id"]:
                return answer


async def test_with_no_bus_initialize_is_answered_calls_say_kernel_unavailable_and_stdin_eof_ends_the_gate(tmp_path: Path) -> None:
    """Started while NATS is unreachable, the gate answers initialize and lists the upstream's tools; a call is the
    tool error kernel_unavailable naming the unreachable bus (nothing ran); when the host closes stdin the gate
    exits, with its upstream."""
    folder = tmp_path / "notes"
    folder.mkdir()
    url = dead_url()
    proc = await asyncio.create_subprocess_exec(
        PGW, "mcp-gate", "--agent", AGENT, "--gate", str(gate_file(tmp_path, folder)), "--server", url,
        "--data-dir", str(tmp_path / "data"), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    try:
        pipe = Pipe(proc)
        init = await asyncio.wait_for(pipe.send("initialize", {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}), 60)
        assert init["result"]["serverInfo"]["name"] == "principal-gateway-mcp-gate"
        await pipe.send("notifications/initialized", notify=True)
        tools = await asyncio.wait_for(pipe.send("tools/list"), 30)
        assert "read_text_file" in {t["name"] for t in tools["result"]["tools"]}
        called = await asyncio.wait_for(pipe.send("tools/call", {
            "name": "read_text_file", "arguments": {"path": str(folder / "a.txt")}}), 30)
        result = called["result"]
        assert result["isError"] is True and "structuredContent" not in result
        body = json.loads(result["content"][0]["text"])
        assert body["code"] == "kernel_unavailable" and url in body["reason"] and "nothing ran" in body["reason"]
        assert proc.stdin is not None
        proc.stdin.close()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_gate_file_that_cannot_be_read_reaches_the_host_as_a_tool_error(tmp_path: Path) -> None:
    """A gate file whose mandate file is missing: the host's initialize is answered, the one tool listed is
    gate_problem, whose description and whose call (as any call) say which file is missing; no closed connection."""
    path = tmp_path / "gate.toml"
    path.write_text('name = "files"\nmandate_file = "nobody.mandate"\n[upstreams.fs]\ncommand = "true"\n')
    params = StdioServerParameters(command=PGW, args=["mcp-gate", "--agent", AGENT, "--gate", str(path), "--server",
                                                      dead_url(), "--data-dir", str(tmp_path / "data")], env=dict(os.environ))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await asyncio.wait_for(session.initialize(), 30)
        (tool,) = (await session.list_tools()).tools
        assert tool.name == "gate_problem" and "nobody.mandate" in (tool.description or "")
        for name in ("gate_problem", "read_text_file"):
            result = await session.call_tool(name, {})
            assert result.isError and result.structuredContent is None
            body = json.loads(result.content[0].text)  # type: ignore[union-attr]
            assert body["code"] == "gate_misconfigured" and "nobody.mandate" in body["reason"]


async def test_check_of_the_example_file_on_a_missing_folder_is_one_line(tmp_path: Path) -> None:
    """`pgw mcp-gate --check` of the example gate file whose folder does not exist (and whose mandate file is not
    there) prints one line naming the folder, as the server said it, and exits 2: no traceback."""
    missing = tmp_path / "no-such-folder"
    raw = tomllib.loads((REPO / "deploy" / "mcp-gate.toml").read_text())
    raw["upstreams"]["fs"] = filesystem_upstream(missing)
    path = tmp_path / "gate.toml"
    path.write_text(_toml(raw))
    proc = await asyncio.create_subprocess_exec(
        PGW, "mcp-gate", "--agent", AGENT, "--gate", str(path), "--check", "--data-dir", str(tmp_path / "data"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    lines = err.decode().splitlines()
    assert proc.returncode == 2 and out == b""
    assert len(lines) == 1 and lines[0].startswith("pgw mcp-gate --check: upstream fs") and str(missing) in lines[0], lines



async def test_stdin_closed_while_a_call_waits_for_the_principal_ends_the_gate(gate_env: GateEnv) -> None:
    """A host that goes away while a write waits for alice (its stdin closed) does not leave the gate behind: it
    exits at once, not when the call's wait_s (an hour) is over; nothing was written."""
    target = gate_env.files / "pending.txt"
    proc = await asyncio.create_subprocess_exec(
        PGW, "mcp-gate", "--agent", AGENT, "--gate", str(gate_env.gate_file()), "--server", gate_env.url,
        "--data-dir", str(gate_env.data_dir), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    try:
        pipe = Pipe(proc)
        await asyncio.wait_for(pipe.send("initialize", {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}), 60)
        await pipe.send("notifications/initialized", notify=True)
        await pipe.send("tools/call", {"name": "write_file", "arguments": {"path": str(target), "content": "x"}}, wait=False)
        await asyncio.wait_for(gate_env.principal(None), 60)  # alice has the moment: the call waits
        assert proc.stdin is not None
        proc.stdin.close()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert not target.exists()


async def test_an_expired_mandate_is_said_in_each_call_and_a_renewed_file_is_taken_without_a_restart(tmp_path: Path) -> None:
    """A gate whose mandate file holds an expired mandate says so in each call (mandate_expired, when, how to renew),
    before anything is sent; once the file holds a renewed one the next call goes on with it (here to the bus, which
    is down: kernel_unavailable), with no restart of the gate."""
    folder = tmp_path / "notes"
    folder.mkdir()
    issuer = Issuer(tmp_path / "issuer")
    so = str(uuid.uuid4())
    expired, _ = issuer.mandate(agent=AGENT, so_id=so, actions=["ReadFile"], now=time.time() - 7200, ttl_s=3600)
    mandate = tmp_path / "planner.mandate"
    mandate.write_text(expired)
    raw = tomllib.loads(gate_file(tmp_path, folder).read_text())
    raw.pop("mandate")
    raw["mandate_file"] = str(mandate)
    path = tmp_path / "expiring.toml"
    path.write_text(_toml(raw))
    params = StdioServerParameters(command=PGW, args=["mcp-gate", "--agent", AGENT, "--gate", str(path), "--server",
                                                      dead_url(), "--data-dir", str(tmp_path / "data")], env=dict(os.environ))
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await asyncio.wait_for(session.initialize(), 60)
        args = {"path": str(folder / "a.txt")}
        first = json.loads((await asyncio.wait_for(session.call_tool("read_text_file", args), 30)).content[0].text)  # type: ignore[union-attr]
        assert first["code"] == "mandate_expired" and "expired at" in first["reason"] and "mandate_file" in first["reason"]
        mandate.write_text(issuer.mandate(agent=AGENT, so_id=so, actions=["ReadFile"])[0])
        second = json.loads((await asyncio.wait_for(session.call_tool("read_text_file", args), 30)).content[0].text)  # type: ignore[union-attr]
        assert second["code"] == "kernel_unavailable"


async def test_credentials_the_server_refuses_reach_the_host_as_kernel_unavailable_naming_them(tmp_path: Path) -> None:
    """On a server enforcing per-party credentials, a gate with no credentials for its agent answers the host and
    each call is kernel_unavailable saying the server refused the agent's credentials and which file would serve."""
    from gateway.security import embedded_auth
    from pgwcore.config import load_config
    from pgwcore.server import EmbeddedServer

    folder = tmp_path / "notes"
    folder.mkdir()
    auth = embedded_auth(load_config(None, data_dir=str(tmp_path / "server-data"), agents={AGENT: {"principals": ["alice"]}}))
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1, authorization=auth.server_block)
    await server.start()
    try:
        params = StdioServerParameters(command=PGW, env=dict(os.environ), args=[
            "mcp-gate", "--agent", AGENT, "--gate", str(gate_file(tmp_path, folder)), "--server", server.client_url,
            "--data-dir", str(tmp_path / "empty-data")])
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await asyncio.wait_for(session.initialize(), 60)
            result = await asyncio.wait_for(session.call_tool("read_text_file", {"path": str(folder / "a.txt")}), 30)
    finally:
        await server.stop()
    body = json.loads(result.content[0].text)  # type: ignore[union-attr]
    assert body["code"] == "kernel_unavailable" and "refused the agent's credentials" in body["reason"]
    assert "agent-planner.creds" in body["reason"]


@pytest.mark.parametrize("case", ["gate without --agent", "gate with another agent's --creds", "mcp with another agent's --creds"])
async def test_a_gate_or_mcp_server_that_cannot_choose_its_credentials_answers_every_call_with_the_reason(
        tmp_path: Path, case: str) -> None:
    """Before the gate's own code runs, the command line chooses the agent's credentials: a run without --agent,
    or with another agent's --creds file, answers initialize, lists only gate_problem, and every call is a tool
    error giving the one-line reason (no "Connection closed"); run with nothing on stdin it ends with exit 2."""
    from gateway.security import Party, embedded_auth
    from pgwcore.config import load_config

    folder = tmp_path / "notes"
    folder.mkdir()
    other = embedded_auth(load_config(None, data_dir=str(tmp_path / "server-data"), agents={"other": {"principals": ["alice"]}}))
    common = ["--server", dead_url(), "--data-dir", str(tmp_path / "data")]
    gate = ["--gate", str(gate_file(tmp_path, folder))]
    creds = ["--creds", str(other.creds_for(Party("agent", "other")))]
    args, reason = {
        "gate without --agent": (["mcp-gate", *gate, *common], "give --agent NAME"),
        "gate with another agent's --creds": (["mcp-gate", "--agent", AGENT, *gate, *creds, *common],
                                              "agent:other's credentials, not agent:planner's"),
        "mcp with another agent's --creds": (["mcp", "--agent", AGENT, *creds, *common],
                                             "agent:other's credentials, not agent:planner's"),
    }[case]
    log = tmp_path / "stderr.txt"
    with log.open("w") as errlog:
        params = StdioServerParameters(command=PGW, args=args, env=dict(os.environ))
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
            await asyncio.wait_for(session.initialize(), 30)
            (tool,) = (await session.list_tools()).tools
            assert tool.name == "gate_problem" and reason in (tool.description or "")
            for name in ("gate_problem", "read_text_file", "ask_principal"):
                result = await asyncio.wait_for(session.call_tool(name, {}), 30)
                assert result.isError and result.structuredContent is None
                body = json.loads(result.content[0].text)  # type: ignore[union-attr]
                assert body["code"] == "gate_misconfigured" and reason in body["reason"], body
    err = log.read_text()
    assert reason in err.splitlines()[0] and "Traceback" not in err, err  # then the SDK's own notes on each call
    # Run by hand, with nothing on its stdin, it says the same line and exits 2.
    proc = await asyncio.create_subprocess_exec(PGW, *args, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err2 = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2 and out == b"" and reason in err2.decode(), err2
