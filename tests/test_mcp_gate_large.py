"""Results and arguments larger than one message of the bus, through `pgw mcp-gate` and the kernel
(subjects/executor.py "Large results", docs/gate.md): on a nats-server whose max_payload is 256 KiB, a read
of a 600 KB file through the reference filesystem server (its result, text and structured content, over
1.2 MB) and a write whose content alone is over half of max_payload."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from integrations.mcp_gate import result_json
from pgwcore.kvread import live_keys
from pgwcore.server import EmbeddedServer
from subjects.executor import LARGE_RESULT, decode_response
from subjects.gate import exec_bucket
from subjects.idp import json_digest
from tests.kernel_support import read_log
from tests.test_mcp_gate import GateEnv, gate_env

__all__ = ["gate_env"]
MAX_PAYLOAD = 256 * 1024


@pytest.fixture
async def nats_server(tmp_path: Path) -> AsyncIterator[EmbeddedServer]:
    """The suite's nats-server, with a max_payload of 256 KiB."""
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1, max_payload=MAX_PAYLOAD)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_a_result_past_max_payload_reaches_the_host_whole_and_the_capsule_binds_its_digest(gate_env: GateEnv) -> None:
    """A read whose result is several times max_payload returns the whole file to the host (not a wait of
    timeout_s + follow_up_s ending dispatched_unconfirmed): the executor kept it in parts and answered the kernel
    with a reference; the capsule is confirmed with the digest of that reference, which carries the JSON-DIGEST
    of exactly the result the host got."""
    text = "".join(f"line {i:06d} of a long file\n" for i in range(24000))  # ~600 KB
    (gate_env.files / "big.txt").write_text(text)
    async with gate_env.session(gate_env.gate_file()) as session:
        result = await asyncio.wait_for(session.call_tool("read_text_file", {"path": str(gate_env.files / "big.txt")}), 60)
    assert not result.isError and result.content[0].text == text  # type: ignore[union-attr]
    assert len(msgspec.json.encode(result_json(result))) > 4 * MAX_PAYLOAD
    cap = await gate_env.capsule("ReadFile")
    assert cap["effect"]["status"] == "confirmed"
    kv = await gate_env.js.key_value(exec_bucket("mcp-files"))
    refs = []
    for key in await live_keys(gate_env.js, kv, exec_bucket("mcp-files")):
        if ".part." not in key:
            resp = decode_response((await kv.get(key)).value)
            if isinstance(resp.result, dict) and LARGE_RESULT in resp.result:
                refs.append(resp.result)
    (ref,) = refs
    assert cap["effect"]["response_digest"] == json_digest(ref)
    assert ref[LARGE_RESULT]["digest"] == json_digest(result_json(result))


async def test_arguments_that_cannot_travel_are_said_to_be_too_large_and_nothing_is_declared(gate_env: GateEnv) -> None:
    """A write whose content is over half of max_payload is refused by the gate as arguments_too_large, with the
    sizes, before anything is sent: no declaration in the kernel's log, no moment, no file."""
    target = gate_env.files / "huge.txt"
    async with gate_env.session(gate_env.gate_file()) as session:
        result = await asyncio.wait_for(session.call_tool(
            "write_file", {"path": str(target), "content": "x" * (MAX_PAYLOAD // 2 + 1)}), 30)
    assert result.isError and result.structuredContent is None
    body = msgspec.json.decode(result.content[0].text)  # type: ignore[union-attr]
    assert body["status"] == "invalid" and body["code"] == "arguments_too_large" and str(MAX_PAYLOAD) in body["reason"]
    assert not target.exists()
    assert await read_log(gate_env.js, "IDP_SUBMITTED") == []
