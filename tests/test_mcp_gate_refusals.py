"""What the MCP gate's executor refuses, and what it keeps (integrations/mcp_gate.py ``path_refusal``,
``Upstreams.call``, ``Gate._handler``; docs/gate.md "What the executor refuses").

A real nats-server and gateway (kernel, Cedar with policies/mcp-gate, a configured secret); `pgw mcp-gate` as a
subprocess in front of the real reference filesystem server, spoken to over stdio by the real `mcp` client, with
a configuration naming the same secret; the principal answers on the bus. The files on disk say what ran; the
executor's bucket is read as stored.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from integrations.mcp_gate import PATH_KEYS, mandate_claims
from subjects.client import Surface
from tests.kernel_support import Issuer, running_gateway
from tests.test_capsule_signer import stream_items
from tests.test_mcp_gate import ACTIONS, AGENT, PRINCIPAL, REPO, GateEnv, said

SECRET = "Zq7PlumBaGo9xK"
MARK = "Lk3NotConfiguredWq"  # caller text that is no configured secret: kept out by not being echoed at all


class SecretGateEnv(GateEnv):
    """A GateEnv whose `pgw mcp-gate` runs with ``extra`` (a configuration naming ``SECRET``)."""

    extra: tuple[str, ...] = ()


@pytest.fixture
async def env(make_config: Any, nc: Any, nats_server: Any, tmp_path: Path) -> AsyncIterator[SecretGateEnv]:
    """tests/test_mcp_gate.py's gateway, with ``SECRET`` configured (pipeline.secrets) in the gateway and in the
    configuration `pgw mcp-gate` runs with (``env.extra``)."""
    issuer = Issuer(tmp_path / "issuer")
    pdir = tmp_path / "policies"
    shutil.copytree(REPO / "policies" / "mcp-gate", pdir)
    token, _jti = issuer.mandate(agent=AGENT, so_id=str(uuid.uuid4()), principal=PRINCIPAL, actions=ACTIONS)
    secrets = {"secrets": {"values": [SECRET]}}
    cfg = make_config(
        kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(pdir),
                "executors": {"mcp-files": {"actions": ACTIONS, "timeout_s": 20}}},
        agents={AGENT: {"principals": [PRINCIPAL]}}, pipeline=secrets,
    )
    # A read the policy forbids by resource (the resource-mismatch test): what an agent must not escape by
    # declaring another resource, or none.
    (pdir / "forbid-private.cedar").write_text(
        f'forbid(principal, action == Action::"ReadFile", resource == File::"{tmp_path / "files" / "private.txt"}");\n')
    gate_conf = tmp_path / "gate-pgw.toml"
    gate_conf.write_text(f'[pipeline.secrets]\nvalues = ["{SECRET}"]\n')
    async with running_gateway(cfg, nc) as gw:
        gate = SecretGateEnv(nats_server.client_url, nc, gw, tmp_path, token)
        gate.extra = ("--config", str(gate_conf))
        yield gate


async def act(env: SecretGateEnv, step: int, arguments: dict[str, Any], resource: str | None = None) -> Any:
    """Agent ``AGENT`` speaks ``agent.{agent}.act`` itself with its own credentials (not through `pgw mcp-gate`):
    ``ReadFile`` with ``arguments`` (``{"tool", "arguments"}``) and the ``resource`` it declares; the kernel's answer."""
    from subjects.gate import ActRequest, act_result_decoder
    from subjects.util import now_rfc3339

    claims = mandate_claims(env.token)
    idp = {"idp_id": str(uuid.uuid4()), "session_id": "direct", "so_id": claims["so_id"],
           "mandate_id": claims["jti"], "step_sequence": step, "requested_action": "ReadFile",
           "timestamp": now_rfc3339(), "profile": "IDP_THIN"}
    req = ActRequest(mandate=env.token, action="ReadFile", idp=idp, arguments=arguments, resource=resource)
    msg = await env.nc.request(f"pgw.agent.{AGENT}.act", msgspec.json.encode(req), timeout=30)
    return act_result_decoder.decode(msg.data)


def test_the_executor_judges_the_arguments_the_card_shows_as_paths() -> None:
    """The executor's path arguments are the approval card's (gateway/kernel/hem.py PATH_KEYS, which a standing
    approval is judged on): a key added there is checked here too."""
    from gateway.kernel.hem import PATH_KEYS as CARD_PATH_KEYS

    assert PATH_KEYS == CARD_PATH_KEYS


async def test_a_standing_approval_does_not_reach_through_a_symbolic_link(env: SecretGateEnv) -> None:
    """After "Allow for this session" on a write in the folder, a write to a symbolic link in that folder (to a file
    in a subfolder) is covered by the standing approval (the kernel judges the path as sent) and refused by the
    gate's executor before the server is called: the linked file is unchanged and she is not asked. A read through
    the link, or through a linked folder, and a read by a relative path are refused the same way."""
    files = env.files
    (files / "sub").mkdir()
    private = files / "sub" / "private.txt"
    private.write_text("private")
    (files / "lnk.txt").symlink_to(private)
    (files / "ldir").symlink_to(files / "sub")
    (files / "plain.txt").write_text("plain")
    async with env.session(env.gate_file(), None, *env.extra) as session:
        asked = asyncio.create_task(session.call_tool("write_file", {"path": str(files / "a1.txt"), "content": "A1"}))
        _item, reply = await asyncio.wait_for(env.principal(2), 30)  # Allow for this session
        assert reply.status == "accepted"
        assert not (await asyncio.wait_for(asked, 30)).isError
        write = await asyncio.wait_for(session.call_tool("write_file", {"path": str(files / "lnk.txt"), "content": "PWNED"}), 30)
        read = await asyncio.wait_for(session.call_tool("read_text_file", {"path": str(files / "lnk.txt")}), 30)
        through = await asyncio.wait_for(session.call_tool("read_text_file", {"path": str(files / "ldir" / "private.txt")}), 30)
        relative = await asyncio.wait_for(session.call_tool("read_text_file", {"path": "plain.txt"}), 30)
        plain = await asyncio.wait_for(session.call_tool("read_text_file", {"path": str(files / "plain.txt")}), 30)
    assert (files / "a1.txt").read_text() == "A1"
    for result in (write, read, through):
        body = said(result)
        assert body["status"] == "failed" and body["error"]["code"] == "symbolic_link", body
        assert "goes through a symbolic link" in body["error"]["message"] and "'path'" in body["error"]["message"]
    assert said(relative)["error"]["code"] == "path_not_absolute"
    assert private.read_text() == "private" and (files / "lnk.txt").is_symlink()
    assert not plain.isError and plain.content[0].text == "plain"  # type: ignore[union-attr]
    assert not await Surface(env.nc, PRINCIPAL).pending()  # the write was covered: she was not asked again


async def test_the_executor_keeps_none_of_the_callers_text_in_its_refusals(env: SecretGateEnv) -> None:
    """An agent speaking the bus itself may name any tool: an `act` whose tool name holds a configured secret is
    refused unknown_tool in words that name the gate's tools, not the caller's; a read of a path that holds the secret,
    with no resource declared (its rule takes the resource from the path), is refused resource_mismatch before the
    server is called, in words that quote neither (a declared resource holding the secret is refused by the
    kernel); a read the server refuses keeps the server's words. Neither the answers nor the
    executor's bucket (KV_PGW_EXEC_MCP-FILES, whose deleted values stay in its files) hold the secret, nor a tool
    name that is no configured secret."""
    from subjects.gate import ActDone

    steps = itertools.count(1)

    async def done(arguments: dict[str, Any], resource: str | None = None) -> ActDone:
        result = await act(env, next(steps), arguments, resource)
        assert isinstance(result, ActDone), result
        return result

    async with env.session(env.gate_file(), None, *env.extra) as session:
        # The gate reaches the bus after answering initialize: one call through it shows its executor is serving.
        assert not (await asyncio.wait_for(session.call_tool("list_allowed_directories", {}), 30)).isError
        named = await done({"tool": f"read_{SECRET}", "arguments": {"path": str(env.files / "a.txt")}})
        unconfigured = await done({"tool": f"read_{MARK}", "arguments": {"path": str(env.files / "a.txt")}})
        undeclared = await done({"tool": "read_text_file", "arguments": {"path": f"/etc/{SECRET}.txt"}})
        quoted = await done({"tool": "read_text_file", "arguments": {"path": "/etc/pgw-nope.txt"}},
                            resource='File::"/etc/pgw-nope.txt"')
    assert named.status == "failed" and named.response["code"] == "unknown_tool"
    assert "no such tool behind this gate" in named.response["message"] and "read_text_file" in named.response["message"]
    assert undeclared.status == "failed" and undeclared.response["code"] == "resource_mismatch", undeclared
    assert quoted.status == "failed" and quoted.response["code"] == "tool_error", quoted
    assert "Access denied" in quoted.response["message"]  # the server's own words, kept
    assert unconfigured.response["message"] == named.response["message"]
    answered = msgspec.json.encode([named.response, unconfigured.response, undeclared.response, quoted.response]).decode()
    assert SECRET not in answered and MARK not in answered
    stored = await stream_items(env.js, "KV_PGW_EXEC_MCP-FILES")
    assert b"unknown_tool" in b"".join(data for _src, data, _h in stored)  # the refusals were stored
    assert not [src for src, data, _h in stored if SECRET.encode() in data or MARK.encode() in data]


async def test_a_call_runs_only_against_the_resource_it_was_judged_on(env: SecretGateEnv) -> None:
    """The kernel judges a call against the resource the agent declares and does not read the arguments; the
    policy here forbids reading ``private.txt`` by resource. An agent speaking ``agent.{agent}.act`` itself (its
    own credentials, not through `pgw mcp-gate`) read it anyway by declaring ``public.txt``, or no resource
    (the governed object), for a call whose path is ``private.txt`` (found by an attack from the docs). The
    gate's executor now runs a call only when the declared resource is the one its rule takes from the
    arguments: both are refused ``resource_mismatch`` before the server is called, and so is a resource declared
    for a tool whose rule names none. Declared honestly, the private read is denied by the policy and the
    public one runs. A path not in its normal form (``/./``), which names the forbidden file as another
    resource, is refused too (found by a review)."""
    from subjects.gate import ActDone
    from subjects.idp import EnrichedDeny

    public, private = env.files / "public.txt", env.files / "private.txt"
    public.write_text("public words")
    private.write_text("private words")

    def file(path: Path) -> str:
        return f'File::"{path}"'

    def read(path: Path) -> dict[str, Any]:
        return {"tool": "read_text_file", "arguments": {"path": str(path)}}

    async with env.session(env.gate_file(), None, *env.extra) as session:
        assert not (await asyncio.wait_for(session.call_tool("list_allowed_directories", {}), 30)).isError
        other = await act(env, 1, read(private), file(public))
        undeclared = await act(env, 2, read(private))
        no_rule = await act(env, 3, {"tool": "list_allowed_directories", "arguments": {}}, file(public))
        honest_private = await act(env, 4, read(private), file(private))
        honest_public = await act(env, 5, read(public), file(public))
        # One file under another name: the policy's resource == File::".../private.txt" would not match it.
        dotted = f"{env.files}/./private.txt"
        other_name = await act(env, 6, {"tool": "read_text_file", "arguments": {"path": dotted}}, f'File::"{dotted}"')
    for result in (other, undeclared, no_rule):
        assert isinstance(result, ActDone) and result.status == "failed", result
        assert result.response["code"] == "resource_mismatch", result.response
        assert "did not run" in result.response["message"] and "private words" not in str(result.response)
        assert str(env.files) not in result.response["message"]  # it names the rule, not the caller's text
    assert isinstance(honest_private, EnrichedDeny), honest_private
    assert isinstance(other_name, ActDone) and other_name.status == "failed", other_name
    assert other_name.response["code"] == "invalid_arguments" and "normal form" in other_name.response["message"]
    assert isinstance(honest_public, ActDone) and honest_public.status == "confirmed", honest_public
    assert honest_public.response["content"][0]["text"] == "public words"
