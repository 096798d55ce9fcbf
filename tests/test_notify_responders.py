"""The notifier's bus responders (issue 17; docs/notifications.md; /work/notes/push-contract.md).

A real nats-server, a real Notifier: push.key, push.subscribe, push.unsubscribe
answer per the contract, subscriptions survive a restart (PGW_PUSH_SUBS), the
VAPID key is made once and kept, presence comes and goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from consumers.notify.service import Notifier
from consumers.notify.store import subscription_id
from consumers.notify.vapid import b64url, b64url_decode, load_or_create_vapid_key, vapid_key_path
from pgwcore.connect import connect
from subjects.client import Presence, Surface
from tests.polling import until


def browser_keys() -> tuple[ec.EllipticCurvePrivateKey, str, str]:
    """What a browser's PushManager makes: a P-256 key pair and a 16-byte auth secret."""
    priv = ec.generate_private_key(ec.SECP256R1())
    pub = priv.public_key().public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    return priv, b64url(pub), b64url(os.urandom(16))


def subscription(endpoint: str = "https://fcm.googleapis.com/fcm/send/abc") -> dict:
    _, p256dh, auth = browser_keys()
    return {"endpoint": endpoint, "expirationTime": None, "keys": {"p256dh": p256dh, "auth": auth}}


async def eventually(pred, *, timeout: float = 5.0, what: str = "condition"):
    async def probe():
        return pred()

    return await until(probe, timeout=timeout, what=what)


async def ask(nc, subject: str, body: object) -> dict:
    msg = await nc.request(subject, json.dumps(body).encode(), timeout=5)
    return json.loads(msg.data)


@pytest.fixture
async def notifier(make_config, nats_server, nc):
    config = make_config()
    ncn = await connect(nats_server.client_url, name="notifier")
    n = Notifier(config, ncn)
    async with n:
        yield n
    await ncn.drain()


async def test_push_key_subscribe_unsubscribe(notifier: Notifier, nc) -> None:
    s = notifier.subjects
    key = await ask(nc, s.push("alice", "key"), {})
    assert key["ok"] is True
    raw = b64url_decode(key["vapid_public_key"])
    assert len(raw) == 65 and raw[0] == 4
    ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), raw)  # a real P-256 point

    sub = subscription()
    r = await ask(nc, s.push("alice", "subscribe"), {"subscription": sub, "device": "phone"})
    assert r == {"ok": True, "id": subscription_id(sub["endpoint"])}
    again = await ask(nc, s.push("alice", "subscribe"), {"subscription": sub})
    assert again["id"] == r["id"], "the same endpoint is one subscription"
    stored = await notifier.store.subscriptions("alice")
    assert list(stored) == [r["id"]] and stored[r["id"]].endpoint == sub["endpoint"]
    assert await notifier.store.subscriptions("bob") == {}

    gone = await ask(nc, s.push("alice", "unsubscribe"), {"endpoint": sub["endpoint"]})
    assert gone == {"ok": True, "removed": True}
    assert await ask(nc, s.push("alice", "unsubscribe"), {"endpoint": sub["endpoint"]}) == {"ok": True, "removed": False}
    assert await notifier.store.subscriptions("alice") == {}


@pytest.mark.parametrize(("mutate", "words"), [
    (lambda b: b.update(subscription="x"), "PushSubscription"),
    (lambda b: b["subscription"].update(endpoint="http://fcm.googleapis.com/x"), "https"),
    (lambda b: b["subscription"].update(endpoint="https://evil.example/x"), "push_hosts"),
    (lambda b: b["subscription"]["keys"].update(p256dh=b64url(b"\x04" + b"\x01" * 64)), "not a point"),
    (lambda b: b["subscription"]["keys"].update(p256dh=b64url(b"\x04" * 33)), "65 bytes"),
    (lambda b: b["subscription"]["keys"].update(auth=b64url(b"short")), "16 bytes"),
    (lambda b: b["subscription"]["keys"].update(auth=7), "base64url"),
    (lambda b: b["subscription"].pop("keys"), "p256dh"),
])
async def test_bad_subscription_is_refused_with_a_reason(notifier: Notifier, nc, mutate, words: str) -> None:
    body = {"subscription": subscription()}
    mutate(body)
    r = await ask(nc, notifier.subjects.push("alice", "subscribe"), body)
    assert r["ok"] is False and r["error"] == "push_subscription_invalid"
    assert words in r["detail"]
    assert await notifier.store.subscriptions("alice") == {}


async def test_subscriptions_per_principal_are_capped(make_config, nats_server, nc) -> None:
    config = make_config(notifier={"push_max_per_principal": 2})
    ncn = await connect(nats_server.client_url, name="notifier")
    try:
        async with Notifier(config, ncn):
            s = config.subjects
            subs = [subscription(f"https://fcm.googleapis.com/fcm/send/{i}") for i in range(3)]
            for sub in subs[:2]:
                assert (await ask(nc, s.push("alice", "subscribe"), {"subscription": sub}))["ok"]
            r = await ask(nc, s.push("alice", "subscribe"), {"subscription": subs[2]})
            assert r["ok"] is False and r["error"] == "push_subscription_limit"
            assert (await ask(nc, s.push("alice", "subscribe"), {"subscription": subs[0]}))["ok"], "a renewal is no new one"
            assert (await ask(nc, s.push("bob", "subscribe"), {"subscription": subs[2]}))["ok"], "the cap is per principal"
    finally:
        await ncn.drain()


async def test_not_json_and_bad_unsubscribe(notifier: Notifier, nc) -> None:
    msg = await nc.request(notifier.subjects.push("alice", "subscribe"), b"{nope", timeout=5)
    r = json.loads(msg.data)
    assert r["ok"] is False and r["error"] == "bad_request"
    r = await ask(nc, notifier.subjects.push("alice", "unsubscribe"), {"url": "x"})
    assert r["ok"] is False and "endpoint" in r["detail"]


async def test_subscriptions_and_vapid_key_survive_a_restart(make_config, nats_server, nc) -> None:
    config = make_config()
    s = config.subjects
    ncn = await connect(nats_server.client_url, name="notifier")
    try:
        async with Notifier(config, ncn):
            first = (await ask(nc, s.push("alice", "key"), {}))["vapid_public_key"]
            sub = subscription()
            sid = (await ask(nc, s.push("alice", "subscribe"), {"subscription": sub}))["id"]
        assert oct(vapid_key_path(config.data_path).stat().st_mode & 0o777) == "0o600"
        async with Notifier(config, ncn) as again:
            assert (await ask(nc, s.push("alice", "key"), {}))["vapid_public_key"] == first
            assert list(await again.store.subscriptions("alice")) == [sid]
    finally:
        await ncn.drain()
    vapid_key_path(config.data_path).chmod(0o644)
    with pytest.raises(Exception, match="0600"):
        load_or_create_vapid_key(config.data_path)


async def test_presence_comes_and_goes(notifier: Notifier, nc) -> None:
    async with Presence(nc, "alice", surface="terminal", ttl_s=3) as p:
        await eventually(lambda: notifier.presence.present("alice"), what="presence heard")
        assert not notifier.presence.present("bob")
        # When the first announcement lapses unless a keep-alive beat renews it: present past that moment.
        lapses = max(notifier.presence._live["alice"].values())
        await eventually(lambda: time.monotonic() > lapses and notifier.presence.present("alice"),
                         timeout=p.ttl_s + 5, what="presence kept past its first ttl by the keep-alive beats")
    await eventually(lambda: not notifier.presence.present("alice"), what="ttl_s 0 heard")
    # A presence that is not renewed expires by itself.
    await nc.publish(notifier.subjects.presence("alice"), b'{"instance": "x", "surface": "web", "ttl_s": 1}')
    await eventually(lambda: notifier.presence.present("alice"), what="presence heard")
    await eventually(lambda: not notifier.presence.present("alice"), what="presence expired")


async def test_surface_items_keeps_presence_while_iterating(gateway, notifier: Notifier, nc) -> None:
    """subjects.client.Surface announces presence while items() runs, and ttl_s 0 when it stops."""
    surface = Surface(nc, "alice")
    it = surface.items().__aiter__()
    waiting = asyncio.ensure_future(it.__anext__())  # nothing pending: it waits for live items
    await eventually(lambda: notifier.presence.present("alice"), what="Surface presence")
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    await eventually(lambda: not notifier.presence.present("alice"), what="Surface gone (ttl_s 0)")


async def test_pgw_surface_keeps_presence(gateway, notifier: Notifier, nats_server) -> None:
    """The terminal surface (`pgw surface`, here in its --json --follow form) keeps presence too."""
    pgw = str(Path(sys.executable).parent / "pgw")
    proc = await asyncio.create_subprocess_exec(
        pgw, "--server", nats_server.client_url, "surface", "--principal", "alice", "--json", "--follow",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        await eventually(lambda: notifier.presence.present("alice"), timeout=30, what="pgw surface presence")
    finally:
        proc.terminate()
        await proc.wait()
