"""The notifier's side of the surface contract (docs/notifications.md, /work/notes/push-contract.md).

- ``principal.P.push.key`` -> ``{"ok": true, "vapid_public_key": <base64url 65-byte point>}``
- ``principal.P.push.subscribe`` ``{"subscription": PushSubscription.toJSON(), "device"?}``
  -> ``{"ok": true, "id"}``; a bad subscription -> ``push_subscription_invalid``
- ``principal.P.push.unsubscribe`` ``{"endpoint"}`` -> ``{"ok": true, "removed": bool}``
- ``principal.P.presence`` ``{"instance", "surface", "ttl_s"}`` (no reply): a surface of P is
  open for ``ttl_s`` seconds; ``ttl_s: 0`` = gone.

P is read from the subject, which the server lets only P's credentials publish
(gateway/security/permissions.py), so a principal manages only its own
subscriptions. Requests are served in the queue group ``pgw-notifier``;
presence is heard by every notifier instance (held in memory, with expiry).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import msgspec
from cryptography.hazmat.primitives.asymmetric import ec

from consumers.notify.store import PushSubscription, Store, subscription_id
from consumers.notify.vapid import VapidKey, b64url_decode
from pgwcore.logs import get_logger
from pgwcore.respond import Responder, release_requests_connection, requests_connection
from subjects.names import check_token

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from pgwcore.notifier_config import NotifierConfig

log = get_logger("pgw.notifier")
QUEUE = "pgw-notifier"
MAX_ENDPOINT = 2048
_enc = msgspec.json.Encoder()


class Invalid(ValueError):
    """A request the notifier refuses; ``code`` goes in the reply."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{code}: {detail}")


def host_allowed(host: str, patterns: list[str]) -> bool:
    host = host.lower().rstrip(".")
    for pattern in patterns:
        p = pattern.lower()
        if p.startswith("*.") and host.endswith(p[1:]) and host != p[2:]:
            return True
        if host == p:
            return True
    return False


def parse_subscription(body: Any, cfg: NotifierConfig) -> PushSubscription:
    """Check a ``push.subscribe`` body; Invalid with a human reason otherwise."""
    bad = "push_subscription_invalid"
    if not isinstance(body, dict) or not isinstance(body.get("subscription"), dict):
        raise Invalid(bad, 'the body must be {"subscription": PushSubscription.toJSON(), "device"?: str}')
    sub = body["subscription"]
    endpoint = sub.get("endpoint")
    if not isinstance(endpoint, str) or not endpoint or len(endpoint) > MAX_ENDPOINT:
        raise Invalid(bad, f"subscription.endpoint must be a URL of at most {MAX_ENDPOINT} characters")
    parts = urlsplit(endpoint)
    if parts.scheme != "https" and not (parts.scheme == "http" and cfg.push_allow_http):
        raise Invalid(bad, "subscription.endpoint must be an https:// URL (RFC 8030 §8)")
    if not parts.hostname or not host_allowed(parts.hostname, cfg.push_hosts):
        raise Invalid(bad, f"push service host {parts.hostname!r} is not in notifier.push_hosts")
    keys = sub.get("keys")
    if not isinstance(keys, dict):
        raise Invalid(bad, "subscription.keys must hold p256dh and auth")
    try:
        p256dh = b64url_decode(keys.get("p256dh"))
        auth = b64url_decode(keys.get("auth"))
    except (ValueError, TypeError) as e:
        raise Invalid(bad, "subscription.keys.p256dh and .auth must be base64url") from e
    if len(p256dh) != 65 or p256dh[0] != 4:
        raise Invalid(bad, "subscription.keys.p256dh must be an uncompressed P-256 point (65 bytes, RFC 8291 §3.1)")
    try:
        ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), p256dh)
    except ValueError as e:
        raise Invalid(bad, "subscription.keys.p256dh is not a point on P-256") from e
    if len(auth) != 16:
        raise Invalid(bad, "subscription.keys.auth must be 16 bytes (RFC 8291 §3.2)")
    exp = sub.get("expirationTime")
    if exp is not None and (not isinstance(exp, int | float) or isinstance(exp, bool)):
        raise Invalid(bad, "subscription.expirationTime must be null or a number (ms since the epoch)")
    device = body.get("device")
    if device is not None and (not isinstance(device, str) or len(device) > 200):
        raise Invalid(bad, "device must be a string of at most 200 characters")
    return PushSubscription(endpoint=endpoint, p256dh=keys["p256dh"], auth=keys["auth"], device=device,
                            expiration_time=exp / 1000.0 if exp else None, created_at=time.time())


class Presence:
    """Which principals have an open surface: ``{P: {instance: expires (monotonic)}}``."""

    MAX_TTL_S = 3600

    def __init__(self) -> None:
        self._live: dict[str, dict[str, float]] = {}

    def heard(self, principal: str, instance: str, ttl_s: float) -> None:
        mine = self._live.setdefault(principal, {})
        if ttl_s <= 0:
            mine.pop(instance, None)
        else:
            mine[instance] = time.monotonic() + min(ttl_s, self.MAX_TTL_S)
        if not mine:
            self._live.pop(principal, None)

    def present(self, principal: str) -> bool:
        now = time.monotonic()
        mine = self._live.get(principal, {})
        for inst in [i for i, exp in mine.items() if exp <= now]:
            del mine[inst]
        return bool(mine)

    def count(self) -> int:
        return sum(1 for p in list(self._live) if self.present(p))


class Responders:
    """Subscribes the four subjects; replies per the contract."""

    def __init__(self, nc: Client, prefix: str, cfg: NotifierConfig, store: Store, vapid: VapidKey,
                 presence: Presence) -> None:
        self.nc = nc
        self.prefix = prefix
        self.responder = Responder(prefix, "notifier")  # docs/security.md "Replies"
        self._rnc: Client | None = None
        self.cfg = cfg
        self.store = store
        self.vapid = vapid
        self.presence = presence
        self._subs: list[Any] = []
        self._depth = len(prefix.split("."))

    async def start(self) -> None:
        p = self.prefix
        self._rnc = await requests_connection(self.nc)  # push.* are requests: the answering connection
        self._subs = [
            await self._rnc.subscribe(f"{p}.principal.*.push.*", queue=QUEUE, cb=self._on_push),
            await self.nc.subscribe(f"{p}.principal.*.presence", cb=self._on_presence),
        ]

    async def stop(self) -> None:
        subs, self._subs = self._subs, []
        for s in subs:
            try:
                await s.unsubscribe()
            except Exception:
                log.debug("unsubscribe failed", exc_info=True)
        rnc, self._rnc = self._rnc, None
        await release_requests_connection(self.nc, rnc)

    def _principal(self, subject: str) -> str:
        return check_token(subject.split(".")[self._depth + 1], "principal token")

    async def _reply(self, msg: Msg, body: dict[str, Any]) -> None:
        await self.responder.answer(msg, _enc.encode(body))

    async def _on_push(self, msg: Msg) -> None:
        if not self.responder.admits(msg):
            return
        verb = msg.subject.rsplit(".", 1)[-1]
        try:
            principal = self._principal(msg.subject)
            try:
                body = msgspec.json.decode(msg.data or b"{}")
            except msgspec.DecodeError as e:
                raise Invalid("bad_request", f"the body is not JSON: {e}") from e
            reply = await self._handle(principal, verb, body)
        except Invalid as e:
            reply = {"ok": False, "error": e.code, "detail": e.detail}
        except ValueError as e:
            reply = {"ok": False, "error": "bad_request", "detail": str(e)}
        except Exception as e:
            log.exception("push request failed", subject=msg.subject)
            reply = {"ok": False, "error": "internal", "detail": type(e).__name__}
        await self._reply(msg, reply)

    async def _handle(self, principal: str, verb: str, body: Any) -> dict[str, Any]:
        match verb:
            case "key":
                return {"ok": True, "vapid_public_key": self.vapid.public_b64url}
            case "subscribe":
                sub = parse_subscription(body, self.cfg)
                have = await self.store.subscriptions(principal)
                if subscription_id(sub.endpoint) not in have and len(have) >= self.cfg.push_max_per_principal:
                    raise Invalid("push_subscription_limit", f"{len(have)} subscriptions already "
                                  f"(notifier.push_max_per_principal); unsubscribe an old device first")
                sid = await self.store.put_subscription(principal, sub)
                # Not the device label: the principal's own words, kept only in her subscription.
                log.info("push subscription stored", principal=principal, id=sid,
                         push_host=urlsplit(sub.endpoint).hostname)
                return {"ok": True, "id": sid}
            case "unsubscribe":
                endpoint = body.get("endpoint") if isinstance(body, dict) else None
                if not isinstance(endpoint, str) or not endpoint:
                    raise Invalid("bad_request", 'the body must be {"endpoint": "<url>"}')
                removed = await self.store.delete_subscription(principal, subscription_id(endpoint))
                log.info("push subscription removed", principal=principal, removed=removed)
                return {"ok": True, "removed": removed}
        raise Invalid("bad_request", f"unknown push verb {verb!r}")

    async def _on_presence(self, msg: Msg) -> None:
        try:
            principal = self._principal(msg.subject)
            body = msgspec.json.decode(msg.data)
            instance, ttl = body["instance"], body["ttl_s"]
            if not isinstance(instance, str) or not 1 <= len(instance) <= 128:
                raise ValueError("instance must be a string of 1-128 characters")
            if not isinstance(ttl, int | float) or isinstance(ttl, bool) or ttl < 0:
                raise ValueError("ttl_s must be a number >= 0")
        except (ValueError, KeyError, TypeError, msgspec.DecodeError) as e:
            log.warning("presence message ignored", subject=msg.subject, error=str(e)[:200])
            return
        self.presence.heard(principal, instance, float(ttl))
