"""Issue 16 item 1: `pgw mcp --agent NAME`, driven by the real MCP client of the `mcp` package.

A real nats-server and gateway (with the IDP kernel); `pgw mcp` runs as a
subprocess, spoken to over stdio and over streamable HTTP; the principal
answers on the bus with ``subjects.client.Surface``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import get_default_environment, stdio_client
from mcp.client.streamable_http import streamable_http_client

from integrations.agent_tools import AskPrincipalArgs, input_schema
from subjects.client import Surface, outcome_durable
from subjects.idp import TransitionReport
from subjects.wire import (
    BindingMomentItem,
    BindingMomentPayload,
    ClarificationAnswers,
    ClarificationItem,
    DialogueVeto,
    FreeTextAnswer,
    OptionChoice,
    Resolution,
    SurfaceItem,
)
from tests.kernel_support import Issuer, idp, policy_dir, running_gateway
from tests.polling import until

AGENT, PRINCIPAL = "planner", "alice"
PGW = str(Path(sys.executable).parent / "pgw")

MOMENT = {
    "synopsis": "Pay the March invoice from Northwind today; it is due tomorrow.",
    "findings": ["Invoice NW-311 is due on 31 March."],
    "recommendations": ["Pay NW-311 in full today."],
    "offer": "Ask for detail on any item.",
    "question": {
        "stem": "When should invoice NW-311 be paid?",
        "options": [
            {"label": "Pay it today", "reasoning": "Avoids the late fee."},
            {"label": "Pay it tomorrow", "reasoning": "Keeps the cash one more day."},
        ],
        "recommended_idx": 0,
        "hatches": {"free_text": True, "dialogue": True},
    },
}


class Env:
    def __init__(self, url: str, data_dir: Path, issuer: Issuer, nc: Any) -> None:
        self.url, self.data_dir, self.nc = url, data_dir, nc
        self.js = nc.jetstream()  # for reading stream and consumer state (a service's rights under isolation)
        self.so = str(uuid.uuid4())
        self.token, self.jti = issuer.mandate(agent=AGENT, so_id=self.so, principal=PRINCIPAL)

    def args(self, *extra: str) -> list[str]:
        return ["mcp", "--agent", AGENT, "--server", self.url, "--data-dir", str(self.data_dir),
                "--progress-every", "0.3", *extra]

    @contextlib.asynccontextmanager
    async def stdio(self, pidfile: Path | None = None) -> AsyncIterator[ClientSession]:
        # The SDK passes the server only a few variables: keep PYTHONPATH, so it runs the code under test.
        env = {**get_default_environment(), **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}}
        params = StdioServerParameters(command=PGW, args=self.args(), env=env)
        if pidfile is not None:  # through sh, which writes the server's pid and execs it (same pid)
            params = StdioServerParameters(command="/bin/sh", args=["-c", f'echo $$ > {pidfile}; exec "$0" "$@"', PGW, *self.args()],
                                           env=env)
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session

    async def http_server(self) -> tuple[asyncio.subprocess.Process, int]:
        """`pgw mcp --transport http` on a free port, listening."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(PGW, *self.args("--transport", "http", "--port", str(port)))

        async def listening() -> bool:
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                return False
            w.close()
            return True

        try:
            await until(listening, timeout=10, what=f"pgw mcp listening on port {port}")
        except BaseException:
            proc.kill()
            await proc.wait()
            raise
        return proc, port

    @staticmethod
    @contextlib.asynccontextmanager
    async def http_client(port: int) -> AsyncIterator[ClientSession]:
        async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as (read, write, _), ClientSession(read, write) as session:
            await session.initialize()
            yield session

    @contextlib.asynccontextmanager
    async def http(self) -> AsyncIterator[ClientSession]:
        proc, port = await self.http_server()
        try:
            async with self.http_client(port) as session:
                yield session
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)

    def session(self, transport: str) -> contextlib.AbstractAsyncContextManager[ClientSession]:
        return self.stdio() if transport == "stdio" else self.http()

    def principal_answers(self, answer: Callable[[SurfaceItem], Resolution | None]) -> asyncio.Task[Any]:
        """The principal, on the bus: answers the first item ``answer`` has an answer for."""

        async def run() -> Any:
            surface = Surface(self.nc, PRINCIPAL)
            async for item in surface.items():
                resolution = answer(item)
                if resolution is not None:
                    return await surface.resolve(item.moment_id, resolution)  # type: ignore[union-attr]
            return None

        return asyncio.create_task(run())

    def idp(self, step: int, action: str, **over: Any) -> dict[str, Any]:
        return idp(so_id=self.so, mandate_id=self.jti, step=step, action=action, session=str(uuid.uuid4()), **over)


@pytest.fixture
async def env(make_config: Any, nc: Any, nats_server: Any, tmp_path: Path) -> AsyncIterator[Env]:
    """A gateway with the IDP kernel; agent planner is bound to principal alice."""
    issuer = Issuer(tmp_path / "issuer")
    cfg = make_config(
        kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path))},
        agents={AGENT: {"principals": [PRINCIPAL]}},
    )
    async with running_gateway(cfg, nc):
        yield Env(nats_server.client_url, tmp_path / "mcp-data", issuer, nc)


def moment_answer(resolution: Resolution) -> Callable[[SurfaceItem], Resolution | None]:
    return lambda item: resolution if isinstance(item, BindingMomentItem) else None


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_ask_principal_keeps_the_three_kinds_distinct(env: Env, transport: str) -> None:
    """Over stdio and streamable HTTP, an option, a free-text answer and a dialogue veto come back as three distinct results, with progress while waiting."""
    cases = [
        (OptionChoice(index=1), {"kind": "option", "index": 1, "label": "Pay it tomorrow"}),
        (FreeTextAnswer(text="Pay half today."), {"kind": "free_text", "text": "Pay half today."}),
        (DialogueVeto(objection="Why pay Northwind at all?"), {"kind": "dialogue", "objection": "Why pay Northwind at all?"}),
    ]
    async with env.session(transport) as session:
        tools = {t.name: t for t in (await session.list_tools()).tools}
        assert set(tools) >= {"ask_principal", "clarify", "declare_intent", "report_transition", "await_moment", "list_moments"}
        # The schemas are the wire Structs' own (msgspec.json.schema), so they cannot drift from the gateway.
        assert tools["ask_principal"].inputSchema == input_schema(AskPrincipalArgs)
        assert set(input_schema(BindingMomentPayload)["properties"]) | {"request_key"} == set(tools["ask_principal"].inputSchema["properties"])
        assert tools["report_transition"].inputSchema == input_schema(TransitionReport)
        assert "binding_moment" in tools["ask_principal"].inputSchema["required"]
        for resolution, expected in cases:
            waiting = asyncio.Event()

            async def on_progress(p: float, total: float | None, message: str | None, waiting=waiting) -> None:
                if "waiting for alice" in (message or ""):
                    waiting.set()

            asking = asyncio.create_task(session.call_tool(
                "ask_principal", {"principal": "~alice", "binding_moment": MOMENT}, progress_callback=on_progress))
            await asyncio.wait_for(waiting.wait(), 20)  # progress notifications while the principal thinks
            reply = await env.principal_answers(moment_answer(resolution))
            assert reply.status == "accepted"
            result = await asyncio.wait_for(asking, 20)
            assert not result.isError
            body = result.structuredContent
            assert body["status"] == "resolved" and {k: body[k] for k in expected} == expected


async def test_tools_list_advertises_binding_moments_and_hatches_default_open(env: Env) -> None:
    """tools/list marks the tools that may put a binding moment before the principal (spec 000 §8.2
    emits_binding_moment), its schema makes each hatch default to true (§6.8), and a moment asked with
    the hatches left out reaches the principal with both open."""
    async with env.stdio() as session:
        tools = {t.name: t for t in (await session.list_tools()).tools}
        flags = {name: (t.annotations.model_extra or {}).get("emits_binding_moment") if t.annotations else None
                 for name, t in tools.items()}
        assert flags == {"ask_principal": True, "declare_intent": True, "clarify": False, "report_transition": False,
                         "await_moment": False, "list_moments": False}
        defs = tools["ask_principal"].inputSchema["$defs"]
        assert "hatches" not in defs["Question"]["required"] and "required" not in defs["Hatches"]
        assert {k: v["default"] for k, v in defs["Hatches"]["properties"].items()} == {"free_text": True, "dialogue": True}
        moment = {**MOMENT, "question": {k: v for k, v in MOMENT["question"].items() if k != "hatches"}}
        seen: list[BindingMomentItem] = []

        def answer(item: SurfaceItem) -> Resolution | None:
            if isinstance(item, BindingMomentItem):
                seen.append(item)
                return DialogueVeto(objection="Not now.")
            return None

        answering = env.principal_answers(answer)
        result = await session.call_tool("ask_principal", {"principal": "alice", "binding_moment": moment})
        await answering
    assert not result.isError and result.structuredContent["kind"] == "dialogue", result
    assert (seen[0].binding_moment.question.hatches.free_text, seen[0].binding_moment.question.hatches.dialogue) == (True, True)


async def test_an_unanswered_moment_expires_as_a_refusal(env: Env) -> None:
    """A moment nobody answers before expires_in_s comes back as status expired, not as consent and not as an error."""
    async with env.stdio() as session:
        result = await session.call_tool("ask_principal", {"principal": "alice", "binding_moment": MOMENT, "expires_in_s": 1})
    assert not result.isError and result.structuredContent["status"] == "expired"


async def test_a_malformed_moment_is_a_tool_error_listing_every_rule(env: Env) -> None:
    """Five options, recommended_idx out of range and a hatch that is not a boolean: one isError result names each rule; the server keeps serving."""
    bad = {**MOMENT, "question": {**MOMENT["question"],
                                   "options": [{"label": f"o{i}", "reasoning": "r"} for i in range(5)],
                                   "recommended_idx": 7, "hatches": {"free_text": True, "dialogue": "yes"}}}
    async with env.stdio() as session:
        result = await session.call_tool("ask_principal", {"principal": "alice", "binding_moment": bad})
        assert result.isError and result.structuredContent, result
        body = result.structuredContent
        assert body["code"] == "envelope_invalid"
        paths = {v.get("path") for v in body["violations"]}
        assert {"$.payload.binding_moment.question.options", "$.payload.binding_moment.question.hatches.dialogue"} <= paths, body
        assert any("recommended_idx" in (v.get("path") or "") for v in body["violations"]), body
        handle = await session.call_tool("ask_principal", {"principal": "not a handle", "binding_moment": MOMENT})
        assert handle.isError and handle.structuredContent["code"] == "invalid_arguments"
        assert "principal" in handle.structuredContent["reason"]
        still = await session.call_tool("ask_principal", {"principal": "alice", "binding_moment": MOMENT, "expires_in_s": 1})
        assert still.structuredContent["status"] == "expired"


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_clarify_returns_the_answers(env: Env, transport: str) -> None:
    """clarify reaches the principal as a clarification item; their answers come back keyed by question id."""
    answer = ClarificationAnswers(answers={"account": "ACME-42"})
    env.principal_answers(lambda item: answer if isinstance(item, ClarificationItem) else None)
    async with env.session(transport) as session:
        result = await session.call_tool("clarify", {"principal": "alice", "questions": [
            {"id": "account", "question": "Which account should the refund go to?"}]})
    assert not result.isError and result.structuredContent["answers"] == {"account": "ACME-42"}


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_declare_intent_permit_deny_reject_and_report(env: Env, transport: str) -> None:
    """PERMIT, then a report; an Enriched DENY with its code; a REJECT (malformed IDP) as a tool error with its code."""
    async with env.session(transport) as session:
        rec = env.idp(1, "ReadBooking")
        permit = await session.call_tool("declare_intent", {"mandate": env.token, "idp": rec})
        assert not permit.isError and permit.structuredContent["result"] == "PERMIT"
        report = await session.call_tool("report_transition", {
            "idp_id": rec["idp_id"], "executed_action": "ReadBooking", "effect": {"type": "booking.read", "status": "ok"}})
        assert report.structuredContent["status"] == "recorded"
        deny = await session.call_tool("declare_intent", {"mandate": env.token, "idp": env.idp(1, "CloseBooking", confidence_level=0.3)})
        assert not deny.isError and deny.structuredContent["result"] == "DENY"
        assert deny.structuredContent["deny_code"] and "available_actions" in deny.structuredContent
        reject = await session.call_tool("declare_intent", {"mandate": env.token, "idp": env.idp(1, "ReadBooking", declared_goal=None)})
        assert reject.isError and reject.structuredContent["result"] == "REJECT"
        assert reject.structuredContent["error_code"] == "IDP_MALFORMED"


async def test_declare_intent_hem_pending_then_the_decision(env: Env) -> None:
    """hem_urgency REQUIRED: the tool reports HEM_PENDING and waits for the principal's decision (approve)."""
    env.principal_answers(lambda item: OptionChoice(index=0) if isinstance(item, BindingMomentItem) and item.hem else None)
    rec = env.idp(1, "ProcessPayment", hem_urgency="REQUIRED")
    async with env.stdio() as session:
        result = await session.call_tool("declare_intent", {"mandate": env.token, "idp": rec})
    body = result.structuredContent
    assert body["result"] == "HEM_PENDING" and body["decision"]["decision"] == "approve"
    assert body["decision"]["idp_id"] == rec["idp_id"]


async def test_a_wait_cut_by_a_restart_is_picked_up_by_await_moment(env: Env) -> None:
    """The MCP server stops while the principal thinks; the answer given meanwhile is read by await_moment after a restart (the agent's durable outcome consumer)."""
    messages: list[str] = []
    delivered = asyncio.Event()

    async def on_progress(p: float, total: float | None, message: str | None) -> None:
        messages.append(message or "")
        delivered.set()

    async with env.stdio() as session:
        asking = asyncio.create_task(session.call_tool(
            "ask_principal", {"principal": "alice", "binding_moment": MOMENT}, progress_callback=on_progress))
        await asyncio.wait_for(delivered.wait(), 20)
        asking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asking
    moment_id = messages[0].split()[1]  # "moment {id} delivered to alice"
    reply = await env.principal_answers(moment_answer(OptionChoice(index=0)))
    assert reply.status == "accepted" and reply.moment_id == moment_id
    async with env.stdio() as session:
        result = await session.call_tool("await_moment", {"moment_id": moment_id})
    assert result.structuredContent == {"status": "resolved", "kind": "option", "index": 0, "moment_id": moment_id}


@contextlib.asynccontextmanager
async def killable(env: Env, transport: str, tmp_path: Path) -> AsyncIterator[tuple[ClientSession, Callable[[], Awaitable[None]]]]:
    """A `pgw mcp` session and a function that SIGKILLs its server (the client side is then torn down quietly)."""
    stack = contextlib.AsyncExitStack()
    proc = None
    try:
        if transport == "stdio":
            pidfile = tmp_path / "mcp.pid"
            session = await stack.enter_async_context(env.stdio(pidfile))
            pid = int(pidfile.read_text())
        else:
            proc, port = await env.http_server()
            pid = proc.pid
            session = await stack.enter_async_context(env.http_client(port))

        async def kill() -> None:
            os.kill(pid, signal.SIGKILL)
            if proc is not None:
                assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL

        yield session, kill
    finally:
        with contextlib.suppress(Exception):  # the client side of a killed server (anyio scopes: no wait_for here)
            await stack.aclose()
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()



async def read_then_kill9(env: Env, transport: str, tmp_path: Path, answer: Resolution) -> str:
    """Start `pgw mcp`, ask_principal, give up on the call (the server stays up), let the principal answer, wait until
    the server has read the answer and its outcome consumer acknowledged it (never to deliver it again), then SIGKILL
    the server before any client got the answer. Returns the moment id."""
    js = env.js
    messages: list[str] = []
    delivered = asyncio.Event()

    async def on_progress(p: float, total: float | None, message: str | None) -> None:
        messages.append(message or "")
        delivered.set()

    async with killable(env, transport, tmp_path) as (session, kill):
        asking = asyncio.create_task(session.call_tool(
            "ask_principal", {"principal": "alice", "binding_moment": MOMENT}, progress_callback=on_progress))
        await asyncio.wait_for(delivered.wait(), 20)
        moment_id = messages[0].split()[1]  # "moment {id} delivered to alice"
        asking.cancel()  # the host stops waiting; the server stays up
        with contextlib.suppress(asyncio.CancelledError):
            await asking
        reply = await env.principal_answers(moment_answer(answer))
        assert reply.status == "accepted" and reply.moment_id == moment_id
        last = (await js.stream_info("PGW_OUTBOUND")).state.last_seq  # the resolution outcome

        async def read_and_acked() -> bool:
            info = await js.consumer_info("PGW_OUTBOUND", outcome_durable(AGENT))
            return info.ack_floor.stream_seq >= last and info.num_ack_pending == 0 and info.num_pending == 0

        await until(read_and_acked, timeout=20, what="the MCP server reading and acknowledging alice's answer")
        await kill()
    return moment_id


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_an_answer_the_server_read_before_a_kill_9_is_returned_after_the_restart(env: Env, transport: str, tmp_path: Path) -> None:
    """The host gives up on ask_principal; alice answers; the MCP server reads the answer (its outcome consumer acks it,
    so the consumer will never deliver it again) and is killed with SIGKILL before any client got it. Restarted,
    await_moment returns that answer (the gateway's moment query), and alice was asked once."""
    moment_id = await read_then_kill9(env, transport, tmp_path, FreeTextAnswer(text="Pay half today, half on Friday."))
    async with env.session(transport) as session:
        result = await asyncio.wait_for(session.call_tool("await_moment", {"moment_id": moment_id}), 20)
    assert result.structuredContent == {
        "status": "resolved", "kind": "free_text", "text": "Pay half today, half on Friday.", "moment_id": moment_id}
    moments = await env.js.stream_info("KV_PGW_MOMENTS", subjects_filter=f"$KV.PGW_MOMENTS.{PRINCIPAL}.*")
    assert list(moments.state.subjects or {}) == [f"$KV.PGW_MOMENTS.{PRINCIPAL}.{moment_id}"]


async def test_await_moment_of_an_unknown_moment_is_a_tool_error(env: Env) -> None:
    """await_moment with an id no moment of this agent has is refused at once (unknown_moment), not waited on forever."""
    async with env.stdio() as session:
        result = await asyncio.wait_for(session.call_tool("await_moment", {"moment_id": uuid.uuid4().hex}), 20)
    assert result.isError and result.structuredContent["code"] == "unknown_moment", result


async def test_without_a_gateway_calls_are_clear_tool_errors(nats_server: Any, tmp_path: Path) -> None:
    """A bus with no gateway (and no streams): declare_intent and ask_principal are tool errors that say the gateway is unavailable; the server keeps serving."""
    env = Env.__new__(Env)
    env.url, env.data_dir = nats_server.client_url, tmp_path / "mcp-data"
    async with env.stdio() as session:
        declared = await session.call_tool("declare_intent", {"mandate": "x.y.z", "idp": {"profile": "IDP_THIN"}})
        asked = await session.call_tool("ask_principal", {"principal": "alice", "binding_moment": MOMENT})
        tools = await session.list_tools()
    for result in (declared, asked):
        assert result.isError and result.structuredContent["code"] == "gateway_unavailable", result
    assert "kernel" in declared.structuredContent["reason"]
    assert len(tools.tools) == 6


async def test_hem_without_waiting_then_await_moment(env: Env) -> None:
    """wait_for_decision false: HEM_PENDING returns at once with its moment_id; await_moment later returns the decision (deny)."""
    rec = env.idp(1, "ProcessPayment", hem_urgency="REQUIRED")
    async with env.stdio() as session:
        pending = await session.call_tool("declare_intent", {"mandate": env.token, "idp": rec, "wait_for_decision": False})
        body = pending.structuredContent
        assert body["result"] == "HEM_PENDING" and "decision" not in body
        env.principal_answers(lambda item: OptionChoice(index=1) if isinstance(item, BindingMomentItem) and item.hem else None)
        decided = await session.call_tool("await_moment", {"moment_id": body["moment_id"]})
    assert decided.structuredContent["status"] == "decided" and decided.structuredContent["decision"] == "deny"


def test_pgw_mcp_help() -> None:
    """`pgw mcp --help` prints the usage with the agent and transport options."""
    out = subprocess.run([PGW, "mcp", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--agent" in out.stdout and "--transport" in out.stdout
    bad = subprocess.run([PGW, "mcp", "--agent", "planner", "--progress-every", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--progress-every" in bad.stderr and "between 0.05 and 3600" in bad.stderr


async def test_the_documented_mcp_example_runs(gateway: Any, nc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/integrations.md's "The MCP server from Python" block, spawning `pgw mcp` over stdio with docs/bus.md's
    MOMENT, returns the resolution it says."""
    from tests.test_readme import DOCS, python_block

    monkeypatch.setenv("PATH", f"{Path(PGW).parent}:{os.environ.get('PATH', '')}")  # the block runs plain `pgw`
    ns: dict[str, Any] = {}
    exec(compile(python_block("## The MCP server from Python", DOCS / "integrations.md"), "docs/integrations.md", "exec"), ns)
    readme_moment: dict[str, Any] = {}
    exec(compile(python_block("## Agents and surfaces in Python"), "docs/bus.md", "exec"), readme_moment)
    url = gateway.config.nats_url
    answering = asyncio.create_task(_answer_first_moment(nc))
    body = await asyncio.wait_for(ns["ask_alice"](url, readme_moment["MOMENT"]), 30)
    assert (await answering).status == "accepted"
    assert {k: body[k] for k in ("status", "kind", "index", "label")} == {
        "status": "resolved", "kind": "option", "index": 0, "label": "Pay it today"}


async def _answer_first_moment(nc: Any) -> Any:
    surface = Surface(nc, PRINCIPAL)
    async for item in surface.items():
        if isinstance(item, BindingMomentItem):
            return await surface.choose(item, 0)
    return None


def test_a_void_approval_reaches_the_model_as_a_denial_with_its_reason() -> None:
    """A ``hem_decision`` whose approval the mandate no longer permitted (``void``) is handed to the model as the
    gateway told it: ``deny``, with the code and why, never as an approval."""
    from integrations.agent_tools import closing_answer
    from subjects.wire import HemDecision

    told = HemDecision(agent="planner", ts="2026-12-07T14:00:00Z", moment_id="ab" * 16, principal="alice",
                       idp_id="i-1", session_id="s-1", decision="deny", void="MANDATE_REVOKED")
    body = closing_answer(told).body
    assert body["decision"] == "deny" and body["void"] == "MANDATE_REVOKED" and "permits nothing" in body["reason"], body
    plain = closing_answer(HemDecision(agent="planner", ts="2026-12-07T14:00:00Z", moment_id="ab" * 16,
                                       principal="alice", idp_id="i-1", session_id="s-1", decision="approve")).body
    assert plain["decision"] == "approve" and "void" not in plain and "reason" not in plain, plain
