"""Helpers of the installable-app tests (tests/test_surface_pwa.py, tests/test_surface_push.py)."""

from __future__ import annotations

from typing import Any

WAIT = 20.0
MS = int(WAIT * 1000)

# Chromium's own notification centre, not the desktop's over D-Bus (there is no desktop
# here): while Chromium probes D-Bus a fresh profile's first notification could be lost.
NOTIFY_ARGS = ["--disable-features=NativeNotifications,SystemNotifications"]

# Headless Chromium keeps every page "visible"; the page reads only these two.
SET_VISIBILITY = """state => {
  Object.defineProperty(document, 'visibilityState', {configurable: true, get: () => state});
  Object.defineProperty(document, 'hidden', {configurable: true, get: () => state === 'hidden'});
  document.dispatchEvent(new Event('visibilitychange'));
}"""
NOTIFICATIONS = """async () => {
  const reg = await navigator.serviceWorker.ready;
  return (await reg.getNotifications()).map(n => ({title: n.title, body: n.body, tag: n.tag, data: n.data}));
}"""


async def open_app(ctx: Any, url: str) -> Any:
    page = ctx.pages[0] if ctx.pages else await ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: m.type == "warning" and errors.append(m.text))  # e.g. "notification not shown"
    page.errors = errors
    await page.goto(url)
    await page.wait_for_selector("body[data-ready=true]", timeout=MS)
    await page.evaluate("navigator.serviceWorker.ready")
    # A first read of the notification store before anything is shown: in about one
    # run in five headless Chromium otherwise lost the first notification of a fresh
    # profile (its notification service starts lazily).
    assert await page.evaluate(NOTIFICATIONS) == []
    return page


async def notifications_shown(page: Any, *, by_page: int | None = None) -> list[dict[str, Any]]:
    """The service worker registration's notifications, once there is at least one.

    ``by_page``: first wait until the page says it has shown that many. Each
    getNotifications() makes Chromium drop stored notifications it does not see
    displayed, so reading while one is being displayed can lose it.
    """
    if by_page is not None:
        await page.wait_for_selector(f"html[data-notified='{by_page}']", state="attached", timeout=MS)
    else:
        await page.wait_for_timeout(1000)
    for _ in range(int(WAIT * 2)):
        if shown := await page.evaluate(NOTIFICATIONS):
            return shown
        await page.wait_for_timeout(500)
    state = await page.evaluate("[document.visibilityState, Notification.permission]")
    raise AssertionError(f"no notification shown (visibility, permission: {state}; page errors: {page.errors})")
