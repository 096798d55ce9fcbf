"""The MCP gate end to end: the official reference MCP servers, unmodified, behind `pgw mcp-gate` and the IDP kernel.

A real nats-server and gateway (kernel, Cedar with policies/mcp-gate, the gate's executor configured);
`pgw mcp-gate` runs as a subprocess spoken to over stdio by the real `mcp` client; the principal answers
on the bus with ``subjects.client.Surface``; the capsules are made by the real signer. The file on disk
says whether a write or a delete ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tomllib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client

from consumers.signer import Signer
from consumers.verifier import payload_of
from integrations.mcp_gate import mandate_claims, result_json
from subjects.client import Surface
from subjects.idp import json_digest
from subjects.wire import BindingMomentItem, OptionChoice
from tests.kernel_support import Issuer, read_log, running_gateway
from tests.mcp_peers import filesystem_upstream, git_upstream
from tests.polling import until
from tests.test_capsule_signer import stream_items

AGENT, PRINCIPAL = "planner", "alice"
PGW = str(Path(sys.executable).parent / "pgw")
REPO = Path(__file__).resolve().parent.parent
CHANGING = Path(__file__).with_name("mcp_changing_upstream.py")
ACTIONS = ["ReadFile", "WriteFile", "DeleteFile", "ReadRepo", "WriteRepo", "add_tool", "shout", "slow"]


class GateEnv:
    def __init__(self, url: str, nc: Any, gw: Any, tmp: Path, token: str) -> None:
        self.url, self.nc, self.gw, self.tmp, self.token = url, nc, gw, tmp, token
        self.js = nc.jetstream()
        self.files = tmp / "files"
        self.files.mkdir()
        self.data_dir = tmp / "gate-data"

    def gate_file(self, **upstreams: dict[str, Any]) -> Path:
        """deploy/mcp-gate.toml (the README's example) with the cached server on ``files`` and the test's mandate;
        ``upstreams`` adds more (then the tools are namespaced and the rules apply to ``fs__*``)."""
        raw = tomllib.loads((REPO / "deploy" / "mcp-gate.toml").read_text())
        raw.pop("mandate_file")
        raw["mandate"] = self.token
        raw["upstreams"]["fs"] = filesystem_upstream(self.files)
        if upstreams:
            raw["upstreams"].update(upstreams)
            raw["tools"] = {f"fs__{k}": v for k, v in raw["tools"].items()}
            raw["tools"].update({f"git__{t}": {"action": "ReadRepo"} for t in ("git_status", "git_log", "git_diff", "git_show")})
            raw["tools"].update({f"git__{t}": {"action": "WriteRepo"} for t in ("git_add", "git_commit", "git_reset")})
        path = self.tmp / f"gate-{uuid.uuid4().hex[:6]}.toml"
        path.write_text(_toml(raw))
        return path

    @contextlib.asynccontextmanager
    async def session(self, gate_file: Path, on_message: Any = None, *extra: str) -> AsyncIterator[ClientSession]:
        params = StdioServerParameters(command=PGW, args=[
            "mcp-gate", "--agent", AGENT, "--gate", str(gate_file), "--server", self.url,
            "--data-dir", str(self.data_dir), "--progress-every", "0.3", *extra], env=dict(os.environ))
        async with stdio_client(params) as (read, write), ClientSession(read, write, message_handler=on_message) as session:
            await session.initialize()
            yield session

    def principal(self, index: int | None) -> asyncio.Task[Any]:
        """alice, on her surface: the first HEM moment, answered with option ``index`` (None: left unanswered)."""

        async def run() -> Any:
            surface = Surface(self.nc, PRINCIPAL)
            try:
                async for item in surface.items():
                    if isinstance(item, BindingMomentItem):
                        if index is None:
                            return item
                        return item, await surface.resolve(item.moment_id, OptionChoice(index=index))
            finally:
                await surface.close()
            return None

        return asyncio.create_task(run())

    async def capsule(self, action: str) -> dict[str, Any]:
        """The signed capsule of the one dispatched ``action`` (its idp_id from the kernel's log)."""
        dispatched = [ev for _s, ev in await read_log(self.js, "STATE_TRANSITIONED") if ev.body.get("executed_action") == action]
        assert len(dispatched) == 1, dispatched
        idp_id = dispatched[0].body["idp_id"]

        async def found() -> dict[str, Any] | None:
            for _src, data, _h in await stream_items(self.js, "PGW_REGISTRATION"):
                p = payload_of(data) or {}
                if p.get("action_id") == idp_id and "statement_type" not in p \
                        and p.get("disposition", {}).get("verdict_class", "executed") == "executed":
                    return p
            return None

        async with Signer(self.gw.config, self.nc):
            return await until(found, timeout=20, what=f"the capsule of {action}")


async def git(repo: Path, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec("git", "-C", str(repo), *args, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == 0, args
    return out.decode().strip()


def said(result: types.CallToolResult) -> dict[str, Any]:
    """The body of a gate's tool error: the JSON of its one text content (no structuredContent, which is the
    upstream's, conforming to its outputSchema: MCP 2025-06-18, Tools, "Output Schema")."""
    assert result.isError and result.structuredContent is None, result
    return msgspec.json.decode(result.content[0].text)  # type: ignore[union-attr]


def _toml(raw: dict[str, Any]) -> str:
    """A small TOML writer for the gate file (tables of scalars, lists and inline tables)."""
    def val(v: Any) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {val(x)}" for k, x in v.items()) + " }"
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, bool):
            return "true" if v else "false"
        return msgspec.json.encode(v).decode()

    lines = [f"{k} = {val(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for section in ("upstreams", "tools"):
        for name, table in raw.get(section, {}).items():
            lines.append(f'[{section}."{name}"]')
            lines += [f"{k} = {val(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(params=[{}], ids=["default"])
async def gate_env(request: Any, make_config: Any, nc: Any, nats_server: Any, tmp_path: Path) -> AsyncIterator[GateEnv]:
    """A gateway whose kernel runs policies/mcp-gate (plus a permit for the list-changing test tools) and sends
    the gate's actions to the executor mcp-files; agent planner is bound to alice and holds a mandate for them."""
    issuer = Issuer(tmp_path / "issuer")
    pdir = tmp_path / "policies"
    shutil.copytree(REPO / "policies" / "mcp-gate", pdir)
    (pdir / "test.cedar").write_text('permit(principal, action in [Action::"add_tool", Action::"shout", Action::"slow"], resource);\n')
    so = str(uuid.uuid4())
    token, _jti = issuer.mandate(agent=AGENT, so_id=so, principal=PRINCIPAL, actions=ACTIONS)
    cfg = make_config(
        kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(pdir),
                "executors": {"mcp-files": {"actions": ACTIONS, "timeout_s": 20}}, **request.param},
        agents={AGENT: {"principals": [PRINCIPAL]}},
    )
    async with running_gateway(cfg, nc) as gw:
        yield GateEnv(nats_server.client_url, nc, gw, tmp_path, token)


async def test_a_read_returns_the_servers_result_and_its_capsule_is_gate_executed_and_confirmed(gate_env: GateEnv) -> None:
    """A permitted read returns the filesystem server's real result; its capsule is gate_executed, confirmed, with the
    JSON-DIGEST of exactly the result the client got."""
    (gate_env.files / "notes.txt").write_text("the real notes\n")
    async with gate_env.session(gate_env.gate_file()) as session:
        tools = {t.name: t for t in (await session.list_tools()).tools}
        assert "intent" in tools["read_text_file"].inputSchema["properties"]
        result = await asyncio.wait_for(session.call_tool("read_text_file", {"path": str(gate_env.files / "notes.txt")}), 30)
    assert not result.isError and result.content[0].text == "the real notes\n"  # type: ignore[union-attr]
    cap = await gate_env.capsule("ReadFile")
    effect = cap["effect"]
    assert effect["status"] == "confirmed"
    assert effect["effect_attestation"] == "gate_executed"
    assert effect["response_digest"] == json_digest(result_json(result))


@pytest.mark.parametrize("answer", [0, 1], ids=["approved", "rejected"])
async def test_a_write_waits_for_the_principal_and_runs_only_after_approval(gate_env: GateEnv, answer: int) -> None:
    """A write is not permitted on its own: the call waits (with progress) while alice sees a binding moment about it;
    approved, the file is written and the call returns the server's result; rejected, the call fails and no file exists."""
    target = gate_env.files / "draft.txt"
    waiting = asyncio.Event()

    async def on_progress(p: float, total: float | None, message: str | None) -> None:
        if "waiting for the principal" in (message or ""):
            waiting.set()

    async with gate_env.session(gate_env.gate_file()) as session:
        call = asyncio.create_task(session.call_tool(
            "write_file", {"path": str(target), "content": "hello", "intent": {"goal": "Save the draft"}},
            progress_callback=on_progress))
        item = await asyncio.wait_for(gate_env.principal(None), 30)
        await asyncio.wait_for(waiting.wait(), 20)
        assert not target.exists()  # nothing ran while alice thinks
        # What alice sees (the README's quick start quotes it): the action, the model's stated goal, Approve / Deny.
        moment = item.binding_moment
        assert "write_file" in moment.synopsis  # the synopsis commits to a position (spec 000 §6.1)
        assert any("Save the draft" in f for f in moment.findings)  # the model's stated goal, as a finding
        # The tool and its arguments, as the upstream will get them (the intent is not one of them).
        assert "Tool to call: write_file." in moment.findings
        assert f"Tool argument path: {msgspec.json.encode(str(target)).decode()}" in moment.findings
        assert 'Tool argument content: "hello"' in moment.findings
        assert not any(f.startswith("Tool argument intent") for f in moment.findings)
        # Approve / Deny, and the two standing approvals a write to a clean path is offered (docs/gate.md).
        assert [o.label for o in moment.question.options] == ["Approve", "Deny", "Allow for this session",
                                                             "Allow for an hour"]
        _item, reply = await asyncio.wait_for(gate_env.principal(answer), 30)
        assert reply.status == "accepted"
        result = await asyncio.wait_for(call, 30)
    if answer == 0:
        assert not result.isError and target.read_text() == "hello"
    else:
        assert result.isError and said(result)["status"] == "not_run" and not target.exists()


@pytest.mark.parametrize("gate_env", [{"hem_expires_in_s": 2}], ids=["hem-2s"], indirect=True)
async def test_a_write_the_principal_lets_expire_does_not_run(gate_env: GateEnv) -> None:
    """A write whose moment expires unanswered is refused (expiry is never consent): the call fails, no file exists."""
    target = gate_env.files / "late.txt"
    async with gate_env.session(gate_env.gate_file()) as session:
        result = await asyncio.wait_for(session.call_tool("write_file", {"path": str(target), "content": "x"}), 60)
    assert result.isError and said(result)["status"] == "not_run"
    assert not target.exists()


async def test_a_delete_is_denied_and_the_file_stays(gate_env: GateEnv) -> None:
    """move_file (governed as DeleteFile: it removes its source) is denied by the forbid, with the Enriched DENY in the
    tool error, and the principal is not asked; the file stays where it was."""
    src = gate_env.files / "keep.txt"
    src.write_text("keep me")
    async with gate_env.session(gate_env.gate_file()) as session:
        result = await asyncio.wait_for(session.call_tool(
            "move_file", {"source": str(src), "destination": str(gate_env.files / "gone.txt")}), 30)
    assert result.isError
    body = said(result)
    assert body["status"] == "denied" and body["deny_code"] == "POLICY_DENY"
    assert isinstance(body["available_actions"], list) and isinstance(body["hem_available"], bool)
    assert src.read_text() == "keep me" and not (gate_env.files / "gone.txt").exists()
    assert not await Surface(gate_env.nc, PRINCIPAL).pending()


async def test_the_git_server_behind_the_same_gate_is_namespaced_and_governed(gate_env: GateEnv) -> None:
    """With the git server beside the filesystem server the tools are fs__* and git__*; git__git_status is a permitted
    read and returns the server's real status; a git__git_commit (WriteRepo, not permitted, not escalated) is denied and
    commits nothing."""
    repo = gate_env.tmp / "repo"
    repo.mkdir()
    (repo / "a.txt").write_text("a")
    for cmd in (["init", "-q", "-b", "main"], ["config", "user.email", "t@example.org"], ["config", "user.name", "T"],
                ["add", "a.txt"]):
        await git(repo, *cmd)
    async with gate_env.session(gate_env.gate_file(git=git_upstream(repo))) as session:
        names = {t.name for t in (await session.list_tools()).tools}
        assert {"fs__read_text_file", "git__git_status", "git__git_commit"} <= names
        status = await asyncio.wait_for(session.call_tool("git__git_status", {"repo_path": str(repo)}), 30)
        commit = await asyncio.wait_for(session.call_tool("git__git_commit", {"repo_path": str(repo), "message": "x"}), 30)
    assert not status.isError and "a.txt" in status.content[0].text  # type: ignore[union-attr]
    assert commit.isError and said(commit)["status"] == "denied"
    assert await git(repo, "rev-list", "--all") == ""  # no commit was made


async def test_a_list_change_upstream_reaches_the_host_and_prompts_pass_resources_refused(gate_env: GateEnv) -> None:
    """An upstream's tools/list_changed reaches the host, whose new listing has the new tool, callable through the
    kernel; the upstream's prompt passes through and its resource is refused as ungoverned."""
    path = gate_env.tmp / "changing.toml"
    path.write_text(_toml({"name": "files", "mandate": gate_env.token,
                           "upstreams": {"ch": {"command": sys.executable, "args": [str(CHANGING)]}}}))
    changed = asyncio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ServerNotification) and isinstance(message.root, types.ToolListChangedNotification):
            changed.set()

    async with gate_env.session(path, on_message) as session:
        assert "shout" not in {t.name for t in (await session.list_tools()).tools}
        added = await asyncio.wait_for(session.call_tool("add_tool", {"name": "shout"}), 30)
        assert not added.isError
        await asyncio.wait_for(changed.wait(), 20)
        assert "shout" in {t.name for t in (await session.list_tools()).tools}
        out = await asyncio.wait_for(session.call_tool("shout", {"text": "hi"}), 30)
        assert out.content[0].text == "shout: hi"  # type: ignore[union-attr]
        assert [p.name for p in (await session.list_prompts()).prompts] == ["summarize"]
        with pytest.raises(Exception, match="not governed"):
            await session.read_resource("memo://notes")  # type: ignore[arg-type]


async def test_a_read_the_server_fails_is_recorded_failed_and_the_host_gets_its_words(gate_env: GateEnv) -> None:
    """A permitted read of a file outside the server's folder: the server answers isError, the executor reports the
    error, the kernel records failed (no confirmed capsule), and the host gets a tool error with the server's words."""
    async with gate_env.session(gate_env.gate_file()) as session:
        result = await asyncio.wait_for(session.call_tool("read_text_file", {"path": "/etc/hostname"}), 30)
    assert result.isError and said(result)["status"] == "failed"
    error = said(result)["error"]
    assert error["code"] == "tool_error" and "denied" in error["message"].lower()
    cap = await gate_env.capsule("ReadFile")
    assert cap["effect"]["status"] == "failed" and cap["effect"]["effect_attestation"] == "gate_executed"


async def test_an_act_that_names_a_write_tool_under_a_read_action_does_not_write(gate_env: GateEnv) -> None:
    """An agent that bypasses the gate's server and submits ReadFile (permitted) with the write tool in its arguments
    gets its act permitted and dispatched, but the gate's executor refuses the mismatch: failed, and nothing is written."""
    from subjects.gate import ActDone, ActRequest, act_result_decoder
    from subjects.util import now_rfc3339

    target = gate_env.files / "smuggled.txt"
    claims = mandate_claims(gate_env.token)
    idp = {"idp_id": str(uuid.uuid4()), "session_id": "direct", "so_id": claims["so_id"], "mandate_id": claims["jti"],
           "step_sequence": 1, "requested_action": "ReadFile", "timestamp": now_rfc3339(), "profile": "IDP_THIN"}
    async with gate_env.session(gate_env.gate_file()) as session:
        # The gate reaches the bus after answering initialize: one call through it shows its executor is serving.
        assert not (await asyncio.wait_for(session.call_tool("list_allowed_directories", {}), 30)).isError
        req = ActRequest(mandate=gate_env.token, action="ReadFile", idp=idp,
                         arguments={"tool": "write_file", "arguments": {"path": str(target), "content": "x"}})
        msg = await gate_env.nc.request(f"pgw.agent.{AGENT}.act", msgspec.json.encode(req), timeout=30)
    result = act_result_decoder.decode(msg.data)
    assert isinstance(result, ActDone) and result.status == "failed"
    assert result.response["code"] == "action_mismatch"
    assert not target.exists()


@pytest.mark.security
async def test_the_gate_works_within_the_agents_and_the_executors_own_permissions(tmp_path: Path) -> None:
    """On a server enforcing the generated permissions, `pgw mcp-gate` speaks for the agent with the agent's credentials
    and serves its executor with the executor role's (both found in the data folder): a read runs, a delete is denied."""
    from gateway.app import Gateway
    from gateway.security import Party, embedded_auth
    from pgwcore.config import load_config
    from pgwcore.connect import connect
    from pgwcore.server import EmbeddedServer

    issuer = Issuer(tmp_path / "issuer")
    pdir = tmp_path / "policies"
    shutil.copytree(REPO / "policies" / "mcp-gate", pdir)
    token, _ = issuer.mandate(agent=AGENT, so_id=str(uuid.uuid4()), principal=PRINCIPAL, actions=ACTIONS)
    data = tmp_path / "data"
    settings: dict[str, Any] = {
        "agents": {AGENT: {"principals": [PRINCIPAL]}},
        "kernel": {"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(pdir),
                   "executors": {"mcp-files": {"actions": ["ReadFile", "WriteFile", "DeleteFile"]}}},
    }
    auth = embedded_auth(load_config(None, data_dir=str(data), **settings))
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1, authorization=auth.server_block)
    await server.start()
    try:
        config = load_config(None, data_dir=str(data), nats_url=server.client_url, **settings)
        service = await connect(server.client_url, creds=str(auth.service_creds), name="gateway")
        try:
            async with Gateway(config, service):
                env = GateEnv(server.client_url, service, None, tmp_path, token)
                env.data_dir = data  # where `pgw creds` put agent-planner.creds
                (env.files / "keep.txt").write_text("kept")
                assert auth.creds_for(Party("executor", "mcp-files")).exists()  # found by the gate in the data folder
                async with env.session(env.gate_file()) as session:
                    read = await asyncio.wait_for(session.call_tool("read_text_file", {"path": str(env.files / "keep.txt")}), 30)
                    moved = await asyncio.wait_for(session.call_tool(
                        "move_file", {"source": str(env.files / "keep.txt"), "destination": str(env.files / "x.txt")}), 30)
        finally:
            await service.drain()
    finally:
        await server.stop()
    assert not read.isError and read.content[0].text == "kept"  # type: ignore[union-attr]
    assert moved.isError and said(moved)["status"] == "denied"
    assert (env.files / "keep.txt").read_text() == "kept"


async def test_the_models_intent_makes_the_declaration_standard_and_never_reaches_the_server(gate_env: GateEnv) -> None:
    """A call with goal, reasoning and confidence in `intent` is declared IDP_STANDARD with them (spec 003 §4.1); one
    without is IDP_THIN (§7); the server gets the call's own arguments only (it would refuse an unknown `intent`)."""
    (gate_env.files / "a.txt").write_text("a")
    intent = {"goal": "Check the notes", "reasoning": "The user asked what they say", "confidence": 0.9,
              "reasoning_type": "RULE_BASED"}
    async with gate_env.session(gate_env.gate_file()) as session:
        stated = await asyncio.wait_for(session.call_tool("read_text_file", {"path": str(gate_env.files / "a.txt"), "intent": intent}), 30)
        bare = await asyncio.wait_for(session.call_tool("get_file_info", {"path": str(gate_env.files / "a.txt")}), 30)
    assert not stated.isError and stated.content[0].text == "a"  # type: ignore[union-attr]
    assert not bare.isError
    submitted = [ev.body for _s, ev in await read_log(gate_env.js, "IDP_SUBMITTED")]
    assert [b["profile"] for b in submitted] == ["IDP_STANDARD", "IDP_THIN"]
    idp = submitted[0]["idp"]
    assert idp["declared_goal"]["description"] == "Check the notes" and idp["reasoning_basis"]["type"] == "RULE_BASED"
    assert idp["confidence_level"] == 0.9 and "declared_goal" not in submitted[1]["idp"]


@pytest.mark.parametrize("gate_env", [{"executors": {"mcp-files": {"actions": ACTIONS, "timeout_s": 1}}}],
                         ids=["executor-1s"], indirect=True)
async def test_a_call_that_outlasts_the_executor_timeout_waits_for_its_late_result(gate_env: GateEnv) -> None:
    """A tool slower than the kernel's executor timeout: the kernel answers DISPATCHED, the call keeps waiting (with
    progress) and returns the tool's real result when the kernel learns it; its capsule is then confirmed."""
    path = gate_env.tmp / "slow.toml"
    path.write_text(_toml({"name": "files", "mandate": gate_env.token,
                           "upstreams": {"ch": {"command": sys.executable, "args": [str(CHANGING)]}}}))
    messages: list[str] = []
    dispatched = asyncio.Event()
    release = gate_env.tmp / "release.fifo"
    os.mkfifo(release)

    async def on_progress(p: float, total: float | None, message: str | None) -> None:
        messages.append(message or "")
        if (message or "").startswith("dispatched, waiting for the result"):
            dispatched.set()

    def let_go() -> None:  # the tool answers once it reads a line (O_NONBLOCK: no error if it is not reading)
        with contextlib.suppress(OSError):
            fd = os.open(release, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"go\n")
            os.close(fd)

    async with gate_env.session(path) as session:
        call = asyncio.create_task(session.call_tool("slow", {"release": str(release)}, progress_callback=on_progress))
        try:
            # The tool holds the call past the kernel's 1 s executor timeout, until the gate says it waits on.
            await asyncio.wait_for(dispatched.wait(), 60)
            assert not call.done()
            let_go()
            result = await asyncio.wait_for(call, 60)
        finally:
            let_go()
            call.cancel()
    assert not result.isError and result.content[0].text == "released: go"  # type: ignore[union-attr]
    assert any(m.startswith("dispatched, waiting for the result") for m in messages), messages
    cap = await gate_env.capsule("slow")
    assert cap["effect"]["status"] == "confirmed" and cap["effect"]["response_digest"] == json_digest(result_json(result))


async def test_the_gate_serves_a_host_over_streamable_http(gate_env: GateEnv) -> None:
    """`pgw mcp-gate --transport http` serves the same gated tools at http://127.0.0.1:PORT/mcp: a read returns the
    server's real result."""
    import socket

    from mcp.client.streamable_http import streamable_http_client

    (gate_env.files / "h.txt").write_text("over http")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = await asyncio.create_subprocess_exec(
        PGW, "mcp-gate", "--agent", AGENT, "--gate", str(gate_env.gate_file()), "--server", gate_env.url,
        "--data-dir", str(gate_env.data_dir), "--transport", "http", "--port", str(port))

    async def listening() -> bool:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return False
        w.close()
        return True

    try:
        await until(listening, timeout=20, what="pgw mcp-gate listening")
        async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as (read, write, _), \
                ClientSession(read, write) as session:
            await session.initialize()
            result = await asyncio.wait_for(session.call_tool("read_text_file", {"path": str(gate_env.files / "h.txt")}), 30)
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
    assert not result.isError and result.content[0].text == "over http"  # type: ignore[union-attr]


async def test_concurrent_calls_of_one_host_all_run(gate_env: GateEnv) -> None:
    """A host that calls several tools at once (as hosts do) gets every result: each call is its own step of the
    gate's session, and a step the kernel saw overtaken by a later one is declared again, never lost."""
    for i in range(6):
        (gate_env.files / f"{i}.txt").write_text(f"file {i}")
    async with gate_env.session(gate_env.gate_file()) as session:
        results = await asyncio.wait_for(asyncio.gather(*(
            session.call_tool("read_text_file", {"path": str(gate_env.files / f"{i}.txt")}) for i in range(6))), 60)
    assert [r.content[0].text for r in results] == [f"file {i}" for i in range(6)], [r.content for r in results]  # type: ignore[union-attr]
