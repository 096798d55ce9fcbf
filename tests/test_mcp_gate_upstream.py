"""The MCP gate's upstream half (integrations/mcp_gate.py) against the official reference servers, unmodified:
``@modelcontextprotocol/server-filesystem`` (npm, cached) and ``mcp-server-git`` (PyPI), through the real ``mcp``
client sessions the gate holds; and against a small FastMCP server whose tool list changes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from integrations.mcp_gate import (
    ExecutionRefused,
    GateConfigError,
    IdpBuilder,
    Upstreams,
    load_gate_config,
    parse_gate_config,
    resource_of,
)
from subjects.idp import IdpStandard, IdpThin, decode_idp
from tests.mcp_peers import filesystem_upstream, git_upstream

CHANGING = Path(__file__).with_name("mcp_changing_upstream.py")
REPO = Path(__file__).resolve().parent.parent


def git_repo(path: Path) -> Path:
    path.mkdir()
    for cmd in (["init", "-q", "-b", "main"], ["config", "user.email", "t@example.org"], ["config", "user.name", "T"]):
        subprocess.run(["git", "-C", str(path), *cmd], check=True)
    (path / "README").write_text("hello\n")
    subprocess.run(["git", "-C", str(path), "add", "README"], check=True)
    subprocess.run(["git", "-C", str(path), "commit", "-q", "-m", "first"], check=True)
    return path


def two_upstreams(tmp_path: Path, **tools: Any) -> dict[str, Any]:
    files = tmp_path / "files"
    files.mkdir()
    (files / "a.txt").write_text("alpha\n")
    return {
        "name": "dev",
        "upstreams": {"fs": filesystem_upstream(files), "git": git_upstream(git_repo(tmp_path / "repo"))},
        "tools": tools,
    }


async def test_two_reference_servers_are_listed_namespaced_and_called_through_the_executor_half(tmp_path: Path) -> None:
    """Behind one gate the filesystem and git servers' tools are listed as fs__* and git__*, each with the optional
    intent argument; the executor half runs a read, a write (the file on disk changes) and a git status for real."""
    config = parse_gate_config(two_upstreams(tmp_path, fs__read_text_file={"action": "ReadFile"},
                                             fs__read_file={"action": "ReadFile"}))
    async with Upstreams(config) as ups:
        names = {t.name for t in ups.host_tools()}
        assert {"fs__read_text_file", "fs__write_file", "fs__move_file", "git__git_status", "git__git_log"} <= names
        assert all(n.startswith(("fs__", "git__")) for n in names)
        schema = next(t for t in ups.host_tools() if t.name == "fs__write_file").inputSchema
        assert {"path", "content", "intent"} <= set(schema["properties"]) and "intent" not in schema.get("required", [])
        # Grouping: two tools, one Cedar action; an ungrouped tool's action is its name.
        assert sorted(ups.actions()["ReadFile"]) == ["fs__read_file", "fs__read_text_file"]
        assert ups.tools["fs__write_file"].action == "fs__write_file"

        read = await ups.call("ReadFile", {"tool": "fs__read_text_file", "arguments": {"path": str(tmp_path / "files" / "a.txt")}})
        assert read["content"][0]["text"] == "alpha\n" and not read.get("isError")
        target = tmp_path / "files" / "b.txt"
        wrote = await ups.call("fs__write_file", {"tool": "fs__write_file", "arguments": {"path": str(target), "content": "beta"}})
        assert not wrote.get("isError") and target.read_text() == "beta"
        status = await ups.call("git__git_status", {"tool": "git__git_status", "arguments": {"repo_path": str(tmp_path / "repo")}})
        assert "On branch main" in status["content"][0]["text"]


async def test_the_executor_half_runs_only_the_tool_its_action_covers(tmp_path: Path) -> None:
    """A dispatch whose action does not govern the named tool (a read action naming the write tool) or that names
    no tool of the gate is refused before the upstream is called: the file is not written."""
    config = parse_gate_config(two_upstreams(tmp_path, fs__read_text_file={"action": "ReadFile"}))
    target = tmp_path / "files" / "evil.txt"
    async with Upstreams(config) as ups:
        with pytest.raises(ExecutionRefused) as e:
            await ups.call("ReadFile", {"tool": "fs__write_file", "arguments": {"path": str(target), "content": "x"}})
        assert e.value.code == "action_mismatch"
        with pytest.raises(ExecutionRefused) as e:
            await ups.call("ReadFile", {"tool": "fs__nope", "arguments": {}})
        assert e.value.code == "unknown_tool"
    assert not target.exists()


async def test_one_upstream_is_not_namespaced_and_renames_and_hiding_apply(tmp_path: Path) -> None:
    """With one upstream the tools keep their own names; a rename changes the listed name (the upstream is still
    called by its own), and a hidden tool is neither listed nor callable."""
    files = tmp_path / "files"
    files.mkdir()
    (files / "a.txt").write_text("alpha\n")
    config = parse_gate_config({"name": "fs", "upstreams": {"fs": filesystem_upstream(files)}, "tools": {
        "read_text_file": {"rename": "read", "action": "ReadFile"}, "move_file": {"hidden": True}}})
    async with Upstreams(config) as ups:
        names = {t.name for t in ups.host_tools()}
        assert "read" in names and "read_text_file" not in names and "move_file" not in names and "write_file" in names
        out = await ups.call("ReadFile", {"tool": "read", "arguments": {"path": str(files / "a.txt")}})
        assert out["content"][0]["text"] == "alpha\n"
        with pytest.raises(ExecutionRefused):
            await ups.call("move_file", {"tool": "move_file", "arguments": {}})


async def test_tools_list_changed_of_an_upstream_is_followed(tmp_path: Path) -> None:
    """When an upstream announces tools/list_changed the gate lists it again: the new tool is listed and callable."""
    config = parse_gate_config({"name": "x", "upstreams": {"ch": {"command": sys.executable, "args": [str(CHANGING)]}}})
    async with Upstreams(config) as ups:
        assert "shout" not in ups.tools
        changed = asyncio.ensure_future(ups.changed(after=ups.list_changes))
        await ups.call("add_tool", {"tool": "add_tool", "arguments": {"name": "shout"}})
        await asyncio.wait_for(changed, 20)
        assert "shout" in ups.tools and ups.list_changes == 1
        out = await ups.call("shout", {"tool": "shout", "arguments": {"text": "hi"}})
        assert out["content"][0]["text"] == "shout: hi"


async def test_prompts_pass_through_and_resources_are_refused_unless_allowed(tmp_path: Path) -> None:
    """An upstream's prompts are passed through; its resources are refused (an ungoverned read) unless the upstream's
    configuration allows them, and then they are read from the upstream unchanged."""
    from mcp.shared.exceptions import McpError

    up = {"command": sys.executable, "args": [str(CHANGING)]}
    async with Upstreams(parse_gate_config({"name": "x", "upstreams": {"ch": up}})) as ups:
        assert [p.name for p in await ups.list_prompts()] == ["summarize"]
        got = await ups.get_prompt("summarize", {"topic": "gates"})
        assert "gates" in got.messages[0].content.text  # type: ignore[union-attr]
        assert await ups.list_resources() == []
        with pytest.raises(McpError, match="not governed"):
            await ups.read_resource("memo://notes")
    async with Upstreams(parse_gate_config({"name": "x", "upstreams": {"ch": {**up, "resources": True}}})) as ups:
        assert [str(r.uri) for r in await ups.list_resources()] == ["memo://notes"]
        assert (await ups.read_resource("memo://notes")).contents[0].text == "secret notes"  # type: ignore[union-attr]


def test_a_bad_configuration_fails_at_start_with_the_field_named(tmp_path: Path) -> None:
    """An upstream with both a command and a URL, none at all, a bad gate name, or unreadable TOML is refused with
    the field named."""
    with pytest.raises(GateConfigError, match=r"upstreams\.a"):
        parse_gate_config({"name": "g", "upstreams": {"a": {"command": "x", "url": "http://h/mcp"}}})
    with pytest.raises(GateConfigError, match="upstreams"):
        parse_gate_config({"name": "g", "upstreams": {}})
    with pytest.raises(GateConfigError, match="name"):
        parse_gate_config({"name": "Bad Name", "upstreams": {"a": {"command": "x"}}})
    bad = tmp_path / "gate.toml"
    bad.write_text("name = \n")
    with pytest.raises(GateConfigError, match="not valid TOML"):
        load_gate_config(bad)
    good = tmp_path / "good.toml"
    good.write_text('name = "g"\n[upstreams.a]\nurl = "http://127.0.0.1:1/mcp"\nheaders = { Authorization = "Bearer s" }\n'
                    '[tools.write]\naction = "WriteFile"\nescalate = true\nresource = { type = "File", argument = "path" }\n')
    cfg = load_gate_config(good)
    assert cfg.kind == "mcp-g" and cfg.upstreams["a"].headers == {"Authorization": "Bearer s"} and cfg.tools["write"].escalate


def test_the_idp_is_thin_without_a_full_intent_and_standard_with_one() -> None:
    """A call without the model's intent gives an IDP_THIN (spec 003 §7) that the kernel's own decoder accepts; with
    goal, reasoning and confidence it is an IDP_STANDARD; steps strictly increase within the gate's session."""
    import base64
    import json
    import uuid

    claims = {"so_id": str(uuid.uuid4()), "jti": "m-1"}
    token = "e30." + base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=") + ".sig"
    b = IdpBuilder(token, session_id="s-1")
    thin = decode_idp(b.idp("ReadFile", None))
    assert isinstance(thin, IdpThin) and thin.so_id == claims["so_id"] and thin.mandate_id == "m-1"
    std = decode_idp(b.idp("WriteFile", {"goal": "Save the notes", "reasoning": "The user asked", "confidence": 0.7,
                                         "reasoning_type": "RULE_BASED"}))
    assert isinstance(std, IdpStandard) and std.reasoning_basis.type == "RULE_BASED" and std.hem_urgency == "NONE"
    # INSTRUCTION needs a source the model cannot name (spec 003 §4.3): not offered, recorded as INFERENCE.
    assert decode_idp(b.idp("ReadFile", {"reasoning": "r", "reasoning_type": "INSTRUCTION"})).reasoning_basis.type == "INFERENCE"
    assert std.step_sequence > thin.step_sequence
    asked = decode_idp(b.idp("WriteFile", {"goal": "Save"}, hem_required=True))
    assert isinstance(asked, IdpThin) and asked.hem_urgency == "REQUIRED" and asked.declared_goal is not None


def test_the_resource_comes_from_the_configured_argument() -> None:
    """A rule's resource is the Cedar entity built from the named argument; an argument that is missing or cannot be
    an entity id is refused (never silently replaced by the governed object); no rule, no resource."""
    from mcp import types

    from integrations.mcp_gate import GatedTool, ResourceFrom

    t = GatedTool(name="w", upstream="fs", tool=types.Tool(name="w", inputSchema={"type": "object"}), action="WriteFile",
                  resource=ResourceFrom(type="File", argument="path"), escalate=False)
    assert resource_of(t, {"path": "/tmp/a b"}) == 'File::"/tmp/a b"'
    for bad in ({}, {"path": '/tmp/a"b'}, {"path": "x" * 257}, {"path": True}, {"path": "/tmp/./a"},
                {"path": "/tmp/x/../a"}, {"path": "//tmp/a"}, {"path": "/tmp//a"}):
        with pytest.raises(ValueError, match="path"):
            resource_of(t, bad)
    assert resource_of(msgspec.structs.replace(t, resource=None), {}) is None


async def test_the_documented_host_config_is_the_tested_gate_file(tmp_path: Path) -> None:
    """docs/gate.md's host configuration for the example gate file runs `pgw mcp-gate` on deploy/mcp-gate.toml (the file
    tests/test_mcp_gate.py runs), and its kernel section lists exactly the Cedar actions that file's rules give the real
    filesystem server's tools."""
    import json
    import re
    import tomllib

    repo = REPO
    text = (repo / "docs" / "gate.md").read_text()
    section = text[text.index("## The example gate file in an MCP host"):]
    host = json.loads(re.search(r"```json\n(.*?)```", section, re.S).group(1))  # type: ignore[union-attr]
    assert host["mcpServers"]["files"] == {"command": "pgw", "args": ["mcp-gate", "--agent", "planner", "--gate", "deploy/mcp-gate.toml"]}
    kernel = tomllib.loads(re.search(r"```toml\n(.*?)```", section, re.S).group(1))["kernel"]  # type: ignore[union-attr]
    assert (repo / kernel["policy_dir"] / "files.cedar").is_file()
    raw = tomllib.loads((repo / "deploy" / "mcp-gate.toml").read_text())
    (tmp_path / "files").mkdir()
    raw["upstreams"]["fs"] = filesystem_upstream(tmp_path / "files")
    config = parse_gate_config(raw)
    async with Upstreams(config) as ups:
        assert sorted(ups.actions()) == kernel["executors"][config.kind]["actions"] == ["DeleteFile", "ReadFile", "WriteFile"]
        assert [t.name for t in ups.host_tools() if ups.tools[t.name].escalate] == ["write_file", "edit_file", "create_directory"]
    # `pgw mcp-gate --check` prints that very section.
    gate_file = tmp_path / "gate.toml"
    upstream = f'[upstreams.fs]\ncommand = {json.dumps(raw["upstreams"]["fs"]["command"])}\nargs = {json.dumps(raw["upstreams"]["fs"]["args"])}\n'
    gate_file.write_text(re.sub(r"(?ms)^\[upstreams\.fs\]\n.*?(?=^#)", lambda _m: upstream,
                                (repo / "deploy" / "mcp-gate.toml").read_text()))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pgwcli", "mcp-gate", "--agent", "planner", "--gate", str(gate_file), "--check",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, cwd=str(repo))
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0
    printed = tomllib.loads(out.decode().split("\n\n", 1)[1])
    assert printed["kernel"]["executors"] == kernel["executors"]


async def test_a_streamable_http_upstream_gets_the_credentials_only_the_gate_holds(tmp_path: Path) -> None:
    """An upstream given by URL is reached over streamable HTTP with the headers of the gate's file (its credentials):
    the server sees them on the call; the tools the host would list carry no trace of them."""
    import socket

    from tests.polling import until

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(sys.executable, str(CHANGING), "http", str(port),
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)

    async def listening() -> bool:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return False
        w.close()
        return True

    try:
        await until(listening, timeout=20, what="the HTTP upstream listening")
        config = parse_gate_config({"name": "h", "upstreams": {"remote": {
            "url": f"http://127.0.0.1:{port}/mcp", "headers": {"Authorization": "Bearer s3cret"}}}})
        async with Upstreams(config) as ups:
            out = await ups.call("whoami", {"tool": "whoami", "arguments": {}})
            listed = json.dumps([t.model_dump(mode="json") for t in ups.host_tools()])
        assert out["content"][0]["text"] == "Bearer s3cret"
        assert "s3cret" not in listed and "whoami" in listed
    finally:
        proc.terminate()
        await proc.wait()


async def test_without_a_gateway_a_call_is_a_clear_tool_error_and_nothing_runs(nc: Any, nats_server: Any, tmp_path: Path) -> None:
    """A gate whose bus has no gateway answering agent.{agent}.act returns the tool error kernel_unavailable (never the
    upstream's result, never an exception string), and the write it was asked for does not happen."""
    import base64
    import uuid

    from integrations.mcp_gate import Gate
    from pgwcore.connect import connect

    claims = {"so_id": str(uuid.uuid4()), "jti": "m-1"}
    token = "e30." + base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=") + ".sig"
    files = tmp_path / "files"
    files.mkdir()
    config = parse_gate_config({"name": "fs", "mandate": token, "upstreams": {"fs": filesystem_upstream(files)}})
    notes: list[str] = []

    async def progress(_elapsed: float, message: str) -> None:
        notes.append(message)

    async def bus() -> tuple[Any, Any]:  # the gate's own connection (it closes it)
        return await connect(nats_server.client_url, name="gate"), None

    async with Gate(config, "planner", connect=bus, request_timeout=2.0) as gate:
        await asyncio.wait_for(gate.connected.wait(), 30)
        result = await gate.call(gate.upstreams.tools["write_file"], {"path": str(files / "x.txt"), "content": "x"}, None, progress)
    assert result.isError and result.structuredContent is None
    assert json.loads(result.content[0].text)["code"] == "kernel_unavailable"  # type: ignore[union-attr]
    assert not (files / "x.txt").exists()


async def test_a_stdio_upstream_gets_the_environment_only_the_gate_holds() -> None:
    """A stdio upstream's `env` from the gate's file (its credentials) reaches the upstream process and appears nowhere
    in what the host is shown."""
    config = parse_gate_config({"name": "x", "upstreams": {"ch": {
        "command": sys.executable, "args": [str(CHANGING)], "env": {"TRACKER_TOKEN": "tok-123"}}}})
    async with Upstreams(config) as ups:
        out = await ups.call("getenv", {"tool": "getenv", "arguments": {"name": "TRACKER_TOKEN"}})
        shown = json.dumps([t.model_dump(mode="json") for t in ups.host_tools()])
    assert out["content"][0]["text"] == "tok-123" and "tok-123" not in shown


MORTAL = '''
import os
from mcp.server.fastmcp import FastMCP

app = FastMCP("mortal")


@app.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


@app.tool()
def echo(text: str) -> str:
    """The text, back."""
    return f"echo: {text}"


@app.tool()
def die() -> str:
    """Exit at once, before answering."""
    os._exit(1)


app.run()
'''


async def test_an_upstream_that_exits_is_started_again_and_its_tools_come_back(tmp_path: Path) -> None:
    """An upstream killed under the gate is started again: its tools are listed again (the host is told), a
    call runs on the new process; while it was down a call was refused as upstream_unavailable, not run."""
    import os
    import signal

    from tests.polling import until

    script = tmp_path / "mortal.py"
    script.write_text(MORTAL)
    config = parse_gate_config({"name": "x", "upstreams": {"m": {"command": sys.executable, "args": [str(script)]}}})
    async with Upstreams(config) as ups:
        first = int((await ups.call("pid", {"tool": "pid", "arguments": {}}))["content"][0]["text"])
        changes = ups.list_changes
        os.kill(first, signal.SIGKILL)
        await until(lambda: _true("m" in ups.down), timeout=20, what="the gate seeing its upstream gone")
        await until(lambda: _true(ups.restarts["m"] == 1 and "m" not in ups.down), timeout=30, what="the restart")
        assert ups.list_changes > changes and {"pid", "echo"} <= set(ups.tools)
        second = int((await ups.call("pid", {"tool": "pid", "arguments": {}}))["content"][0]["text"])
        assert second != first
        assert (await ups.call("echo", {"tool": "echo", "arguments": {"text": "hi"}}))["content"][0]["text"] == "echo: hi"


async def test_an_upstream_that_keeps_exiting_is_started_again_only_up_to_the_limit(tmp_path: Path) -> None:
    """An upstream that exits as soon as it starts is started again restart_limit times, then left down; the
    gate then lists gate_problem saying so (with the upstream's last stderr line), and a call of it is refused
    unrun."""
    script = tmp_path / "dies.py"
    script.write_text("import sys\nprint('no licence key', file=sys.stderr)\nsys.exit(3)\n")
    config = parse_gate_config({"name": "x", "restart_limit": 2,
                                "upstreams": {"d": {"command": sys.executable, "args": [str(script)]}}})
    async with Upstreams(config) as ups:
        await asyncio.wait_for(ups._runners["d"], 30)
        why = ups.down["d"]
        assert "not started again (limit 2)" in why and "no licence key" in why
        (problem,) = ups.host_tools()
        assert problem.name == "gate_problem" and "no licence key" in (problem.description or "")
        with pytest.raises(ExecutionRefused) as e:
            await ups.call("t", {"tool": "t", "arguments": {}})
        assert e.value.code == "unknown_tool"


async def test_a_call_its_upstream_dies_in_is_upstream_exited_and_later_calls_upstream_unavailable(tmp_path: Path) -> None:
    """The executor half's words for an upstream that went away (the kernel records them as the failure): a call the
    upstream exits during is upstream_exited (it may have acted), and with no restart left a later call is
    upstream_unavailable with the reason, not run; neither is an EXECUTOR_EXCEPTION."""
    script = tmp_path / "mortal.py"
    script.write_text(MORTAL)
    config = parse_gate_config({"name": "x", "restart_limit": 0,
                                "upstreams": {"m": {"command": sys.executable, "args": [str(script)]}}})
    async with Upstreams(config) as ups:
        with pytest.raises(ExecutionRefused) as e:
            await ups.call("die", {"tool": "die", "arguments": {}})
        assert e.value.code == "upstream_exited"
        await asyncio.wait_for(ups._runners["m"], 30)
        with pytest.raises(ExecutionRefused) as e:
            await ups.call("echo", {"tool": "echo", "arguments": {"text": "hi"}})
        assert e.value.code == "upstream_unavailable" and "upstream m exited" in e.value.message


async def _true(value: bool) -> bool:
    return value


async def test_a_call_of_an_upstream_still_on_its_first_start_waits_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate serves after UPSTREAM_FIRST_WAIT_S, upstreams still starting or not (an ``npx -y`` fetching its
    package, a loaded machine). A host's call of such an upstream's tool waits for its first start and is served,
    instead of "no tool ... behind this gate" (found by a loaded run of the quick start); a name no upstream has is
    still unknown_tool, and once the wait's bound has passed no call waits again. The upstream is the real git
    server, started 2 s late."""
    from mcp import types
    from mcp.shared.memory import create_connected_server_and_client_session

    import integrations.mcp_gate as gate

    monkeypatch.setattr(gate, "UPSTREAM_FIRST_WAIT_S", 0.2)
    repo = git_repo(tmp_path / "repo")
    late = {"command": "sh", "args": ["-c", f"sleep 2; exec {sys.executable} -m mcp_server_git --repository {repo}"]}
    config = parse_gate_config({"name": "git", "upstreams": {"git": late}, "tools": {}})

    async def run_with(ups: Upstreams) -> Any:
        async def run(gated: Any, args: dict[str, Any], _intent: Any, _progress: Any) -> types.CallToolResult:
            return types.CallToolResult(**await ups.call(gated.action, {"tool": gated.name, "arguments": args}))
        return gate.build_server(ups, run)

    async with Upstreams(config) as ups:
        assert ups.tools == {} and not ups.started_all  # serving already, the upstream not up yet
        async with create_connected_server_and_client_session(await run_with(ups)) as host:
            result = await host.call_tool("git_status", {"repo_path": str(repo)})
            assert not result.isError, result
            assert "On branch main" in result.content[0].text  # type: ignore[union-attr]
            nope = await host.call_tool("no_such_tool", {})
            assert nope.isError and "unknown_tool" in nope.content[0].text  # type: ignore[union-attr]

    async with Upstreams(config) as ups, create_connected_server_and_client_session(await run_with(ups)) as host:
        ups._first_deadline = 0.0  # the wait's bound (UPSTREAM_START_S from the gate's start) passed
        t0 = asyncio.get_running_loop().time()
        nope = await host.call_tool("git_status", {"repo_path": str(repo)})
        assert asyncio.get_running_loop().time() - t0 < 1.5  # told at once, not kept waiting for the start
        assert nope.isError and "unknown_tool" in nope.content[0].text and not ups.started_all  # type: ignore[union-attr]
