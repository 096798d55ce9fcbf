"""`pgw mcp-gate init FOLDER`: a gate set up by one command (pgwcli/commands/mcp_gate.py, docs/gate.md "Set-up in
one command"). The command runs as a user runs it; the gateway is started from the configuration it wrote, and
the gate from the host JSON it printed, spoken to by the real `mcp` client."""

from __future__ import annotations

import asyncio
import json
import os
import time
import tomllib
from pathlib import Path

import msgspec
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from gateway.app import Gateway
from gateway.security import embedded_auth
from integrations.mcp_gate import mandate_claims
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from tests.mcp_peers import NODE, install_filesystem
from tests.test_mcp_gate import PGW


async def pgw(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(PGW, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _absolute_and_there(paths: list[str]) -> bool:
    return bool(paths) and all(Path(p).is_absolute() and Path(p).exists() for p in paths)


async def test_init_writes_a_gate_that_works_and_says_when_its_mandate_expires(tmp_path: Path) -> None:
    """`init` on a folder writes the gate file, a mandate whose lifetime it states, the gateway's configuration
    (the agent bound to alice, the dev issuer trusted, the policy, the executor) and the credentials, and prints the
    host's JSON with absolute paths; a gateway started from that configuration, on a server enforcing its generated
    permissions, and a gate started from that JSON read a file of the folder. Run again, it renews the mandate for
    the same governed object."""
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "hello.txt").write_text("hello from the folder\n")
    data = tmp_path / "data"
    upstream = f"{NODE} {await asyncio.to_thread(install_filesystem)}"
    args = ("--data-dir", str(data), "mcp-gate", "init", str(folder), "--mandate-ttl", "2h", "--upstream-command", upstream)
    code, out, err = await pgw(*args)
    assert code == 0, err
    host = json.loads(out)["mcpServers"]["files"]
    assert Path(host["command"]).is_absolute()
    assert _absolute_and_there([a for a in host["args"] if "/" in a]), host
    assert "expires" in err and "in 2 hours" in err
    out_dir = data.resolve() / "gates" / "files"
    token = (out_dir / "planner.mandate").read_text().strip()
    claims = mandate_claims(token)
    assert abs(claims["exp"] - (time.time() + 7200)) < 120 and claims["sub"] == "planner"
    conf = tomllib.loads((out_dir / "pgw.toml").read_text())
    assert conf["agents"]["planner"]["principals"] == ["alice"] and conf["kernel"]["trust_dev_issuer"] is True
    assert conf["kernel"]["executors"]["mcp-files"]["actions"] == ["DeleteFile", "ReadFile", "WriteFile"]
    assert (data / "creds" / "agent-planner.creds").exists() and (data / "creds" / "executor-mcp-files.creds").exists()

    config = load_config(out_dir / "pgw.toml")
    auth = embedded_auth(config)  # what `pgw up` does with this configuration: the files init wrote are reused
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1, authorization=auth.server_block)
    await server.start()
    try:
        service = await connect(server.client_url, creds=str(auth.service_creds), name="gateway")
        try:
            async with Gateway(msgspec.structs.replace(config, nats_url=server.client_url), service):
                params = StdioServerParameters(command=host["command"], args=[*host["args"], "--server", server.client_url],
                                               env=dict(os.environ), cwd=str(tmp_path))
                async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                    await asyncio.wait_for(session.initialize(), 60)
                    result = await asyncio.wait_for(session.call_tool("read_text_file", {"path": str(folder / "hello.txt")}), 60)
        finally:
            await service.drain()
    finally:
        await server.stop()
    assert not result.isError, result.content
    assert result.content[0].text == "hello from the folder\n"  # type: ignore[union-attr]

    code, _out, err = await pgw(*args)
    assert code == 0, err
    renewed = mandate_claims((out_dir / "planner.mandate").read_text().strip())
    assert renewed["so_id"] == claims["so_id"] and renewed["jti"] != claims["jti"]


async def test_init_on_a_folder_that_does_not_exist_is_one_line(tmp_path: Path) -> None:
    """`init` naming a folder that is not there prints one line saying so and exits 2, writing nothing."""
    code, out, err = await pgw("--data-dir", str(tmp_path / "data"), "mcp-gate", "init", str(tmp_path / "nowhere"))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "nowhere" in err and "is not a folder" in err
    assert not (tmp_path / "data").exists()
