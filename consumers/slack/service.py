"""``pgw surface-slack``: principals read and answer their binding moments in Slack.

One process serves every principal of ``[slack.principals]``; each principal
has a *lane* with its own NATS identity (``slack:P``, docs/contract.md), which
may read only P's surface items (a durable ``slack-P`` on ``PGW_SURFACE`` that
the gateway creates), answer only P's moments (``principal.P.resolve``) and
keep only P's records (keys ``P.*`` of the KV bucket ``PGW_SLACK``).

What is stored where, and what survives a crash:

* ``PGW_SLACK`` key ``{P}.{moment or item id}``: the record of one item on
  Slack: ``posting`` (written *before* ``chat.postMessage``), ``open`` with
  the channel and ``ts`` of the message, ``closed`` with the status shown.
  The item is acked on ``PGW_SURFACE`` only once its record says what is on
  Slack, so a restart redelivers it and finds the record: it updates the
  message instead of posting again. A record left ``posting`` (killed between
  the post and the record) is reconciled from the channel's history, where
  every message we post carries the moment id in its metadata.
* Slack unreachable or rate-limited: slack-sdk retries 429s after their
  ``Retry-After`` and connection errors (``slack.max_retries``); then the item
  is nak'ed with exponential back-off and comes again. Nothing is acked that
  is not on Slack.

Rendering goes through the shared render model (consumers/surfaces/model.py,
spec 000 §9) and ``blocks.py``. Only what the gateway put on the surface
subject, already redacted, reaches Slack.

Answers: a button press or a modal arrives over HTTP (signed by Slack,
``verify.py``) or Socket Mode; the Slack user must be the one configured for
the principal the message belongs to (anyone else gets an ephemeral refusal
and a log line); the answer goes to ``principal.P.resolve`` like any other
surface's (first answer wins, the others get ``withdrawn``). Every message of
a moment is then updated in place and loses its buttons, as it is when the
moment is answered elsewhere, expires or is withdrawn.

- A button's value and a modal's metadata are ours (``{"p", "m", "k"[, "i"]}``);
  any other shape, or a moment id that is not one (``*``, ``>``), is refused
  with HTTP 400 before anything is read. A press counts only on the message it
  was pressed on: the record of the moment its value names must list that
  message (or, while still ``posting``, the message's metadata must name it,
  or the channel's history must show it as the moment's post).
- The principal's own words (a free text, an objection) are shown only in the
  form the gateway recorded, after SR-1 redaction (``ResolveReply.resolution``,
  what the agent gets), and never stored: the record's ``detail`` says which
  kind of answer it was, the words go to Slack's message update alone
  (spec 000 §13; docs/security.md "Data at rest"). A message re-synced from
  the record after a restart shows the kind without the words.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qs

import msgspec
from aiohttp import web
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import (
    BadRequestError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue
from slack_sdk.errors import SlackApiError, SlackClientError
from slack_sdk.http_retry.builtin_async_handlers import (
    AsyncConnectionErrorRetryHandler,
    AsyncRateLimitErrorRetryHandler,
)
from slack_sdk.web.async_client import AsyncWebClient

from consumers.slack import blocks as kit
from consumers.slack.verify import Refusal, RequestGuard
from consumers.surfaces.model import (
    ClarificationPlan,
    DecisionPlan,
    Plan,
    WithdrawPlan,
    plan_item,
)
from pgwcore import health
from pgwcore.connect import close_quietly, connect
from pgwcore.logs import get_logger
from pgwcore.metrics import acquire_server
from pgwcore.slack_config import SLACK_BUCKET, SURFACE_STREAM, ensure_slack_state, slack_durable
from subjects.errors import PgwError, SubjectError
from subjects.names import principal_token
from subjects.wire import (
    ClarificationAnswers,
    DialogueVeto,
    FreeTextAnswer,
    OptionChoice,
    Resolution,
    ResolveReply,
    ResolveRequest,
    encoder,
    pending_reply_decoder,
    resolve_reply_decoder,
)

if TYPE_CHECKING:
    from nats.aio.client import Client

    from pgwcore.config import Config
    from pgwcore.slack_config import SlackConfig

log = get_logger("pgw.slack")

BUCKET = SLACK_BUCKET
METADATA_EVENT = "pgw_moment"  # message metadata: how a restart finds what it posted


class SlackConfigError(PgwError):
    """A Slack secret is missing or unreadable."""


class BadInteraction(PgwError):
    """A signed interaction whose shape, value or metadata is not one this surface made (HTTP 400)."""


_KINDS = ("option", "free_text", "dialogue", "answers")
_MOMENT_ID = re.compile(r"[0-9a-f]{16,64}")  # subjects.constraints.HexId


def _obj(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadInteraction(f"{what} is not an object")
    return value


def parse_ref(text: Any) -> dict[str, Any]:
    """A button value or modal metadata as this surface writes it (``blocks.py``); anything else is refused."""
    if not isinstance(text, str):
        raise BadInteraction("no value")
    try:
        ref = json.loads(text)
    except (ValueError, RecursionError):
        raise BadInteraction("the value is not JSON") from None
    ref = _obj(ref, "the value")
    p, m, k, i = ref.get("p"), ref.get("m"), ref.get("k"), ref.get("i", 0)
    try:
        ok_p = isinstance(p, str) and principal_token(p) == p
    except SubjectError:
        ok_p = False
    if not ok_p or not isinstance(m, str) or not _MOMENT_ID.fullmatch(m) or k not in _KINDS \
            or type(i) is not int or not 0 <= i < 16:
        raise BadInteraction("the value is not a moment reference of this surface")
    return ref


def read_secret(file: str, env: str, what: str, environ: dict[str, str] | os._Environ[str]) -> str:
    """A secret from its file (mode 0600) or the environment; never from the TOML itself."""
    if file:
        p = Path(file).expanduser()
        try:
            mode = p.stat().st_mode & 0o777
            value = p.read_text().strip()
        except OSError as e:
            raise SlackConfigError(f"slack {what} file {p}: cannot read ({e.strerror})") from e
        if mode & 0o077:
            raise SlackConfigError(f"slack {what} file {p} has mode {mode:o}; it must be 0600 (chmod 600 {p})")
        if value:
            return value
    value = environ.get(env, "").strip()
    if not value:
        raise SlackConfigError(f"no Slack {what}: set slack.{what.replace(' ', '_')}_file or ${env}")
    return value


class Posted(msgspec.Struct):
    channel: str
    ts: str


class Record(msgspec.Struct, omit_defaults=True):
    """What one surface item is on Slack (the value of ``PGW_SLACK`` key ``{P}.{id}``)."""

    state: Literal["posting", "open", "closed"]
    item: str  # the surface item as the gateway published it (already redacted)
    at: float = 0.0  # when the post was begun (the history search starts here)
    channel: str = ""
    messages: list[Posted] = msgspec.field(default_factory=list)
    status: str = ""  # closed: our status line (mrkdwn, no agent text)
    detail: str = ""  # closed: the answer as plain text: an option's label, never the principal's own words
    synced: bool = False  # closed: every message shows it


_rec_dec = msgspec.json.Decoder(Record)
_rec_enc = msgspec.json.Encoder()


class SlackDown(Exception):
    """Slack did not take the call (after slack-sdk's own retries); ``error`` is Slack's code when it gave one."""

    def __init__(self, message: str, error: str = "") -> None:
        super().__init__(message)
        self.error = error


# Slack's answers that no retry will change: the token is wrong, revoked or lacks a scope.
FATAL_AUTH = ("invalid_auth", "not_authed", "token_revoked", "token_expired", "account_inactive", "missing_scope")


def _key_of(raw: bytes, plan: Plan) -> str:
    ident = getattr(plan, "moment_id", None) or getattr(plan, "item_id", None)
    return ident or hashlib.sha256(raw).hexdigest()[:32]


def _answered_by(user: str) -> str:
    return f":white_check_mark: *Answered in Slack* by <@{_slack_id(user)}>:"


def _status(reason: str) -> str:
    return {
        "resolved": ":white_check_mark: *Answered* on another surface (the app, the terminal or e-mail).",
        "expired": ":hourglass: *Expired* before it was answered.",
        "superseded": ":leftwards_arrow_with_hook: *Withdrawn* by the gateway (superseded).",
    }.get(reason, f":leftwards_arrow_with_hook: *Withdrawn* ({kit.escape(reason)}).")


class Lane:
    """One principal on Slack: its own NATS connection, durable, records and answers."""

    def __init__(self, surface: SlackSurface, principal: str, nc: Client) -> None:
        self.s = surface
        self.principal = principal_token(principal)
        self.pc = surface.cfg.principals.get(principal) or surface.cfg.principals[f"~{self.principal}"]
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = surface.config.subjects
        self.kv = KeyValue(name=BUCKET, stream=f"KV_{BUCKET}", pre=f"$KV.{BUCKET}.", js=self.js, direct=True)
        self.sub: Any = None
        self.channel = ""
        self._failures = 0
        # Moments being answered in Slack by this process: their closing status and detail. The
        # gateway's ``withdrawn`` (resolved) can come before our own close after the answer, and
        # the first close wins: it must say "Answered in Slack", not "on another surface".
        self.answering: dict[str, tuple[str, str]] = {}
        # Their words as the gateway recorded them, for the message alone (never the record), and one
        # message update at a time: a close after the answer and the withdrawn's close may overlap, and
        # the update sent last must be the one with the words.
        self.shown: dict[str, str] = {}
        self._syncing = asyncio.Lock()

    # -- set up ------------------------------------------------------------------
    async def open(self) -> None:
        durable = slack_durable(self.principal)
        subject = self.subjects.surface(self.principal)
        try:
            await self.js.consumer_info(SURFACE_STREAM, durable)
        except NotFoundError:
            # Open mode (no isolation): nobody made it for us, so make it ourselves.
            await ensure_slack_state(self.js, self.principal, prefix=self.subjects.prefix)
        self.sub = await self.js.pull_subscribe_bind(durable, SURFACE_STREAM)
        log.info("slack lane open", principal=self.principal, durable=durable, subject=subject)

    async def target(self) -> str:
        """The channel moments go to: the configured one, else the DM with the principal."""
        if not self.channel:
            if self.pc.channel:
                self.channel = self.pc.channel
            else:
                resp = await self.s.call("conversations_open", users=self.pc.user)
                self.channel = resp["channel"]["id"]
        return self.channel

    # -- records -----------------------------------------------------------------
    def key(self, ident: str) -> str:
        return f"{self.principal}.{ident}"

    async def record(self, ident: str) -> tuple[Record, int] | None:
        try:
            entry = await self.kv.get(self.key(ident))
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        return _rec_dec.decode(entry.value), entry.revision or 0

    async def write(self, ident: str, rec: Record, rev: int | None) -> int | None:
        """Create (rev None) or compare-and-set; None if someone else changed it first."""
        data = _rec_enc.encode(rec)
        try:
            if rev is None:
                return await self.kv.create(self.key(ident), data)
            return await self.kv.update(self.key(ident), data, last=rev)
        except (KeyWrongLastSequenceError, BadRequestError):
            return None

    # -- the feed ------------------------------------------------------------------
    async def run(self) -> None:
        while not self.s.stopping.is_set():
            try:
                msgs = await self.sub.fetch(16, timeout=0.5)
            except (NatsTimeout, TimeoutError):
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - reconnecting; try again
                log.warning("slack lane fetch failed; retrying", principal=self.principal, error=str(e))
                await asyncio.sleep(0.5)
                continue
            snapshot: dict[str, None] | None = None
            for msg in msgs:
                if self.s.stopping.is_set():
                    return  # unacked: redelivered to the next run
                try:
                    if snapshot is None:
                        snapshot = await self.pending_ids()
                    await self.on_item(msg.data, snapshot)
                except Exception as e:  # noqa: BLE001 - Slack down, rate limit exhausted, KV trouble
                    self._failures += 1
                    delay = min(2.0 ** min(self._failures, 10) * 0.25, self.s.cfg.backoff_max_s)
                    log.warning("slack item not delivered; redelivered later", principal=self.principal,
                                error=f"{type(e).__name__}: {e}"[:300], retry_in_s=delay)
                    with contextlib.suppress(Exception):
                        await msg.nak(delay=delay)
                    continue
                self._failures = 0
                await msg.ack()

    async def pending_ids(self) -> dict[str, None] | None:
        """The gateway's list of P's moments still awaiting an answer; None when it does not answer."""
        try:
            msg = await self.nc.request(self.subjects.pending(self.principal), b"{}", timeout=5)
            reply = pending_reply_decoder.decode(msg.data)
        except (NoRespondersError, NatsTimeout, msgspec.DecodeError, msgspec.ValidationError):
            return None
        if reply.more:  # a part of the list (one message's worth): a moment left out of it may still wait
            return None
        return {getattr(i, "moment_id", ""): None for i in reply.items}

    async def on_item(self, raw: bytes, pending: dict[str, None] | None) -> None:
        plan = plan_item(raw)
        ident = _key_of(raw, plan)
        if isinstance(plan, WithdrawPlan):
            mine = self.answering.get(ident) if plan.reason == "resolved" else None
            await self.close(ident, *(mine or (_status(plan.reason), "")))
            return
        got = await self.record(ident)
        if got is not None and got[0].state != "posting":
            return  # posted (or closed) already: a redelivery after a restart
        if isinstance(plan, DecisionPlan | ClarificationPlan) and pending is not None and ident not in pending:
            # Answered or expired before we got to it (history at a first start, a long outage):
            # nothing to ask; the record keeps a redelivery from posting it.
            if got is None:
                await self.write(ident, Record(state="closed", item=raw.decode(), synced=True,
                                               status="closed before it reached Slack"), None)
            else:  # a post of an earlier run may be on Slack: close it
                await self.close(ident, ":leftwards_arrow_with_hook: *No longer waiting* (answered or expired).", "")
            return
        await self.post(ident, raw, plan, got)

    async def post(self, ident: str, raw: bytes, plan: Plan, got: tuple[Record, int] | None) -> None:
        channel = await self.target()
        if got is not None:  # killed between the post and its record: did Slack take it?
            rec, rev = got
            found = await self.s.find_posted(channel, ident, rec.at)
            if found is not None:
                rec.state, rec.channel, rec.messages = "open", channel, [Posted(channel, found)]
                await self.write(ident, rec, rev)
                log.info("slack post found after a restart", principal=self.principal, moment_id=ident)
                return
        else:
            rec = Record(state="posting", item=raw.decode(), at=time.time())
            rev = await self.write(ident, rec, None)
            if rev is None:
                return  # another instance is posting it
        text, blocks = kit.render(plan, self.principal, surface_url=self.s.cfg.surface_url)
        kit.check_blocks(blocks)
        resp = await self.s.call("chat_postMessage", channel=channel, text=text, blocks=blocks,
                                 unfurl_links=False, unfurl_media=False,
                                 metadata={"event_type": METADATA_EVENT,
                                           "event_payload": {"principal": self.principal, "id": ident}})
        rec.state, rec.channel, rec.messages = "open", resp["channel"], [Posted(resp["channel"], resp["ts"])]
        if await self.write(ident, rec, rev) is None:
            got2 = await self.record(ident)  # closed meanwhile (answered at once): keep the close, add the message
            if got2 is not None:
                rec2, rev2 = got2
                mine = Posted(resp["channel"], resp["ts"])
                rec2.messages = [*rec2.messages, *([] if mine in rec2.messages else [mine])]
                rec2.synced = False
                await self.write(ident, rec2, rev2)
                await self.sync(ident)
        log.info("posted to slack", principal=self.principal, moment_id=ident, item=type(plan).__name__,
                 untrusted=plan.untrusted)

    # -- closing -----------------------------------------------------------------
    async def close(self, ident: str, status: str, detail: str, shown: str | None = None) -> None:
        """Mark the item closed (first status wins) and update its messages in place.

        ``shown``: what the messages say in ``detail``'s place this once (the principal's words as
        the gateway recorded them), never written to the record."""
        for _ in range(10):
            got = await self.record(ident)
            if got is None:
                # Withdrawn before it was posted: remember, so a redelivered item is not posted.
                if await self.write(ident, Record(state="closed", item="", status=status, detail=detail,
                                                  synced=True), None) is not None:
                    return
                continue
            rec, rev = got
            if rec.state == "closed":
                if rec.synced and shown is None:
                    return
                break
            if rec.state == "posting" and not rec.messages:
                # Killed between a post and its record: the message may be on Slack, with its buttons.
                channel = await self.target()
                found = await self.s.find_posted(channel, ident, rec.at)
                if found is not None:
                    rec.messages = [Posted(channel, found)]
            rec.state, rec.status, rec.detail, rec.synced = "closed", status, detail, False
            if await self.write(ident, rec, rev) is not None:
                break
        await self.sync(ident, shown)

    async def sync(self, ident: str, shown: str | None = None) -> None:
        async with self._syncing:
            await self._sync(ident, shown)

    async def _sync(self, ident: str, shown: str | None) -> None:
        got = await self.record(ident)
        if got is None or got[0].state != "closed" or (got[0].synced and shown is None):
            return
        rec, rev = got
        plan = plan_item(rec.item.encode()) if rec.item else None
        detail = shown or self.shown.get(ident) or rec.detail
        for m in rec.messages:
            text, blocks = kit.closed(plan, self.principal, rec.status, detail) if plan else (rec.status, [])
            kit.check_blocks(blocks)
            await self.s.call("chat_update", channel=m.channel, ts=m.ts, text=text, blocks=blocks)
        if not rec.synced:
            rec.synced = True
            await self.write(ident, rec, rev)
        log.info("slack message closed", principal=self.principal, moment_id=ident, messages=len(rec.messages))

    # -- answering ---------------------------------------------------------------
    async def resolve(self, moment_id: str, resolution: Resolution, closing: tuple[str, str]) -> ResolveReply:
        """Answer ``moment_id``; ``closing`` (status, detail) is what its message says once accepted."""
        self.answering[moment_id] = closing
        reply = await self._resolve(moment_id, resolution)
        if reply.status != "accepted":
            self.answering.pop(moment_id, None)
        return reply

    async def _resolve(self, moment_id: str, resolution: Resolution) -> ResolveReply:
        body = encoder.encode(ResolveRequest(moment_id=moment_id, resolution=resolution))
        try:
            msg = await self.nc.request(self.subjects.resolve(self.principal), body, timeout=5)
        except NoRespondersError:
            return ResolveReply(status="refused", moment_id=moment_id, code="no_gateway",
                                reason="no gateway is answering; the answer was not recorded")
        except NatsTimeout:
            return ResolveReply(status="refused", moment_id=moment_id, code="timeout",
                                reason="the gateway did not reply in time; the answer may not be recorded")
        return resolve_reply_decoder.decode(msg.data)


class SlackSurface:
    """The Slack surface service: lanes, the Web API client, and the interaction receiver."""

    name = "surface-slack"

    def __init__(self, config: Config, nc: Client | None = None, *, environ: dict[str, str] | None = None,
                 principals: list[str] | None = None) -> None:
        self.config = config
        self.cfg: SlackConfig = config.slack
        env = os.environ if environ is None else environ
        self.bot_token = read_secret(self.cfg.bot_token_file, "PGW_SLACK_BOT_TOKEN", "bot token", env)
        self.app_token = (read_secret(self.cfg.app_token_file, "PGW_SLACK_APP_TOKEN", "app token", env)
                          if self.cfg.mode == "socket" else "")
        self.signing_secret = (read_secret(self.cfg.signing_secret_file, "PGW_SLACK_SIGNING_SECRET",
                                           "signing secret", env) if self.cfg.mode == "http" else "")
        names = [principal_token(p) for p in self.cfg.principals]
        if principals:
            wanted = [principal_token(p) for p in principals]
            unknown = [p for p in wanted if p not in names]
            if unknown:
                raise SlackConfigError(f"no [slack.principals.{unknown[0]}] in the configuration")
            names = wanted
        if not names:
            raise SlackConfigError("no principal on Slack: add [slack.principals.NAME] user = \"U…\"")
        self.names = names
        self.stopping = asyncio.Event()
        self.lanes: dict[str, Lane] = {}
        self._conns: list[Client] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._updates: set[asyncio.Task[None]] = set()  # message updates after an answer
        self._runner: web.AppRunner | None = None
        self._socket: Any = None
        self.guard = RequestGuard(self.signing_secret) if self.signing_secret else None
        self.port = 0
        self._health = health.Registered()
        self._release_http: Any = None
        self.web = AsyncWebClient(
            token=self.bot_token, base_url=self.cfg.api_url, timeout=15,
            retry_handlers=[AsyncRateLimitErrorRetryHandler(max_retry_count=self.cfg.max_retries),
                            AsyncConnectionErrorRetryHandler(max_retry_count=self.cfg.max_retries)])

    # -- life cycle --------------------------------------------------------------
    def creds_for(self, principal: str) -> str | None:
        """The lane's own credentials (``slack-P.creds``, made by ``pgw creds``/``pgw up``), else the process's."""
        d = Path(self.config.security.creds_dir).expanduser() if self.config.security.creds_dir \
            else self.config.data_path / "creds"
        own = d / f"slack-{principal}.creds"
        return str(own) if own.exists() else self.config.creds

    async def __aenter__(self) -> SlackSurface:
        try:
            await self.start()
        except BaseException:
            await self.drain()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()

    async def start(self) -> None:
        try:
            who = await self.call("auth_test")
            log.info("slack bot", team=who.get("team"), user=who.get("user"), bot_id=who.get("bot_id"))
        except SlackDown as e:
            if e.error in FATAL_AUTH:
                raise SlackConfigError(f"Slack refused the bot token ({e.error}); check slack.bot_token_file "
                                       "or $PGW_SLACK_BOT_TOKEN and the app's scopes") from e
            # Slack unreachable: the items wait on the stream, nothing is lost.
            log.warning("slack unreachable at start; items wait until it answers", error=str(e))
        for p in self.names:
            creds = self.creds_for(p)
            if creds is None and self.config.security.enabled:
                log.warning("no slack credentials; connecting without (open mode only)", principal=p,
                            hint="`pgw creds` with [slack] enabled writes slack-{principal}.creds")
            nc = await connect(self.config.nats_url, creds=creds, tls=self.config.tls.files(),
                               name=f"pgw-slack-{p}")
            self._conns.append(nc)
            lane = Lane(self, p, nc)
            await lane.open()
            self.lanes[p] = lane
        if self.cfg.mode == "http":
            app = web.Application(client_max_size=256 * 1024)
            app.router.add_post(self.cfg.path, self._on_http)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.cfg.http_host, self.cfg.http_port)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            log.info("slack interactions", url=f"http://{self.cfg.http_host}:{self.port}{self.cfg.path}")
        else:
            from slack_sdk.socket_mode.aiohttp import SocketModeClient

            self._socket = SocketModeClient(app_token=self.app_token, web_client=self.web)
            self._socket.socket_mode_request_listeners.append(self._on_socket)
            await self._socket.connect()
            log.info("slack socket mode connected")
        for lane in self.lanes.values():
            self._tasks.append(asyncio.create_task(lane.run(), name=f"pgw-slack-{lane.principal}"))
        ops = self.config.ops
        if ops.metrics_port is not None:
            # /metrics and /healthz like every service (pgwcore/health.py): each lane's connection and durable.
            self._release_http = acquire_server(ops.metrics_addr, ops.metrics_port)
            for lane in self.lanes.values():
                self._health.add(f"slack:{lane.principal}:connected", health.connected(lane.nc))
                self._health.add(f"slack:{lane.principal}:consumer",
                                 health.consumer_progress(lane.sub.consumer_info, ops.stall_after_s))

    async def drain(self) -> None:
        """Stop reading, let each lane finish the item it holds, close everything. Idempotent."""
        self.stopping.set()
        tasks, self._tasks = [*self._tasks, *self._updates], []
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        sock, self._socket = self._socket, None
        if sock is not None:
            with contextlib.suppress(Exception):
                await sock.close()
        conns, self._conns = self._conns, []
        for nc in conns:
            await close_quietly(nc)
        self._health.remove()
        release, self._release_http = self._release_http, None
        if release is not None:
            release()

    # -- Slack Web API -----------------------------------------------------------
    async def call(self, method: str, **kw: Any) -> Any:
        """One Web API call (slack-sdk retries 429 after Retry-After and connection errors)."""
        try:
            return await getattr(self.web, method)(**kw)
        except SlackApiError as e:
            data = getattr(e.response, "data", None)
            code = str(data.get("error", "")) if isinstance(data, dict) else ""
            why = code or f"HTTP {getattr(e.response, 'status_code', '?')}"
            raise SlackDown(f"{method}: {why}", code) from e
        except (SlackClientError, OSError, TimeoutError) as e:
            raise SlackDown(f"{method}: {type(e).__name__}: {e}") from e

    async def find_posted(self, channel: str, ident: str, since: float) -> str | None:
        """The ts of our message for ``ident`` posted since ``since``, from the channel's history."""
        resp = await self.call("conversations_history", channel=channel, oldest=f"{since - 5:.6f}", limit=200,
                               include_all_metadata=True)
        for m in resp.get("messages", []):
            meta = m.get("metadata") or {}
            if meta.get("event_type") == METADATA_EVENT and (meta.get("event_payload") or {}).get("id") == ident:
                return m.get("ts")
        return None

    # -- interactions --------------------------------------------------------------
    async def _on_http(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        assert self.guard is not None
        try:
            self.guard.check(body, request.headers.get("X-Slack-Request-Timestamp"),
                             request.headers.get("X-Slack-Signature"))
        except Refusal as r:
            log.warning("slack request refused", code=r.code, reason=r.reason, peer=request.remote)
            return web.json_response({"code": r.code, "reason": r.reason}, status=401)
        try:
            payload = json.loads(parse_qs(body.decode())["payload"][0])
        except (KeyError, IndexError, ValueError, UnicodeDecodeError, RecursionError):
            return web.json_response({"code": "bad_request", "reason": "no interaction payload"}, status=400)
        try:
            out = await self.handle(payload)
        except BadInteraction as e:
            log.warning("slack interaction refused: malformed", reason=str(e), peer=request.remote)
            return web.json_response({"code": "bad_request", "reason": str(e)}, status=400)
        return web.json_response(out) if out else web.Response(status=200)

    async def _on_socket(self, client: Any, req: Any) -> None:
        from slack_sdk.socket_mode.response import SocketModeResponse

        try:
            out = await self.handle(req.payload) if req.type == "interactive" else None
        except BadInteraction as e:
            log.warning("slack interaction refused: malformed", reason=str(e))
            out = None
        await client.send_socket_mode_response(SocketModeResponse(envelope_id=req.envelope_id, payload=out))

    async def handle(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        """One interaction (HTTP or Socket Mode, already authenticated as Slack's)."""
        payload = _obj(payload, "the payload")
        kind = payload.get("type")
        user = str(_obj(payload.get("user"), "user").get("id", ""))
        if kind == "block_actions":
            actions = payload.get("actions") or []
            if not isinstance(actions, list) or not actions:
                return None
            action = _obj(actions[0], "the action")
            if not str(action.get("action_id", "")).startswith(kit.ACTION_PREFIX):
                return None
            ref = parse_ref(action.get("value"))
            container = _obj(payload.get("container"), "container")
            message = _obj(payload.get("message"), "message")
            channel = str(container.get("channel_id") or _obj(payload.get("channel"), "channel").get("id", ""))
            pressed = (channel, str(container.get("message_ts") or message.get("ts") or ""),
                       _obj(_obj(message.get("metadata"), "metadata").get("event_payload"), "metadata").get("id"))
            lane = await self._admit(user, ref, channel)
            if lane is None:
                return None
            await self._on_action(lane, user, ref, str(payload.get("trigger_id", "")), pressed)
            return None
        if kind == "view_submission":
            view = _obj(payload.get("view"), "view")
            ref = parse_ref(view.get("private_metadata"))
            lane = await self._admit(user, ref, "")
            if lane is None:
                return {"response_action": "errors", "errors": {_first_input(view): "You are not this principal."}}
            return await self._on_submit(lane, user, ref, view)
        return None

    async def _admit(self, user: str, ref: dict[str, Any], channel: str) -> Lane | None:
        """The lane of the principal this Slack user is, if the pressed message is that principal's."""
        principal = self.cfg.principal_of(user)
        lane = self.lanes.get(principal) if principal else None
        if lane is None or ref.get("p") != lane.principal:
            log.warning("slack interaction refused: not the principal", slack_user=user,
                        mapped_to=principal, belongs_to=ref.get("p"), moment_id=ref.get("m"))
            if channel:
                with contextlib.suppress(SlackDown):
                    await self.call("chat_postEphemeral", channel=channel, user=user,
                                    text="Only the principal this decision was sent to can answer it. "
                                         "Nothing was recorded.")
            return None
        return lane

    async def _on_action(self, lane: Lane, user: str, ref: dict[str, Any], trigger: str,
                         pressed: tuple[str, str, Any]) -> None:
        ident, k = str(ref.get("m", "")), ref.get("k")
        channel, ts, meta_id = pressed
        got = await lane.record(ident)
        # "posting": a press can arrive before the post's record says "open"; the moment is answerable.
        if got is None or got[0].state == "closed" or not got[0].item:
            await self._tell(channel, user, "This decision is no longer open; nothing was recorded.")
            return
        rec = got[0]
        on_it = Posted(channel, ts) in rec.messages if rec.messages else meta_id == ident
        if not on_it and not rec.messages and channel and ts:
            # Still "posting": the post's record is not written yet; the channel's history says which
            # message carries this moment (its metadata), as after a restart.
            with contextlib.suppress(SlackDown):
                on_it = await self.find_posted(channel, ident, rec.at) == ts
        if not on_it:
            # A value naming another moment than the message it is on answers nothing (module docstring).
            log.warning("slack press refused: the button is not on this moment's message", slack_user=user,
                        moment_id=ident, channel=channel, message_ts=ts)
            await self._tell(channel, user, "This button does not belong to that decision; nothing was recorded.")
            return
        plan = plan_item(got[0].item.encode())
        if k == "option" and isinstance(plan, DecisionPlan):
            idx = ref.get("i")
            if not isinstance(idx, int) or not 0 <= idx < len(plan.options):
                return
            shown = f"Option {idx + 1}: {plan.options[idx].label}"
            reply = await lane.resolve(ident, OptionChoice(index=idx), (_answered_by(user), shown))
            await self._after(lane, ident, user, channel, reply, shown, None)
        elif k in ("free_text", "dialogue") and isinstance(plan, DecisionPlan):
            if k not in {h.kind for h in plan.hatches}:
                return
            modal = (kit.free_text_modal if k == "free_text" else kit.dialogue_modal)(lane.principal, ident, plan.stem)
            kit.check_view(modal)
            await self.call("views_open", trigger_id=trigger, view=modal)
        elif k == "answers" and isinstance(plan, ClarificationPlan):
            modal = kit.answers_modal(lane.principal, plan)
            kit.check_view(modal)
            await self.call("views_open", trigger_id=trigger, view=modal)

    async def _on_submit(self, lane: Lane, user: str, ref: dict[str, Any], view: dict[str, Any]) -> dict[str, Any] | None:
        ident, k = str(ref.get("m", "")), ref.get("k")
        values = (view.get("state") or {}).get("values") or {}

        def text(block: str) -> str:
            return str(((values.get(block) or {}).get("text") or {}).get("value") or "").strip()

        got = await lane.record(ident)
        if got is None:
            return {"response_action": "errors", "errors": {_first_input(view): "Not a decision of yours."}}
        plan = plan_item(got[0].item.encode())
        # ``kept``: what the record may say of the answer (its kind, never the principal's words).
        resolution: Resolution
        if k == "free_text":
            if not text("answer"):
                return {"response_action": "errors", "errors": {"answer": "Write your answer."}}
            resolution, kept = FreeTextAnswer(text=text("answer")), "Answered in my own words."
        elif k == "dialogue":
            obj = text("objection") or None
            resolution = DialogueVeto(objection=obj)
            kept = "You rejected the question" + (" (with an objection)." if obj else ".")
        elif k == "answers" and isinstance(plan, ClarificationPlan):
            answers = {q.id: text(f"q{n}") for n, q in enumerate(plan.questions)}
            resolution, kept = ClarificationAnswers(answers=answers), "Answered the questions."
        else:
            return None
        reply = await lane.resolve(ident, resolution, (_answered_by(user), kept))
        if reply.status != "accepted":
            return {"response_action": "errors",
                    "errors": {_first_input(view): f"Not recorded: {reply.reason or reply.code}"[:150]}}
        await self._after(lane, ident, user, "", reply, kept, _echo(reply.resolution))
        return None

    async def _after(self, lane: Lane, ident: str, user: str, channel: str, reply: ResolveReply, kept: str,
                     shown: str | None) -> None:
        if reply.status == "accepted":
            log.info("answered in slack", principal=lane.principal, moment_id=ident, slack_user=user)
            if shown is not None:
                lane.shown[ident] = shown
            # The update runs apart: the gateway already has the answer; Slack wants our reply in 3 s.
            task = asyncio.create_task(self._close_quietly(lane, ident, _answered_by(user), kept, shown))
            self._updates.add(task)
            task.add_done_callback(self._updates.discard)
        else:
            await self._tell(channel, user, f"Not recorded: {reply.reason or reply.code} ({reply.code}).")

    async def _close_quietly(self, lane: Lane, ident: str, status: str, detail: str, shown: str | None) -> None:
        try:
            await lane.close(ident, status, detail, shown)
        except Exception as e:  # noqa: BLE001 - the withdrawn item retries the update
            log.warning("slack update after an answer failed; the withdrawn item retries it",
                        moment_id=ident, error=str(e)[:200])
            return
        lane.answering.pop(ident, None)  # closed as answered here; a later withdrawn changes nothing
        lane.shown.pop(ident, None)

    async def _tell(self, channel: str, user: str, text: str) -> None:
        if channel:
            with contextlib.suppress(SlackDown):
                await self.call("chat_postEphemeral", channel=channel, user=user, text=text)


def _echo(res: Resolution | None) -> str | None:
    """The principal's words as the gateway recorded them (SR-1 redacted), for the message alone; None: none."""
    match res:
        case FreeTextAnswer(text=t):
            return f"In my words: {t}"
        case DialogueVeto(objection=o) if o:
            return f"You rejected the question: {o}"
    return None


def _slack_id(user: str) -> str:
    return "".join(c for c in user if c.isalnum())[:32]


def _first_input(view: dict[str, Any]) -> str:
    for b in view.get("blocks") or []:
        if b.get("type") == "input":
            return str(b.get("block_id", "answer"))
    return "answer"


__all__ = ["BUCKET", "Lane", "Record", "SlackSurface", "ensure_slack_state", "slack_durable"]
