"""The installed app and the notifier together (issue 17), with isolation on.

A real nats-server enforcing per-party credentials, the real gateway, the
real notifier (``consumers.notify``) as ``service:notifier``, the page in
headless Chromium as ``principal:alice`` (her nkey over the WebSocket
listener), and the loopback push service of tests/push_peer.py that decrypts
with the reference ``http_ece`` and checks the VAPID JWT.

What is real and what is not:

- The page's subscription reaches the notifier over the bus on the page's
  own connection with alice's credentials, and is stored. Here the
  subscription is made by the push-service peer (its endpoint and keys), so
  that http_ece can decrypt what the notifier sent; Chromium's own
  pushManager.subscribe, end to end through a loopback GCM stand-in, is
  tests/test_surface_push_gcm.py. Without that stand-in Chromium cannot reach
  its push service (Google's FCM; no internet): on a persistent profile the
  call had not settled after 40 s (the page gives up after 30 s), in
  incognito it fails at once and the page says so (tested below). No
  PushManager is faked.
- Presence from the open page makes the notifier hold back its push while
  the page itself shows the desktop notification; once the page is gone
  (ttl_s 0 on pagehide) the next moment is pushed, and the payload the push
  service decrypted is shown by the app's service worker through Chromium's
  own push-event path (CDP ServiceWorker.deliverPushMessage).
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from consumers.notify.service import Notifier
from subjects.client import Agent
from tests.polling import until
from tests.push_bed import secured_push_bed
from tests.push_peer import push_service

sys.path.insert(0, str(Path(__file__).parent / "web"))
from pwa_kit import NOTIFY_ARGS, SET_VISIBILITY, notifications_shown, open_app
from surface_kit import CHROMIUM, CHROMIUM_ARGS, browser_ready, moment

WAIT = 20.0
MS = int(WAIT * 1000)

_REASON = browser_ready()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.fixture
async def bed(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """Server with isolation, gateway, notifier and alice's page server (its URL is the notifier's link)."""
    async with push_service() as ps, secured_push_bed(
            tmp_path, {"push_hosts": ["127.0.0.1"], "push_allow_http": True}) as bed:
        yield {**bed, "push": ps}


async def send(agent: Agent) -> str:
    eid = await agent.send_moment("alice", moment(), expires_in_s=600)
    out = await agent.outcome_for(eid, timeout=WAIT)
    assert out.status == "accepted" and out.moment_id, out
    return out.moment_id


async def push_jobs(notifier: Notifier, moment_id: str) -> list[Any]:
    jobs = []
    for key in await notifier.store.job_keys():
        got = await notifier.store.get_job(key)
        if got and got[0].moment_id == moment_id and got[0].channel.startswith("push"):
            jobs.append(got[0])
    return jobs


async def settled_push(notifier: Notifier, moment_id: str) -> Any:
    async def probe() -> Any:
        jobs = await push_jobs(notifier, moment_id)
        return jobs if jobs and all(j.status not in ("scheduled", "sending") for j in jobs) else None

    [job] = await until(probe, timeout=WAIT, what=f"the push job of {moment_id} settled")
    return job


async def test_open_page_suppresses_the_push_and_a_closed_one_gets_it(bed: dict[str, Any]) -> None:
    """Subscription over the bus as alice; while the page is open (hidden) it notifies and the notifier does not push; after pagehide the next moment is pushed, decrypted by http_ece, and shown by the service worker; the page's unsubscribe removes it."""
    from playwright.async_api import async_playwright

    web, notifier, ps = bed["web"], bed["notifier"], bed["push"]
    async with async_playwright() as pw:
        ctx = await pw.chromium.launch_persistent_context(
            str(bed["tmp"] / "profile"), executable_path=CHROMIUM, args=[*CHROMIUM_ARGS, *NOTIFY_ARGS])
        try:
            await ctx.grant_permissions(["notifications"], origin=bed["base"].rstrip("/"))
            page = await open_app(ctx, web.url)
            await until(lambda: _async(notifier.presence.present("alice")), timeout=WAIT, what="the page's presence")

            # The bus leg of "Notify me on this device", on the page's own connection.
            _, sub = await ps.new_subscription()
            reply = await page.evaluate("sub => window.pgwReach.sendSubscription(sub)", sub)
            assert reply["ok"] is True and reply["id"], reply
            stored = await notifier.store.subscriptions("alice")
            assert [s.endpoint for s in stored.values()] == [sub["endpoint"]]
            assert next(iter(stored.values())).device  # the page's device label

            # Open but hidden: the page notifies, the notifier holds back.
            await page.evaluate(SET_VISIBILITY, "hidden")
            first = await send(bed["agent"])
            [shown] = await notifications_shown(page, by_page=1)
            assert shown["title"] == "A decision waits" and shown["tag"] == f"pgw-{first}"
            assert (await settled_push(notifier, first)).status == "suppressed"
            assert await ps.received() == []

            # The page goes (pagehide: ttl_s 0): the next moment is pushed.
            await page.close(run_before_unload=True)
            await until(lambda: _async(not notifier.presence.present("alice")), timeout=WAIT, what="presence gone")
            second = await send(bed["agent"])
            assert (await settled_push(notifier, second)).status == "sent"
            [got] = await ps.received()
            assert got["vapid_ok"], got.get("vapid_error")
            payload = got["payload"]
            assert payload == {"title": "A decision waits", "body": "A decision from agent planner waits.",
                               "url": bed["base"], "moment_id": second, "tag": f"pgw-{second}"}

            # What the push service decrypted, through Chromium's own push-event path into the app's worker.
            page = await ctx.new_page()
            await page.goto(bed["base"])  # start_url: the kept token, no ?t=
            await page.wait_for_selector("body[data-ready=true]", timeout=MS)
            cdp = await ctx.new_cdp_session(page)
            regs: list[dict[str, Any]] = []
            cdp.on("ServiceWorker.workerRegistrationUpdated", lambda ev: regs.extend(ev["registrations"]))
            await cdp.send("ServiceWorker.enable")
            await until(lambda: _async(bool(regs)), timeout=WAIT, what="the service worker registration")
            await cdp.send("ServiceWorker.deliverPushMessage", {
                "origin": bed["base"].rstrip("/"), "registrationId": regs[0]["registrationId"],
                "data": json.dumps(payload)})
            shown_now = await notifications_shown(page)
            assert {"title": "A decision waits", "body": "A decision from agent planner waits.",
                    "tag": f"pgw-{second}", "data": {"url": bed["base"]}} in shown_now
            assert moment()["synopsis"] not in json.dumps(shown_now)

            # The page's "stop" path, on its own connection: the notifier forgets the endpoint.
            assert await page.evaluate("e => window.pgwReach.forget(e)", sub["endpoint"]) == {"ok": True, "removed": True}
            assert await notifier.store.subscriptions("alice") == {}
        finally:
            await ctx.close()


async def test_notify_button_gets_the_key_as_alice_then_the_browser_cannot_subscribe(bed: dict[str, Any]) -> None:
    """With alice's credentials the page gets the notifier's VAPID key; Chromium then cannot reach its push service (incognito: refused at once) and the page says so."""
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            ctx = await browser.new_context()
            await ctx.grant_permissions(["notifications"], origin=bed["base"].rstrip("/"))
            page = await ctx.new_page()
            await page.goto(bed["web"].url)
            await page.wait_for_selector("body[data-ready=true]", timeout=MS)
            await page.get_by_role("button", name="Notify me on this device").click()
            status = page.locator("#reach-status[data-kind=refused]")
            await status.wait_for(timeout=MS)
            text = await status.inner_text()
            assert "could not register with its push service" in text, text  # past the key request, as alice
            assert await bed["notifier"].store.subscriptions("alice") == {}
        finally:
            await browser.close()


async def _async(value: Any) -> Any:
    return value
