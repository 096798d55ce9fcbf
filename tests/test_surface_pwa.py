"""The browser surface as an installable app (issue 17), in headless Chromium.

Debian's Chromium (tests/web/setup.sh) driven by Playwright, the page served
by WebSurfaceServer, a real nats-server and the real gateway. What these
tests prove and what they cannot:

- Chromium itself judges the app installable (CDP Page.getInstallabilityErrors
  on a persistent profile: incognito never is), and the service worker opens
  the shell with the network off.
- The phone layout (390x844) and the desktop layout, measured in the browser;
  the phone screenshot is left under the test's tmp_path, its path printed
  with ``-v``.
- A desktop notification for a new moment while the page is hidden, shown by
  the real service worker registration and read back with getNotifications().
  Headless Chromium never hides a page (no window to minimise; a second tab,
  Browser.setWindowBounds and Page.setWebLifecycleState all leave it
  "visible"), so the test sets document.visibilityState, which is all the
  page reads.
- The service worker's push handler through Chromium's own push-event path
  (CDP ServiceWorker.deliverPushMessage with the contract's payload).
- NOT pushManager.subscribe: Chromium registers with Google's push service
  (FCM) first, and this machine has no internet. On a persistent profile the
  call had not settled after 40 s (the page gives up after 30 s and says
  so); in incognito it fails at once and the page says so (tested). See
  tests/test_surface_push.py for the bus side.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

import tests.test_surface_web as page_tests
from consumers.surfaces.feed import SurfaceFeed
from consumers.surfaces.web import WebSurfaceServer
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from subjects.client import Agent
from subjects.wire import OptionChoice
from tests.polling import until as polling_until

sys.path.insert(0, str(Path(__file__).parent / "web"))
from pwa_kit import NOTIFICATIONS, NOTIFY_ARGS, SET_VISIBILITY, notifications_shown, open_app
from surface_kit import (
    CHROMIUM,
    CHROMIUM_ARGS,
    REPO,
    accepted_moment,
    browser_ready,
    moment,
)

WAIT = 20.0
MS = int(WAIT * 1000)
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 800}


_REASON = browser_ready()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
# the same gateway and agent fixtures as the page's own tests
gateway = page_tests.gateway
agent = page_tests.agent

@pytest.fixture
async def web(nats_server: EmbeddedServer) -> AsyncIterator[WebSurfaceServer]:
    async with WebSurfaceServer(principal="alice", ws_url=nats_server.websocket_url, port=0) as server:
        yield server


@pytest.fixture
async def pw() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        yield p


async def persistent(pw: Any, profile: Path, web: WebSurfaceServer, **kw: Any) -> Any:
    """A Chromium with a profile on disk (installability and push need one), notifications allowed for the page."""
    ctx = await pw.chromium.launch_persistent_context(
        str(profile), executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, *NOTIFY_ARGS], **kw
    )
    await ctx.grant_permissions(["notifications"], origin=f"http://{web.host}:{web.port}")
    return ctx


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def show(request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str], what: str, path: Path) -> None:
    """Print where a screenshot is, past pytest's capture when run with -v (and with -s)."""
    request.node.user_properties.append((what, str(path)))
    if request.config.get_verbosity() > 0:
        with capsys.disabled():
            print(f"\n    {what}: {path}")


async def test_manifest_service_worker_and_icons_are_served_right(web: WebSurfaceServer) -> None:
    """The manifest as application/manifest+json with what an install needs; sw.js at the root with its scope header; the icons are the committed drawing."""
    import aiohttp

    sys.path.insert(0, str(REPO / "consumers" / "web"))
    import icons

    base = f"http://{web.host}:{web.port}"
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/manifest.webmanifest") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("application/manifest+json")
            assert "manifest-src 'self'" in r.headers["Content-Security-Policy"]
            man = json.loads(await r.text())
        assert man["start_url"] == "/" and man["scope"] == "/" and man["display"] == "standalone"
        assert man["name"] == "Principal Gateway (~alice)" and man["short_name"]
        assert man["theme_color"] and man["background_color"]
        seen = set()
        for icon in man["icons"]:
            async with s.get(base + icon["src"]) as r:
                assert r.status == 200 and r.headers["Content-Type"] == "image/png"
                w, h = png_size(await r.read())
            assert f"{w}x{h}" == icon["sizes"]
            seen.add((w, icon["purpose"]))
        assert {(192, "any"), (512, "any"), (512, "maskable")} <= seen
        async with s.get(f"{base}/sw.js") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/javascript")
            assert r.headers["Service-Worker-Allowed"] == "/"
            assert "worker-src 'self'" in r.headers["Content-Security-Policy"]
            assert "showNotification" in await r.text()
    committed = (REPO / "consumers" / "web" / "static" / "icons" / "icon-192.png").read_bytes()
    assert icons.png(192, icons.draw(192, maskable=False)) == committed, "run python consumers/web/icons.py"


async def test_chromium_finds_the_app_installable_and_it_opens_offline(
    gateway: Any, web: WebSurfaceServer, pw: Any, tmp_path: Path
) -> None:
    """Chromium's own installability check passes; the installed start_url works without the token; offline the shell opens and says why it cannot connect."""
    ctx = await persistent(pw, tmp_path / "profile", web)
    try:
        page = await open_app(ctx, web.url)
        assert "t=" not in page.url, "the token stays off the address bar"
        cdp = await ctx.new_cdp_session(page)
        manifest = await cdp.send("Page.getAppManifest")
        assert manifest["errors"] == [], manifest["errors"]
        assert (await cdp.send("Page.getInstallabilityErrors"))["installabilityErrors"] == []
        # The installed app starts at start_url, "/", without ?t=: the page kept its token.
        await page.goto(f"http://{web.host}:{web.port}/")
        await page.wait_for_selector("body[data-ready=true]", timeout=MS)
        await page.wait_for_function("navigator.serviceWorker.controller !== null", timeout=MS)
        await ctx.set_offline(True)
        await page.reload()
        await page.locator("#fatal").wait_for(timeout=MS)
        assert "Principal Gateway" in await page.locator(".brand-name").inner_text()
        assert "page server does not answer" in await page.locator("#fatal").inner_text()
        assert page.errors == []
    finally:
        await ctx.close()


async def test_a_wrong_token_is_refused_and_forgotten(web: WebSurfaceServer, pw: Any, tmp_path: Path) -> None:
    """No token: the page says to open the printed URL; a stale kept token is dropped."""
    ctx = await persistent(pw, tmp_path / "profile", web)
    try:
        page = ctx.pages[0]
        base = f"http://{web.host}:{web.port}/"
        await page.goto(base)
        await page.locator("#fatal").wait_for(timeout=MS)
        assert "open the URL that `pgw surface-web` printed" in await page.locator("#fatal").inner_text()
        await page.evaluate("localStorage.setItem('pgw.surface-web.token', 'stale-token-from-an-old-run')")
        await page.goto(base)
        await page.locator("#fatal", has_text="no longer valid").wait_for(timeout=MS)
        assert await page.evaluate("localStorage.getItem('pgw.surface-web.token')") is None
    finally:
        await ctx.close()


async def test_phone_size_layout_with_a_pending_moment(
    agent: Agent, web: WebSurfaceServer, pw: Any, tmp_path: Path,
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str],
) -> None:
    """At 390x844 a pending moment fits the width, and every control is a finger-sized target; the screenshot is kept."""
    mid = await accepted_moment(agent)
    ctx = await persistent(pw, tmp_path / "profile", web, viewport=PHONE, device_scale_factor=2,
                           is_mobile=True, has_touch=True)
    try:
        page = await open_app(ctx, web.url)
        card = page.locator(f"article[data-moment-id='{mid}']")
        await card.wait_for(timeout=MS)
        await page.locator("#reach-status", has_text="notification").wait_for(timeout=MS)
        shot = tmp_path / "surface-phone-390x844.png"
        await page.screenshot(path=str(shot), full_page=True)
        show(request, capsys, "phone screenshot", shot)
        assert await page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
        assert await page.evaluate("document.body.scrollWidth") <= PHONE["width"]
        targets = [
            *[card.locator("label.option").nth(i) for i in range(3)],
            card.locator("button.answer"),
            card.get_by_role("button", name="Answer in my own words"),
            card.get_by_role("button", name="Reject the question"),
            page.get_by_role("button", name="Notify me on this device"),
        ]
        for t in targets:
            assert await t.is_visible()
            box = await t.bounding_box()
            assert box is not None and box["height"] >= 44, (await t.inner_text(), box)
            assert box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], (await t.inner_text(), box)
        # The briefing is one column on a phone.
        cols = await card.locator(".brief-cols").evaluate("e => getComputedStyle(e).gridTemplateColumns")
        assert len(cols.split()) == 1, cols
        # Answering works by touch at this size.
        await card.locator("label.option", has_text="Send the summary only").tap()
        await card.get_by_role("button", name="Answer: Send the summary only").tap()
        await card.locator(".reply-ok", has_text="Accepted").wait_for(timeout=MS)
        assert page.errors == []
    finally:
        await ctx.close()


async def test_desktop_size_layout(
    agent: Agent, web: WebSurfaceServer, pw: Any, tmp_path: Path,
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str],
) -> None:
    """At 1280x800 the page keeps a readable column, the briefing in two columns, and no horizontal scroll."""
    mid = await accepted_moment(agent)
    ctx = await persistent(pw, tmp_path / "profile", web, viewport=DESKTOP)
    try:
        page = await open_app(ctx, web.url)
        card = page.locator(f"article[data-moment-id='{mid}']")
        await card.wait_for(timeout=MS)
        shot = tmp_path / "surface-desktop-1280x800.png"
        await page.screenshot(path=str(shot), full_page=True)
        show(request, capsys, "desktop screenshot", shot)
        assert await page.evaluate("document.documentElement.scrollWidth") <= DESKTOP["width"]
        box = await card.bounding_box()
        assert box is not None and 700 <= box["width"] <= 860, box
        cols = await card.locator(".brief-cols").evaluate("e => getComputedStyle(e).gridTemplateColumns")
        assert len(cols.split()) == 2, cols
        for name in ("Answer in my own words", "Reject the question"):
            b = await card.get_by_role("button", name=name).bounding_box()
            assert b is not None and b["height"] >= 44
    finally:
        await ctx.close()


async def presence_watch(nats_server: EmbeddedServer) -> tuple[Any, list[dict[str, Any]]]:
    nc = await connect(nats_server.client_url, name="presence-watch")
    seen: list[dict[str, Any]] = []

    async def got(msg: Any) -> None:
        seen.append(json.loads(msg.data))

    await nc.subscribe("pgw.principal.alice.presence", cb=got)
    await nc.flush()
    return nc, seen


async def until(cond: Any, what: str) -> None:
    """tests.polling.until for a plain condition on what the page sent."""

    async def probe() -> Any:
        return cond()

    await polling_until(probe, timeout=WAIT, what=what)


async def test_hidden_page_notifies_a_new_moment_and_keeps_presence(
    nats_server: EmbeddedServer, agent: Agent, web: WebSurfaceServer, pw: Any, tmp_path: Path
) -> None:
    """A moment sent through the gateway while the page is hidden shows "A decision from agent planner waits." (no synopsis), tagged as the notifier tags it; it closes when the moment is answered elsewhere; presence is kept while hidden with notifications allowed and ends with ttl_s 0 when the page goes."""
    watch, presence = await presence_watch(nats_server)
    ctx = await persistent(pw, tmp_path / "profile", web)
    try:
        page = await open_app(ctx, web.url)
        await until(lambda: any(p["ttl_s"] == 30 for p in presence), "presence from the open page")
        first = presence[0]
        assert first["surface"] == "web" and len(first["instance"]) >= 16
        before = await accepted_moment(agent, moment(stem="Seen while visible?"))
        await page.locator(f"article[data-moment-id='{before}']").wait_for(timeout=MS)
        assert await page.evaluate(NOTIFICATIONS) == [], "a visible page does not notify"

        await page.evaluate(SET_VISIBILITY, "hidden")
        n = len(presence)
        await until(lambda: len(presence) > n, "presence sent on visibilitychange")
        assert presence[-1]["ttl_s"] == 30, "hidden with notifications allowed: still reaches the principal"
        mid = await accepted_moment(agent)
        await page.locator(f"article[data-moment-id='{mid}']").wait_for(timeout=MS)
        shown = await notifications_shown(page, by_page=1)
        assert shown == [{  # the notifier's words and tag for the same moment (consumers/notify/channels.py)
            "title": "A decision waits",
            "body": "A decision from agent planner waits.",
            "tag": f"pgw-{mid}",
            "data": {"url": f"http://{web.host}:{web.port}/"},
        }]
        assert moment()["synopsis"] not in json.dumps(shown)

        other = await connect(nats_server.client_url, name="phone")
        try:
            assert (await SurfaceFeed(other, "alice").resolve(mid, OptionChoice(index=1))).status == "accepted"
        finally:
            await other.drain()
        await page.locator(f"article[data-moment-id='{mid}']").wait_for(state="detached", timeout=MS)
        for _ in range(int(WAIT * 10)):
            if not await page.evaluate(NOTIFICATIONS):
                break
            await page.wait_for_timeout(100)
        assert await page.evaluate(NOTIFICATIONS) == [], "the answered moment's notification is closed"

        instance = first["instance"]
        await page.close(run_before_unload=True)
        await until(lambda: presence[-1] == {"instance": instance, "surface": "web", "ttl_s": 0}, "ttl_s 0 on pagehide")
    finally:
        await ctx.close()
        await watch.drain()


async def test_synopsis_only_when_the_principal_opted_in(
    nats_server: EmbeddedServer, agent: Agent, pw: Any, tmp_path: Path
) -> None:
    """With notify_synopsis on, the hidden page's notification carries the moment's synopsis."""
    async with WebSurfaceServer(principal="alice", ws_url=nats_server.websocket_url, port=0, notify_synopsis=True) as web:
        ctx = await persistent(pw, tmp_path / "profile", web)
        try:
            page = await open_app(ctx, web.url)
            await page.evaluate(SET_VISIBILITY, "hidden")
            mid = await accepted_moment(agent)
            await page.locator(f"article[data-moment-id='{mid}']").wait_for(timeout=MS)
            [shown] = await notifications_shown(page, by_page=1)
            assert shown["body"] == f"A decision from agent planner waits.\n{moment()['synopsis']}"
            assert shown["tag"] == f"pgw-{mid}"
        finally:
            await ctx.close()


async def test_hidden_page_without_permission_gives_up_presence(
    nats_server: EmbeddedServer, gateway: Any, web: WebSurfaceServer, pw: Any
) -> None:
    """A hidden page that may not notify cannot reach the principal: it sends ttl_s 0 so the notifier pushes instead, and claims presence again when shown."""
    watch, presence = await presence_watch(nats_server)
    browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    try:
        page = await browser.new_page()
        await page.goto(web.url)
        await page.wait_for_selector("body[data-ready=true]", timeout=MS)
        await until(lambda: presence and presence[-1]["ttl_s"] == 30, "presence")
        await page.evaluate(SET_VISIBILITY, "hidden")
        await until(lambda: presence[-1]["ttl_s"] == 0, "ttl_s 0 when hidden without notifications")
        await page.evaluate(SET_VISIBILITY, "visible")
        await until(lambda: presence[-1]["ttl_s"] == 30, "presence again when visible")
    finally:
        await browser.close()
        await watch.drain()


async def test_notify_button_says_what_happened(gateway: Any, web: WebSurfaceServer, pw: Any) -> None:
    """Refused permission and an unreachable push setup each end in words on the page, never silence."""
    browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    try:
        refused = await browser.new_context()  # no permission granted: headless denies the prompt
        page = await refused.new_page()
        await page.goto(web.url)
        await page.wait_for_selector("body[data-ready=true]", timeout=MS)
        await page.get_by_role("button", name="Notify me on this device").click()
        status = page.locator("#reach-status[data-kind=refused]")
        await status.wait_for(timeout=MS)
        assert "refused" in (await status.inner_text()) or "blocked" in (await status.inner_text())

        allowed = await browser.new_context()
        await allowed.grant_permissions(["notifications"], origin=f"http://{web.host}:{web.port}")
        page = await allowed.new_page()
        await page.goto(web.url)
        await page.wait_for_selector("body[data-ready=true]", timeout=MS)
        await page.locator("#reach-status", has_text="on while this app is open").wait_for(timeout=MS)
        await page.get_by_role("button", name="Notify me on this device").click()
        status = page.locator("#reach-status[data-kind=refused]")
        await status.wait_for(timeout=MS)
        text = await status.inner_text()
        assert text.startswith("Notifications are on while this app is open."), text
        # Without a notifier on the bus the key request has no responder; with one, this
        # incognito context's pushManager.subscribe fails ("Registration failed").
        assert "notifier did not answer" in text or "could not register with its push service" in text, text
    finally:
        await browser.close()


async def test_service_worker_shows_a_push_message(gateway: Any, web: WebSurfaceServer, pw: Any, tmp_path: Path) -> None:
    """Chromium's own push-event path (CDP ServiceWorker.deliverPushMessage) with the contract's payload shows that notification."""
    ctx = await persistent(pw, tmp_path / "profile", web)
    try:
        page = await open_app(ctx, web.url)
        cdp = await ctx.new_cdp_session(page)
        regs: list[dict[str, Any]] = []
        cdp.on("ServiceWorker.workerRegistrationUpdated", lambda ev: regs.extend(ev["registrations"]))
        await cdp.send("ServiceWorker.enable")
        await until(lambda: regs, "the service worker registration")
        origin = f"http://{web.host}:{web.port}"
        payload = {  # as consumers/notify/channels.py renders it
            "title": "A decision waits",
            "body": "A decision from agent planner waits.",
            "url": f"{origin}/",
            "moment_id": "m" * 32,
            "tag": "pgw-" + "m" * 32,
        }
        await cdp.send("ServiceWorker.deliverPushMessage", {
            "origin": origin, "registrationId": regs[0]["registrationId"], "data": msgspec.json.encode(payload).decode(),
        })
        assert await notifications_shown(page) == [
            {"title": payload["title"], "body": payload["body"], "tag": payload["tag"], "data": {"url": payload["url"]}}
        ]
    finally:
        await ctx.close()
