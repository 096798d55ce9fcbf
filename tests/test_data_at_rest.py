"""Forgotten means gone, also on disk (spec 000 §13; spec 002 SR-1; docs/security.md "Data at rest").

A configured secret, a ``secret:`` token and a distinct free text per entry are
planted through every entry a principal and an agent have here: the envelope's
fields (binding moments, a clarification request, a binding moment asked
through ``pgw mcp``'s ``ask_principal`` tool), answers on the bus as the web
and terminal surfaces send them (a free text, a dialogue objection,
clarification answers), a free text in a Slack modal and a free text on an
e-mail answer page. After ``gateway.answer_text_keep_s`` the services stop,
the server is shut down cleanly and started again, and every byte under the
test's folder (the server's store, every service's data folder) and every log
line is searched: no secret anywhere, no free text anywhere, no plain sha256
of an answer anywhere; each answer is kept only as the keyed digest
docs/contract.md names (the verdict's ``text_digest``, the forgotten record).
A second test does the same for what ``PGW_INBOUND`` keeps past the pipeline:
a dead-lettered turn and a transition report (gateway/at_rest.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from email import policy
from email.parser import BytesParser
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import get_default_environment, stdio_client

from consumers.notify.service import Notifier
from consumers.slack.service import SlackSurface
from gateway.app import Gateway
from gateway.stages.base import INBOUND_DURABLE
from pgwcore.connect import connect
from pgwcore.kvread import live_keys
from subjects.client import Agent, Surface, envelope
from subjects.wire import ClarificationAnswers, DialogueVeto, FreeTextAnswer
from tests.logcapture import capture_logs_with_context
from tests.moments import good_moment
from tests.notify_peers import smtp_server
from tests.polling import until
from tests.slack_standin import (
    BOT_TOKEN,
    SIGNING_SECRET,
    button_press,
    signed_interaction,
    slack_standin,
    view_submission,
)
from tests.stored import acks, arrived
from tests.test_answer_retention import everything_stored
from tests.test_notify_email_answers import answer_links, parts

SECRET = "NYX-vault-Key-8842-Quartz"  # pipeline.secrets
TOKEN_BODY = "Marigold-hunter-5531"
TOKEN = f"secret:{TOKEN_BODY}"  # a secret: token (spec 002 SR-1)
# The principal's own words, one per entry; each must be gone after the window.
BUS_FREE = "Pay the Oslo invoice on the ninth and never before"
BUS_OBJECTION = "Harbor lost my passport copy so ask about them first"
BUS_CLARIFICATION = "The account that ends with the lighthouse number"
SLACK_FREE = "Tell Ingrid the boat keys are under the blue crate"
MAIL_FREE = "Move the dentist to Thursday after the school run"
MCP_FREE = "Buy the blue kettle but only from the corner shop"
WORDS = (BUS_FREE, BUS_OBJECTION, BUS_CLARIFICATION, SLACK_FREE, MAIL_FREE, MCP_FREE)
PGW = str(Path(sys.executable).parent / "pgw")
USER = "U0ALICE"
MAIL_KEY = "answer-link-test-key-0123456789abcdefghij"
DIGEST_DOMAIN = b"pgw-text-digest/v1\n"  # docs/contract.md: hmac-sha256:{kid}:{hex} over this label and the text


def every_file(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def where(files: dict[Path, bytes], needle: bytes, root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p, b in files.items() if needle in b)


def keyed(key_dir: Path, text: str) -> str:
    kid = (key_dir / "active").read_text().strip()
    key = bytes.fromhex((key_dir / f"{kid}.key").read_text().strip())
    return f"hmac-sha256:{kid}:" + hmac.new(key, DIGEST_DOMAIN + text.encode(), hashlib.sha256).hexdigest()


async def gone_after_restart(nats_server: Any, root: Path, logs: Any, needles: Any) -> dict[Path, bytes]:
    """Shut the server down cleanly, start it (it reads its store again) and shut it down again; then no
    needle is in any file under ``root`` or in any captured log line. The files, for further checks."""
    await nats_server.stop()
    await nats_server.start()
    await nats_server.stop()
    files = every_file(root)
    logged = json.dumps([dict(e) for e in logs], default=str).encode()
    found = {}
    for needle in needles:
        hits = where(files, needle.encode(), root) + (["logs"] if needle.encode() in logged else [])
        if hits:
            found[needle] = hits
    assert not found, f"found at rest: {found}"
    return files


async def ask_through_mcp(url: str, tmp_path: Path, web: Surface) -> tuple[str, str]:
    """``pgw mcp --agent helper`` (a subprocess, its log in the test's folder) asks alice a moment holding the
    secret and the token; she answers it on the bus in her words with the secret; (moment id, what the tool
    returned to the model)."""
    env = {**get_default_environment(), **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}}
    params = StdioServerParameters(command=PGW, env=env, args=[
        "mcp", "--agent", "helper", "--server", url, "--data-dir", str(tmp_path / "mcp-data"), "--progress-every", "0.3"])
    m = good_moment()
    m["synopsis"] = f"Rotate the deploy key {SECRET} before Harbor uses it (mcp)."
    m["findings"][0] = f"The token {TOKEN} was pasted in a ticket."
    with (tmp_path / "mcp.log").open("w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            asking = asyncio.create_task(session.call_tool("ask_principal", {"principal": "alice", "binding_moment": m}))

            async def asked() -> str | None:
                for item in await web.pending():
                    if "(mcp)" in getattr(getattr(item, "binding_moment", None), "synopsis", ""):
                        return item.moment_id  # type: ignore[union-attr]
                return None

            await until(asked, timeout=20, what="the moment asked through pgw mcp")
            mid = await asked()
            assert mid is not None
            assert (await web.resolve(mid, FreeTextAnswer(text=f"{MCP_FREE} {SECRET}"))).status == "accepted"
            result = await asyncio.wait_for(asking, 30)
    assert not result.isError and result.structuredContent is not None
    return mid, result.structuredContent["text"]


@contextlib.asynccontextmanager
async def gateway_and_client(nats_server: Any, config: Any) -> AsyncIterator[tuple[Gateway, Any]]:
    """A gateway on its own connection and the test's connection (what an agent sends), both drained after."""
    gw_nc = await connect(nats_server.client_url, name="gateway")
    nc = await connect(nats_server.client_url, name="test")
    try:
        async with Gateway(config, gw_nc) as gw:
            yield gw, nc
    finally:
        await nc.drain()
        await gw_nc.drain()


async def test_secrets_and_free_text_are_gone_from_every_byte_after_the_window(
        tmp_path, nats_server, make_config, monkeypatch) -> None:
    """A configured secret, a secret: token and five free texts planted through envelopes, bus, Slack and e-mail
    answers are, after the window, a clean shutdown and a restart, in no file under the server's store or the
    services' data folders and in no log line; each answer survives only as its keyed digest in the verdicts."""
    monkeypatch.setenv("PGW_ANSWER_KEY", MAIL_KEY)
    env = {"PGW_SLACK_BOT_TOKEN": BOT_TOKEN, "PGW_SLACK_SIGNING_SECRET": SIGNING_SECRET}
    with capture_logs_with_context() as logs, smtp_server(tmp_path) as relay:
        async with slack_standin() as slack:
            config = make_config(
                pipeline={"secrets": {"values": [SECRET]}},
                gateway={"answer_text_keep_s": 1.0},
                agents={"planner": {"principals": ["alice"]}, "helper": {"principals": ["alice"]}},
                notifier={"presence_grace_s": 0, "answer_port": 0,
                          "smtp": {"host": relay.host, "port": relay.port,
                                   "credentials_file": str(relay.credentials_file),
                                   "ca_file": str(relay.ca_file), "from_addr": "pgw@pgw.example"},
                          "principals": {"alice": {"email": "alice@example.com", "web_push": False,
                                                   "answer_by_email": True}}},
                slack={"enabled": True, "api_url": slack.url, "http_port": 0, "max_retries": 3,
                       "principals": {"alice": {"user": USER}}},
            )
            gw_nc = await connect(nats_server.client_url, name="gateway")
            n_nc = await connect(nats_server.client_url, name="notifier")
            nc = await connect(nats_server.client_url, name="test")
            agent, web = Agent(nc, "planner"), Surface(nc, "alice")
            try:
                async with Gateway(config, gw_nc), Notifier(config, n_nc), \
                        SlackSurface(config, environ=env) as surface, aiohttp.ClientSession() as http:
                    # -- the agent's side: a secret and a token in the envelope's fields
                    moments = []
                    for n in range(4):
                        m = good_moment()
                        m["synopsis"] = f"Rotate the deploy key {SECRET} before Harbor uses it ({n})."
                        m["findings"][0] = f"The token {TOKEN} was pasted in a ticket."
                        eid = await agent.send_moment("alice", m, expires_in_s=600)
                        out = await agent.outcome_for(eid, timeout=10)
                        assert out.status == "accepted", (out.code, out.reason)
                        moments.append(out.moment_id)
                    clar = envelope("clarification.request", {"questions": [
                        {"id": "acct", "question": f"Which account holds {SECRET} (see {TOKEN})?"}]})
                    eid = await agent.send(clar, principal="alice")
                    out = await agent.outcome_for(eid, timeout=10)
                    assert out.status == "accepted", (out.code, out.reason)
                    m_bus, m_obj, m_slack, m_mail = moments
                    m_clar = out.moment_id
                    m_mcp, mcp_text = await ask_through_mcp(nats_server.client_url, tmp_path, web)
                    # -- the principal's answers: the bus (web, terminal), Slack, e-mail
                    assert (await web.resolve(m_bus, FreeTextAnswer(text=f"{BUS_FREE} {SECRET} {TOKEN}"))).status == "accepted"
                    assert (await web.resolve(m_obj, DialogueVeto(objection=f"{BUS_OBJECTION} {TOKEN}"))).status == "accepted"
                    assert (await web.resolve(m_clar, ClarificationAnswers(
                        answers={"acct": f"{BUS_CLARIFICATION} {SECRET}"}))).status == "accepted"
                    [msg] = await slack.wait(lambda: slack.of(m_slack))
                    url = f"http://127.0.0.1:{surface.port}{surface.cfg.path}"

                    async def send(payload: dict[str, Any]) -> int:
                        body, headers = signed_interaction(payload)
                        async with http.post(url, data=body, headers=headers) as r:
                            return r.status

                    assert await send(button_press(msg, "pgw_free_text", USER)) == 200
                    [opened] = await slack.wait(lambda: slack.views)
                    assert await send(view_submission(opened["view"], USER, {"answer": f"{SLACK_FREE} {SECRET}"})) == 200

                    def mail_link() -> str | None:
                        """The free-text link of the e-mail moment's mail (the others may be answered before
                        the notifier mails them, and are then not mailed)."""
                        for e in relay.box.envelopes:
                            mail = BytesParser(policy=policy.default).parsebytes(e.original_content)
                            if "uses it (3)" in " ".join(parts(mail)[0].split()):
                                return answer_links(mail)["free_text"]
                        return None

                    async def mailed() -> bool:
                        return mail_link() is not None

                    await until(mailed, timeout=30, what="the e-mail moment's mail")
                    link = mail_link()
                    assert link is not None
                    async with http.post(link, data={"text": f"{MAIL_FREE} {TOKEN}"}, allow_redirects=False) as r:
                        assert r.status == 200, await r.text()
                    # -- what the agent got: the principal's words, redacted
                    got = {m: await agent.resolution_for(m, principal="alice", timeout=10)
                           for m in (m_bus, m_obj, m_clar, m_slack, m_mail)}
                    texts = {
                        m_bus: got[m_bus].resolution.text, m_obj: got[m_obj].resolution.objection,
                        m_clar: got[m_clar].resolution.answers["acct"], m_slack: got[m_slack].resolution.text,
                        m_mail: got[m_mail].resolution.text, m_mcp: mcp_text,
                    }
                    for m, words in zip(texts, WORDS, strict=True):
                        assert texts[m].startswith(words) and SECRET not in texts[m] and TOKEN_BODY not in texts[m]
                    # Slack shows the redacted form the agent got, never the words as typed.
                    closed = await slack.wait(lambda: next(
                        (x for x in slack.of(m_slack) if x.versions and SLACK_FREE in json.dumps(x.blocks)), None))
                    assert SECRET not in json.dumps(closed.blocks) and SECRET not in closed.text

                    async def forgotten() -> bool:
                        blob = await everything_stored(nc)
                        return not any(w.encode() in blob for w in WORDS)

                    await until(forgotten, timeout=30, interval=0.2, what="every free text forgotten")
                    await surface.drain()
            finally:
                await agent.close()
                await web.close()
                for c in (nc, n_nc, gw_nc):
                    await c.drain()
    needles = (SECRET, TOKEN_BODY, *WORDS, *(hashlib.sha256(t.encode()).hexdigest() for t in texts.values()))
    files = await gone_after_restart(nats_server, tmp_path, logs, needles)
    # Each answer is kept as its keyed digest, and only where docs/contract.md says: the forgotten record
    # (PGW_MOMENTS) and, for a free text or an objection, the verdict's text_digest (PGW_VERDICTS).
    key_dir = tmp_path / "data" / "keys" / "digest"
    for m, text in texts.items():
        hits = where(files, keyed(key_dir, text).encode(), tmp_path)
        streams = {h.split("/streams/")[1].split("/")[0] for h in hits if "/streams/" in h}
        assert len(streams) == len(hits) and streams <= {"PGW_VERDICTS", "KV_PGW_MOMENTS"}, (text, hits)
        assert "KV_PGW_MOMENTS" in streams and ("PGW_VERDICTS" in streams) == (m != m_clar), (text, hits)


async def test_a_dead_lettered_turn_and_a_transition_report_leave_no_secret_in_inbound(
        tmp_path, nats_server, make_config) -> None:
    """A poison turn holding a configured secret, dead-lettered after max_deliver, and a transition report holding the
    secret and a secret: token in its effect, once the dead letter and the report are recorded, are in no file under
    the server's store after a clean shutdown and a restart; pgw replay re-drives the dead letter's redacted copy."""
    from consumers.replay import Replayer, ReplayRange
    from pgwcore.streams import INBOUND_REDACTED_BUCKET
    from subjects.idp import Permit
    from tests.kernel_support import Issuer, idp, policy_dir, read_log, request

    issuer = Issuer(tmp_path / "issuer")
    config = make_config(pipeline={"secrets": {"values": [SECRET]}}, gateway={"max_deliver": 2},
                         kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path))})
    poison = {"type": "error", "envelopeId": "poison", "correlationId": "poison-c",
              "payload": {"code": "x", "message": f"the vault key is {SECRET}"},
              "meta": {"source": "ai-generation", "ts": "2026-01-01T00:00:00Z"}}

    async def fail_poison(ctx: Any) -> None:
        if isinstance(ctx.raw, dict) and ctx.raw.get("envelopeId") == "poison":
            raise RuntimeError("injected fault")

    with capture_logs_with_context() as logs:
        async with gateway_and_client(nats_server, config) as (gw, nc):
            js = nc.jetstream()
            # -- a poison turn: dead-lettered after max_deliver deliveries
            gw.worker.pipeline.stages.insert(0, fail_poison)
            ack = await js.publish("pgw.agent.bot.envelope", json.dumps(poison).encode(),
                                   headers={"Nats-Msg-Id": "bot:poison"})

            await arrived(js, "PGW_DEADLETTER", 1, timeout=15)  # the poison turn dead-lettered
            # -- a transition report with the secret and the token in its effect
            so = str(uuid.uuid4())
            token, jti = issuer.mandate(agent="bot", so_id=so)
            rec = idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")
            assert isinstance(await request(nc, "bot", {"mandate": token, "idp": rec}), Permit)
            report = {"idp_id": rec["idp_id"], "executed_action": "CloseBooking",
                      "effect": {"type": "booking.close", "status": "confirmed",
                                 "request": {"api_key": SECRET}, "response": {"note": f"rotated {TOKEN}"}}}
            tack = await js.publish("pgw.agent.bot.transition", json.dumps(report).encode(),
                                    headers={"Nats-Msg-Id": f"bot:{rec['idp_id']}"})

            async def settled() -> bool:  # both recorded, so both erased from PGW_INBOUND
                return (await js.stream_info("PGW_INBOUND")).state.messages == 0

            await until(settled, timeout=15, what="the dead letter and the report erased from PGW_INBOUND")
            # The kernel recorded the report (its request and response as digests in its log).
            [(_, st)] = await read_log(js, "STATE_TRANSITIONED")
            assert st.body["idp_id"] == rec["idp_id"] and st.body["effect"]["request_digest"]
            copies = await js.stream_info(f"KV_{INBOUND_REDACTED_BUCKET}")
            assert copies.state.messages == 2
            # -- pgw replay of the range: both at their own sequence and subject, redacted
            replayer = Replayer(nc, gw.subjects)
            dry = await replayer.replay(ReplayRange(stream="PGW_INBOUND"), "gateway", dry_run=True)
            assert [(a.seq, a.subject, a.msg_id) for a in dry.actions] == [
                (ack.seq, "pgw.agent.bot.envelope", "bot:poison"),
                (tack.seq, "pgw.agent.bot.transition", f"bot:{rec['idp_id']}")]
            # The fault is fixed; the dead letter is re-driven from its redacted copy and answered.
            gw.worker.pipeline.stages.remove(fail_poison)
            again = await replayer.replay(ReplayRange(stream="PGW_INBOUND", from_seq=ack.seq, to_seq=ack.seq),
                                          "gateway")
            assert again.counts() == {"published": 1}

            async def answered() -> list[Any] | None:
                outs = [json.loads(m.data) for m in await read_stored_all(js, "PGW_OUTBOUND")]
                done = [o for o in outs if o.get("envelope_id") == "poison" and o.get("status") == "accepted"]
                return done or None

            await until(answered, timeout=15, what="the replayed dead letter answered")
    await gone_after_restart(nats_server, tmp_path, logs, (SECRET, TOKEN_BODY))


async def read_stored_all(js: Any, stream: str) -> list[Any]:
    """Every message of ``stream``, by message get."""
    info = await js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq or 1, info.state.last_seq + 1):
        try:
            out.append(await js.get_msg(stream, seq))
        except Exception:  # noqa: BLE001 - deleted
            continue
    return out


async def test_the_kernel_log_keeps_no_secret_an_agent_sends(tmp_path, nats_server, make_config) -> None:
    """The kernel's signed log is never deleted, so no secret an agent sends may enter it (spec 002 SR-1,
    spec 003 §5.3; docs/security.md "Data at rest"). Sent on the bus as an agent sends them:

    - IDPs holding the configured secret (plainly, and disguised with a zero-width space and full-width
      letters), a ``secret:`` token, a secret in a metadata key or in the resource: each is refused
      (REJECT naming where, never what) and nothing of it is committed;
    - a report of a permitted step whose ``executed_action`` holds the token and whose ``external_ref``
      holds the secret: recorded with both redacted, and judged on what was sent (a commitment gap);
    - a report the kernel fails to record on every delivery (a fault injected in the kernel: no bus
      input makes a correct kernel fail each time): dead-lettered after ``max_deliver`` and erased.

    After a clean shutdown and a restart neither the secret nor the token is in any file under the
    server's store or in any log line.
    """
    from gateway.kernel.service import KernelService
    from subjects.idp import Permit, Reject
    from tests.kernel_support import Issuer, idp, policy_dir, read_log, read_verdicts, request

    issuer = Issuer(tmp_path / "issuer")
    config = make_config(pipeline={"secrets": {"values": [SECRET]}}, gateway={"max_deliver": 2},
                         kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path))})
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent="bot", so_id=so)
    zw = SECRET[:6] + "\u200b" + SECRET[6:]  # a zero-width space inside
    wide = "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in SECRET)  # full-width letters

    def goal(text: str) -> dict[str, Any]:
        return {"goal_id": str(uuid.uuid4()), "description": text}

    refused = {
        "$.declared_goal.description": {"declared_goal": goal(f"Close it with {SECRET}")},
        "$.reasoning_basis.description": {"reasoning_basis": {"type": "RULE_BASED", "description": f"use {TOKEN}"}},
        "$.metadata.[REDACTED]": {"metadata": {zw: "the key as a key"}},
        "$.declared_goal.description ": {"declared_goal": goal(f"Close it with {wide}")},
    }
    step = 0
    with capture_logs_with_context() as logs:
        async with gateway_and_client(nats_server, config) as (gw, nc):
            js = nc.jetstream()
            ids = []
            for path, over in refused.items():
                step += 1
                rec = idp(so_id=so, mandate_id=jti, step=step, action="CloseBooking", **over)
                ids.append(rec["idp_id"])
                res = await request(nc, "bot", {"mandate": token, "idp": rec})
                assert isinstance(res, Reject) and res.error_code == "IDP_MALFORMED", res
                assert [d.path for d in res.details] == [path.strip()] and {d.rule for d in res.details} == {"secret"}
            step += 1
            rec = idp(so_id=so, mandate_id=jti, step=step, action="CloseBooking")
            res = await request(nc, "bot", {"mandate": token, "idp": rec, "resource": f'Booking::"{SECRET}"'})
            assert isinstance(res, Reject) and res.error_code == "REQUEST_MALFORMED", res
            assert [d.path for d in res.details] == ["resource"]
            ids.append(rec["idp_id"])
            # -- a permitted step, then its report with the token in the action and the secret in the ref
            step += 1
            gap = idp(so_id=so, mandate_id=jti, step=step, action="CloseBooking")
            assert isinstance(await request(nc, "bot", {"mandate": token, "idp": gap}), Permit)
            report = {"idp_id": gap["idp_id"], "executed_action": f"CloseBooking {TOKEN}",
                      "effect": {"type": "booking.close", "status": "confirmed", "external_ref": f"ref {SECRET}"}}
            await js.publish("pgw.agent.bot.transition", json.dumps(report).encode(),
                             headers={"Nats-Msg-Id": f"bot:{gap['idp_id']}"})
            # -- a permitted step whose report the kernel fails to record on every delivery
            kernel = next(p for p in gw.parts if isinstance(p, KernelService))
            step += 1
            lost = idp(so_id=so, mandate_id=jti, step=step, action="ReadBooking", session="s-2")
            assert isinstance(await request(nc, "bot", {"mandate": token, "idp": lost}), Permit)
            handle = kernel.handle_transition

            async def failing(agent: str, data: bytes, msg_seq: int, **kw: Any) -> str:
                if lost["idp_id"].encode() in data:
                    raise RuntimeError("injected fault")
                return await handle(agent, data, msg_seq, **kw)

            kernel.handle_transition = failing  # type: ignore[method-assign]
            lost_report = {"idp_id": lost["idp_id"], "executed_action": "ReadBooking",
                           "effect": {"type": "booking.read", "status": "confirmed", "external_ref": SECRET}}
            lack = await js.publish("pgw.agent.bot.transition", json.dumps(lost_report).encode(),
                                    headers={"Nats-Msg-Id": f"bot:{lost['idp_id']}"})

            async def settled() -> bool:  # the gap recorded and the lost report dead-lettered: both erased
                return (await js.stream_info("PGW_INBOUND")).state.messages == 0 and \
                    (await js.stream_info("PGW_DEADLETTER")).state.messages == 1

            await until(settled, timeout=20, what="both reports settled and erased from PGW_INBOUND")
            events = await read_log(js)
            assert not [e for _, e in events if e.body.get("idp_id") in ids], "a refused IDP was committed"
            [(_, st)] = [(s, e) for s, e in events if e.event_type == "STATE_TRANSITIONED"]
            assert st.body["executed_action"] == "CloseBooking [REDACTED]"
            assert st.body["effect"]["external_ref"] == "ref [REDACTED]"
            [(_, ver)] = [(s, e) for s, e in events if e.event_type == "IDP_COMMITMENT_GAP"]
            assert ver.body["record"]["executed_action"] == "CloseBooking [REDACTED]"
            dl = json.loads((await js.get_msg("PGW_DEADLETTER", 1)).data)
            assert (dl["consumer"], dl["idp_id"], dl["stream_seq"]) == ("pgw-kernel", lost["idp_id"], lack.seq)

            async def failed() -> list[Any] | None:
                return [v for v in await read_verdicts(js, "engine_failure") if v.idp_id == lost["idp_id"]] or None

            [v] = await until(failed, timeout=10, what="the lost report's engine_failure verdict")
            assert v.action_type == "idp.transition"
    await gone_after_restart(nats_server, tmp_path, logs, (SECRET, TOKEN_BODY))


async def test_a_gated_actions_secret_arguments_are_erased_once_it_is_done(tmp_path, nats_server, make_config) -> None:
    """Arguments of a gated action that hold a configured secret reach the executor as sent, but the kernel's
    open-dispatch record (``PGW_KERNEL_GATE``, a KV bucket that cannot erase) only ever holds them redacted;
    as sent they wait in an erasable stream and are erased once the step is done: run at once, approved by the
    principal (read back by sequence for the dispatch), or rejected by her. After a clean shutdown and a
    restart the secret is in no file under the server's store and no log line (gateway/kernel/gate_args.py)."""
    from subjects.client import Agent
    from subjects.gate import ActDone, idempotency_key
    from subjects.idp import HemPending
    from subjects.wire import ActionResult, OptionChoice
    from tests.kernel_support import Issuer, running_gateway
    from tests.test_gate import AGENT, PRINCIPAL, GateEnv, NotesExecutor, gate_config
    from tests.test_gate import SECRET as GATE_SECRET
    from tests.test_kernel_hem import LogWatch, _moment

    nc = await connect(nats_server.client_url, name="test")
    issuer = Issuer(tmp_path / "issuer")
    watch = LogWatch()
    await watch.start(nc)
    notes = NotesExecutor(nc)
    with capture_logs_with_context() as logs:
        try:
            async with notes.ex, running_gateway(gate_config(make_config, issuer, tmp_path), nc) as gw:
                env = GateEnv(nc, gw, issuer, watch, notes)
                kv = await env.js.key_value("PGW_KERNEL_GATE")
                # -- permitted: runs at once with the secret, as sent
                r = await env.act("WriteNote", {"name": "now", "text": f"the key {GATE_SECRET}"})
                assert isinstance(r, ActDone) and notes.notes["now"] == f"the key {GATE_SECRET}"
                agent = Agent(nc, AGENT)
                try:
                    for name, choice in (("asked", 0), ("refused", 1)):
                        rec = env.idp("WriteNote", hem_urgency="REQUIRED")
                        held = await env.act("WriteNote", {"name": name, "text": f"{name} {GATE_SECRET}"}, rec)
                        assert isinstance(held, HemPending)
                        stored = json.loads((await kv.get(idempotency_key(env.so, rec["idp_id"]))).value)
                        assert GATE_SECRET not in json.dumps(stored) and stored["arguments_seq"] > 0
                        assert stored["arguments"]["text"] == f"{name} [REDACTED]"
                        item = await _moment(Surface(nc, PRINCIPAL), rec["idp_id"])
                        await Surface(nc, PRINCIPAL).resolve(item.moment_id, OptionChoice(index=choice))

                        async def result(idp_id: str = rec["idp_id"]) -> ActionResult:
                            async for o in agent.outcomes():
                                if isinstance(o, ActionResult) and o.idp_id == idp_id:
                                    return o
                            raise AssertionError("outcomes ended")

                        out = await asyncio.wait_for(result(), 15)
                        assert out.status == ("confirmed" if choice == 0 else "not_run"), out
                finally:
                    await agent.close()
                # approved: read back by its sequence and sent as sent; refused: never sent
                assert notes.notes == {"now": f"the key {GATE_SECRET}", "asked": f"asked {GATE_SECRET}"}

                async def closed() -> bool:  # every open dispatch finished, so its arguments erased
                    return not await live_keys(env.js, kv, "PGW_KERNEL_GATE")

                await until(closed, timeout=15, what="every open dispatch closed")
        finally:
            await nc.drain()
    await gone_after_restart(nats_server, tmp_path, logs, (GATE_SECRET,))


async def test_headers_duplicate_members_nested_encodings_and_revocations_keep_no_secret(
        tmp_path, nats_server, make_config) -> None:
    """What a hostile agent (and an operator's slip) can put beside a body, found by an attack from the docs:
    a ``traceparent`` that is not W3C or whose trace id is a configured secret (on an envelope, an IDP request,
    a report and a principal's answer), a secret in any other header or in the ``Nats-Msg-Id``, a JSON member
    given twice (the parsed value clean, the bytes not; also with the secret: token disguised by an escaped
    full-width letter), a secret of digits sent as a number, base64 of base64,
    hex of base64 and white-space-broken base64 and hex of the secret in an IDP, and mandate revocations whose
    reason holds the secret (plainly, as a spaced hex dump). Each is refused, dropped or erased; after a
    clean shutdown and a restart no secret is in any file under the server's store or in any log line."""
    from gateway.kernel.revocation import sign_revocation
    from subjects.idp import Permit, Reject
    from subjects.kernelops import revoke_subject
    from tests.kernel_support import Issuer, idp, policy_dir, request

    hexsecret = "a1b2c3d4e5f60718293a4b5c6d7e8f90"  # a configured secret shaped like a trace id
    digits = "904417358261"  # a configured secret of digits, sent as a JSON number
    issuer = Issuer(tmp_path / "issuer")
    config = make_config(pipeline={"secrets": {"values": [SECRET, hexsecret, digits]}},
                         kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path))})
    bad_tp = f"00-{SECRET}-x-01"
    hex_tp = f"00-{hexsecret}-00f067aa0ba902b7-01"
    b64 = base64.b64encode
    with capture_logs_with_context() as logs:
        async with gateway_and_client(nats_server, config) as (_, nc):
            js = nc.jetstream()
            sent = 0
            for i, (headers, body) in enumerate((
                ({"traceparent": bad_tp}, None),
                ({"traceparent": hex_tp}, None),
                ({"X-Leak": SECRET}, None),
                ({f"X-{SECRET}": "1"}, None),
                ({"Pgw-Principal": TOKEN}, None),
                ({}, "msgid"),
                ({}, "duplicate"),
                ({}, "disguised duplicate"),
                ({}, "number"),
            )):
                eid = f"hdr-{i}"
                env = envelope("ai.generation", {"text": "nothing to see"}, envelope_id=eid)
                raw = json.dumps(env).encode()
                msg_id = f"bot:{eid}"
                if body == "msgid":
                    msg_id = f"bot:{eid}:{TOKEN}"
                if body == "duplicate":  # nodeId twice: a parser keeps the last, the bytes keep both
                    raw = raw[:-1] + f', "nodeId": "{SECRET}", "nodeId": "node-clean"}}'.encode()
                if body == "disguised duplicate":  # the same, the token's "s" a full-width letter as an escape
                    raw = raw[:-1] + f', "nodeId": "\\uff53ecret:{TOKEN_BODY}", "nodeId": "node-clean"}}'.encode()
                if body == "number":
                    raw = json.dumps({**env, "meta": {**env["meta"], "acme": {"acct": int(digits)}}}).encode()
                await js.publish("pgw.agent.bot.envelope", raw, headers={"Nats-Msg-Id": msg_id, **headers})
                sent += 1
            # -- the kernel: IDP requests with a hostile traceparent (permitted) and nested encodings (refused)
            so = str(uuid.uuid4())
            token, jti = issuer.mandate(agent="bot", so_id=so)
            rec = idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")
            msg = await nc.request("pgw.agent.bot.idp", json.dumps({"mandate": token, "idp": rec}).encode(),
                                   headers={"traceparent": hex_tp}, timeout=10)
            assert b'"PERMIT"' in msg.data
            once = b64(SECRET.encode()).decode()
            for step, meta in enumerate((b64(once.encode()).decode(), once.encode().hex(), int(digits),
                                         f"{once[:8]} {once[8:]}", " ".join(f"{c:02x}" for c in SECRET.encode())),
                                        start=2):
                nested = idp(so_id=so, mandate_id=jti, step=step, action="CloseBooking", metadata={"note": meta})
                res = await request(nc, "bot", {"mandate": token, "idp": nested})
                assert isinstance(res, Reject) and [d.rule for d in res.details] == ["secret"], res
            report = {"idp_id": rec["idp_id"], "executed_action": "CloseBooking",
                      "effect": {"type": "booking.close", "status": "confirmed"}}
            await js.publish("pgw.agent.bot.transition", json.dumps(report).encode(),
                             headers={"Nats-Msg-Id": f"bot:{rec['idp_id']}", "traceparent": bad_tp, "X-Leak": SECRET})
            sent += 1
            # -- a principal's answer to no moment, with a hostile traceparent (refused, and logged)
            await nc.request("pgw.principal.alice.resolve", b'{"moment_id": "nope", "resolution": {"kind": "deny"}}',
                             headers={"traceparent": bad_tp}, timeout=10)
            # -- a revocation whose reason holds the secret: refused, nothing logged
            for reason in (f"leaked {SECRET}", " ".join(f"{c:02x}" for c in SECRET.encode())):
                rev = sign_revocation(issuer.key, issuer.kid, jti, reason=reason)
                reply = json.loads((await nc.request(revoke_subject("pgw"), json.dumps({"token": rev}).encode(),
                                                     timeout=10)).data)
                assert reply["ok"] is False and reply["refusal"]["code"] == "REVOCATION_INVALID", reply
            assert isinstance(await request(nc, "bot", {"mandate": token, "idp": idp(
                so_id=so, mandate_id=jti, step=9, action="CloseBooking")}), Permit)  # not revoked

            async def settled() -> bool:  # every message held a secret: each erased once recorded
                info = await js.stream_info("PGW_INBOUND")
                return info.state.messages == 0 and info.state.last_seq == sent

            await until(settled, timeout=20, what="every hostile message erased from PGW_INBOUND")
    spaced = base64.b64encode(SECRET.encode()).decode()
    await gone_after_restart(nats_server, tmp_path, logs,
                             (SECRET, TOKEN_BODY, hexsecret, digits, spaced[8:], SECRET.encode().hex()[:24]))


async def test_a_disguised_token_in_a_member_given_twice_is_erased_with_no_configured_secret(
        tmp_path, nats_server, make_config) -> None:
    """A gateway with no configured secret (the default): an agent's envelope whose first ``nodeId`` holds a secret:
    token with its "s" an escaped full-width letter, and whose second ``nodeId`` is clean (the parser keeps that one),
    is erased from PGW_INBOUND once answered; after a clean shutdown and a restart the token is in no file or log."""
    config = make_config()
    with capture_logs_with_context() as logs:
        async with gateway_and_client(nats_server, config) as (_, nc), acks(nc, "PGW_INBOUND", INBOUND_DURABLE) as acked:
            js = nc.jetstream()
            env = envelope("ai.generation", {"text": "nothing to see"}, envelope_id="disguised-twice")
            raw = json.dumps(env).encode()[:-1]
            raw += f', "nodeId": "\\uff53ecret:{TOKEN_BODY}", "nodeId": "node-clean"}}'.encode()
            await js.publish("pgw.agent.bot.envelope", raw, headers={"Nats-Msg-Id": "bot:disguised-twice"})
            await acked(1, timeout=20)  # answered and settled at rest
            info = await js.stream_info("PGW_INBOUND")
            assert (info.state.messages, info.state.last_seq) == (0, 1)  # erased
    await gone_after_restart(nats_server, tmp_path, logs, (TOKEN_BODY,))


async def test_with_no_configured_secret_a_clean_turn_stays_and_each_form_the_scan_refuses_is_erased(
        tmp_path, nats_server, make_config) -> None:
    """The default gateway (no configured secret) judges most turns by one scan of their bytes
    (``Redactor.bytes_plainly_clean``). Through the bus: a clean moment stays in PGW_INBOUND byte for byte;
    a token in mixed case, a token split by an escaped backspace (JSON ``\\b``, which the surface drops) and
    one split by a raw BEL (not JSON: read as text) each take the full read, and are erased with their
    redacted copies kept; after a restart the token is in no file or log."""
    from pgwcore.streams import INBOUND_REDACTED_BUCKET
    from tests.pipeline_helpers import moment_env

    config = make_config()
    clean = json.dumps(moment_env("alice", good_moment(), envelope_id="clean-1")).encode()
    plain = json.dumps(envelope("ai.generation", {"text": f"the key SeCrEt:{TOKEN_BODY} here"},
                                envelope_id="mixed-case")).encode()
    escaped = json.dumps(envelope("ai.generation", {"text": "X"}, envelope_id="escaped-bs")).encode().replace(
        b'"X"', f'"the key sec\\bret:{TOKEN_BODY} here"'.encode())
    raw_bel = b'{"type": "ai.generation", "payload": {"text": "sec\x07ret:' + TOKEN_BODY.encode() + b'"}}'
    with capture_logs_with_context() as logs:
        async with gateway_and_client(nats_server, config) as (_, nc), acks(nc, "PGW_INBOUND", INBOUND_DURABLE) as acked:
            js = nc.jetstream()
            for i, body in enumerate((clean, plain, escaped, raw_bel)):
                await js.publish("pgw.agent.bot.envelope", body, headers={"Nats-Msg-Id": f"bot:scan-{i}"})
            await acked(4, timeout=20)  # every turn answered and settled at rest
            info = await js.stream_info("PGW_INBOUND")
            assert (info.state.messages, info.state.last_seq) == (1, 4)  # the three holding a token erased
            kept = await js.get_msg("PGW_INBOUND", 1)
            assert kept.data == clean  # judged clean by the scan: as sent
            copies = await arrived(js, f"KV_{INBOUND_REDACTED_BUCKET}", 3, timeout=20)
            assert sorted(c.subject.rsplit(".", 1)[-1] for c in copies) == ["2", "3", "4"]
            assert all(TOKEN_BODY.encode() not in c.data for c in copies)
    await gone_after_restart(nats_server, tmp_path, logs, (TOKEN_BODY,))


async def test_an_escaped_token_in_a_body_no_parser_reads_is_erased_and_text_not_ascii_stays(
        tmp_path, nats_server, make_config) -> None:
    """The default gateway (no configured secret), through the bus. A moment written in French and Russian is
    judged clean by the scan of its text (``_clean_text_json``) and stays in PGW_INBOUND byte for byte. A
    token whose "s" is a JSON escape, in a body deeper than any parser reads and in one with a byte that is not
    UTF-8, is read with its escapes decoded, erased, and kept redacted (the third docs-only attack of the ninth
    session: both stayed as sent); after a restart the token is in no file or log."""
    from pgwcore.streams import INBOUND_REDACTED_BUCKET
    from tests.pipeline_helpers import Recorder, moment_env

    config = make_config()
    moment = good_moment()
    moment["findings"] = ["Le cabinet Harbor veut le grand livre complet, pas seulement le r\u00e9sum\u00e9.",
                          "\u0411\u0443\u0445\u0433\u0430\u043b\u0442\u0435\u0440 \u0445\u043e\u0447\u0435\u0442 \u0432\u0441\u0451."]
    clean = json.dumps(moment_env("alice", moment, envelope_id="text-1"), ensure_ascii=False).encode()
    token = f'"\\u0073ecret:{TOKEN_BODY}"'.encode()
    deep = b'{"type": "ai.generation", "note": ' + token + b', "deep": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    not_utf8 = b'{"type": "ai.generation", "note": ' + token + b', "x": "caf\xe9"}'
    long_s = dict(moment, findings=[f"Le r\u00e9sum\u00e9 suffit: \u017fecret:{TOKEN_BODY}", *moment["findings"]])
    long_s_body = json.dumps(moment_env("alice", long_s, envelope_id="text-2"), ensure_ascii=False).encode()
    with capture_logs_with_context() as logs:
        async with gateway_and_client(nats_server, config) as (_, nc), acks(nc, "PGW_INBOUND", INBOUND_DURABLE) as acked, \
                Recorder(nc) as rec:
            js = nc.jetstream()
            for msg_id, body in (("bot:text-1", clean), ("bot:esc-1", deep), ("bot:esc-2", not_utf8),
                                 ("bot:text-2", long_s_body)):
                await js.publish("pgw.agent.bot.envelope", body, headers={"Nats-Msg-Id": msg_id})
            await acked(4, timeout=20)
            info = await js.stream_info("PGW_INBOUND")
            assert (info.state.messages, info.state.last_seq) == (1, 4)  # the three holding a token erased
            assert (await js.get_msg("PGW_INBOUND", 1)).data == clean
            copies = await arrived(js, f"KV_{INBOUND_REDACTED_BUCKET}", 3, timeout=20)
            assert sorted(c.subject.rsplit(".", 1)[-1] for c in copies) == ["2", "3", "4"]
            # A token written with a long s ("\u017f", which UTS #39 draws as "f") reaches the principal redacted.
            assert (await rec.outcome("text-2")).status == "accepted"
            item = await rec.item(lambda i: getattr(i, "envelope_id", None) == "text-2")
            assert TOKEN_BODY not in str(item.binding_moment.findings) and "[REDACTED]" in item.binding_moment.findings[0]
            assert all(TOKEN_BODY.encode() not in raw for raw in rec.raw)
            assert all(TOKEN_BODY.encode() not in c.data and b"[REDACTED]" in c.data for c in copies)
    await gone_after_restart(nats_server, tmp_path, logs, (TOKEN_BODY,))


async def test_a_token_in_a_header_line_the_parse_does_not_keep_is_erased(tmp_path, nats_server, make_config) -> None:
    """Header lines as an agent may write them on the wire (a raw HPUB, which nats-py's publish would refuse):
    a line ``secret:...`` (parsed as a name and a value), a name that is not ASCII, the first of two equal names,
    a name with a space. Each message is erased once answered, though the parse kept no header holding the
    token (the third docs-only attack of the ninth session); a message with clean headers stays."""
    from tests.pipeline_helpers import moment_env

    config = make_config()
    lines = [b"secret:" + TOKEN_BODY.encode(), "X-Not\u00e9: secret:".encode() + TOKEN_BODY.encode(),
             b"X-Note: secret:" + TOKEN_BODY.encode() + b"\r\nX-Note: fine", b"X Note: secret:" + TOKEN_BODY.encode(),
             b"X-Note: fine"]
    with capture_logs_with_context() as logs:
        async with gateway_and_client(nats_server, config) as (_, nc), acks(nc, "PGW_INBOUND", INBOUND_DURABLE) as acked:
            js = nc.jetstream()
            for i, line in enumerate(lines):
                body = json.dumps(moment_env("alice", good_moment(), envelope_id=f"hdr-{i}")).encode()
                hdr = b"NATS/1.0\r\nNats-Msg-Id: bot:hdr-" + str(i).encode() + b"\r\n" + line + b"\r\n\r\n"
                await nc._send_command(b"HPUB pgw.agent.bot.envelope %d %d\r\n" % (len(hdr), len(hdr) + len(body))
                                       + hdr + body + b"\r\n")
            await nc.flush()
            await acked(len(lines), timeout=30)
            info = await js.stream_info("PGW_INBOUND")
            assert (info.state.messages, info.state.last_seq) == (1, len(lines)), info.state  # four erased
            kept = await js.get_msg("PGW_INBOUND", len(lines))  # the one with clean headers, as sent
            assert (kept.headers or {}).get("X-Note") == "fine", kept.headers
    await gone_after_restart(nats_server, tmp_path, logs, (TOKEN_BODY,))


async def test_a_secret_in_a_gated_calls_folder_or_tool_is_offered_no_standing_approval(
        tmp_path, nats_server, make_config) -> None:
    """Found by an attack from the docs: an agent speaking the bus put a configured secret in the folder of a
    gated write's path, or in its tool's name. The card redacted it, but the standing-approval options built
    from the same folder and tool did not: the option text she read (PGW_SURFACE, the moments bucket), the offer
    in ``HEM_ESCALATED`` and ``APPROVAL_SCOPE_GRANTED`` (the event log, kept for good), the open dispatch and the
    scope's key all held it. Such a call is now offered Approve and Deny only, asked each time; after a clean
    shutdown and a restart the secret is in no file under the server's store and no log line."""
    from tests.kernel_support import Issuer, policy_dir, read_log, running_gateway
    from tests.test_gate_scopes import AGENT, ALLOW, POLICY, PRINCIPAL, Env, Files
    from tests.test_kernel_hem import _moment


    nc = await connect(nats_server.client_url, name="test")
    issuer = Issuer(tmp_path / "issuer")
    # Its results do not repeat the path: an executor's results are its own to keep (docs/security.md "What
    # this does not cover"); this test is about what the kernel keeps.
    files = Files(nc, echo=False)
    cfg = make_config(
        kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path, POLICY)),
                "executors": {"files": {"actions": ["WriteFile"], "timeout_s": 2.0}}, "gate_sweep_s": 0},
        agents={AGENT: {"principals": [PRINCIPAL]}},
        pipeline={"secrets": {"values": [SECRET]}},
    )
    with capture_logs_with_context() as logs:
        try:
            async with files.ex, running_gateway(cfg, nc) as gw:
                env = Env(nc, gw, issuer, files)
                asked = []
                for path, tool in ((f"/notes/dir_{SECRET}/s1.txt", "write_file"), ("/notes/s2.txt", f"wr_{SECRET}")):
                    args = {"tool": tool, "arguments": {"path": path, "content": "v"}}
                    rec, r = await env.act(AGENT, args, "s-1", hem_urgency="REQUIRED")
                    assert type(r).__name__ == "HemPending", r
                    item = await _moment(env.surface, rec["idp_id"])
                    labels = [o.label for o in item.binding_moment.question.options]
                    assert labels == ["Approve", "Deny"], labels
                    assert SECRET not in json.dumps(msgspec.to_builtins(item))
                    assert (await env.surface.choose(item, ALLOW)).status == "accepted"
                    asked.append(rec["idp_id"])

                async def ran() -> bool:
                    return files.calls == 2

                await until(ran, timeout=15, what="both approved calls")
                # The same folder again is asked again: nothing was granted.
                _, again = await env.act(AGENT, {"tool": "write_file", "arguments": {
                    "path": f"/notes/dir_{SECRET}/s3.txt", "content": "v"}}, "s-1")
                assert type(again).__name__ == "EnrichedDeny" and again.hem_available, again
                assert await read_log(env.js, "APPROVAL_SCOPE_GRANTED") == []
                kv = await env.js.key_value("PGW_KERNEL_GATE")

                async def closed() -> bool:
                    return not await live_keys(env.js, kv, "PGW_KERNEL_GATE")

                await until(closed, timeout=15, what="every open dispatch closed")
        finally:
            await nc.drain()
    await gone_after_restart(nats_server, tmp_path, logs, (SECRET,))
