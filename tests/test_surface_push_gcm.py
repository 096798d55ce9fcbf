"""Chromium's own Web Push, end to end with the notifier (issue 17), with isolation on.

The page's "Notify me on this device" makes Chromium's ``pushManager.subscribe``
register with its push service; the subscription (Chromium's endpoint, and the
p256dh/auth keys Chromium generated, its private key never leaving it) goes to
the notifier over the bus on the page's own connection as ``principal:alice``.
With the page gone, a moment makes the notifier encrypt a push to those keys
and POST it with VAPID; Chromium receives it on its GCM connection, decrypts
it itself and the app's service worker shows the notification.

Chromium's push service is Google's (GCM/FCM), unreachable here: it is stood
in on loopback by tests/gcm_standin.py (a TEST STAND-IN: its docstring says
what is real and what is not), reached through Chromium's own switches
``--gcm-checkin-url``, ``--gcm-registration-url``, ``--gcm-mcs-endpoint``.
Everything else is real: nats-server with per-party credentials, the
gateway, the notifier, the page, Chromium's GCM client, its decryption and
its push event. No PushManager is faked and nothing is delivered over CDP.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from consumers.notify.service import Notifier
from consumers.notify.vapid import load_or_create_vapid_key
from tests.gcm_standin import GOOGLE_HOSTS, check_vapid, gcm_standin
from tests.polling import until
from tests.push_bed import secured_push_bed

sys.path.insert(0, str(Path(__file__).parent / "web"))
from pwa_kit import MS, NOTIFY_ARGS, WAIT, notifications_shown, open_app
from surface_kit import CHROMIUM, CHROMIUM_ARGS, browser_ready, moment

_REASON = browser_ready()
needs_chromium = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@pytest.fixture
async def bed(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """Server with isolation, gateway, notifier (its HTTP client reaching the GCM stand-in) and alice's page server."""
    async with gcm_standin() as gcm, secured_push_bed(tmp_path, {"push_hosts": list(GOOGLE_HOSTS)}) as bed:
        notifier = bed["notifier"]
        assert notifier.http is not None
        await notifier.http.close()
        notifier.http = gcm.client_session()  # Google's push hosts -> the loopback stand-in
        yield {**bed, "gcm": gcm}


async def _push_job(notifier: Notifier, moment_id: str) -> Any:
    async def probe() -> Any:
        for key in await notifier.store.job_keys():
            got = await notifier.store.get_job(key)
            if got and got[0].moment_id == moment_id and got[0].channel.startswith("push") \
                    and got[0].status not in ("scheduled", "sending"):
                return got[0]
        return None

    return await until(probe, timeout=WAIT, what=f"the push job of {moment_id} settled")


@needs_chromium
async def test_chromium_subscribes_and_shows_the_notifiers_push(bed: dict[str, Any]) -> None:
    """Button -> Chromium's own subscription -> notifier over the bus as alice; page gone -> encrypted push -> Chromium decrypts -> service worker shows it."""
    from playwright.async_api import async_playwright

    web, notifier, gcm = bed["web"], bed["notifier"], bed["gcm"]
    async with async_playwright() as pw:
        ctx = await pw.chromium.launch_persistent_context(
            str(bed["tmp"] / "profile"), executable_path=CHROMIUM,
            args=[*CHROMIUM_ARGS, *NOTIFY_ARGS, *gcm.chromium_args()])
        try:
            await ctx.grant_permissions(["notifications"], origin=bed["base"].rstrip("/"))
            page = await open_app(ctx, web.url)
            await until(lambda: _async(notifier.presence.present("alice")), timeout=WAIT, what="the page's presence")

            # "Notify me on this device": the notifier's VAPID key as alice, Chromium subscribes, the page sends it on.
            await page.get_by_role("button", name="Notify me on this device").click()
            await page.locator("#reach-status[data-kind=ok]").wait_for(timeout=MS)
            browser_sub = await page.evaluate(
                "(async () => (await (await navigator.serviceWorker.ready).pushManager.getSubscription()).toJSON())()")
            [reg] = gcm.web_push_registrations()
            assert gcm.checkins >= 1
            assert reg.sender == notifier.vapid.public_b64url  # Chromium registered with the notifier's key
            assert urlsplit(browser_sub["endpoint"]).hostname in GOOGLE_HOSTS
            assert browser_sub["endpoint"].endswith(f"/fcm/send/{reg.token}")
            [stored] = (await notifier.store.subscriptions("alice")).values()
            assert (stored.endpoint, stored.p256dh, stored.auth) == (
                browser_sub["endpoint"], browser_sub["keys"]["p256dh"], browser_sub["keys"]["auth"])

            # The page goes (pagehide: presence ttl 0): the next moment is pushed to Chromium.
            await page.close(run_before_unload=True)
            await until(lambda: _async(not notifier.presence.present("alice")), timeout=WAIT, what="presence gone")
            eid = await bed["agent"].send_moment("alice", moment(), expires_in_s=600)
            out = await bed["agent"].outcome_for(eid, timeout=WAIT)
            assert out.status == "accepted" and out.moment_id, out
            job = await _push_job(notifier, out.moment_id)
            assert job.status == "sent", job
            [push] = gcm.pushes
            assert push.token == reg.token and push.vapid_error is None, push

            # Chromium decrypted it with its own key and the app's service worker showed it. Read from
            # a document of the origin that runs none of the app's script (an icon): only the worker's
            # push event can have shown it.
            page = await ctx.new_page()
            page.errors = []
            await page.goto(bed["base"] + "static/icons/icon-192.png")
            shown = await notifications_shown(page)
            assert {"title": "A decision waits", "body": "A decision from agent planner waits.",
                    "tag": f"pgw-{out.moment_id}", "data": {"url": bed["base"]}} in shown, shown
            assert moment()["synopsis"] not in str(shown)
        finally:
            await ctx.close()


def test_the_standin_checks_vapid_as_fcm_does(tmp_path: Path) -> None:
    """The stand-in's push resource refuses a VAPID header for another key, another origin, or a forged signature."""
    key, other = load_or_create_vapid_key(tmp_path / "a"), load_or_create_vapid_key(tmp_path / "b")
    endpoint = "https://jmt17.google.com/fcm/send/t1"
    good = key.authorization(endpoint, "mailto:ops@example.org")
    assert check_vapid(good, key.public_b64url, "https://jmt17.google.com") is None
    assert "applicationServerKey" in str(check_vapid(good, other.public_b64url, "https://jmt17.google.com"))
    assert "aud" in str(check_vapid(good, key.public_b64url, "https://fcm.googleapis.com"))
    forged = other.authorization(endpoint, "mailto:ops@example.org").replace(other.public_b64url, key.public_b64url)
    assert "bad VAPID JWT" in str(check_vapid(forged, key.public_b64url, "https://jmt17.google.com"))


async def _async(value: Any) -> Any:
    return value
