"""Answering from the e-mail (consumers/notify/answers.py): real gateway, nats-server, notifier and aiosmtpd.

Every mail here is the real message aiosmtpd received, parsed with
``email.parser``; every link in it is fetched with GET as a mail scanner
would, and the moment must still wait afterwards; only the confirmation
page's POST answers, once.
"""

from __future__ import annotations

import contextlib
import html.parser
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from email import policy
from email.message import EmailMessage
from email.parser import BytesParser
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats.errors as nats_errors
import pytest

from consumers.notify.answers import (
    USED_BUCKET,
    AnswerKeyError,
    Claims,
    TokenRefused,
    Tokens,
    load_answer_key,
)
from consumers.notify.service import Notifier
from consumers.surfaces.model import plan_item
from gateway.app import Gateway
from pgwcore.config import Config
from pgwcore.connect import connect
from subjects.client import Agent, Surface
from subjects.wire import ClarificationAnswers, DialogueVeto, FreeTextAnswer, OptionChoice
from tests.moments import good_moment
from tests.notify_peers import Relay, smtp_server
from tests.polling import until

KEY = "answer-link-test-key-0123456789abcdefghij"


@dataclass
class Bed:
    config: Config
    relay: Relay
    notifier: Notifier
    agent: Agent
    nc: Any

    async def mail(self, n: int = 1) -> EmailMessage:
        """The ``n``-th mail aiosmtpd received, parsed from its raw bytes."""
        async def arrived() -> bool:
            return len(self.relay.box.envelopes) >= n

        await until(arrived, timeout=15, what=f"{n} mail(s) at the relay")
        raw = self.relay.box.envelopes[n - 1].original_content
        return BytesParser(policy=policy.default).parsebytes(raw)  # type: ignore[return-value]

    async def moment(self, moment: dict[str, Any] | None = None, principal: str = "alice", **kw: Any) -> str:
        eid = await self.agent.send_moment(principal, moment or good_moment(), expires_in_s=600, **kw)
        out = await self.agent.outcome_for(eid, timeout=10)
        assert out.status == "accepted", (out.code, out.reason)
        return out.moment_id  # type: ignore[return-value]

    async def pending_ids(self, principal: str = "alice") -> list[str]:
        return [getattr(i, "moment_id", "") for i in await Surface(self.nc, principal, presence=False).pending()]


@contextlib.asynccontextmanager
async def running(tmp_path: Path, make_config, nats_server, nc, monkeypatch, *, pipeline: dict[str, Any] | None = None,
                  kernel: dict[str, Any] | None = None, **alice: Any) -> AsyncIterator[Bed]:
    monkeypatch.setenv("PGW_ANSWER_KEY", KEY)
    with smtp_server(tmp_path) as relay:
        mail = {"web_push": False, "answer_by_email": True}
        settings = {
            "presence_grace_s": 0, "answer_port": 0,
            "smtp": {"host": relay.host, "port": relay.port, "credentials_file": str(relay.credentials_file),
                     "ca_file": str(relay.ca_file), "from_addr": "pgw@pgw.example"},
            "principals": {"alice": {"email": "alice@example.com", **mail, **alice},
                           "bob": {"email": "bob@example.com", **mail}},
        }
        overrides: dict[str, Any] = {"notifier": settings,
                                     "agents": {"planner": {"principals": ["alice", "bob"]}}}
        if pipeline:
            overrides["pipeline"] = pipeline
        if kernel:
            overrides["kernel"] = kernel
        config = make_config(**overrides)
        gw_nc = await connect(nats_server.client_url, name="gateway")
        n_nc = await connect(nats_server.client_url, name="notifier")
        try:
            async with Gateway(config, gw_nc), Notifier(config, n_nc) as notifier:
                bed = Bed(config, relay, notifier, Agent(nc, "planner"), nc)
                try:
                    yield bed
                finally:
                    await bed.agent.close()
        finally:
            await gw_nc.drain()
            await n_nc.drain()


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.hrefs += [v for k, v in attrs if k == "href" and v]


def parts(mail: EmailMessage) -> tuple[str, str]:
    text = mail.get_body(("plain",))
    htm = mail.get_body(("html",))
    assert text is not None and htm is not None, "a text part and an HTML part"
    return text.get_content(), htm.get_content()


def every_link(mail: EmailMessage) -> list[str]:
    """Every URL of both parts (the HTML's hrefs, any http(s) URL of the text)."""
    text, htm = parts(mail)
    p = _Links()
    p.feed(htm)
    return sorted(set(p.hrefs) | set(re.findall(r"https?://\S+", text)))


def answer_links(mail: EmailMessage) -> dict[str, str]:
    """The answer links by the answer they carry (o0.., free_text, dialogue, answers)."""
    return {u.split("?")[0].rsplit("/", 1)[-1]: u for u in every_link(mail) if "/answer/" in u}


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url, allow_redirects=False) as r:
        return r.status, await r.text()


async def post(url: str, data: dict[str, str] | None = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.post(url, data=data or {}, allow_redirects=False) as r:
        return r.status, await r.text()


async def test_every_link_fetched_answers_nothing_then_one_post_answers_once(
        tmp_path, make_config, nats_server, nc, monkeypatch) -> None:
    """GET on every link of the real mail answers nothing; the confirmation POST answers once (the agent gets it, the other surfaces get withdrawn); a second POST is refused."""
    async with running(tmp_path, make_config, nats_server, nc, monkeypatch) as bed:
        mid = await bed.moment()
        mail = await bed.mail()
        links = answer_links(mail)
        assert sorted(links) == ["dialogue", "free_text", "o0", "o1", "o2"], "one link per option and per open hatch"
        every = every_link(mail)
        assert set(links.values()) < set(every), "the surface link is there too"
        for url in every:  # what a mail scanner or a link preview does
            if url in links.values():
                status, _ = await get(url)
                assert status == 200, url
            else:  # the surface's own link (no web surface runs here): fetched all the same
                with contextlib.suppress(aiohttp.ClientError):
                    await get(url)
        status, page = await get(links["o1"])
        assert status == 200 and "Send this answer" in page and "Option 2: Send the full ledger" in page
        assert 'method="post"' in page and "Harbor requested the full ledger" in page, "the page shows the moment"
        assert mid in await bed.pending_ids(), "after every GET the moment still waits"

        withdrawn: list[Any] = []

        async def heard(m: Any) -> None:
            withdrawn.append(msgspec.json.decode(m.data))

        sub = await nc.subscribe("pgw.principal.alice.surface", cb=heard)
        status, page = await post(links["o1"])
        assert status == 200 and "Answer sent" in page
        res = await bed.agent.resolution_for(mid, timeout=10)
        assert res.resolution == OptionChoice(index=1) and res.principal == "alice"
        assert mid not in await bed.pending_ids()

        async def other_surfaces_told() -> bool:
            return any(w.get("item") == "withdrawn" and w.get("moment_id") == mid for w in withdrawn)

        await until(other_surfaces_told, timeout=10, what="withdrawn on alice's surface subject")
        await sub.unsubscribe()

        status, page = await post(links["o1"])
        assert status == 409 and 'data-code="used"' in page, "a link answers once"
        status, page = await post(links["o0"])
        assert status == 410 and 'data-code="gone"' in page, "the moment was answered: first answer wins"


async def test_single_use_survives_a_notifier_restart(tmp_path, make_config, nats_server, nc, monkeypatch) -> None:
    """A used link stays used for a second notifier instance (the used-token record lives in a KV bucket)."""
    async with running(tmp_path, make_config, nats_server, nc, monkeypatch) as bed:
        mid = await bed.moment()
        links = answer_links(await bed.mail())
        status, _ = await post(links["dialogue"], {"objection": ""})
        assert status == 200
        assert (await bed.agent.resolution_for(mid, timeout=10)).resolution == DialogueVeto()
        other = await connect(nats_server.client_url, name="notifier-2")
        try:
            async with Notifier(bed.config, other) as second:
                url2 = links["dialogue"].replace(f":{bed.notifier.answers.port}/", f":{second.answers.port}/")
                status, page = await post(url2, {"objection": "again"})
                assert status == 409 and 'data-code="used"' in page
        finally:
            await other.drain()
        kv = await nc.jetstream().key_value(USED_BUCKET)
        assert (await kv.status()).values == 1


async def test_forged_expired_and_foreign_tokens_are_refused(tmp_path, make_config, nats_server, nc, monkeypatch) -> None:
    """A token changed by a byte, signed with another key, expired, another principal's (pasted into this URL), or for a principal who did not opt in answers nothing."""
    async with running(tmp_path, make_config, nats_server, nc, monkeypatch) as bed:
        mid = await bed.moment()
        url = answer_links(await bed.mail())["o0"]
        base, token = url.split("?t=")
        body, mac = token.split(".")
        flipped = f"{base}?t={body}.{'A' if mac[0] != 'A' else 'B'}{mac[1:]}"
        other_key = Tokens(b"another-gateway-key-0123456789abcdef")
        now = int(time.time())
        cases = {
            "changed MAC": (flipped, 403, "forged"),
            "other key": (f"{base}?t={other_key.mint(Claims('alice', mid, 'o0', now + 600, 'ab' * 12))}", 403, "forged"),
            "no token": (base, 403, "forged"),
            "expired": (f"{base}?t={bed.notifier.answers.tokens.mint(Claims('alice', mid, 'o0', now - 1, 'cd' * 12))}",
                        410, "expired"),
        }
        bob_mid = await bed.moment(principal="bob")
        bob_url = answer_links(await bed.mail(2))["o0"]
        assert f"/answer/bob/{bob_mid}/o0" in bob_url
        carol = bed.notifier.answers.tokens.mint(Claims("carol", mid, "o0", now + 600, "ef" * 12))
        cases["a principal who did not opt in"] = (f"{base.replace('/alice/', '/carol/')}?t={carol}", 403, "not_enabled")
        cases["bob's token on alice's URL"] = (f"{base}?t={bob_url.split('?t=')[1]}", 403, "foreign")
        # bob's genuine token, with the path rewritten to alice's moment: refused, bound to bob and his moment
        cases["bob's URL aimed at alice"] = (bob_url.replace(f"/bob/{bob_mid}/", f"/alice/{mid}/"), 403, "foreign")
        for what, (u, code, why) in cases.items():
            for fetch in (get, post):
                status, page = await fetch(u)
                assert (status, f'data-code="{why}"' in page) == (code, True), (what, fetch.__name__, status)
                assert "Nothing was answered" in page
        assert mid in await bed.pending_ids("alice") and bob_mid in await bed.pending_ids("bob")


async def test_free_text_and_dialogue_links_open_forms(tmp_path, make_config, nats_server, nc, monkeypatch) -> None:
    """The free-text link opens a form whose POST answers in the principal's words; an empty answer is refused and leaves the link usable."""
    async with running(tmp_path, make_config, nats_server, nc, monkeypatch) as bed:
        mid = await bed.moment()
        links = answer_links(await bed.mail())
        status, page = await get(links["free_text"])
        assert status == 200 and '<textarea id="text" name="text"' in page and "required" in page
        status, page = await get(links["dialogue"])
        assert status == 200 and '<textarea id="objection" name="objection"' in page
        status, page = await post(links["free_text"], {"text": "   "})
        assert status == 400 and mid in await bed.pending_ids()
        status, page = await post(links["free_text"], {"text": "Send the summary and page 4 of the ledger."})
        assert status == 200 and "Answer sent" in page
        res = await bed.agent.resolution_for(mid, timeout=10)
        assert res.resolution == FreeTextAnswer(text="Send the summary and page 4 of the ledger.")


async def test_clarification_link_opens_a_form_per_question(tmp_path, make_config, nats_server, nc, monkeypatch) -> None:
    """A clarification mail has one link; its page asks each question and the POST answers them all."""
    from subjects.client import envelope

    async with running(tmp_path, make_config, nats_server, nc, monkeypatch) as bed:
        env = envelope("clarification.request", {"questions": [{"id": "year", "question": "Which year should I file?"}]})
        eid = await bed.agent.send(env, principal="alice")
        out = await bed.agent.outcome_for(eid, timeout=10)
        assert out.status == "accepted", (out.code, out.reason)
        links = answer_links(await bed.mail())
        assert list(links) == ["answers"]
        status, page = await get(links["answers"])
        assert status == 200 and "Which year should I file?" in page and 'name="q:year"' in page
        status, page = await post(links["answers"], {"q:year": "2025"})
        assert status == 200, page
        res = await bed.agent.resolution_for(out.moment_id, timeout=10)  # type: ignore[arg-type]
        assert res.resolution == ClarificationAnswers(answers={"year": "2025"})


async def test_the_mail_shows_the_whole_moment_under_the_invariants(
        tmp_path, make_config, nats_server, nc, monkeypatch) -> None:
    """Both parts carry the four briefing slots, every option with its reasoning, the recommendation marked but every option link alike, and no untrusted mark on trusted content."""
    async with running(tmp_path, make_config, nats_server, nc, monkeypatch) as bed:
        m = good_moment(recommended_idx=2)
        await bed.moment(m)
        mail = await bed.mail()
        text, htm = parts(mail)
        for part in (" ".join(text.split()), htm):  # the text part is wrapped at 76 columns
            for slot in (m["synopsis"], *m["findings"], *m["recommendations"], m["offer"], m["question"]["stem"]):
                assert slot in part or slot.replace("'", "&#x27;") in part, slot
            for o in m["question"]["options"]:
                assert o["label"] in part and o["reasoning"] in part
            assert "UNTRUSTED" not in part
            assert part.count("★ recommended") == 1
        assert re.search(r"Send nothing yet</b> <span class=\"recommended\"", htm), "the mark is on option 3"
        styles = set(re.findall(r'<a class="answer" href="[^"]+" style="([^"]+)"', htm))
        assert len(styles) == 1, "no option link is styled as the default"
        assert "checked" not in htm and "selected" not in htm
        assert mail["Message-ID"] and mail["Auto-Submitted"] == "auto-generated"


async def test_the_mail_never_carries_a_redacted_secret(tmp_path, make_config, nats_server, nc, monkeypatch) -> None:
    """Redaction holds in the mail and on the page: the secret planted in the moment is in neither, nor in the notifier's job."""
    secret = "NYX-deploy-Key-4471-Quartz"
    m = good_moment()
    m["synopsis"] = f"Rotate the deploy key {secret} before Harbor Accounting uses it."
    m["findings"][0] = f"The key {secret} was pasted in a ticket."
    m["question"]["options"][1]["reasoning"] = f"Keeps {secret} working for now."
    async with running(tmp_path, make_config, nats_server, nc, monkeypatch, pipeline={"secrets": {"values": [secret]}}) as bed:
        await bed.moment(m)
        mail = await bed.mail()
        raw = bed.relay.box.envelopes[0].original_content.decode("utf-8", "replace")
        text, htm = parts(mail)
        _, page = await get(answer_links(mail)["o0"])
        for where in (raw, text, htm, page):
            assert secret not in where and "4471-Quartz" not in where
        assert "Rotate the deploy key" in text and "Harbor Accounting" in htm
        jobs = [j for k in await bed.notifier.store.job_keys() if (j := await bed.notifier.store.get_job(k))]
        assert all(secret not in (j[0].surface_item or "") for j in jobs)


async def test_a_gateway_made_moment_says_who_recommends_and_shows_the_arguments_whole(
        tmp_path, make_config, nats_server, nc, monkeypatch) -> None:
    """The approval moment of a gated write (the kernel's, through the bus) is mailed saying the gateway asks and its
    policy recommends Deny (never the agent), with its four answers; a 5,000-character argument is previewed in the
    mail and shown whole on the page its link opens (a GET that answers nothing, a POST refused) and on every
    confirmation page; answering Allow for this session from the mail grants a standing approval."""
    from subjects.approvals import ApprovalsRequest, approvals_reply_decoder, approvals_subject
    from subjects.gate import act_result_decoder
    from subjects.idp import HemPending
    from tests.kernel_support import Issuer, idp, policy_dir
    from tests.test_gate_scopes import POLICY, Files

    issuer = Issuer(tmp_path / "issuer")
    files = Files(nc)
    kernel = {"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path, POLICY)),
              "executors": {"files": {"actions": ["WriteFile"], "timeout_s": 2.0}}, "gate_sweep_s": 0}
    path = "/home/alice/notes/long.txt"
    content = "".join(f"line {i:04d} of the long draft\n" for i in range(180)) + "THE LAST LINE"
    async with files.ex, running(tmp_path, make_config, nats_server, nc, monkeypatch, kernel=kernel) as bed:
        so = "6f1c2a9e-3b7d-4e5f-8a90-1b2c3d4e5f60"
        token, jti = issuer.mandate(agent="planner", so_id=so, principal="alice", actions=["WriteFile"])
        rec = idp(so_id=so, mandate_id=jti, step=1, action="WriteFile", hem_urgency="REQUIRED")
        body = {"mandate": token, "action": "WriteFile", "idp": rec,
                "arguments": {"tool": "write_file", "arguments": {"path": path, "content": content}}}
        reply = await nc.request("pgw.agent.planner.act", msgspec.json.encode(body), timeout=15)
        assert isinstance(act_result_decoder.decode(reply.data), HemPending)
        mail = await bed.mail()
        text, htm = parts(mail)
        for part in (" ".join(text.split()), htm):
            assert "The gateway asks your approval before agent planner acts." in part
            assert "asks your approval before it acts" not in part and "recommended by the agent" not in part
            assert part.count("★ recommended by the gateway&#x27;s policy" if part is htm
                              else "★ recommended by the gateway's policy") == 1
            assert "idp.hem" not in part and "THE LAST LINE" not in part, "the mail previews; the page shows whole"
        assert re.search(r"Deny</b> <span class=\"recommended\"", htm), "the mark is on Deny"
        links = answer_links(mail)
        assert sorted(links) == ["arguments", "dialogue", "free_text", "o0", "o1", "o2", "o3"]
        chars = f"{len(content) + len(path):,} characters"
        assert f"Show the arguments in full ({chars})</a>" in htm
        assert f"Show the arguments in full ({chars}): {links['arguments']}" in text
        assert "[w]" not in text, "no terminal key in a mail"
        status, page = await get(links["arguments"])
        assert status == 200 and "THE LAST LINE" in page and "line 0179 of the long draft" in page
        assert "<form" not in page, "the arguments page answers nothing"
        status, page = await post(links["arguments"])
        assert status == 409 and 'data-code="not_answerable"' in page
        status, page = await get(links["o2"])
        assert status == 200 and "Option 3: Allow for this session" in page and "THE LAST LINE" in page
        status, page = await post(links["o2"])
        assert status == 200 and "Answer sent" in page

        async def granted() -> list[Any]:
            msg = await nc.request(approvals_subject("pgw", "alice"), msgspec.json.encode(ApprovalsRequest(op="list")),
                                   timeout=10)
            return approvals_reply_decoder.decode(msg.data).approvals or []

        (standing,) = await until(granted, timeout=10, what="the standing approval granted from the mail")
        assert (standing.kind, standing.folder, standing.tool) == ("session", "/home/alice/notes", "write_file")


# -- units: the rendering of plans the gateway never sends whole -----------------------

def _item(**over: Any) -> dict[str, Any]:
    bm = good_moment()
    bm["question"].update(over)
    return {"item": "binding_moment", "agent": "planner", "principal": "alice", "created_at": "2026-01-01T00:00:00Z",
            "moment_id": "a" * 32, "envelope_id": "e", "correlation_id": "c", "expires_at": None,
            "untrusted": False, "hem": False, "binding_moment": bm}


def _mail_of(item: dict[str, Any], tmp_path: Path, monkeypatch) -> Any:
    from consumers.notify.answers import AnswerLinks
    from pgwcore.config import load_config

    monkeypatch.setenv("PGW_ANSWER_KEY", KEY)
    cfg = load_config(None, data_dir=str(tmp_path), notifier={"smtp": {"host": "127.0.0.1", "starttls": False},
                                                              "principals": {"alice": {"email": "a@example.com",
                                                                                       "answer_by_email": True}}})
    return AnswerLinks(cfg, None, None).mail("alice", msgspec.json.encode(item).decode(), None)  # type: ignore[arg-type]


def test_a_malformed_moment_is_mailed_as_a_notice_without_links(tmp_path, monkeypatch) -> None:
    """recommended_idx out of range: the mail is a notice with no answer link, never a partial decision."""
    out = _mail_of(_item(recommended_idx=7), tmp_path, monkeypatch)
    assert out.links == {}
    for part in (out.text, out.html):
        assert "NOTICE" in part and "recommended_idx 7" in part and "Choose option" not in part


def test_an_untrusted_item_carries_the_mark(tmp_path, monkeypatch) -> None:
    """An item marked untrusted is mailed with the UNTRUSTED mark in both parts (the gateway delivers no untrusted
    binding moment, spec 002 "Trust boundary"; a surface still marks any item that says it is untrusted)."""
    out = _mail_of({**_item(), "untrusted": True}, tmp_path, monkeypatch)
    for part in (out.text, out.html):
        assert "UNTRUSTED" in part


def test_a_closed_hatch_gets_no_link(tmp_path, monkeypatch) -> None:
    """Only hatches whose boolean is true get a link (spec 000 §9.1)."""
    out = _mail_of(_item(hatches={"free_text": False, "dialogue": True}), tmp_path, monkeypatch)
    assert sorted(out.links) == ["dialogue", "o0", "o1", "o2"]


def test_an_unknown_authorization_kind_renders_blocked() -> None:
    """The e-mail renderer shows an authorization item of unknown kind as BLOCKED, its content hidden (spec 001)."""
    from consumers.notify.answers import plan_html, plan_text

    item = {"item": "authorization", "agent": "planner", "principal": "alice", "created_at": "2026-01-01T00:00:00Z",
            "item_id": "b" * 32, "envelope_id": "e", "workflow_id": "w", "untrusted": False,
            "envelope": {"kind": "teleport", "secret_payload": "launch codes"}}
    plan = plan_item(item)
    for part in (plan_html(plan), plan_text(plan)):
        assert "BLOCKED" in part and "launch codes" not in part


def test_answer_key_never_from_toml_and_refused_when_short(tmp_path, monkeypatch) -> None:
    """The key comes from $PGW_ANSWER_KEY or a 0600 file; a short or world-readable one stops the start."""
    from pgwcore.config import load_config

    monkeypatch.delenv("PGW_ANSWER_KEY", raising=False)
    cfg = load_config(None, data_dir=str(tmp_path))
    key = load_answer_key(cfg)
    assert len(key) >= 32 and (tmp_path / "keys" / "answer_link.key").stat().st_mode & 0o777 == 0o600
    assert load_answer_key(cfg) == key, "kept across restarts"
    monkeypatch.setenv("PGW_ANSWER_KEY", "short")
    with pytest.raises(AnswerKeyError, match="fewer than 32"):
        load_answer_key(cfg)
    monkeypatch.delenv("PGW_ANSWER_KEY")
    loose = tmp_path / "loose.key"
    loose.write_text("x" * 40)
    loose.chmod(0o644)
    with pytest.raises(AnswerKeyError, match="0600"):
        load_answer_key(load_config(None, data_dir=str(tmp_path), notifier={"answer_key_file": str(loose)}))


@pytest.mark.security
async def test_secured_answer_goes_out_as_the_principal_and_only_for_her(tmp_path: Path, monkeypatch) -> None:
    """Under server-enforced isolation the notifier (service:notifier) answers alice's link with alice's own credentials; that connection cannot answer bob's moment."""
    from gateway.security import Party, embedded_auth
    from pgwcore.config import load_config
    from pgwcore.server import EmbeddedServer
    from pgwcore.streams import ensure_streams

    monkeypatch.setenv("PGW_ANSWER_KEY", KEY)
    with smtp_server(tmp_path) as relay:
        mail = {"web_push": False, "answer_by_email": True}
        config = load_config(
            None, data_dir=str(tmp_path / "data"), agents={"planner": {"principals": ["alice", "bob"]}},
            notifier={"presence_grace_s": 0, "answer_port": 0,
                      "smtp": {"host": relay.host, "port": relay.port, "credentials_file": str(relay.credentials_file),
                               "ca_file": str(relay.ca_file)},
                      "principals": {"alice": {"email": "alice@example.com", **mail},
                                     "bob": {"email": "bob@example.com", **mail}}})
        auth = embedded_auth(config)
        server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1,
                                authorization=auth.server_block)
        await server.start()
        config = load_config(None, data_dir=str(tmp_path / "data"), nats_url=server.client_url,
                             agents=config.agents, notifier=msgspec.to_builtins(config.notifier))
        conns: list[Any] = []
        try:
            def creds(role: str, name: str) -> str:
                return str(auth.creds_for(Party(role, name)))  # type: ignore[arg-type]

            gw_nc = await connect(server.client_url, creds=creds("service", "gateway"), name="gateway")
            n_nc = await connect(server.client_url, creds=creds("service", "notifier"), name="notifier")
            agent_nc = await connect(server.client_url, creds=creds("agent", "planner"), name="planner")
            conns = [gw_nc, n_nc, agent_nc]
            await ensure_streams(gw_nc.jetstream(), config.subjects)
            async with Gateway(config, gw_nc), Notifier(config, n_nc) as notifier:
                agent = Agent(agent_nc, "planner")
                eid = await agent.send_moment("alice", good_moment(), expires_in_s=600)
                mid = (await agent.outcome_for(eid, timeout=10)).moment_id
                eid = await agent.send_moment("bob", good_moment(), expires_in_s=600)
                bob_mid = (await agent.outcome_for(eid, timeout=10)).moment_id

                async def two() -> bool:
                    return len(relay.box.envelopes) >= 2

                await until(two, timeout=15, what="both mails")
                mails = [BytesParser(policy=policy.default).parsebytes(e.original_content) for e in relay.box.envelopes]
                alice_mail = next(m for m in mails if m["To"] == "alice@example.com")
                status, page = await post(answer_links(alice_mail)["o0"])  # type: ignore[arg-type]
                assert status == 200 and "Answer sent" in page, page
                res = await agent.resolution_for(mid, timeout=10)  # type: ignore[arg-type]
                assert res.resolution == OptionChoice(index=0) and res.principal == "alice"
                assert notifier.answers is not None and list(notifier.answers._conns) == ["alice"]
                as_alice = notifier.answers._conns["alice"]
                # The server drops the publish (a permissions violation), so the request gets no reply.
                with pytest.raises(nats_errors.TimeoutError):
                    await Surface(as_alice, "bob", presence=False, timeout=1).resolve(bob_mid, OptionChoice(index=0))  # type: ignore[arg-type]
                bob_pending = [i.moment_id for i in await Surface(
                    await _principal(server, creds("principal", "bob"), conns), "bob", presence=False).pending()]
                assert bob_mid in bob_pending, "bob's moment still waits"
                await agent.close()
        finally:
            for c in conns:
                await c.drain()
            await server.stop()


async def _principal(server: Any, creds: str, conns: list[Any]) -> Any:
    nc = await connect(server.client_url, creds=creds, name="bob")
    conns.append(nc)
    return nc


def test_answer_by_email_needs_an_address() -> None:
    """answer_by_email without an e-mail address fails the start with the field named."""
    from pgwcore.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"principals\.alice\.answer_by_email"):
        load_config(None, notifier={"principals": {"alice": {"answer_by_email": True}}})


async def test_in_chromium_the_mail_renders_and_the_form_button_answers(
        tmp_path, make_config, nats_server, nc, monkeypatch) -> None:
    """In headless Chromium the mail's HTML part renders, the confirmation page's form submits to itself under its CSP and answers; the screenshots of docs/surfaces.md come from here."""
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "web"))
    from surface_kit import CHROMIUM, CHROMIUM_ARGS, browser_ready

    reason = browser_ready()
    if reason is not None:
        pytest.skip(reason)
    from playwright.async_api import async_playwright

    shots = Path(os.environ.get("PGW_EMAIL_SCREENSHOTS", str(tmp_path)))
    async with running(tmp_path, make_config, nats_server, nc, monkeypatch) as bed, async_playwright() as pw:
        mid = await bed.moment()
        mail = await bed.mail()
        _, htm = parts(mail)
        links = answer_links(mail)
        b = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await b.new_page(viewport={"width": 760, "height": 900})
            await page.set_content(htm)
            assert await page.locator("a.answer").count() == 5
            assert await page.locator(".recommended").count() == 1
            await page.screenshot(path=str(shots / "email-answer.png"), full_page=True)
            await page.goto(links["o0"])
            assert "Option 1: Send the 2025 tax summary only" in await page.locator(".chosen").inner_text()
            await page.screenshot(path=str(shots / "email-confirm.png"), full_page=True)
            await page.goto(links["free_text"])
            await page.screenshot(path=str(shots / "email-confirm-free-text.png"), full_page=True)
            assert mid in await bed.pending_ids(), "opening the pages answered nothing"
            await page.fill("textarea#text", "Only the summary, and tell them why.")
            await page.get_by_role("button", name="Send this answer").click()
            await page.locator("h1.accepted").wait_for(timeout=10_000)
        finally:
            await b.close()
        res = await bed.agent.resolution_for(mid, timeout=10)
        assert res.resolution == FreeTextAnswer(text="Only the summary, and tell them why.")


async def test_every_email_page_passes_axe_reflows_and_names_the_principals_zone(
        tmp_path, make_config, nats_server, nc, monkeypatch) -> None:
    """axe-core (WCAG 2.0-2.2 A/AA, best practice) finds nothing on the mail and on every page its links open (option, own words, reject, clarification, refused, empty answer, sent), light and dark, at phone and desktop size; none is wider than 320 CSS px allows; each has one main landmark and one h1; deadlines are in the principal's zone, named."""
    import sys

    from subjects.client import envelope

    sys.path.insert(0, str(Path(__file__).parent / "web"))
    from a11y_kit import DESKTOP, NARROW, PHONE, assert_no_violations, axe_ready, overflow_x
    from surface_kit import CHROMIUM, CHROMIUM_ARGS, browser_ready

    reason = browser_ready() or axe_ready()
    if reason is not None:
        pytest.skip(reason)
    from playwright.async_api import async_playwright

    async with running(tmp_path, make_config, nats_server, nc, monkeypatch, timezone="Europe/Paris") as bed:
        await bed.moment()
        mail = await bed.mail()
        text, htm = parts(mail)
        links = answer_links(mail)
        env = envelope("clarification.request", {"questions": [{"id": "year", "question": "Which year should I file?"}]})
        out = await bed.agent.outcome_for(await bed.agent.send(env, principal="alice"), timeout=10)
        assert out.status == "accepted", (out.code, out.reason)
        clarify = answer_links(await bed.mail(2))["answers"]
        pages = {"mail": htm}
        for name, url in (("option", links["o0"]), ("own words", links["free_text"]), ("reject", links["dialogue"]),
                          ("clarification", clarify), ("refused", links["o0"].split("?")[0])):
            pages[name] = (await get(url))[1]
        status, pages["empty answer"] = await post(links["free_text"], {"text": " "})
        assert status == 400
        status, pages["sent"] = await post(links["o1"])
        assert status == 200 and "Answer sent" in pages["sent"]

        for where in (text, htm, pages["option"]):
            assert "(Europe/Paris)" in where, "deadlines in the principal's zone, named"
            assert not re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d", where), "no raw RFC 3339 time"
        async with async_playwright() as pw:
            b = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                for viewport, scheme in ((PHONE, "light"), (DESKTOP, "light"), (PHONE, "dark"), (NARROW, "light")):
                    ctx = await b.new_context(viewport=viewport, color_scheme=scheme, bypass_csp=True)
                    page = await ctx.new_page()
                    for name, content in pages.items():
                        await page.set_content(content)
                        state = f"{name} at {viewport['width']} px, {scheme}"
                        assert await page.locator("main").count() == 1, state
                        assert await page.locator("h1").count() == 1, state
                        assert await overflow_x(page) <= 0, f"{state}: wider than the screen (WCAG 1.4.10)"
                        if viewport is not NARROW:
                            await assert_no_violations(page, state)
                    if viewport is NARROW:  # the text box itself fits, not only the page
                        await page.set_content(pages["own words"])
                        box = await page.locator("textarea").bounding_box()
                        assert box is not None and box["x"] + box["width"] <= NARROW["width"]
                    await ctx.close()
            finally:
                await b.close()


def test_an_answer_link_mac_verifies_only_in_its_canonical_spelling() -> None:
    """A token whose MAC is spelled otherwise for the same 32 bytes (a last character differing in its unused
    bits, padding, standard-base64 twins of - and _, a stray character the decoder skips) is refused as forged."""
    tokens = Tokens(KEY.encode())
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    for n in range(500):
        token = tokens.mint(Claims(p="alice", m="0" * 32, c="o0", x=int(time.time()) + 600, n=f"n{n}"))
        body, mac = token.split(".")
        if "-" in mac and "_" in mac:
            break
    else:
        raise AssertionError("no MAC spelled with both - and _")
    assert tokens.verify(token).p == "alice"
    last = alphabet.index(mac[-1])
    spellings = [mac[:-1] + alphabet[last ^ bits] for bits in (1, 2, 3)]  # 43 chars carry 258 bits: 2 unused
    spellings += [mac + "=", mac.replace("-", "+"), mac.replace("_", "/"), mac + "!", " " + mac]
    for other in spellings:
        with pytest.raises(TokenRefused) as refused:
            tokens.verify(f"{body}.{other}")
        assert refused.value.code == "forged", other
