"""The MCP gate met by the official TypeScript MCP client (``@modelcontextprotocol/sdk``'s ``Client`` and
``StdioClientTransport``, the client the MCP Inspector CLI is built on; pinned in tests/mcp_ts/package.json,
installed by tests/mcp_peers.py), beside the Python client of tests/test_mcp_gate.py.

That client validates a result's ``structuredContent`` against the tool's advertised ``outputSchema`` (MCP
2025-06-18, Server Features, Tools, "Output Schema"), and every tool of the reference filesystem server
advertises one (``{content: string}``, required): a gate refusal carried as structured content would reach
the host as the client's own "data must have required property 'content'", not the gate's words. Every result
kind of the gate is driven through it: done, denied, not_run, failed, invalid, kernel_unavailable.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any

from tests.mcp_peers import NODE, install_ts_client
from tests.test_mcp_gate import AGENT, PGW, GateEnv, gate_env

__all__ = ["gate_env"]


async def ts_client(plan: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    """Run tests/mcp_ts/client.mjs on ``plan``; its steps, one dict per JSON line."""
    script = await asyncio.to_thread(install_ts_client)
    path = tmp / f"plan-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps(plan))
    proc = await asyncio.create_subprocess_exec(NODE, str(script), str(path), stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, out.decode()[-3000:]
    return [json.loads(line) for line in out.decode().splitlines() if line.strip()]


def gate_plan(env: GateEnv, gate_file: Path, calls: list[dict[str, Any]], *, server: str | None = None) -> dict[str, Any]:
    return {"command": PGW, "env": dict(os.environ), "calls": calls, "args": [
        "mcp-gate", "--agent", AGENT, "--gate", str(gate_file), "--server", server or env.url,
        "--data-dir", str(env.data_dir), "--progress-every", "0.3"]}


def said(step: dict[str, Any]) -> dict[str, Any]:
    """A gate tool error's body: the JSON of its one text content."""
    result = step["result"]
    assert result["isError"] is True and "structuredContent" not in result, result
    return json.loads(result["content"][0]["text"])


async def test_the_typescript_client_reads_every_result_kind_of_the_gate(gate_env: GateEnv) -> None:
    """Through the official TypeScript client, against tools that advertise an outputSchema: a read returns the
    server's structured result; a denied move, a write alice rejects (not_run), a read the server fails (failed)
    and a call with an argument that cannot name a resource (invalid) each reach the client as a tool error whose
    text says so: none is rejected by the client's output-schema validation."""
    (gate_env.files / "notes.txt").write_text("the real notes\n")
    (gate_env.files / "keep.txt").write_text("keep")
    calls = [
        {"name": "read_text_file", "arguments": {"path": str(gate_env.files / "notes.txt")}},
        {"name": "move_file", "arguments": {"source": str(gate_env.files / "keep.txt"),
                                            "destination": str(gate_env.files / "gone.txt")}},
        {"name": "write_file", "arguments": {"path": str(gate_env.files / "draft.txt"), "content": "x"}},
        {"name": "read_text_file", "arguments": {"path": "/etc/hostname"}},
        {"name": "read_text_file", "arguments": {"path": 'a"b'}},
    ]
    alice = gate_env.principal(1)  # alice denies the write
    steps = await ts_client(gate_plan(gate_env, gate_env.gate_file(), calls), gate_env.tmp)
    await asyncio.wait_for(alice, 30)
    tools = {t["name"]: t for t in next(s for s in steps if s["step"] == "list")["tools"]}
    assert all(tools[c["name"]]["outputSchema"] for c in calls)  # each result is checked against a schema
    results = [s for s in steps if s["step"] == "call"]
    assert [r.get("thrown") for r in results] == [None] * len(calls), results
    done, denied, not_run, failed, invalid = results
    assert done["result"]["structuredContent"] == {"content": "the real notes\n"} and not done["result"].get("isError")
    assert said(denied)["status"] == "denied" and said(denied)["deny_code"] == "POLICY_DENY"
    assert said(not_run)["status"] == "not_run"
    assert said(failed)["status"] == "failed" and said(failed)["error"]["code"] == "tool_error"
    assert said(invalid)["status"] == "invalid" and said(invalid)["code"] == "invalid_arguments"
    assert (gate_env.files / "keep.txt").exists() and not (gate_env.files / "draft.txt").exists()


async def test_the_typescript_client_reads_kernel_unavailable_when_the_bus_is_down(gate_env: GateEnv) -> None:
    """A gate whose bus cannot be reached answers the TypeScript client's initialize and lists the tools; a call
    is a kernel_unavailable tool error that says the bus is unreachable, not a schema rejection."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"nats://127.0.0.1:{s.getsockname()[1]}"
    calls = [{"name": "read_text_file", "arguments": {"path": str(gate_env.files / "x.txt")}}]
    steps = await ts_client(gate_plan(gate_env, gate_env.gate_file(), calls, server=dead), gate_env.tmp)
    (call,) = [s for s in steps if s["step"] == "call"]
    assert call.get("thrown") is None, call
    body = said(call)
    assert body["code"] == "kernel_unavailable" and dead in body["reason"] and "nothing ran" in body["reason"]
