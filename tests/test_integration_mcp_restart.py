"""Issue 16, "nothing lost on restart", for an MCP host: `pgw mcp` killed with SIGKILL while a moment waits.

Two hosts the moment query alone did not serve: one that never asked for
progress (so it never saw a moment_id) finds the moment with ``list_moments``
and waits on it with ``await_moment``; one that simply calls ``ask_principal``
again gets the same moment's answer when it passes the same ``request_key``,
and the principal is asked once. Real nats-server, gateway, `pgw mcp`
processes and the real MCP client, over stdio and streamable HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

import tests.test_integration_mcp as mcp_tests
from subjects.client import Surface
from subjects.wire import BindingMomentItem, ClarificationAnswers, OptionChoice
from tests.polling import consumer_drained, until
from tests.test_integration_mcp import MOMENT, PRINCIPAL, Env, killable, moment_answer

TRANSPORTS = ["stdio", "http"]
env = mcp_tests.env  # the same gateway fixture as test_integration_mcp (agent planner bound to alice)


async def ask_then_kill9(env: Env, transport: str, tmp_path: Path, args: dict[str, Any]) -> BindingMomentItem:
    """ask_principal without a progress token (the host never sees a moment_id), the moment reaches alice's
    surface, and the server is killed with SIGKILL while she thinks. Returns the item she sees."""
    surface = Surface(env.nc, PRINCIPAL)
    async with killable(env, transport, tmp_path) as (session, kill):
        asking = asyncio.create_task(session.call_tool("ask_principal", args))
        items = await until(surface.pending, timeout=20, what="the moment on alice's surface")
        await kill()
        asking.cancel()
        with contextlib.suppress(BaseException):
            await asking
    assert len(items) == 1 and isinstance(items[0], BindingMomentItem)
    return items[0]


async def moments_of_alice(env: Env) -> list[str]:
    """The moment ids of every record the desk holds for alice (each moment the gateway ever opened for her)."""
    info = await env.js.stream_info("KV_PGW_MOMENTS", subjects_filter=f"$KV.PGW_MOMENTS.{PRINCIPAL}.*")
    return sorted(s.rsplit(".", 1)[1] for s in info.state.subjects or {})


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_after_a_kill_9_list_moments_finds_the_open_moment_and_await_moment_returns_its_answer(
    env: Env, transport: str, tmp_path: Path
) -> None:
    """A host that asked without progress never saw the moment_id; the server dies (-9) while alice thinks.
    Restarted, list_moments shows the open moment (id, synopsis, status); alice answers; await_moment returns it;
    list_moments then shows it closed and no longer open."""
    item = await ask_then_kill9(env, transport, tmp_path, {"principal": "alice", "binding_moment": MOMENT})
    async with env.session(transport) as session:
        listed = (await session.call_tool("list_moments", {})).structuredContent
        assert listed["status"] == "listed" and listed["which"] == "open" and not listed["more"], listed
        [entry] = listed["moments"]
        assert entry["moment_id"] == item.moment_id and entry["status"] == "pending" and entry["principal"] == PRINCIPAL
        assert entry["kind"] == "binding_moment" and entry["synopsis"] == MOMENT["synopsis"]
        answering = env.principal_answers(moment_answer(OptionChoice(index=1)))
        result = await asyncio.wait_for(session.call_tool("await_moment", {"moment_id": entry["moment_id"]}), 20)
        assert (await answering).status == "accepted"
        assert result.structuredContent == {"status": "resolved", "kind": "option", "index": 1, "moment_id": item.moment_id}
        assert (await session.call_tool("list_moments", {"which": "open"})).structuredContent["moments"] == []
        closed = (await session.call_tool("list_moments", {"which": "closed", "limit": 5})).structuredContent["moments"]
        assert [(m["moment_id"], m["status"]) for m in closed] == [(item.moment_id, "resolved")] and closed[0]["closed_at"]
        bad = await session.call_tool("list_moments", {"which": "pending"})
        assert bad.isError and bad.structuredContent["code"] == "invalid_arguments" and "which" in bad.structuredContent["reason"]
    assert await moments_of_alice(env) == [item.moment_id]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_ask_principal_again_with_the_same_request_key_after_a_kill_9_returns_that_moments_answer(
    env: Env, transport: str, tmp_path: Path
) -> None:
    """ask_principal with a request_key; the server dies (-9) while alice thinks and she answers while it is down.
    The host restarts it and calls ask_principal again with the same key and arguments: the gateway's dedup gives the
    same moment, so the call returns her answer at once (replayed) and exactly one moment ever reached her.
    A new key is a new question: a second moment."""
    args = {"principal": "alice", "binding_moment": MOMENT, "request_key": "pay-nw-311"}
    item = await ask_then_kill9(env, transport, tmp_path, args)
    assert (await Surface(env.nc, PRINCIPAL).answer(item, "Pay half today.")).status == "accepted"
    async with env.session(transport) as session:
        again = await asyncio.wait_for(session.call_tool("ask_principal", args), 20)
        assert again.structuredContent == {
            "status": "resolved", "kind": "free_text", "text": "Pay half today.", "moment_id": item.moment_id,
            "request_key": "pay-nw-311", "replayed": True}
        assert await moments_of_alice(env) == [item.moment_id]
        fresh = await asyncio.wait_for(session.call_tool("ask_principal", {**args, "request_key": "pay-nw-311-again", "expires_in_s": 1}), 20)
        body = fresh.structuredContent
        assert body["status"] == "expired" and body["moment_id"] != item.moment_id and body["replayed"] is False
        bad = await session.call_tool("ask_principal", {**args, "request_key": ""})
        assert bad.isError and bad.structuredContent["code"] == "invalid_arguments" and "request_key" in bad.structuredContent["reason"]
    assert await moments_of_alice(env) == sorted([item.moment_id, body["moment_id"]])


async def test_the_same_request_key_while_the_first_call_still_waits_is_the_same_moment(env: Env) -> None:
    """A host that retries on its own timeout while the server still waits on the first call: both calls wait on the
    one moment and both return alice's answer; clarify takes a request_key the same way."""
    args = {"principal": "alice", "binding_moment": MOMENT, "request_key": "k1"}
    surface = Surface(env.nc, PRINCIPAL)
    async with env.stdio() as session:
        first = asyncio.create_task(session.call_tool("ask_principal", args))
        [item] = await until(surface.pending, timeout=20, what="the moment on alice's surface")
        inbound = (await env.js.stream_info("PGW_INBOUND")).state.messages
        second = asyncio.create_task(session.call_tool("ask_principal", args))

        async def retry_taken() -> bool:  # the retry's envelope stored and the gateway done with it
            stored = (await env.js.stream_info("PGW_INBOUND")).state.messages > inbound
            return stored and await consumer_drained(env.js, "PGW_INBOUND", "pgw-gateway")

        await until(retry_taken, timeout=20, what="the retry's envelope taken by the gateway")
        assert await surface.pending() == [item]  # the retry opened nothing new
        assert isinstance(item, BindingMomentItem)
        assert (await surface.answer(item, "Tomorrow.")).status == "accepted"
        one, two = await asyncio.wait_for(asyncio.gather(first, second), 20)
        assert one.structuredContent["text"] == two.structuredContent["text"] == "Tomorrow."
        assert (one.structuredContent["replayed"], two.structuredContent["replayed"]) == (False, True)
        question = {"principal": "alice", "questions": [{"id": "acct", "question": "Which account?"}], "request_key": "k1"}
        asking = asyncio.create_task(session.call_tool("clarify", question))
        [clar] = await until(surface.pending, timeout=20, what="the clarification on alice's surface")
        assert (await surface.resolve(clar.moment_id, ClarificationAnswers(answers={"acct": "ACME-42"}))).status == "accepted"  # type: ignore[union-attr]
        answered = (await asyncio.wait_for(asking, 20)).structuredContent
        assert answered["answers"] == {"acct": "ACME-42"} and answered["request_key"] == "k1" and not answered["replayed"]
        repeated = (await asyncio.wait_for(session.call_tool("clarify", question), 20)).structuredContent
        assert repeated["answers"] == {"acct": "ACME-42"} and repeated["replayed"] is True
    assert len(await moments_of_alice(env)) == 2
