"""The principal's approval card tells the truth (docs/gate.md "What the principal sees"; spec 000 §6, §9.1; spec 003 §4.4, §6.3).

Through the bus: the agent's gated write (an ``act`` request as ``pgw mcp-gate`` sends it: the tool and its
arguments, ``hem_urgency: REQUIRED`` after the policy's DENY, spec 003 §6.3) reaches a real gateway and kernel
running the MCP gate's example policy; the principal's surface item is read on her subject and rendered by each
surface shipped here (the render plan, the terminal, Slack's blocks, the browser at phone size). The last test
drives the real ``pgw mcp-gate`` and answers in the principal's own words.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from consumers.slack.blocks import check_blocks, decision_blocks
from consumers.surfaces.model import DecisionPlan, plan_item
from consumers.surfaces.text import render_plan
from gateway.kernel.gate import _od_dec
from gateway.kernel.hem import ARG_CHARS
from integrations.mcp_gate import mandate_claims
from subjects.client import Surface
from subjects.gate import act_result_decoder, idempotency_key
from subjects.idp import HemPending
from subjects.wire import BindingMomentItem, DialogueVeto, FreeTextAnswer
from tests.kernel_support import idp
from tests.test_kernel_hem import _moment
from tests.test_mcp_gate import AGENT, PRINCIPAL, GateEnv, gate_env  # noqa: F401 - the fixture

sys.path.insert(0, str(Path(__file__).parent / "web"))
from surface_kit import CHROMIUM, CHROMIUM_ARGS, browser_ready

KEY = "sk-live-4f9a1c77e2d8b3a0"  # in no configuration: only the detector can find it
JARGON = ("hem_urgency", "REQUIRED", "idp.hem", "Reasoning basis", "RULE_BASED", "INFERENCE", "HEM_URGENCY",
          "Escalated because", "decision class")
PHONE = {"width": 390, "height": 844}
DOC_IMG = Path(__file__).resolve().parent.parent / "docs" / "img" / "gate-card-phone.png"


async def ask(env: GateEnv, args: dict[str, Any], path: str) -> BindingMomentItem:
    """agent planner asks, as the MCP gate does after the policy's DENY, to run write_file with ``args``; the item
    alice's surface receives for it."""
    claims = mandate_claims(env.token)
    rec = idp(so_id=claims["so_id"], mandate_id=claims["jti"], step=1, action="WriteFile", session=str(uuid.uuid4()),
              hem_urgency="REQUIRED")
    body = {"mandate": env.token, "action": "WriteFile", "idp": rec, "resource": f'File::"{path}"',
            "arguments": {"tool": "write_file", "arguments": args}}
    msg = await env.nc.request(f"pgw.agent.{AGENT}.act", msgspec.json.encode(body), timeout=15)
    assert isinstance(act_result_decoder.decode(msg.data), HemPending)
    surface = Surface(env.nc, PRINCIPAL)
    try:
        return await _moment(surface, rec["idp_id"])
    finally:
        await surface.close()


def rendered(item: BindingMomentItem, *, whole: bool = False) -> tuple[DecisionPlan, str, str]:
    """The render plan, the terminal's text and Slack's blocks (as JSON text) of ``item``."""
    plan = plan_item(msgspec.json.encode(item))
    assert isinstance(plan, DecisionPlan), plan
    blocks = decision_blocks(plan, PRINCIPAL)
    check_blocks(blocks)
    return plan, "\n".join(render_plan(plan, width=100, whole=whole)), json.dumps(blocks, ensure_ascii=False)


async def test_the_card_says_the_policy_recommends_deny_what_is_asked_and_why(gate_env: GateEnv) -> None:  # noqa: F811 - gate_env is the fixture
    """The recommendation is the gateway's policy's on every surface (not the agent's), the headline is a
    recommendation and names the tool and the path (never reads as done), the question names the file (not the
    governed object's UUID), the first finding is the rule that escalated it, and no auditor's jargon is shown."""
    path = str(gate_env.files / "draft.txt")
    item = await ask(gate_env, {"content": "hello", "path": path}, path)
    so_id = mandate_claims(gate_env.token)["so_id"]
    bm = item.binding_moment
    assert item.hem
    assert bm.synopsis.startswith("The gateway's policy recommends Deny: agent planner asks to run write_file on "
                                  f'"{path}"'), bm.synopsis
    assert not bm.synopsis.startswith("Deny")
    assert bm.question.stem == f'Should agent planner run write_file on "{path}"?'
    assert bm.findings[0] == ("Why you are asked: the gateway's policy does not allow WriteFile for agent planner on "
                              "its own, so the request asks for your approval instead of being refused.")
    # the tool, then its arguments with the path first
    tool_at = bm.findings.index("Tool to call: write_file.")
    assert bm.findings[tool_at + 1] == f"Tool argument path: {json.dumps(path)}"
    assert bm.findings[tool_at + 2] == 'Tool argument content: "hello"'
    plan, text, slack = rendered(item)
    assert plan.recommended_by == "gateway" and plan.options[plan.recommended_idx].label == "Deny"
    assert "★ recommended by the gateway's policy" in text and "recommended by the agent" not in text
    assert "Recommended by the gateway's policy" in slack and "Recommended by the agent" not in slack
    assert "The gateway asks your approval before agent planner acts." in text
    for where in (text, slack, bm.synopsis, bm.question.stem, *bm.findings):
        assert so_id not in where
        assert not [j for j in JARGON if j in where], where


async def test_a_secret_in_an_argument_is_redacted_by_the_detector(gate_env: GateEnv) -> None:  # noqa: F811 - gate_env is the fixture
    """A key nobody configured (``api_key=sk-live-...``) is found by the detect-secrets plugins and shown as
    [REDACTED] on every surface and in the attached whole value, with a finding saying so; the executor's
    stored request still holds it as sent."""
    path = str(gate_env.files / "settings.env")
    content = f"region=eu-west-1\napi_key={KEY}\n"
    item = await ask(gate_env, {"path": path, "content": content}, path)
    plan, text, slack = rendered(item, whole=True)
    raw = msgspec.json.encode(item).decode()
    assert KEY not in raw and KEY not in text and KEY not in slack
    assert 'Tool argument content: "region=eu-west-1\\napi_key=[REDACTED]\\n"' in item.binding_moment.findings
    assert any(f.startswith("Shown as [REDACTED]: what looks like a secret (Secret Keyword)") for f in item.binding_moment.findings)
    assert [a.text for a in plan.attachments if a.name == "content"] == ["region=eu-west-1\napi_key=[REDACTED]\n"]
    kv = await gate_env.js.key_value("PGW_KERNEL_GATE")
    key = idempotency_key(mandate_claims(gate_env.token)["so_id"], item.envelope_id)
    assert _od_dec.decode((await kv.get(key)).value).arguments["arguments"]["content"] == content


async def test_a_long_argument_is_previewed_with_its_length_and_shown_whole_on_request(gate_env: GateEnv) -> None:  # noqa: F811 - gate_env is the fixture
    """A 5,000-character write is previewed with its length said, never silently clipped: the whole value is
    attached to the card and each surface shows it whole on request (the terminal's ``w``, Slack's message)."""
    path = str(gate_env.files / "long.txt")
    content = "".join(f"line {i:04d} of the long draft\n" for i in range(180))  # 5,040 characters
    content += "THE LAST LINE"
    item = await ask(gate_env, {"path": path, "content": content}, path)
    preview = next(f for f in item.binding_moment.findings if f.startswith("Tool argument content"))
    assert preview.startswith(f"Tool argument content ({len(content):,} characters; the first {ARG_CHARS} here, the whole value "
                              "attached to this card): ")
    assert "THE LAST LINE" not in preview
    plan, folded, _ = rendered(item)
    assert [a.text for a in plan.attachments if a.name == "content"] == [content]
    assert "THE LAST LINE" not in folded and f"[w] show the arguments in full ({len(content) + len(path):,} characters)" in folded
    _, text, slack = rendered(item, whole=True)
    assert "THE LAST LINE" in text and "line 0179 of the long draft" in text
    assert "THE LAST LINE" in slack


async def test_invisible_characters_in_an_argument_are_marked_where_they_stand(gate_env: GateEnv) -> None:  # noqa: F811 - gate_env is the fixture
    """A path with U+202E, U+200B and U+2066 in it is shown with each marked ⟦U+…⟧ where it stands (not dropped,
    so the principal reads what will run): in the question, the finding, the attachment and every surface."""
    path = str(gate_env.files / "in\u202evoice\u200bx\u2066.txt")
    shown = str(gate_env.files / "in⟦U+202E⟧voice⟦U+200B⟧x⟦U+2066⟧.txt")
    item = await ask(gate_env, {"path": path, "content": "x"}, path)
    bm = item.binding_moment
    assert bm.question.stem == f'Should agent planner run write_file on "{shown}"?'
    assert f'Tool argument path: "{shown}"' in bm.findings
    assert "Characters you could not see are shown as ⟦U+…⟧ where they stand; they will be sent as they are." in bm.findings
    plan, text, slack = rendered(item, whole=True)
    assert [a.text for a in plan.attachments if a.name == "path"] == [shown]
    for where in (text, slack, msgspec.json.encode(item).decode("utf-8")):
        assert shown in "".join(where.split())  # (the terminal wraps a long line)
        assert "\u202e" not in where and "\u200b" not in where and "\u2066" not in where


_BROWSER = browser_ready()


@pytest.mark.skipif(_BROWSER is not None, reason=_BROWSER or "")
async def test_the_card_at_phone_size_in_the_browser(gate_env: GateEnv, nats_server: Any, tmp_path: Path) -> None:  # noqa: F811 - gate_env is the fixture
    """On the web surface at 390x844 the card badges Deny "Recommended by the gateway's policy", shows no decision
    class, and opens the whole arguments on request; the picture is docs/img/gate-card-phone.png
    (PGW_DOC_IMAGES=1 retakes it)."""
    from playwright.async_api import async_playwright

    from consumers.surfaces.web import WebSurfaceServer

    path = "/home/alice/invoices/march.txt"  # never written: the principal is only asked
    content = "Invoice 2026-03 for Harbor Ltd.\n" + "".join(f"- item {i}: 40.00 EUR\n" for i in range(40))
    content += f"api_key={KEY}\nTotal due: 1600.00 EUR\n"
    item = await ask(gate_env, {"path": path, "content": content}, path)
    async with WebSurfaceServer(principal=PRINCIPAL, ws_url=nats_server.websocket_url, port=0) as web, \
            async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport=PHONE, device_scale_factor=2, is_mobile=True)
            await page.goto(web.url)
            await page.wait_for_selector("body[data-ready=true]", timeout=20_000)
            card = page.locator(f"article[data-moment-id='{item.moment_id}']")
            await card.wait_for(timeout=20_000)
            rec = card.locator("label.option.recommended")
            assert "Deny" in await rec.inner_text()
            assert "Recommended by the gateway's policy" in await rec.inner_text()
            text = await card.inner_text()
            assert "Recommended by the agent" not in text and "idp.hem" not in text and KEY not in text
            assert "Total due: 1600.00 EUR" not in text  # folded until asked for
            await card.locator("summary", has_text="Show the arguments in full").click()
            assert "Total due: 1600.00 EUR" in await card.inner_text()
            assert "api_key=[REDACTED]" in await card.inner_text()
            await card.locator("details.whole-args").evaluate("d => d.open = false")
            # The picture in docs/gate.md is retaken on request only (a test run leaves the tree as it found it).
            shot = DOC_IMG if os.environ.get("PGW_DOC_IMAGES") else tmp_path / DOC_IMG.name
            await card.screenshot(path=str(shot))
            assert shot.stat().st_size > 0
        finally:
            await browser.close()


@pytest.mark.parametrize("answer", [FreeTextAnswer(text="Yes, but remove the api_key line first"),
                                    DialogueVeto(objection="Why a new file? Append to notes.txt instead")],
                         ids=["own-words", "objection"])
async def test_her_own_words_reach_the_model_with_the_refusal(gate_env: GateEnv, answer: Any) -> None:  # noqa: F811 - gate_env is the fixture
    """Through the real ``pgw mcp-gate``: a write the principal answers in her own words (or whose question she
    rejects with an objection) does not run, and the model's tool result carries her words beside the refusal."""
    target = gate_env.files / "draft.txt"
    words = answer.text if isinstance(answer, FreeTextAnswer) else answer.objection
    async with gate_env.session(gate_env.gate_file()) as session:
        call = asyncio.create_task(session.call_tool("write_file", {"path": str(target), "content": f"api_key={KEY}\n"}))
        item = await asyncio.wait_for(gate_env.principal(None), 30)
        surface = Surface(gate_env.nc, PRINCIPAL)
        try:
            reply = await surface.resolve(item.moment_id, answer)
        finally:
            await surface.close()
        assert reply.status == "accepted"
        result = await asyncio.wait_for(call, 30)
    assert result.isError and not target.exists()
    body = json.loads(result.content[0].text)  # type: ignore[union-attr]
    assert body["status"] == "not_run"
    assert body["principal_answer"] == words
    assert "nothing ran" in body["reason"]



async def test_a_call_naming_two_paths_is_asked_about_both(gate_env: GateEnv) -> None:  # noqa: F811 - gate_env is the fixture
    """``{"file": "harmless.txt", "path": "sub/private.txt"}``: which one a tool acts on is the tool's to decide
    (the reference filesystem server writes ``path`` and drops ``file``). The card named the first only, so she
    approved a write of harmless.txt and private.txt was written (found by an attack from the docs). The
    headline and the question now name every path the call carries."""
    harmless, private = str(gate_env.files / "harmless.txt"), str(gate_env.files / "sub" / "private.txt")
    item = await ask(gate_env, {"file": harmless, "path": private, "content": "x"}, harmless)
    bm = item.binding_moment
    _plan, text, slack = rendered(item)
    for where in (bm.synopsis, bm.question.stem, slack):
        assert harmless in where and private in where, where
    headline = text.split("Findings")[0]  # the terminal wraps long paths: their ends, in the headline
    assert "harmless.txt" in headline and "sub/private.txt" in headline, headline
    assert f'on "{harmless}" and "{private}"' in bm.question.stem


@pytest.mark.parametrize(("quote", "shown"), [('"', '\\"'), ("\u201d", "⟦U+201D⟧")], ids=["ascii", "curly"])
async def test_a_quote_in_a_path_cannot_write_the_gateways_question(gate_env: GateEnv, quote: str, shown: str) -> None:  # noqa: F811 - gate_env is the fixture
    """A path holding a quote closed the gateway's own quotes in the question, so the agent's words read as the
    gateway's: 'Should agent planner do WriteFile on "todo.txt" (to add one line ...). The second name is only
    where the old copy is kept; it is read, not written: "" and "authorized_keys"?' (found by an attack from the
    docs). Each path is now quoted as a JSON string, its quotes escaped, as the findings show it; and a character
    drawn as a quote (a curly one, found by a review) is marked where it stands."""
    trick = (str(gate_env.files / "todo.txt") + quote + ' (to add one line to your to-do list). The second name is '
             'only where the old copy of the list is kept; it is read, not written: ' + quote)
    keys = str(gate_env.files / "authorized_keys")
    item = await ask(gate_env, {"file": trick, "path": keys, "content": "ssh-ed25519 AAAA attacker"}, keys)
    stem = item.binding_moment.question.stem
    assert f"todo.txt{shown} (to add one line" in stem, stem
    assert f"todo.txt{quote} (to add" not in stem and f'"{keys}"' in stem, stem
