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


async def test_init_from_a_configuration_with_relative_folders_and_a_secret_writes_them_absolute_and_private(
        tmp_path: Path) -> None:
    """From a 0600 configuration naming a secret inline and its folders (data_dir, security.creds_dir, keys.dir)
    relative to itself, run from another folder: the generated configuration names those same folders, absolute, so
    the kernel started from it trusts the mandate init issued (a data folder named by --data-dir is the one it
    names); and it is written 0600 (like the gate file and the mandate), also over a file an earlier init left
    readable to others."""
    from gateway.kernel.mandate import MandateVerifier

    conf_dir, elsewhere, folder = tmp_path / "conf", tmp_path / "elsewhere", tmp_path / "notes"
    for d in (conf_dir, elsewhere, folder):
        d.mkdir()
    source = conf_dir / "pgw.toml"
    source.write_text('data_dir = "data"\n[security]\ncreds_dir = "creds"\n[keys]\ndir = "keys"\n'
                      '[pipeline.secrets]\nvalues = ["Zq7PlumBaGo9xK"]\n')
    source.chmod(0o600)
    out_dir = conf_dir / "data" / "gates" / "files"

    async def init(*extra: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            PGW, "--config", str(source), *extra, "mcp-gate", "init", str(folder), "--upstream-command", "true",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(elsewhere))
        _out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()

    await init()
    generated = out_dir / "pgw.toml"
    conf = tomllib.loads(generated.read_text())
    assert conf["data_dir"] == str(conf_dir / "data")
    assert conf["security"]["creds_dir"] == str(conf_dir / "creds") and conf["keys"]["dir"] == str(conf_dir / "keys")
    assert (conf_dir / "creds" / "agent-planner.creds").exists() and list(elsewhere.iterdir()) == []
    config = load_config(generated)
    mandate = (out_dir / "planner.mandate").read_text().strip()
    verified = MandateVerifier(config.kernel, config.data_path, keys_dir=config.keys_path).verify(mandate, agent="planner")
    assert verified.sub == "planner"
    assert not (out_dir / "data").exists()
    for f in ("pgw.toml", "gate.toml", "planner.mandate"):
        assert (out_dir / f).stat().st_mode & 0o777 == 0o600, f
    assert "Zq7PlumBaGo9xK" in generated.read_text()  # why it must be private

    generated.chmod(0o644)  # as an earlier init wrote it
    await init()
    assert generated.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in out_dir.iterdir()) == ["gate.toml", "pgw.toml", "planner.mandate", "policies"]  # no temporary file left

    other = tmp_path / "other"  # a data folder named on the command line: the one this run used, and its gate's
    await init("--data-dir", "../other")
    assert tomllib.loads((other / "gates" / "files" / "pgw.toml").read_text())["data_dir"] == str(other)
