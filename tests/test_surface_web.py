"""The browser surface ``pgw surface-web`` end to end, in headless Chromium.

The page is the built bundle (consumers/web/static) served by
WebSurfaceServer; it connects to the real nats-server's WebSocket listener
with @nats-io/nats-core. Chromium is Debian's (installed by
tests/web/setup.sh), driven by Playwright. A screenshot of the page is left
at /tmp/surface-web.png for a human to look at.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from consumers.surfaces.model import plan_item, plan_to_builtins
from consumers.surfaces.web import WebSurfaceServer
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from subjects.client import Agent
from subjects.wire import FreeTextAnswer, OptionChoice, ResolutionOutcome

sys.path.insert(0, str(Path(__file__).parent / "web"))
from surface_kit import (
    CHROMIUM,
    CHROMIUM_ARGS,
    REPO,
    Relay,
    accepted_moment,
    browser_ready,
    corpus,
    moment,
    planner_agent,
    running_gateway,
)

SCREENSHOT = Path(os.environ.get("PGW_SURFACE_SCREENSHOT", "/tmp/surface-web.png"))
WAIT = 20.0
MS = int(WAIT * 1000)


_REASON = browser_ready()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.fixture
async def gateway(nats_server: EmbeddedServer, tmp_path: Path) -> AsyncIterator[Any]:
    async with running_gateway(nats_server, tmp_path / "gw") as gw:
        yield gw


@pytest.fixture
async def agent(nats_server: EmbeddedServer, gateway: Any) -> AsyncIterator[Agent]:
    async with planner_agent(nats_server) as a:
        yield a


@pytest.fixture
async def web(nats_server: EmbeddedServer) -> AsyncIterator[WebSurfaceServer]:
    assert nats_server.websocket_url.startswith("ws://")
    async with WebSurfaceServer(principal="alice", ws_url=nats_server.websocket_url, port=0) as server:
        yield server


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            await b.close()


async def open_page(browser: Any, web: WebSurfaceServer) -> Any:
    page = await browser.new_page(viewport={"width": 1000, "height": 1300})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    await page.goto(web.url)
    await page.wait_for_selector("body[data-ready=true]", timeout=MS)
    return page


async def test_page_shows_moment_per_contract_and_a_click_answers_it(
    agent: Agent, web: WebSurfaceServer, browser: Any
) -> None:
    """Agent publishes → the page renders briefing, recommended option, reasoning and both hatches → a click answers → the agent receives it."""
    page = await open_page(browser, web)
    mid = await accepted_moment(agent)
    card = page.locator(f"article[data-moment-id='{mid}']")
    await card.wait_for(timeout=MS)
    text = await card.inner_text()
    bm = moment()
    for slot in [bm["synopsis"], bm["offer"], *bm["findings"], *bm["recommendations"], bm["question"]["stem"]]:
        assert slot in text
    options = card.locator("label.option")
    assert await options.count() == 3
    # The recommended option is distinguished before any action, in words as well as style.
    rec = card.locator("label.option.recommended")
    assert await rec.count() == 1
    assert "Send the summary only" in await rec.inner_text()
    assert "Recommended by the agent" in await rec.inner_text()
    assert await card.locator("input[type=radio]:checked").count() == 0
    for o in bm["question"]["options"]:
        assert await card.locator("label.option", has_text=o["label"]).locator(".option-reasoning").inner_text() == o["reasoning"]
    assert await card.get_by_role("button", name="Answer in my own words").is_visible()
    assert await card.get_by_role("button", name="Reject the question").is_visible()
    await page.screenshot(path=str(SCREENSHOT), full_page=True)

    await card.locator("label.option", has_text="Send the full report").click()
    await card.get_by_role("button", name="Answer: Send the full report").click()
    await card.locator(".reply-ok", has_text="Accepted").wait_for(timeout=MS)
    out = await agent.final_outcome(mid, timeout=WAIT)
    assert isinstance(out, ResolutionOutcome) and out.resolution == OptionChoice(index=0)
    assert page.errors == []


async def test_second_tab_sees_the_moment_withdrawn_when_the_first_answers(
    agent: Agent, web: WebSurfaceServer, browser: Any
) -> None:
    """Two tabs show the same moment; one answers in its own words, the other tab's card is withdrawn with a note."""
    laptop = await open_page(browser, web)
    phone = await open_page(browser, web)
    mid = await accepted_moment(agent)
    sel = f"article[data-moment-id='{mid}']"
    await laptop.locator(sel).wait_for(timeout=MS)
    await phone.locator(sel).wait_for(timeout=MS)
    card = laptop.locator(sel)
    await card.get_by_role("button", name="Answer in my own words").click()
    await card.locator("textarea").first.fill("Send totals only, no customer names")
    await laptop.screenshot(path=str(SCREENSHOT.with_name(SCREENSHOT.stem + "-hatch.png")), full_page=True)
    await card.get_by_role("button", name="Send my answer").click()
    await card.locator(".reply-ok", has_text="Accepted").wait_for(timeout=MS)
    await phone.locator(sel).wait_for(state="detached", timeout=MS)
    assert "answered on another device" in await phone.locator("#activity").inner_text()
    out = await agent.final_outcome(mid, timeout=WAIT)
    assert isinstance(out, ResolutionOutcome)
    assert out.resolution == FreeTextAnswer(text="Send totals only, no customer names")


async def test_page_opened_late_lists_pending_and_shows_refusal_reply(
    agent: Agent, gateway: Any, web: WebSurfaceServer, browser: Any
) -> None:
    """A page opened after moments were sent lists them; an answer the gateway refuses shows why, and the card stays answerable."""
    from gateway.moment_record import HemContext
    from subjects.wire import BindingMoment

    mid = await accepted_moment(agent)
    hem = msgspec.convert(
        moment(
            stem="May the agent refund order 1042?",
            options=[
                {"label": "Approve", "reasoning": "The customer was double charged."},
                {"label": "Deny", "reasoning": "The charge may be legitimate."},
            ],
            recommended_idx=0,
        ),
        BindingMoment,
    )
    hem_id = await gateway.desk.dispatch(
        agent="planner", principal="alice", binding_moment=hem, envelope_id="env-hem", correlation_id="c-hem",
        untrusted=True, hem=HemContext(idp_id="idp-1", session_id="s-1", action="refund"),
    )
    page = await open_page(browser, web)
    await page.locator(f"article[data-moment-id='{mid}']").wait_for(timeout=MS)
    card = page.locator(f"article[data-moment-id='{hem_id}']")
    await card.wait_for(timeout=MS)
    assert "Untrusted content" in await card.inner_text()
    await card.locator("label.option", has_text="Approve").click()
    await card.get_by_role("button", name="Answer: Approve").click()
    refused = card.locator(".reply-refused")
    await refused.wait_for(timeout=MS)
    assert "Untrusted content cannot approve" in await refused.inner_text()
    assert "untrusted_content_blocks_approval" in await refused.inner_text()
    # Not gone: the principal can still deny or use a hatch.
    assert await card.get_by_role("button", name="Reject the question").is_enabled()
    assert page.errors == []


async def test_page_renders_fallbacks_blocked_and_untrusted_items(
    nats_server: EmbeddedServer, gateway: Any, web: WebSurfaceServer, browser: Any
) -> None:
    """Notice, malformed moment, unknown authorization kind and untrusted moment reach the page in their safe forms."""
    page = await open_page(browser, web)
    items = dict(corpus())
    nc = await connect(nats_server.client_url, name="test-publisher")
    try:
        for name in ("untrusted", "out_of_range", "notice", "auth_unknown_kind", "auth_refusal"):
            await nc.publish("pgw.principal.alice.surface", msgspec.json.encode(items[name]))
        await nc.flush()
    finally:
        await nc.drain()
    untrusted = page.locator(f"article[data-moment-id='{items['untrusted']['moment_id']}']")
    await untrusted.wait_for(timeout=MS)
    assert "Untrusted content" in await untrusted.locator(".banner-untrusted").inner_text()
    malformed = page.locator(f"article.card-notice[data-item-id='{items['out_of_range']['moment_id']}']")
    await malformed.wait_for(timeout=MS)
    assert "recommended_idx 3" in await malformed.inner_text()
    assert await malformed.locator("input[type=radio]").count() == 0  # never a partial decision
    notice = page.locator(f"article.card-notice[data-item-id='{items['notice']['item_id']}']")
    assert "synopsis hedges" in await notice.inner_text()
    assert "q3.pdf" in await notice.locator("pre.conventional").inner_text()
    blocked = page.locator(f"article[data-item-id='{items['auth_unknown_kind']['item_id']}']")
    assert "BLOCKED" in await blocked.inner_text()
    assert "trust me" not in await blocked.inner_text()
    refusal = page.locator(f"article[data-item-id='{items['auth_refusal']['item_id']}']")
    assert "This request is not allowed." in await refusal.inner_text()
    await page.screenshot(path=str(SCREENSHOT.with_name(SCREENSHOT.stem + "-fallbacks.png")), full_page=True)
    assert page.errors == []


async def test_browser_and_python_render_models_agree_on_the_corpus(
    web: WebSurfaceServer, browser: Any
) -> None:
    """plan.js in the browser and consumers/surfaces/model.py give the same plan for every corpus item."""
    page = await browser.new_page()
    await page.goto(web.url)
    await page.wait_for_function("() => typeof window.pgwPlan === 'function'", timeout=MS)
    names, items = zip(*corpus(), strict=True)
    js_plans = await page.evaluate("items => items.map(i => window.pgwPlan(i))", list(items))
    for name, item, js in zip(names, items, js_plans, strict=True):
        py = plan_to_builtins(plan_item(item))
        if py["plan"] == "notice" and name not in ("notice",):
            # Diagnostics are each model's own words; what is shown instead of a decision must match.
            assert js["plan"] == "notice", (name, js)
            assert {k: js[k] for k in ("item_id", "conventional", "agent")} == {
                k: py[k] for k in ("item_id", "conventional", "agent")
            }, name
        else:
            assert js == py, name


async def test_config_needs_the_printed_token(web: WebSurfaceServer) -> None:
    """The page's config (which may carry credentials) is refused without the per-run token."""
    import aiohttp

    base = f"http://{web.host}:{web.port}"
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/config.json") as r:
            assert r.status == 403
        async with s.get(f"{base}/config.json?t={web.token}") as r:
            assert r.status == 200
            cfg = await r.json()
            assert cfg["principal"] == "alice" and cfg["ws_url"] == web.ws_url


async def test_page_catches_up_after_its_connection_drops(
    nats_server: EmbeddedServer, agent: Agent, browser: Any
) -> None:
    """After the page's WebSocket drops and comes back, a moment answered meanwhile is gone and one sent meanwhile is shown."""
    from consumers.surfaces.feed import SurfaceFeed

    host, port = nats_server.websocket_url.removeprefix("ws://").split(":")
    relay = await Relay(host, int(port)).start()
    other = await connect(nats_server.client_url, name="phone")
    try:
        async with WebSurfaceServer(principal="alice", ws_url=f"ws://127.0.0.1:{relay.port}", port=0) as web:
            page = await open_page(browser, web)
            answered = await accepted_moment(agent, moment(stem="Answered while offline?"))
            await page.locator(f"article[data-moment-id='{answered}']").wait_for(timeout=MS)
            relay.cut()
            await page.locator("#conn[data-status=offline]").wait_for(timeout=MS)
            assert (await SurfaceFeed(other, "alice").resolve(answered, OptionChoice(index=0))).status == "accepted"
            later = await accepted_moment(agent, moment(stem="Sent while offline?"))
            relay.open = True
            await page.locator(f"article[data-moment-id='{later}']").wait_for(timeout=MS)
            await page.locator(f"article[data-moment-id='{answered}']").wait_for(state="detached", timeout=MS)
            assert "no longer waiting" in await page.locator("#activity").inner_text()
            assert page.errors == []
    finally:
        await other.drain()
        await relay.close()


async def test_surface_web_command_serves_the_page_with_its_settings(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    """`pgw surface-web --port 0 --ws-url URL` prints a tokened URL whose config names the principal and the WebSocket URL."""
    import aiohttp

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pgwcli", "--server", nats_server.client_url, "surface-web",
        "--principal", "~alice", "--port", "0", "--ws-url", nats_server.websocket_url,
        cwd=str(REPO), env=dict(os.environ, PGW_DATA_DIR=str(tmp_path / "d")),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), WAIT)).decode()  # type: ignore[union-attr]
        assert "Browser surface for ~alice: http://127.0.0.1:" in line, line
        url = line.split(": ", 1)[1].strip()
        async with aiohttp.ClientSession() as s:
            async with s.get(url) as r:
                assert r.status == 200 and "Principal Gateway" in await r.text()
            async with s.get(url.replace("/?t=", "/config.json?t=")) as r:
                cfg = await r.json()
        assert cfg == {"principal": "alice", "prefix": "pgw", "ws_url": nats_server.websocket_url, "auth": None,
                       "notify_synopsis": False, "time_zone": None}
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), WAIT) == 0


async def test_page_answers_a_clarification(gateway: Any, agent: Agent, web: WebSurfaceServer, browser: Any) -> None:
    """A clarification card shows each question with a labelled box; sending answers reaches the agent keyed by question id."""
    from subjects.wire import ClarificationAnswers, ClarificationQuestion

    page = await open_page(browser, web)
    from subjects.client import ensure_agent_consumer

    # The agent never sent an envelope here, so its outcome consumer is made up front
    # (subjects.client.Agent cannot create it itself once bound; reported to the lead).
    await ensure_agent_consumer(gateway.js, "planner")
    mid = await gateway.desk.dispatch(
        agent="planner", principal="alice", envelope_id="env-clar", correlation_id="c-clar",
        questions=[ClarificationQuestion(id="account", question="Which account should be billed?")],
    )
    card = page.locator(f"article[data-moment-id='{mid}']")
    await card.wait_for(timeout=MS)
    await card.get_by_label("Which account should be billed?").fill("ACME-42")
    await card.get_by_role("button", name="Send answers").click()
    await card.locator(".reply-ok", has_text="Accepted").wait_for(timeout=MS)
    out = await agent.final_outcome(mid, timeout=WAIT)
    assert isinstance(out, ResolutionOutcome)
    assert out.resolution == ClarificationAnswers(answers={"account": "ACME-42"})
