"""The Slack surface (consumers/slack/, docs/surfaces.md "Slack") end to end.

A real nats-server and gateway, the real surface in-process, and a loopback
stand-in for Slack's Web API (tests/slack_standin.py) that checks every block
with slack-sdk's own Block Kit classes. Interactions are POSTed to the
surface as Slack sends them, signed with the signing secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import structlog

from consumers.slack import blocks as kit
from consumers.slack.service import SlackConfigError, SlackSurface
from consumers.surfaces.model import plan_item
from pgwcore.config import load_config
from subjects.client import Agent, Surface, envelope
from subjects.wire import ClarificationAnswers, DialogueVeto, FreeTextAnswer, OptionChoice
from tests.moments import good_moment
from tests.pipeline_helpers import running_gateway
from tests.slack_standin import (
    BOT_TOKEN,
    SIGNING_SECRET,
    Message,
    SlackStandin,
    button_press,
    signed_interaction,
    slack_standin,
    view_submission,
)

USER, MALLORY = "U0ALICE", "U0MALLORY"
ENV = {"PGW_SLACK_BOT_TOKEN": BOT_TOKEN, "PGW_SLACK_SIGNING_SECRET": SIGNING_SECRET}


def slack_settings(standin: SlackStandin, **over: Any) -> dict[str, Any]:
    return {"enabled": True, "api_url": standin.url, "http_port": 0, "max_retries": 3,
            "principals": {"alice": {"user": USER}}, **over}


@dataclass
class Bed:
    slack: SlackStandin
    surface: SlackSurface
    http: aiohttp.ClientSession
    agent: Agent
    nc: Any

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.surface.port}{self.surface.cfg.path}"

    async def send(self, payload: dict[str, Any], **kw: Any) -> aiohttp.ClientResponse:
        body, headers = signed_interaction(payload, **kw)
        async with self.http.post(self.url, data=body, headers=headers) as r:
            await r.read()
            return r

    async def moment(self, moment: dict[str, Any] | None = None, **kw: Any) -> str:
        eid = await self.agent.send_moment("alice", moment or good_moment(), **kw)
        out = await self.agent.outcome_for(eid, timeout=10)
        assert out.status == "accepted", (out.code, out.reason)
        return out.moment_id

    async def posted(self, ident: str) -> Message:
        [msg] = await self.slack.wait(lambda: self.slack.of(ident))
        return msg


@contextlib.asynccontextmanager
async def bed(nats_server: Any, tmp_path: Path, nc: Any, **over: Any) -> AsyncIterator[Bed]:
    async with slack_standin() as s, running_gateway(nats_server, str(tmp_path / "gw")):
        config = load_config(None, data_dir=str(tmp_path / "slack"), nats_url=nats_server.client_url,
                             slack=slack_settings(s, **over))
        agent = Agent(nc, "planner")
        async with SlackSurface(config, environ=ENV) as surface, aiohttp.ClientSession() as http:
            try:
                yield Bed(s, surface, http, agent, nc)
            finally:
                await agent.close()


def buttons(msg: Message) -> list[dict[str, Any]]:
    out = []
    for b in msg.blocks:
        if b.get("accessory", {}).get("type") == "button":
            out.append(b["accessory"])
        out += [e for e in b.get("elements", []) if b["type"] == "actions"]
    return out


def texts(msg: Message) -> str:
    return json.dumps(msg.blocks, ensure_ascii=False)


async def closed(bed: Bed, ident: str) -> Message:
    return await bed.slack.wait(lambda: next((m for m in bed.slack.of(ident) if m.versions and not buttons(m)), None))


async def test_option_press_answers_the_agent_and_closes_the_message(nats_server, tmp_path, nc) -> None:
    """A moment becomes one DM with all four briefing slots, each option's reasoning beside its button, the
    recommended option marked but its button unstyled, both hatches; pressing option 2 gives the agent option 2
    and the message then says so and has no buttons."""
    async with bed(nats_server, tmp_path, nc) as b:
        mid = await b.moment(good_moment(recommended_idx=1))
        msg = await b.posted(mid)
        m = good_moment()
        shown = texts(msg)
        for slot in (m["synopsis"], *m["findings"], *m["recommendations"], m["offer"], m["question"]["stem"]):
            assert slot in shown, slot
        opts = [bl for bl in msg.blocks if bl.get("accessory", {}).get("action_id", "").startswith("pgw_option_")]
        assert len(opts) == 3
        for o, block in zip(m["question"]["options"], opts, strict=True):
            assert o["label"] in block["text"]["text"] and o["reasoning"] in block["text"]["text"]
        marker = msg.blocks[msg.blocks.index(opts[1]) + 1]
        assert marker["type"] == "context" and "Recommended by the agent" in marker["elements"][0]["text"]
        assert all("style" not in btn for btn in buttons(msg)), "no button is styled as the default"
        assert {btn["action_id"] for btn in buttons(msg)} >= {"pgw_free_text", "pgw_dialogue"}
        assert msg.channel == "D0ALICE"  # the DM with the principal
        assert m["synopsis"] not in msg.text  # the notification line carries no agent text

        r = await b.send(button_press(msg, "pgw_option_1", USER))
        assert r.status == 200
        res = await b.agent.resolution_for(mid, timeout=10)
        assert res.resolution == OptionChoice(index=1)
        done = await closed(b, mid)
        assert "Answered in Slack" in texts(done) and m["question"]["options"][1]["label"] in texts(done)
        assert not b.slack.invalid


async def test_free_text_modal_answers_in_my_words(nats_server, tmp_path, nc) -> None:
    """"Answer in my own words" opens a modal; its submission reaches the agent as a free_text resolution."""
    async with bed(nats_server, tmp_path, nc) as b:
        mid = await b.moment()
        msg = await b.posted(mid)
        await b.send(button_press(msg, "pgw_free_text", USER))
        [opened] = await b.slack.wait(lambda: b.slack.views)
        assert opened["view"]["callback_id"] == "pgw_free_text"
        r = await b.send(view_submission(opened["view"], USER, {"answer": "Send page 2 of the summary only"}))
        assert r.status == 200
        res = await b.agent.resolution_for(mid, timeout=10)
        assert res.resolution == FreeTextAnswer(text="Send page 2 of the summary only")
        assert "Send page 2" in texts(await closed(b, mid))


async def test_question_is_wrong_modal_with_optional_objection(nats_server, tmp_path, nc) -> None:
    """"Reject the question" opens a modal whose objection is optional; sent empty, the agent gets a dialogue
    resolution without one."""
    async with bed(nats_server, tmp_path, nc) as b:
        mid = await b.moment()
        await b.send(button_press(await b.posted(mid), "pgw_dialogue", USER))
        [opened] = await b.slack.wait(lambda: b.slack.views)
        assert next(bl for bl in opened["view"]["blocks"] if bl["type"] == "input")["optional"] is True
        await b.send(view_submission(opened["view"], USER, {}))
        res = await b.agent.resolution_for(mid, timeout=10)
        assert res.resolution == DialogueVeto(objection=None)


async def test_clarification_answered_in_a_modal(nats_server, tmp_path, nc) -> None:
    """A clarification becomes a message with its questions and one button; the modal's answers reach the agent."""
    async with bed(nats_server, tmp_path, nc) as b:
        eid = await b.agent.send(envelope("clarification.request", {"questions": [
            {"id": "q1", "question": "Which account?"}, {"id": "q2", "question": "From when?"}]}), principal="alice")
        mid = (await b.agent.outcome_for(eid, timeout=10)).moment_id
        msg = await b.posted(mid)
        assert "Which account?" in texts(msg) and "From when?" in texts(msg)
        await b.send(button_press(msg, "pgw_answers", USER))
        [opened] = await b.slack.wait(lambda: b.slack.views)
        await b.send(view_submission(opened["view"], USER, {"q0": "Savings", "q1": "January"}))
        res = await b.agent.resolution_for(mid, timeout=10)
        assert res.resolution == ClarificationAnswers(answers={"q1": "Savings", "q2": "January"})


async def test_forged_stale_and_replayed_requests_are_refused(nats_server, tmp_path, nc) -> None:
    """A request signed with another secret, one six minutes old and a second copy of a valid one are each
    refused with 401 and answer nothing; the valid first copy is taken."""
    async with bed(nats_server, tmp_path, nc) as b:
        mid = await b.moment()
        press = button_press(await b.posted(mid), "pgw_option_0", USER)
        with structlog.testing.capture_logs() as logs:
            forged = await b.send(press, secret="not-the-signing-secret-at-all-00")
            stale = await b.send(press, ts=1_000_000)
            old = await b.send(press, ts=int(time.time()) - 360)
        assert (forged.status, stale.status, old.status) == (401, 401, 401)
        codes = [e.get("code") for e in logs if e.get("event") == "slack request refused"]
        assert codes == ["bad_signature", "stale", "stale"]
        assert [i.moment_id for i in await Surface(nc, "alice", presence=False).pending()] == [mid]

        body, headers = signed_interaction(press)
        async with b.http.post(b.url, data=body, headers=headers) as first:
            assert first.status == 200
        async with b.http.post(b.url, data=body, headers=headers) as again:
            assert again.status == 401 and (await again.json())["code"] == "replay"
        res = await b.agent.resolution_for(mid, timeout=10)
        assert res.resolution == OptionChoice(index=0)


async def test_unmapped_slack_user_is_refused(nats_server, tmp_path, nc) -> None:
    """A press by a Slack user who is not the principal (a shared channel) is refused with an ephemeral message and
    a log line, and the moment still waits."""
    async with bed(nats_server, tmp_path, nc) as b:
        mid = await b.moment()
        with structlog.testing.capture_logs() as logs:
            r = await b.send(button_press(await b.posted(mid), "pgw_option_0", MALLORY))
        assert r.status == 200
        [eph] = b.slack.ephemerals
        assert eph["user"] == MALLORY and "Only the principal" in eph["text"]
        assert any(e.get("event") == "slack interaction refused: not the principal" and e.get("slack_user") == MALLORY
                   for e in logs)
        assert [i.moment_id for i in await Surface(nc, "alice", presence=False).pending()] == [mid]


async def test_answer_in_another_surface_updates_the_slack_message(nats_server, tmp_path, nc) -> None:
    """A moment answered in the app (another surface on principal.P.resolve) is updated in place on Slack: it says
    so and loses its buttons; a press on the old message then records nothing."""
    async with bed(nats_server, tmp_path, nc) as b:
        mid = await b.moment()
        old = copy.deepcopy(await b.posted(mid))  # the stand-in updates its own copy in place
        reply = await Surface(nc, "alice", presence=False).resolve(mid, OptionChoice(index=2))
        assert reply.status == "accepted"
        done = await closed(b, mid)
        assert "Answered* on another surface" in texts(done)
        assert (await b.agent.resolution_for(mid, timeout=10)).resolution == OptionChoice(index=2)
        await b.send(button_press(old, "pgw_option_0", USER))  # the old buttons, pressed late
        assert any("no longer open" in e["text"] for e in b.slack.ephemerals)


async def test_recommended_idx_out_of_range_becomes_a_notice(nats_server, tmp_path, nc) -> None:
    """A moment whose recommended_idx is not one of its options reaches Slack only as a notice with the agent's
    conventional text and no button; rendered directly, such an item is a notice too (spec 000 §9.3, §12.5)."""
    async with bed(nats_server, tmp_path, nc) as b:
        eid = await b.agent.send_moment("alice", good_moment(recommended_idx=3), conventional="Plan A or plan B?")
        await b.agent.outcome_for(eid, timeout=10)
        [msg] = await b.slack.wait(b.slack.posted)
        assert "Plan A or plan B?" in texts(msg) and not buttons(msg) and msg.text.startswith("A notice")
    raw = {"item": "binding_moment", "agent": "planner", "principal": "alice", "created_at": "2026-01-01T00:00:00Z",
           "untrusted": False, "moment_id": "ab" * 16, "envelope_id": "ab" * 16, "correlation_id": "ab" * 16,
           "expires_at": None, "hem": False, "binding_moment": good_moment(recommended_idx=3)}
    text, blocks = kit.render(plan_item(raw), "alice")
    assert text.startswith("A notice") and "recommended_idx 3" in json.dumps(blocks)
    assert not any(bl.get("accessory") or bl["type"] == "actions" for bl in blocks)


async def test_rate_limit_and_outage_lose_nothing(nats_server, tmp_path, nc) -> None:
    """Slack answering 429 with Retry-After is waited out, and a moment sent while Slack is down is posted once it
    is back: each moment exactly once."""
    async with bed(nats_server, tmp_path, nc) as b:
        b.slack.rate_limit["chat.postMessage"] = 2
        first = await b.moment()
        await b.posted(first)
        assert b.slack.count("chat.postMessage:429") == 2
        b.slack.down = True
        second = await b.moment()
        await b.slack.wait(lambda: b.slack.count("chat.postMessage:down") >= 1)  # met the outage; backs off
        assert not b.slack.of(second)
        b.slack.down = False
        await b.posted(second)
        assert len(b.slack.of(first)) == 1 and len(b.slack.of(second)) == 1


def test_invalid_blocks_are_refused_by_slack_sdk() -> None:
    """slack-sdk's models, which the stand-in and the surface both use, refuse an over-long section, an unknown
    field and a button text over Slack's 75 characters; the blocks of a real moment pass."""
    from tests.slack_standin import blocks_valid

    assert blocks_valid([{"type": "section", "text": {"type": "plain_text", "text": "x" * 3001}}])
    assert blocks_valid([{"type": "section", "text": {"type": "plain_text", "text": "x"}, "bogus": 1}])
    assert blocks_valid([{"type": "actions", "elements": [
        {"type": "button", "text": {"type": "plain_text", "text": "y" * 76}, "action_id": "a"}]}])
    with pytest.raises(kit.InvalidBlocks):
        kit.check_blocks([{"type": "section", "text": {"type": "plain_text", "text": "x" * 3001}}])
    raw = {"item": "binding_moment", "agent": "planner", "principal": "alice", "created_at": "2026-01-01T00:00:00Z",
           "untrusted": True, "moment_id": "ab" * 16, "envelope_id": "ab" * 16, "correlation_id": "ab" * 16,
           "expires_at": None, "hem": False, "binding_moment": good_moment()}
    _, blocks = kit.render(plan_item(raw), "alice")
    assert blocks_valid(blocks) is None
    assert "untrusted content" in json.dumps(blocks)


def test_agent_text_never_becomes_slack_markup() -> None:
    """An option label that tries a mention, a link and our own recommended marker stays plain text: every agent
    string is in a plain_text object and only the real recommended option has the marker block."""
    m = good_moment(recommended_idx=0)
    m["question"]["options"][2]["label"] = "<!channel> *:star: Recommended by the agent* <https://x.test|here>"
    raw = {"item": "binding_moment", "agent": "planner", "principal": "alice", "created_at": "2026-01-01T00:00:00Z",
           "untrusted": False, "moment_id": "ab" * 16, "envelope_id": "ab" * 16, "correlation_id": "ab" * 16,
           "expires_at": None, "hem": False, "binding_moment": m}
    _, blocks = kit.render(plan_item(raw), "alice")
    for bl in blocks:
        if "<!channel>" in json.dumps(bl):
            assert bl["text"]["type"] == "plain_text"
    markers = [bl for bl in blocks if bl["type"] == "context" and "Recommended by the agent" in json.dumps(bl)]
    assert len(markers) == 1 and "option 1" in markers[0]["elements"][0]["text"]


def test_secrets_never_come_from_the_toml(tmp_path) -> None:
    """Without a secret file or environment variable the surface refuses to start and says where to put it; a
    secret file readable by others is refused."""
    config = load_config(None, data_dir=str(tmp_path), slack={"enabled": True, "principals": {"alice": {"user": USER}}})
    with pytest.raises(SlackConfigError, match="PGW_SLACK_BOT_TOKEN"):
        SlackSurface(config, environ={})
    loose = tmp_path / "token"
    loose.write_text(BOT_TOKEN)
    loose.chmod(0o644)
    config = load_config(None, data_dir=str(tmp_path), slack={"enabled": True, "bot_token_file": str(loose),
                                                              "principals": {"alice": {"user": USER}}})
    with pytest.raises(SlackConfigError, match="0600"):
        SlackSurface(config, environ={"PGW_SLACK_SIGNING_SECRET": SIGNING_SECRET})
    with pytest.raises(Exception, match="bot_token"):
        load_config(None, slack={"bot_token": BOT_TOKEN})


async def test_isolated_deployment_answers_with_the_slack_identity(tmp_path) -> None:
    """With isolation on, the gateway creates the Slack surface's durable and bucket, the surface connects as
    slack:alice (its own credentials) and a moment is posted and answered end to end under the server's permissions."""
    from gateway.app import Gateway
    from gateway.security import embedded_auth
    from pgwcore.connect import connect
    from pgwcore.identity import Party
    from pgwcore.server import EmbeddedServer

    async with slack_standin() as s:
        settings = {"data_dir": str(tmp_path / "data"), "agents": {"planner": {"principals": ["alice"]}},
                    "slack": slack_settings(s)}
        auth = embedded_auth(load_config(None, **settings))
        assert Party("slack", "alice") in auth.parties
        server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1,
                                authorization=auth.server_block)
        await server.start()
        config = load_config(None, nats_url=server.client_url, **settings)
        gw_nc = await connect(server.client_url, creds=str(auth.service_creds), name="gateway")
        agent_nc = await connect(server.client_url, creds=str(auth.creds_for(Party("agent", "planner"))), name="agent")
        try:
            async with Gateway(config, gw_nc), SlackSurface(config, environ=ENV) as surface, \
                    aiohttp.ClientSession() as http:
                assert surface.creds_for("alice") == str(auth.creds_for(Party("slack", "alice")))
                b = Bed(s, surface, http, Agent(agent_nc, "planner"), agent_nc)
                mid = await b.moment()
                await b.send(button_press(await b.posted(mid), "pgw_option_2", USER))
                assert (await b.agent.resolution_for(mid, timeout=10)).resolution == OptionChoice(index=2)
                await closed(b, mid)
                await b.agent.close()
        finally:
            await agent_nc.drain()
            await gw_nc.drain()
            await server.stop()


def test_every_corpus_item_is_valid_slack_and_blocked_stays_blocked() -> None:
    """Every item of the shared render corpus becomes blocks slack-sdk accepts; an unknown authorization kind, an
    unprovenanced action and a refusal with an unknown code are BLOCKED without their content; untrusted items carry
    the warning; malformed moments are notices without buttons; a moment offers exactly its open hatches."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "web"))
    import surface_kit

    from tests.slack_standin import blocks_valid

    corpus = dict(surface_kit.corpus())
    hatched = 0
    for name, item in corpus.items():
        plan = plan_item(item)
        _, blocks = kit.render(plan, "alice")
        assert blocks_valid(blocks) is None, name
        shown = json.dumps(blocks)
        if getattr(plan, "untrusted", False):
            assert "untrusted content" in shown, name
        if type(plan).__name__ == "NoticePlan":
            assert not any(b.get("accessory") or b["type"] == "actions" for b in blocks), name
        if type(plan).__name__ == "DecisionPlan":  # exactly the open hatches, each its own button
            hatch_ids = {e["action_id"] for b in blocks if b["type"] == "actions" for e in b["elements"]}
            assert hatch_ids == {f"pgw_{h.kind}" for h in plan.hatches}, name
            hatched += len(plan.hatches) < 2
    assert hatched, "the corpus has a moment with one hatch closed"
    for name in ("auth_unknown_kind", "auth_no_kind", "auth_action_no_provenance", "auth_refusal_unknown_code"):
        _, blocks = kit.render(plan_item(corpus[name]), "alice")
        shown = json.dumps(blocks)
        assert "BLOCKED" in shown and "trust me" not in shown and "no kind at all" not in shown, name


async def test_socket_mode_answers_without_a_public_endpoint(nats_server, tmp_path, nc) -> None:
    """In Socket Mode (app-level token, no HTTP endpoint) a press arrives over Slack's WebSocket, is acknowledged by
    its envelope id and reaches the agent; a press by someone else over the socket is refused the same way."""
    from tests.slack_standin import APP_TOKEN, socket_send

    async with slack_standin() as s, running_gateway(nats_server, str(tmp_path / "gw")):
        config = load_config(None, data_dir=str(tmp_path / "slack"), nats_url=nats_server.client_url,
                             slack=slack_settings(s, mode="socket"))
        agent = Agent(nc, "planner")
        env = {"PGW_SLACK_BOT_TOKEN": BOT_TOKEN, "PGW_SLACK_APP_TOKEN": APP_TOKEN}
        async with SlackSurface(config, environ=env) as surface, aiohttp.ClientSession() as http:
            assert surface.port == 0 and surface.signing_secret == ""
            b = Bed(s, surface, http, agent, nc)
            await s.wait(lambda: s.sockets)
            mid = await b.moment()
            msg = await b.posted(mid)
            await socket_send(s, "env-mallory", button_press(msg, "pgw_option_0", MALLORY))
            await s.wait(lambda: [a for a in s.socket_acks if a.get("envelope_id") == "env-mallory"])
            assert [e["user"] for e in s.ephemerals] == [MALLORY]
            await socket_send(s, "env-1", button_press(msg, "pgw_option_2", USER))
            await s.wait(lambda: [a for a in s.socket_acks if a.get("envelope_id") == "env-1"])
            assert (await agent.resolution_for(mid, timeout=10)).resolution == OptionChoice(index=2)
            await closed(b, mid)
        await agent.close()


async def test_expired_moment_is_updated_and_loses_its_buttons(nats_server, tmp_path, nc) -> None:
    """A moment that expires unanswered is updated in place on Slack to say it expired, without buttons."""
    async with bed(nats_server, tmp_path, nc) as b:
        mid = await b.moment(expires_in_s=1)
        await b.posted(mid)
        done = await closed(b, mid)
        assert "Expired" in texts(done)


async def test_a_refused_bot_token_stops_the_start_with_its_reason(nats_server, tmp_path) -> None:
    """A bot token Slack refuses (invalid_auth) fails the start with a clear reason instead of running deaf."""
    async with slack_standin() as s:
        config = load_config(None, data_dir=str(tmp_path), nats_url=nats_server.client_url, slack=slack_settings(s))
        with pytest.raises(SlackConfigError, match="invalid_auth"):
            async with SlackSurface(config, environ={**ENV, "PGW_SLACK_BOT_TOKEN": "xoxb-wrong"}):
                pass


@pytest.mark.parametrize("answered_meanwhile", [False, True])
async def test_a_post_whose_record_was_lost_is_found_not_posted_again(nats_server, tmp_path, nc,
                                                                       answered_meanwhile) -> None:
    """A previous run that died between chat.postMessage and its record left the record `posting` and the message on
    Slack: the next run finds the message by its metadata and adopts it instead of posting again; when the moment was
    answered meanwhile, that message is closed."""
    from consumers.slack.service import Record
    from pgwcore.slack_config import SLACK_BUCKET, ensure_slack_state
    from tests.slack_standin import Message

    async with slack_standin() as s, running_gateway(nats_server, str(tmp_path / "gw")):
        agent = Agent(nc, "planner")
        eid = await agent.send_moment("alice", good_moment())
        mid = (await agent.outcome_for(eid, timeout=10)).moment_id
        js = nc.jetstream()
        raw = (await js.get_last_msg("PGW_SURFACE", "pgw.principal.alice.surface")).data
        await ensure_slack_state(js, "alice")
        kv = await js.key_value(SLACK_BUCKET)
        await kv.create(f"alice.{mid}", msgspec.json.encode(Record(state="posting", item=raw.decode(),
                                                                   at=time.time())))
        _, blocks = kit.render(plan_item(raw), "alice")
        ts = f"{int(time.time())}.000001"
        s.messages[("D0ALICE", ts)] = Message("D0ALICE", ts, "A decision", blocks,
                                              {"event_type": "pgw_moment", "event_payload": {"principal": "alice", "id": mid}})
        if answered_meanwhile:
            assert (await Surface(nc, "alice", presence=False).resolve(mid, OptionChoice(index=0))).status == "accepted"
        config = load_config(None, data_dir=str(tmp_path / "slack"), nats_url=nats_server.client_url,
                             slack=slack_settings(s))
        async with SlackSurface(config, environ=ENV), aiohttp.ClientSession() as http:
            b = Bed(s, None, http, agent, nc)  # type: ignore[arg-type]
            if not answered_meanwhile:
                await s.wait(lambda: s.count("conversations.history"))
                assert (await Surface(nc, "alice", presence=False).resolve(mid, OptionChoice(index=0))).status == "accepted"
            done = await closed(b, mid)
            assert done.ts == ts and s.count("chat.postMessage") == 0
        await agent.close()


async def test_slack_surface_serves_healthz_per_lane(nats_server, tmp_path, nc) -> None:
    """With ops.metrics_port the Slack surface serves /healthz: each lane's connection and durable consumer."""
    import urllib.request

    from tests.chaos.harness import free_port

    port = free_port()
    async with slack_standin() as s, running_gateway(nats_server, str(tmp_path / "gw")):
        config = load_config(None, data_dir=str(tmp_path / "slack"), nats_url=nats_server.client_url,
                             slack=slack_settings(s), ops={"metrics_port": port})
        async with SlackSurface(config, environ=ENV):
            def get() -> tuple[int, dict]:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                    return r.status, json.loads(r.read())

            code, doc = await asyncio.to_thread(get)
            assert code == 200 and doc["checks"]["slack:alice:connected"] == "ok"
            assert doc["checks"]["slack:alice:consumer"] == "ok"


async def test_an_answer_in_slack_says_so_even_when_the_gateways_withdrawal_closes_it_first(nats_server, tmp_path, nc) -> None:
    """The gateway's ``withdrawn`` (resolved) for a moment answered in Slack can be handled before the
    surface's own close after the answer (the first close wins): the message still says it was answered in
    Slack, by whom and with what, not "on another surface"."""
    async with bed(nats_server, tmp_path, nc) as b:
        mid = await b.moment(good_moment())
        msg = await b.posted(mid)
        original = b.surface._close_quietly

        async def late(lane: Any, ident: str, status: str, detail: str, shown: str | None = None) -> None:
            await closed(b, ident)  # the withdrawn item has closed the message already
            await original(lane, ident, status, detail, shown)

        b.surface._close_quietly = late
        r = await b.send(button_press(msg, "pgw_option_1", USER))
        assert r.status == 200
        assert (await b.agent.resolution_for(mid, timeout=10)).resolution == OptionChoice(index=1)
        done = await closed(b, mid)
        assert "Answered in Slack" in texts(done) and "another surface" not in texts(done)
        assert good_moment()["question"]["options"][1]["label"] in texts(done)


async def test_a_press_naming_another_moment_or_a_malformed_value_answers_nothing(nats_server, tmp_path, nc) -> None:
    """A signed press on moment A's message whose value names alice's open moment B answers nothing (B still
    waits); a value naming moment ``*`` or ``>``, or one that is no moment reference, is HTTP 400, never 500."""
    async with bed(nats_server, tmp_path, nc) as b:
        a, other = await b.moment(), await b.moment()
        msg_a = await b.posted(a)
        await b.posted(other)
        press = button_press(msg_a, "pgw_option_0", USER)
        value = json.loads(press["actions"][0]["value"])
        forged = copy.deepcopy(press)
        forged["actions"][0]["value"] = json.dumps({**value, "m": other})
        assert (await b.send(forged)).status == 200  # Slack's request is answered; the answer is refused
        await b.slack.wait(lambda: [e for e in b.slack.ephemerals if "does not belong" in e.get("text", "")])
        pending = [getattr(i, "moment_id", "") for i in await Surface(nc, "alice", presence=False).pending()]
        assert other in pending and a in pending
        for bad in ({**value, "m": "*"}, {**value, "m": ">"}, {**value, "m": "alice.*"}, {**value, "p": "*"},
                    {**value, "k": "nope"}, {**value, "i": "0"}, [value], "x", 7):
            broken = copy.deepcopy(press)
            broken["actions"][0]["value"] = json.dumps(bad)
            assert (await b.send(broken)).status == 400, bad
        broken = copy.deepcopy(press)
        broken["actions"][0]["value"] = "{not json"
        assert (await b.send(broken)).status == 400
        broken["actions"] = ["pgw_option_0"]
        assert (await b.send(broken)).status == 400
        assert (await b.send(press)).status == 200  # the press on its own message still answers
        assert (await b.agent.resolution_for(a, timeout=10)).resolution == OptionChoice(index=0)


async def test_slack_shows_and_keeps_only_the_redacted_answer(nats_server, tmp_path, nc) -> None:
    """An answer in the principal's words holding a configured secret is echoed in Slack in the redacted form the
    agent got, and the surface's record in PGW_SLACK keeps the kind of answer, never the words."""
    secret = "NYX-deploy-Key-4471-Quartz"
    async with slack_standin() as s, running_gateway(nats_server, str(tmp_path / "gw"),
                                                     pipeline={"secrets": {"values": [secret]}}):
        config = load_config(None, data_dir=str(tmp_path / "slack"), nats_url=nats_server.client_url,
                             slack=slack_settings(s))
        agent = Agent(nc, "planner")
        async with SlackSurface(config, environ=ENV) as surface, aiohttp.ClientSession() as http:
            b = Bed(s, surface, http, agent, nc)
            try:
                mid = await b.moment()
                await b.send(button_press(await b.posted(mid), "pgw_free_text", USER))
                [opened] = await s.wait(lambda: s.views)
                words = f"Use the key {secret} only for the staging push"
                assert (await b.send(view_submission(opened["view"], USER, {"answer": words}))).status == 200
                res = await agent.resolution_for(mid, timeout=10)
                assert secret not in res.resolution.text and res.resolution.text.startswith("Use the key")
                done = await s.wait(lambda: next((m for m in s.of(mid) if "the staging push" in texts(m)), None))
                assert f"In my words: {res.resolution.text}" in texts(done) and secret not in texts(done)
                entry = await nc.jetstream().get_msg("KV_PGW_SLACK", subject=f"$KV.PGW_SLACK.alice.{mid}")
                assert b"staging push" not in entry.data and secret.encode() not in entry.data
                assert b"Answered in my own words." in entry.data
            finally:
                await agent.close()


async def test_a_press_before_the_posts_record_is_checked_against_the_channel_history(nats_server, tmp_path, nc) -> None:
    """A press that arrives while the moment's record still says ``posting`` (no message recorded yet) is taken
    when the channel's history shows the pressed message as that moment's post, and refused when its value names
    another moment."""
    async with bed(nats_server, tmp_path, nc) as b:
        a, other = await b.moment(), await b.moment()
        msg_a = await b.posted(a)
        await b.posted(other)
        kv = await nc.jetstream().key_value("PGW_SLACK")
        for ident in (a, other):  # as if killed between chat.postMessage and the record's update
            rec = json.loads((await kv.get(f"alice.{ident}")).value)
            rec.update(state="posting", channel="", messages=[])
            await kv.put(f"alice.{ident}", json.dumps(rec).encode())
        press = button_press(msg_a, "pgw_option_0", USER)
        forged = copy.deepcopy(press)
        forged["actions"][0]["value"] = json.dumps({**json.loads(press["actions"][0]["value"]), "m": other})
        assert (await b.send(forged)).status == 200
        await b.slack.wait(lambda: [e for e in b.slack.ephemerals if "does not belong" in e.get("text", "")])
        assert other in [getattr(i, "moment_id", "") for i in await Surface(nc, "alice", presence=False).pending()]
        assert (await b.send(press)).status == 200
        assert (await b.agent.resolution_for(a, timeout=10)).resolution == OptionChoice(index=0)
