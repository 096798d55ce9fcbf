"""The browser surface holds WCAG 2.2 AA: axe-core on every state, keyboard walks, the accessibility tree.

Real gateway and nats-server, the built page (consumers/web/static) in
Debian's Chromium driven by Playwright, and real axe-core (pinned in
tests/web/package.json) injected into the page and run with its WCAG 2.0-2.2
A/AA and best-practice rules at phone (390x844) and desktop (1280x800) size,
light and dark. docs/surfaces.md "Accessibility" lists the criteria and which
test holds each.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from consumers.surfaces.web import WebSurfaceServer
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from subjects.client import Agent
from subjects.wire import DialogueVeto, FreeTextAnswer, OptionChoice, ResolutionOutcome

sys.path.insert(0, str(Path(__file__).parent / "web"))
from a11y_kit import (
    DESKTOP,
    NARROW,
    PHONE,
    assert_no_violations,
    axe_ready,
    focused,
    live_text,
    overflow_x,
)
from surface_kit import (
    CHROMIUM,
    CHROMIUM_ARGS,
    Relay,
    accepted_moment,
    browser_ready,
    corpus,
    moment,
    planner_agent,
    running_gateway,
)

WAIT = 20.0
MS = int(WAIT * 1000)

_REASON = browser_ready() or axe_ready()
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
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            await b.close()


async def open_page(browser: Any, url: str, *, viewport: dict[str, int] = DESKTOP, scheme: str = "light",
                    timezone: str | None = None) -> Any:
    """A page in a context of its own; CSP bypassed only so that axe-core can be injected."""
    ctx = await browser.new_context(viewport=viewport, color_scheme=scheme, bypass_csp=True, locale="en-GB",
                                    **({"timezone_id": timezone} if timezone else {}))
    page = await ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    await page.goto(url)
    await page.wait_for_selector("body[data-ready=true]", timeout=MS)
    return page


async def publish(nats_server: EmbeddedServer, *items: Any) -> None:
    """Put items on alice's surface subject as the gateway would."""
    nc = await connect(nats_server.client_url, name="test-publisher")
    try:
        for item in items:
            await nc.publish("pgw.principal.alice.surface", msgspec.json.encode(item))
        await nc.flush()
    finally:
        await nc.drain()


SIZES = [
    pytest.param(PHONE, "light", id="phone-390x844"),
    pytest.param(DESKTOP, "light", id="desktop-1280x800"),
    pytest.param(PHONE, "dark", id="phone-390x844-dark"),
    pytest.param(DESKTOP, "dark", id="desktop-1280x800-dark"),
]


@pytest.mark.parametrize(("viewport", "scheme"), SIZES)
async def test_axe_finds_nothing_in_any_state_of_the_page(
    nats_server: EmbeddedServer, agent: Agent, browser: Any, viewport: dict[str, int], scheme: str
) -> None:
    """axe-core (WCAG 2.0-2.2 A/AA, best practice) reports no violation with the page empty, waiting, an option selected, each panel open, an empty answer refused, answered, expired and offline; the page never scrolls sideways."""
    host, port = nats_server.websocket_url.removeprefix("ws://").split(":")
    relay = await Relay(host, int(port)).start()
    try:
        async with WebSurfaceServer(principal="alice", ws_url=f"ws://127.0.0.1:{relay.port}", port=0) as web:
            page = await open_page(browser, web.url, viewport=viewport, scheme=scheme)
            await assert_no_violations(page, "empty")
            mid = await accepted_moment(agent, expires_in_s=3600)
            card = page.locator(f"article[data-moment-id='{mid}']")
            await card.wait_for(timeout=MS)
            items = dict(corpus())
            await publish(nats_server, items["untrusted"], items["clarification"], items["notice"],
                          items["auth_refusal"], items["auth_unknown_kind"])
            await page.locator(f"article[data-item-id='{items['auth_unknown_kind']['item_id']}']").wait_for(timeout=MS)
            await assert_no_violations(page, "waiting")
            assert await overflow_x(page) <= 0
            await card.locator("label.option", has_text="Send the full report").click()
            await assert_no_violations(page, "selected")
            await card.get_by_role("button", name="Answer in my own words").click()
            await card.locator(".hatch-free_text textarea").wait_for(state="visible")
            await assert_no_violations(page, "own-words panel open")
            await card.get_by_role("button", name="Send my answer").click()
            await card.locator(".hatch-free_text textarea[aria-invalid=true]").wait_for(timeout=MS)
            await assert_no_violations(page, "empty own-words answer refused")
            await card.get_by_role("button", name="Reject the question").click()
            await card.locator(".hatch-dialogue textarea").wait_for(state="visible")
            await assert_no_violations(page, "reject panel open")
            await card.locator(".hatch-dialogue").get_by_role("button", name="Cancel").click()
            await page.evaluate("window.pgwAnsweredHoldMs = 600000")  # keep the answered card to check it
            await card.get_by_role("button", name="Answer: Send the full report").click()
            await card.locator(".reply-ok", has_text="Accepted").wait_for(timeout=MS)
            await assert_no_violations(page, "answered")
            await publish(nats_server, {**items["untrusted"], "item": "withdrawn", "reason": "expired"})
            await page.locator(f"article[data-moment-id='{items['untrusted']['moment_id']}']").wait_for(
                state="detached", timeout=MS)
            await assert_no_violations(page, "expired")
            relay.cut()
            await page.locator("#conn[data-status=offline]").wait_for(timeout=MS)
            await assert_no_violations(page, "offline")
            assert await overflow_x(page) <= 0
            assert page.errors == []
    finally:
        await relay.close()


async def test_page_reflows_at_320_px(agent: Agent, browser: Any, nats_server: EmbeddedServer) -> None:
    """At 320 CSS px (1280 px at 400 % zoom) a moment with both panels open fits the width: nothing is cut off (WCAG 1.4.10)."""
    async with WebSurfaceServer(principal="alice", ws_url=nats_server.websocket_url, port=0) as web:
        page = await open_page(browser, web.url, viewport=NARROW)
        mid = await accepted_moment(agent, expires_in_s=3600)
        card = page.locator(f"article[data-moment-id='{mid}']")
        await card.wait_for(timeout=MS)
        await card.get_by_role("button", name="Reject the question").click()
        await card.locator(".hatch-dialogue textarea").wait_for(state="visible")
        assert await overflow_x(page) <= 0
        box = await card.locator(".hatch-dialogue textarea").bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= NARROW["width"]


async def _tab_to(page: Any, name: str, *, limit: int = 40, back: bool = False) -> None:
    """Press Tab (or Shift+Tab) until the focused element's text is ``name``."""
    for _ in range(limit):
        await page.keyboard.press("Shift+Tab" if back else "Tab")
        if (await focused(page))["text"] == name:
            return
    raise AssertionError(f"{name!r} not reached by keyboard; focus is on {await focused(page)}")


async def _focus_after_answer(page: Any, mid: str, nxt: str | None) -> None:
    """Focus is on the card's reply line while it says 'Accepted', then on the next card's heading once the card goes."""
    f = await focused(page)
    assert f["moment"] == mid and "reply" in f["cls"] and f["text"].startswith("Accepted"), f
    await page.locator(f"article[data-moment-id='{mid}']").wait_for(state="detached", timeout=MS)
    f = await focused(page)
    if nxt is None:  # nothing left to answer: the list's heading, which says so
        assert f["tag"] == "h1" and f["text"] == "Waiting for you", f
        return
    assert f["moment"] == nxt and f["tag"] == "h2", f
    await page.keyboard.press("Tab")  # the next Tab goes on into that card, not back to the top of the page
    f = await focused(page)
    assert f["moment"] == nxt and f["tag"] in ("input", "button"), f


async def test_keyboard_alone_answers_by_option_own_words_and_reject(
    agent: Agent, nats_server: EmbeddedServer, browser: Any
) -> None:
    """With the keyboard only: an option (arrow keys, Enter), own words (an empty answer named as an error first) and reject (Escape and Cancel give focus back to the button) all answer, and focus never falls to the page."""
    async with WebSurfaceServer(principal="alice", ws_url=nats_server.websocket_url, port=0) as web:
        page = await open_page(browser, web.url, viewport=PHONE)
        first = await accepted_moment(agent, moment(stem="First: send the report?"))
        second = await accepted_moment(agent, moment(stem="Second: send the report?"))
        third = await accepted_moment(agent, moment(stem="Third: send the report?"))
        for mid in (first, second, third):
            await page.locator(f"article[data-moment-id='{mid}']").wait_for(timeout=MS)

        # 1. By option: Tab into the group, arrow to the second option, Tab to the answer button, Enter.
        await _tab_to(page, "Send the full report\nAuditors asked for it and the NDA covers it.")
        await page.keyboard.press("ArrowDown")
        await _tab_to(page, "Answer: Send the summary only")
        await page.keyboard.press("Enter")
        await page.locator(f"article[data-moment-id='{first}'] .reply-ok", has_text="Accepted").wait_for(timeout=MS)
        await _focus_after_answer(page, first, second)
        assert (await agent.final_outcome(first, timeout=WAIT)).resolution == OptionChoice(index=1)

        # 2. Own words: the panel opens with focus in the box; an empty answer is an error, named.
        await _tab_to(page, "Answer in my own words")
        assert await page.evaluate("document.activeElement.getAttribute('aria-expanded')") == "false"
        await page.keyboard.press("Enter")
        f = await focused(page)
        assert f["tag"] == "textarea" and f["moment"] == second, f
        assert await page.locator(f"article[data-moment-id='{second}'] button.hatch-free_text").get_attribute(
            "aria-expanded") == "true"
        await page.keyboard.press("Tab")
        await page.keyboard.press("Enter")  # "Send my answer" with nothing written
        box = page.locator(f"article[data-moment-id='{second}'] .hatch-free_text textarea")
        await box.and_(page.locator("[aria-invalid=true]")).wait_for(timeout=MS)
        assert (await focused(page))["tag"] == "textarea"
        error_id = await box.get_attribute("aria-describedby")
        error = (await page.locator(f"#{error_id}").inner_text()).strip()
        assert "Write your answer" in error, error
        assert any("Write your answer" in t for t in await live_text(page)), "the error is announced"
        await page.keyboard.type("Send the totals only.")
        assert await box.get_attribute("aria-invalid") in (None, "false")
        await page.keyboard.press("Tab")
        await page.keyboard.press("Enter")
        await page.locator(f"article[data-moment-id='{second}'] .reply-ok", has_text="Accepted").wait_for(timeout=MS)
        await _focus_after_answer(page, second, third)
        assert (await agent.final_outcome(second, timeout=WAIT)).resolution == FreeTextAnswer(text="Send the totals only.")

        # 3. Reject: Escape closes the panel and gives focus back to its button; so does Cancel.
        reject = page.locator(f"article[data-moment-id='{third}'] button.hatch-dialogue")
        await _tab_to(page, "Reject the question")
        await page.keyboard.press("Enter")
        assert (await focused(page))["tag"] == "textarea"
        await page.keyboard.press("Escape")
        await page.locator(f"article[data-moment-id='{third}'] form.hatch-dialogue").wait_for(state="hidden")
        assert (await focused(page))["text"] == "Reject the question"
        assert await reject.get_attribute("aria-expanded") == "false"
        await page.keyboard.press("Enter")
        await page.keyboard.press("Tab")  # from the box to "Send: reject the question"
        await page.keyboard.press("Tab")
        assert (await focused(page))["text"] == "Cancel"
        await page.keyboard.press("Enter")
        assert (await focused(page))["text"] == "Reject the question"
        await page.keyboard.press("Enter")
        await page.keyboard.type("Ask me after the audit.")
        await page.keyboard.press("Tab")
        await page.keyboard.press("Enter")
        await page.locator(f"article[data-moment-id='{third}'] .reply-ok", has_text="Accepted").wait_for(timeout=MS)
        await _focus_after_answer(page, third, None)
        out = await agent.final_outcome(third, timeout=WAIT)
        assert isinstance(out, ResolutionOutcome) and out.resolution == DialogueVeto(objection="Ask me after the audit.")
        assert page.errors == []


async def test_a_new_moment_and_a_moment_gone_elsewhere_are_announced(
    agent: Agent, nats_server: EmbeddedServer, browser: Any
) -> None:
    """Read from Chromium's accessibility tree: a moment arriving is told in a live region (and counted in the title); one answered on another device is told too, and Activity is a log."""
    async with WebSurfaceServer(principal="alice", ws_url=nats_server.websocket_url, port=0) as web:
        page = await open_page(browser, web.url)
        assert not any("Send Acme" in t for t in await live_text(page))
        mid = await accepted_moment(agent)
        await page.locator(f"article[data-moment-id='{mid}']").wait_for(timeout=MS)
        said = " | ".join(await live_text(page))
        assert "New decision from agent planner" in said and moment()["synopsis"] in said, said
        assert "1 item waiting" in said, said
        assert (await page.title()).startswith("(1) ")
        log = page.get_by_role("log", name="Activity")
        assert await log.count() == 1, "the Activity list is a log"

        from consumers.surfaces.feed import SurfaceFeed

        other = await connect(nats_server.client_url, name="phone")
        try:
            assert (await SurfaceFeed(other, "alice").resolve(mid, OptionChoice(index=0))).status == "accepted"
        finally:
            await other.drain()
        await page.locator(f"article[data-moment-id='{mid}']").wait_for(state="detached", timeout=MS)
        said = " | ".join(await live_text(page))
        assert "answered on another device" in said, said
        assert "0 items waiting" in said, said
        assert not (await page.title()).startswith("(")


async def test_deadlines_show_in_the_principals_zone_with_the_zone_named(
    agent: Agent, nats_server: EmbeddedServer, browser: Any
) -> None:
    """The 'Answer by' chip names its time zone: the browser's by default, the principal's configured one when set."""
    async with WebSurfaceServer(principal="alice", ws_url=nats_server.websocket_url, port=0) as web:
        page = await open_page(browser, web.url, timezone="America/New_York")
        mid = await accepted_moment(agent, expires_in_s=3600)
        chip = page.locator(f"article[data-moment-id='{mid}'] .chip-expiry")
        await chip.wait_for(timeout=MS)
        text = await chip.inner_text()
        assert "GMT-4" in text or "GMT-5" in text or "EST" in text or "EDT" in text, text
        assert await chip.locator("time").get_attribute("datetime")
    async with WebSurfaceServer(principal="alice", ws_url=nats_server.websocket_url, port=0,
                                time_zone="Asia/Tokyo") as web:
        page = await open_page(browser, web.url, timezone="America/New_York")
        chip = page.locator(f"article[data-moment-id='{mid}'] .chip-expiry")
        await chip.wait_for(timeout=MS)
        assert "GMT+9" in await chip.inner_text() or "JST" in await chip.inner_text()


def test_a_time_zone_that_is_not_iana_fails_at_start() -> None:
    """WebSurfaceServer refuses a time zone no IANA database knows, naming it."""
    from pgwcore.config import ConfigError

    with pytest.raises(ConfigError, match="Mars/Olympus"):
        WebSurfaceServer(principal="alice", ws_url="ws://127.0.0.1:1", port=0, time_zone="Mars/Olympus")


async def test_the_page_says_connecting_until_the_first_pending_list_answers(
        nats_server: EmbeddedServer, browser: Any) -> None:
    """Until the first pending request is answered the page says it is connecting, never "Nothing is waiting for
    you", and axe finds nothing; once the (empty) list is in, it says nothing is waiting and counts 0 items."""
    nc = await connect(nats_server.client_url, name="test-slow-gateway")
    asked: asyncio.Queue[Any] = asyncio.Queue()
    await nc.subscribe("pgw.principal.alice.pending", cb=asked.put)  # a gateway that answers when told to
    await nc.flush()
    try:
        async with WebSurfaceServer(principal="alice", ws_url=nats_server.websocket_url, port=0) as web:
            ctx = await browser.new_context(viewport=DESKTOP, bypass_csp=True, locale="en-GB")
            page = await ctx.new_page()
            await page.goto(web.url)
            request = await asyncio.wait_for(asked.get(), WAIT)
            assert "Connecting" in await page.locator("#empty").inner_text()
            assert "Nothing is waiting" not in await page.locator("main").inner_text()
            assert await page.get_attribute("#conn", "data-status") == "connecting"
            await assert_no_violations(page, "connecting")
            await request.respond(b'{"items": []}')
            await page.wait_for_selector("body[data-ready=true]", timeout=MS)
            assert "Nothing is waiting for you" in await page.locator("#empty").inner_text()
            assert await page.locator("#count").inner_text() == "0 items waiting"
            await assert_no_violations(page, "connected, nothing waiting")
    finally:
        await nc.drain()
