"""The plain client's yes/no question and its expiry (subjects/client.py ``Agent.approve``, ``ask(timeout=)``).

Through the bus: a real gateway, a real surface answering as the principal. The
docs/integrations.md example runs verbatim as its own process, connected with the
agent's credentials file as `pgw up` writes it, on a server that enforces them.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.app import Gateway
from gateway.security import Party, embedded_auth
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from subjects.client import Agent, Surface
from subjects.errors import CredentialsError, NoConnectionError, RefusedError
from subjects.util import parse_rfc3339
from subjects.wire import (
    BindingMomentItem,
    DialogueVeto,
    FreeTextAnswer,
    OptionChoice,
    Resolution,
    SurfaceItem,
    WithdrawnItem,
)
from tests.moments import good_moment

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "integrations.md"


def doc_example() -> str:
    """The first Python block of docs/integrations.md's plain-client section."""
    section = DOC.read_text().split("## Ten lines to a first approval", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


async def answer_next(surface: Surface, resolution: Resolution) -> BindingMomentItem:
    """The surface answers the first binding moment it sees; returns it."""
    async for item in surface.items():
        if isinstance(item, BindingMomentItem):
            reply = await surface.resolve(item.moment_id, resolution)
            assert reply.status == "accepted", reply
            return item
    raise AssertionError("no moment")


async def watch(surface: Surface, seen: list[SurfaceItem], until_withdrawn: bool = True) -> None:
    async for item in surface.items():
        seen.append(item)
        if isinstance(item, WithdrawnItem) and until_withdrawn:
            return


async def test_approve_returns_each_kind_of_answer(gateway: Any, nc: Any) -> None:
    """approve() puts a two-option moment, both hatches open, and returns alice's answer as a Decision of the
    four answer kinds: approved, rejected, her own words, the question rejected (and only the first consents)."""
    agent = Agent(nc, "planner")
    surface = Surface(nc, "alice", presence=False)
    try:
        answers: list[tuple[Resolution, tuple[str, str | None, bool]]] = [
            (OptionChoice(index=0), ("approve", None, True)),
            (OptionChoice(index=1), ("reject", None, False)),
            (FreeTextAnswer(text="only after Friday's review"), ("free_text", "only after Friday's review", False)),
            # last: after a dialogue veto the same decision class is held to spec 000 §7.2
            (DialogueVeto(objection="ask finance, not me"), ("dialogue", "ask finance, not me", False)),
        ]
        for resolution, want in answers:
            answering = asyncio.create_task(answer_next(surface, resolution))
            decision = await asyncio.wait_for(
                agent.approve("alice", "send the Q3 invoice to ACME Ltd", ["total = 12,400 EUR"], timeout=60), 30)
            item = await answering
            assert (decision.kind, decision.text, decision.approved) == want
            assert decision.moment_id == item.moment_id
            q = item.binding_moment.question
            assert [o.label for o in q.options] == ["Approve", "Reject"] and q.recommended_idx == 0
            assert q.hatches.free_text and q.hatches.dialogue
            assert item.binding_moment.findings == ["total = 12,400 EUR"]
    finally:
        await agent.close()


async def test_an_ask_nobody_answers_expires_at_its_timeout_and_is_withdrawn(gateway: Any, nc: Any) -> None:
    """ask(timeout=1) gives the moment a 1 s expiry: the surface sees it offered with that expiry, then withdrawn
    (reason expired); the ask raises RefusedError expired; a late answer is refused."""
    agent = Agent(nc, "planner")
    surface = Surface(nc, "alice", presence=False)
    seen: list[SurfaceItem] = []
    watching = asyncio.create_task(watch(surface, seen))
    try:
        with pytest.raises(RefusedError) as refused:
            await asyncio.wait_for(agent.ask("alice", good_moment(), timeout=1), 30)
        assert refused.value.code == "expired"
        await asyncio.wait_for(watching, 10)
        offered, withdrawn = seen
        assert isinstance(offered, BindingMomentItem) and isinstance(withdrawn, WithdrawnItem)
        assert (withdrawn.moment_id, withdrawn.reason) == (offered.moment_id, "expired")
        assert offered.expires_at is not None
        life = (parse_rfc3339(offered.expires_at) - parse_rfc3339(offered.created_at)).total_seconds()
        assert 0.9 <= life <= 1.1
        late = await surface.resolve(offered.moment_id, OptionChoice(index=0))
        assert late.status != "accepted"
    finally:
        watching.cancel()
        await agent.close()


async def test_an_unanswered_approve_is_an_expired_decision_never_a_consent(gateway: Any, nc: Any) -> None:
    """approve(timeout=1) unanswered: Decision("expired"), not approved, and the surface sees the moment withdrawn."""
    agent = Agent(nc, "planner")
    surface = Surface(nc, "alice", presence=False)
    seen: list[SurfaceItem] = []
    watching = asyncio.create_task(watch(surface, seen))
    try:
        decision = await asyncio.wait_for(agent.approve("alice", "archive the 2019 invoices", timeout=1), 30)
        assert (decision.kind, decision.approved) == ("expired", False)
        await asyncio.wait_for(watching, 10)
        assert [type(i).__name__ for i in seen] == ["BindingMomentItem", "WithdrawnItem"]
        assert seen[1].reason == "expired"
    finally:
        watching.cancel()
        await agent.close()


async def test_an_explicit_expiry_outlives_the_callers_wait(gateway: Any, nc: Any) -> None:
    """ask(expires_in_s=3600, timeout=0.5): the call gives up (TimeoutError) and the moment stays open for alice."""
    agent = Agent(nc, "planner")
    surface = Surface(nc, "alice", presence=False)
    try:
        with pytest.raises(TimeoutError):
            await agent.ask("alice", good_moment(), expires_in_s=3600, timeout=0.5)
        (item,) = [i for i in await surface.pending() if isinstance(i, BindingMomentItem)]
        life = (parse_rfc3339(item.expires_at) - parse_rfc3339(item.created_at)).total_seconds()
        assert 3599 <= life <= 3601
    finally:
        await agent.close()


def test_credentials_of_another_party_are_refused_before_connecting(tmp_path: Path) -> None:
    """Agent.connect("planner", creds=alice's file) is one clear error naming both parties, not a server refusal."""
    config = load_config(None, data_dir=str(tmp_path / "d"), agents={"planner": {"principals": ["alice"]}})
    auth = embedded_auth(config)
    with pytest.raises(CredentialsError, match="principal:alice, not of agent:planner"):
        asyncio.run(Agent.connect("planner", creds=auth.creds_for(Party("principal", "alice")), url="nats://127.0.0.1:1"))


@pytest.fixture
async def secured_up(tmp_path: Path) -> AsyncIterator[tuple[str, Path, Any]]:
    """As `pgw up` runs: the server enforcing each party's credentials, planner bound to alice, the gateway on the
    services' credentials, the files in {data}/creds with {data} = ./.pgw; (URL, the working folder, alice's connection)."""
    data = tmp_path / ".pgw"
    agents = {"planner": {"principals": ["alice"]}}
    auth = embedded_auth(load_config(None, data_dir=str(data), agents=agents))
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=None, websocket_port=None,
                            authorization=auth.server_block)
    await server.start()
    ncs: list[Any] = []
    try:
        config = load_config(None, data_dir=str(data), nats_url=server.client_url, agents=agents)
        service = await connect(server.client_url, creds=str(auth.service_creds), name="gateway")
        alice = await connect(server.client_url, creds=str(auth.creds_for(Party("principal", "alice"))), name="alice")
        ncs += [service, alice]
        async with Gateway(config, service):
            yield server.client_url, tmp_path, alice
    finally:
        for c in ncs:
            await c.drain()
        await server.stop()


async def test_the_ten_line_example_runs_as_written(secured_up: tuple[str, Path, Any]) -> None:
    """docs/integrations.md's example, run verbatim in its own process with planner's credentials file, gets alice's
    approval from her surface and prints it; it is at most ten lines."""
    url, cwd, alice = secured_up
    code = doc_example()
    assert len(code.strip().splitlines()) <= 10, code
    answering = asyncio.create_task(answer_next(Surface(alice, "alice", presence=False), OptionChoice(index=0)))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=cwd, env={**os.environ, "NATS_URL": url, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    item = await answering
    assert item.binding_moment.question.stem.startswith("Should the agent ")
    assert out.decode().split() == ["approve"]


async def test_a_refusal_or_no_server_is_one_error_at_once(secured_up: tuple[str, Path, Any]) -> None:
    """Agent.connect without credentials on a server that wants them, or with no server at the URL, raises
    NoConnectionError at once saying which (and which file would serve), instead of retrying for minutes."""
    url, _, _ = secured_up
    with pytest.raises(NoConnectionError) as refused:
        await asyncio.wait_for(Agent.connect("planner", url=url), 10)
    assert refused.value.auth and "creds='.pgw/creds/agent-planner.creds'" in str(refused.value)
    with pytest.raises(NoConnectionError) as absent:
        await asyncio.wait_for(Agent.connect("planner", url="nats://127.0.0.1:1"), 10)
    assert not absent.value.auth
