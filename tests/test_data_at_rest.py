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
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import sys
from email import policy
from email.parser import BytesParser
from pathlib import Path
from typing import Any

import aiohttp
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import get_default_environment, stdio_client

from consumers.notify.service import Notifier
from consumers.slack.service import SlackSurface
from gateway.app import Gateway
from pgwcore.connect import connect
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
    await nats_server.stop()  # a clean shutdown, then the store read again at a start, and shut down again
    await nats_server.start()
    await nats_server.stop()
    files = every_file(tmp_path)
    logged = json.dumps([dict(e) for e in logs], default=str).encode()
    found = {}
    for needle in (SECRET, TOKEN_BODY, *WORDS, *(hashlib.sha256(t.encode()).hexdigest() for t in texts.values())):
        hits = where(files, needle.encode(), tmp_path) + (["logs"] if needle.encode() in logged else [])
        if hits:
            found[needle] = hits
    assert not found, f"found at rest: {found}"
    # Each answer is kept as its keyed digest, and only where docs/contract.md says: the forgotten record
    # (PGW_MOMENTS) and, for a free text or an objection, the verdict's text_digest (PGW_VERDICTS).
    key_dir = tmp_path / "data" / "keys" / "digest"
    for m, text in texts.items():
        hits = where(files, keyed(key_dir, text).encode(), tmp_path)
        streams = {h.split("/streams/")[1].split("/")[0] for h in hits if "/streams/" in h}
        assert len(streams) == len(hits) and streams <= {"PGW_VERDICTS", "KV_PGW_MOMENTS"}, (text, hits)
        assert "KV_PGW_MOMENTS" in streams and ("PGW_VERDICTS" in streams) == (m != m_clar), (text, hits)
