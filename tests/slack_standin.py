"""A loopback stand-in for the parts of Slack the Slack surface uses (test wiring).

The Web API methods the surface calls (``auth.test``, ``conversations.open``,
``conversations.history``, ``chat.postMessage``, ``chat.update``,
``chat.postEphemeral``, ``views.open``), with Slack's answers: ``{"ok": true,
...}`` or ``{"ok": false, "error": ...}``, ``invalid_auth`` for a wrong bot
token and HTTP 429 with ``Retry-After`` when told to. Every block payload is
checked with slack-sdk's own Block Kit classes (``slack_sdk.models.blocks`` /
``slack_sdk.models.views``): a block they refuse, or one that does not survive
their parse and ``to_dict()`` unchanged, is answered ``invalid_blocks`` as
Slack does, and counted in ``invalid``.

:func:`signed_interaction` builds what Slack POSTs to an interactivity URL:
the form body ``payload=<json>`` with ``X-Slack-Request-Timestamp`` and
``X-Slack-Signature`` (``v0=`` HMAC-SHA256 of ``v0:{ts}:{body}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from slack_sdk.models.blocks import Block
from slack_sdk.models.views import View

BOT_TOKEN = "xoxb-test-0000-standin"
APP_TOKEN = "xapp-1-test-0000-standin"
SIGNING_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
TEAM = "T0STANDIN"


def blocks_valid(blocks: Any) -> str | None:
    """None if slack-sdk's Block Kit models take every block unchanged, else why not."""
    if not isinstance(blocks, list) or len(blocks) > 50:
        return "blocks must be a list of at most 50"
    for b in blocks:
        try:
            parsed = Block.parse(b)
            again = parsed.to_dict() if parsed is not None else None
        except Exception as e:  # noqa: BLE001 - SlackObjectFormationError and friends
            return f"{b.get('type') if isinstance(b, dict) else b!r}: {e}"
        if again != b:
            return f"{b.get('type')!r} does not survive slack-sdk's model"
    return None


def view_valid(view: Any) -> str | None:
    try:
        again = View(**view).to_dict()
    except Exception as e:  # noqa: BLE001
        return f"view: {e}"
    if again != view:
        return "view does not survive slack-sdk's model"
    return blocks_valid(view.get("blocks", []))


@dataclass
class Message:
    channel: str
    ts: str
    text: str
    blocks: list[dict[str, Any]]
    metadata: dict[str, Any] | None
    versions: list[list[dict[str, Any]]] = field(default_factory=list)


@dataclass
class SlackStandin:
    url: str = ""
    messages: dict[tuple[str, str], Message] = field(default_factory=dict)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    views: list[dict[str, Any]] = field(default_factory=list)
    ephemerals: list[dict[str, Any]] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    rate_limit: dict[str, int] = field(default_factory=dict)  # method -> how many 429s to answer next
    retry_after: int = 1
    down: bool = False
    # Past this many chat.postMessage calls, each waits for ``released`` before it is answered (posts stay
    # in flight, for the kill -9 test); None: every post answered at once.
    hold_posts_after: int | None = None
    released: asyncio.Event = field(default_factory=asyncio.Event)
    socket_acks: list[dict[str, Any]] = field(default_factory=list)  # Socket Mode: what the app acknowledged
    sockets: list[web.WebSocketResponse] = field(default_factory=list)
    _seq: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def posted(self) -> list[Message]:
        return sorted(self.messages.values(), key=lambda m: m.ts)

    def of(self, moment_id: str) -> list[Message]:
        return [m for m in self.posted() if (m.metadata or {}).get("event_payload", {}).get("id") == moment_id]

    def count(self, method: str) -> int:
        return sum(1 for m, _ in self.calls if m == method)

    async def wait(self, pred: Any, timeout: float = 20.0) -> Any:
        async def loop() -> Any:
            while True:
                got = pred()
                if got:
                    return got
                self.changed.clear()
                await self.changed.wait()
        return await asyncio.wait_for(loop(), timeout)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        method = request.match_info["method"]
        if self.down:
            self.calls.append((method + ":down", {}))
            self.changed.set()
            return web.Response(status=503, text="down")
        if self.rate_limit.get(method, 0) > 0:
            self.rate_limit[method] -= 1
            self.calls.append((method + ":429", {}))
            return web.json_response({"ok": False, "error": "ratelimited"}, status=429,
                                     headers={"Retry-After": str(self.retry_after)})
        token = APP_TOKEN if method == "apps.connections.open" else BOT_TOKEN
        if request.headers.get("Authorization") != f"Bearer {token}":
            return web.json_response({"ok": False, "error": "invalid_auth"})
        args: dict[str, Any] = dict(request.query)
        if request.content_type == "application/json":
            args.update(await request.json())
        else:
            args.update(dict(await request.post()))
        for k in ("blocks", "view", "metadata"):
            if isinstance(args.get(k), str):
                args[k] = json.loads(args[k])
        self.calls.append((method, args))
        if method == "chat.postMessage" and self.hold_posts_after is not None \
                and self.count("chat.postMessage") > self.hold_posts_after:
            await self.released.wait()
        try:
            return web.json_response(self.answer(method, args))
        finally:
            self.changed.set()

    def _ts(self) -> str:
        self._seq += 1
        return f"{int(time.time())}.{self._seq:06d}"

    def answer(self, method: str, a: dict[str, Any]) -> dict[str, Any]:
        match method:
            case "apps.connections.open":
                return {"ok": True, "url": self.url.replace("http://", "ws://").replace("/api/", "/socket")}
            case "auth.test":
                return {"ok": True, "team": "Stand-in", "team_id": TEAM, "user": "pgw", "bot_id": "B0PGW"}
            case "conversations.open":
                return {"ok": True, "channel": {"id": "D" + str(a.get("users", "X"))[1:]}}
            case "chat.postMessage" | "chat.update":
                why = blocks_valid(a.get("blocks", []))
                if why:
                    self.invalid.append(why)
                    return {"ok": False, "error": "invalid_blocks", "errors": [why]}
                ch = str(a["channel"])
                if method == "chat.postMessage":
                    ts = self._ts()
                    self.messages[(ch, ts)] = Message(ch, ts, a.get("text", ""), a.get("blocks", []), a.get("metadata"))
                    return {"ok": True, "channel": ch, "ts": ts}
                msg = self.messages.get((ch, str(a["ts"])))
                if msg is None:
                    return {"ok": False, "error": "message_not_found"}
                msg.versions.append(msg.blocks)
                msg.blocks, msg.text = a.get("blocks", []), a.get("text", "")
                return {"ok": True, "channel": ch, "ts": msg.ts}
            case "conversations.history":
                oldest = float(a.get("oldest") or 0)
                ms = [m for m in self.posted() if m.channel == a.get("channel") and float(m.ts) >= oldest]
                return {"ok": True, "messages": [
                    {"type": "message", "ts": m.ts, "text": m.text, "metadata": m.metadata} for m in reversed(ms)]}
            case "chat.postEphemeral":
                self.ephemerals.append(a)
                return {"ok": True, "message_ts": self._ts()}
            case "views.open":
                why = view_valid(a.get("view"))
                if why:
                    self.invalid.append(why)
                    return {"ok": False, "error": "invalid_arguments", "response_metadata": {"messages": [why]}}
                view = {**a["view"], "id": f"V{len(self.views):08d}", "team_id": TEAM}
                self.views.append({"trigger_id": a.get("trigger_id"), "view": view})
                return {"ok": True, "view": view}
        return {"ok": False, "error": "unknown_method"}


@contextlib.asynccontextmanager
async def slack_standin() -> AsyncIterator[SlackStandin]:
    s = SlackStandin()
    app = web.Application()
    app.router.add_route("*", "/api/{method}", s.handle)  # slack-sdk GETs a few read methods

    async def socket_route(request: web.Request) -> web.WebSocketResponse:
        return await _socket(s, request)

    app.router.add_get("/socket", socket_route)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    s.url = f"http://127.0.0.1:{port}/api/"
    try:
        yield s
    finally:
        s.released.set()  # a held post ends before the server does
        for ws in s.sockets:
            await ws.close()
        await runner.cleanup()


async def _socket(s: SlackStandin, request: web.Request) -> web.WebSocketResponse:
    """Socket Mode as Slack speaks it: ``hello``, then envelopes; the app acknowledges each by envelope_id."""
    ws = web.WebSocketResponse(autoping=True)
    await ws.prepare(request)
    await ws.send_json({"type": "hello", "num_connections": 1, "connection_info": {"app_id": "A0PGW"}})
    s.sockets.append(ws)
    s.changed.set()
    async for msg in ws:
        if msg.type == web.WSMsgType.TEXT:
            s.socket_acks.append(json.loads(msg.data))
            s.changed.set()
    return ws


async def socket_send(s: SlackStandin, envelope_id: str, payload: dict[str, Any]) -> None:
    """Deliver an interaction over Socket Mode (``type: interactive``), as Slack does."""
    await s.sockets[-1].send_json({"envelope_id": envelope_id, "type": "interactive", "payload": payload,
                                   "accepts_response_payload": payload.get("type") == "view_submission"})


def sign(body: str, ts: int, secret: str = SIGNING_SECRET) -> str:
    return "v0=" + hmac.new(secret.encode(), f"v0:{ts}:{body}".encode(), hashlib.sha256).hexdigest()


def signed_interaction(payload: dict[str, Any], *, ts: int | None = None,
                       secret: str = SIGNING_SECRET) -> tuple[bytes, dict[str, str]]:
    """The body and headers Slack POSTs for ``payload`` (form-encoded, signed)."""
    ts = int(time.time()) if ts is None else ts
    body = "payload=" + urllib.parse.quote(json.dumps(payload))
    return body.encode(), {"Content-Type": "application/x-www-form-urlencoded",
                           "X-Slack-Request-Timestamp": str(ts), "X-Slack-Signature": sign(body, ts, secret)}


def _user(user: str) -> dict[str, Any]:
    return {"id": user, "username": user.lower(), "name": user.lower(), "team_id": TEAM}


def button_press(msg: Message, action_id: str, user: str) -> dict[str, Any]:
    """A ``block_actions`` payload as Slack sends it when ``user`` presses ``action_id`` on ``msg``."""
    for b in msg.blocks:
        elements = b.get("elements", []) if b["type"] == "actions" else [b.get("accessory")] if b.get("accessory") else []
        for el in elements:
            if el.get("action_id") == action_id:
                return {
                    "type": "block_actions", "user": _user(user), "api_app_id": "A0PGW", "token": "legacy-unused",
                    "container": {"type": "message", "message_ts": msg.ts, "channel_id": msg.channel,
                                  "is_ephemeral": False},
                    "trigger_id": f"{int(time.time())}.1234.{hashlib.md5(msg.ts.encode()).hexdigest()[:8]}",
                    "team": {"id": TEAM, "domain": "standin"},
                    "channel": {"id": msg.channel, "name": "directmessage"},
                    "message": {"type": "message", "ts": msg.ts, "text": msg.text, "blocks": msg.blocks},
                    "response_url": "https://hooks.slack.invalid/actions/T0/1/x",
                    "actions": [{"action_id": action_id, "block_id": b.get("block_id", "b"), "text": el["text"],
                                 "value": el.get("value"), "type": "button", "action_ts": str(time.time())}],
                }
    raise AssertionError(f"no button {action_id!r} on the message")


def view_submission(view: dict[str, Any], user: str, values: dict[str, str]) -> dict[str, Any]:
    """A ``view_submission`` payload: ``values`` maps an input block id to the text typed."""
    state = {bid: {"text": {"type": "plain_text_input", "value": v}} for bid, v in values.items()}
    return {"type": "view_submission", "team": {"id": TEAM, "domain": "standin"}, "user": _user(user),
            "api_app_id": "A0PGW", "token": "legacy-unused", "trigger_id": "1.2.3",
            "view": {**view, "state": {"values": state}, "hash": "1.abc"}}
