"""A principal's feed of surface items, spoken over the bus contract only.

DESIGN §4: a surface subscribes to ``principal.{P}.surface`` (live items),
asks ``principal.{P}.pending`` for what is still awaiting the principal (so
a surface that was offline gets it, and gets nothing already answered or
expired), and answers on ``principal.{P}.resolve``. No JetStream consumer
rights are needed (DESIGN §7).

Items are yielded as raw bytes, not decoded Structs: an item this surface
cannot decode must still reach the render model, which turns it into the
notice fallback (spec 000 §9.3) instead of silently dropping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import nats
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from pgwcore.identity import creds_connect_options, read_creds
from pgwcore.logs import get_logger
from pgwcore.tls import TlsFiles
from subjects.approvals import (
    ApprovalsReply,
    ApprovalsRequest,
    approvals_reply_decoder,
    approvals_subject,
)
from subjects.errors import PgwError
from subjects.names import Subjects, principal_token
from subjects.util import now_rfc3339, parse_rfc3339
from subjects.wire import (
    Refusal,
    Resolution,
    ResolveReply,
    ResolveRequest,
    WithdrawnItem,
    encoder,
    resolve_reply_decoder,
    surface_item_decoder,
)

log = get_logger("pgw.surface")


class SurfaceError(PgwError):
    """The surface could not reach the gateway or read its credentials."""


class _RawPending(msgspec.Struct):
    items: list[msgspec.Raw]
    more: bool = False  # a part of the list (PendingReply): what it leaves out may still wait


class _Ident(msgspec.Struct):
    item: str = ""
    moment_id: str = ""
    item_id: str = ""


_pending_dec = msgspec.json.Decoder(_RawPending)
_ident_dec = msgspec.json.Decoder(_Ident)


def item_key(raw: bytes) -> tuple[str, str] | None:
    """(item kind, moment or item id) of a raw item; None if unreadable."""
    try:
        ident = _ident_dec.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return ident.item, ident.moment_id or ident.item_id


class ConnectionWatch:
    """What the NATS connection tells a surface: refusals by the server, and reconnects.

    A surface with another principal's credentials must fail at once with a
    clear reason (nats-server ``Permissions Violation``), not wait for replies
    the server will never let through. After a reconnect the feed asks for
    the pending snapshot again, since live items sent meanwhile were missed.
    """

    def __init__(self) -> None:
        self.denied = asyncio.Event()
        self.message = ""
        self.on_reconnect: list[Callable[[], None]] = []

    async def error_cb(self, e: Exception) -> None:
        text = str(e)
        if "permissions violation" in text.lower() or "authorization violation" in text.lower():
            self.message = self.message or text.removeprefix("nats: ").strip()
            self.denied.set()

    async def reconnected_cb(self) -> None:
        for cb in list(self.on_reconnect):
            cb()


async def connect_principal(
    url: str, *, creds: str | None = None, name: str = "pgw-surface", watch: ConnectionWatch | None = None,
    tls: TlsFiles | None = None,
) -> Client:
    """Connect as the principal, with its own credentials when given (DESIGN §7).

    ``creds`` is what ``pgw creds`` writes (a decorated nkey seed, which also
    names the principal's own inbox prefix) or a standard JWT ``.creds`` file.
    """
    opts: dict[str, Any] = {
        "servers": [u.strip() for u in url.split(",")],
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 5,
    }
    if creds:
        # A small local file read once at start; no event-loop work is waiting yet.
        opts.update(creds_connect_options(Path(creds).expanduser()))  # noqa: ASYNC240
    if tls:  # a private CA and/or a client certificate (pgwcore/tls.py)
        opts["tls"] = tls.client_context()
    if watch is not None:
        opts["error_cb"] = watch.error_cb
        opts["reconnected_cb"] = watch.reconnected_cb
    try:
        return await nats.connect(**opts)
    except Exception as e:
        raise SurfaceError(f"cannot connect to {url}: {e}") from e


def browser_auth(url: str, creds: str | None) -> dict[str, str] | None:
    """What the browser needs to authenticate as the principal, or None (no auth).

    The same credentials file the terminal surface uses: an nkey seed (with
    its inbox prefix) or a JWT ``.creds`` file; else user/password or a token
    embedded in the NATS URL.
    """
    if creds:
        path = Path(creds).expanduser()
        try:
            text = path.read_text()
        except OSError as e:
            raise SurfaceError(f"cannot read credentials file {path}: {e.strerror}") from e
        if "BEGIN NATS USER JWT" in text:
            return {"type": "creds", "value": text}
        c = read_creds(path)
        out = {"type": "nkey", "value": c.seed}
        if c.inbox_prefix:
            out["inbox_prefix"] = c.inbox_prefix
        return out
    parts = urlsplit(url.split(",", maxsplit=1)[0].strip())
    if parts.username:
        if parts.password is not None:
            return {"type": "userpass", "user": parts.username, "pass": parts.password}
        return {"type": "token", "value": parts.username}
    return None


class SurfaceFeed:
    """One principal's items: pending snapshot first, then live, deduplicated."""

    def __init__(
        self, nc: Client, principal: str, *, prefix: str = "pgw", timeout: float = 10.0,
        watch: ConnectionWatch | None = None,
    ) -> None:
        self.nc = nc
        self.watch = watch
        self._open: dict[str, bytes] = {}  # answerable items yielded and not withdrawn
        self.principal = principal_token(principal)
        self.subjects = Subjects(prefix)
        self.timeout = timeout
        self._seen: set[tuple[str, str]] = set()
        self._closed_ids: set[str] = set()
        self.partial = False  # the last pending reply said "more"

    def _fresh(self, raw: bytes) -> bool:
        """First sighting of this item, and not of a moment already withdrawn."""
        key = item_key(raw)
        if key is None:
            return True  # unreadable: let the render model show the fallback
        kind, ident = key
        if key in self._seen:
            return False
        self._seen.add(key)
        if kind == "withdrawn":
            self._closed_ids.add(ident)
            self._open.pop(ident, None)
            return True
        if ident in self._closed_ids:
            return False
        if kind in ("binding_moment", "clarification"):
            self._open[ident] = raw
        return True

    def _gone_since(self, snapshot: list[bytes]) -> list[bytes]:
        """Withdrawn items for open moments missing from a fresh snapshot.

        Only after a reconnect: the gateway's own ``withdrawn`` was published
        while we were away, and a moment leaves the pending set only by being
        answered or expiring, so this local stand-in says which, by its expiry.
        """
        if self.partial:  # a part of the list: a moment it leaves out is not gone (a review)
            return []
        still = {k[1] for k in map(item_key, snapshot) if k}
        out = []
        for ident, raw in list(self._open.items()):
            if ident in still:
                continue
            try:
                item = surface_item_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            expires = getattr(item, "expires_at", None)
            expired = bool(expires) and parse_rfc3339(expires).timestamp() <= time.time()
            out.append(encoder.encode(WithdrawnItem(
                agent=item.agent, principal=item.principal, created_at=now_rfc3339(),
                untrusted=item.untrusted, moment_id=ident, reason="expired" if expired else "resolved",
            )))
        return out

    async def _guard(self, aw: Any) -> Any:
        """Await ``aw`` unless the server refuses this connection first (then SurfaceError)."""
        task = asyncio.ensure_future(aw)
        if self.watch is None:
            return await task
        waiter = asyncio.ensure_future(self.watch.denied.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if task.done():
            return task.result()
        task.cancel()
        raise SurfaceError(
            f"the NATS server refused this connection ({self.watch.message}); "
            f"are these the credentials of principal {self.principal!r}?"
        )

    async def pending(self) -> list[bytes]:
        """The raw items still awaiting the principal, as the gateway sees them."""
        delay = 0.2
        for attempt in range(5):
            try:
                msg = await self._guard(
                    self.nc.request(self.subjects.pending(self.principal), b"{}", timeout=self.timeout)
                )
                break
            except NoRespondersError:
                # The gateway may be starting; retry briefly, then give up clearly.
                if attempt == 4:
                    raise SurfaceError("no gateway answers the pending request; is `pgw up` running?") from None
                await asyncio.sleep(delay)
                delay *= 2
            except NatsTimeout:
                raise SurfaceError("the gateway did not answer the pending request in time") from None
        try:
            reply = _pending_dec.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise SurfaceError(f"the gateway's pending reply is not valid: {e}") from e
        self.partial = reply.more
        return [bytes(r) for r in reply.items]

    async def items(self, on_snapshot: Callable[[], object] | None = None) -> AsyncIterator[bytes]:
        """Yield raw surface items: the pending snapshot, then live ones, each once.

        ``on_snapshot`` is called once the whole pending snapshot was yielded.
        """
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: resync after a reconnect

        async def on_msg(msg: Any) -> None:
            queue.put_nowait(msg.data)

        def resync() -> None:
            queue.put_nowait(None)

        if self.watch is not None:
            self.watch.on_reconnect.append(resync)

        # Subscribe before the snapshot, so nothing published in between is lost.
        sub = await self.nc.subscribe(self.subjects.surface(self.principal), cb=on_msg)
        try:
            await self.nc.flush()
            for raw in await self.pending():
                if self._fresh(raw):
                    yield raw
            if on_snapshot is not None:
                on_snapshot()
            while True:
                raw = await self._guard(queue.get())
                if raw is None:
                    snapshot = await self.pending()
                    for gone in self._gone_since(snapshot):
                        if self._fresh(gone):
                            yield gone
                    for raw in snapshot:
                        if self._fresh(raw):
                            yield raw
                elif self._fresh(raw):
                    yield raw
        finally:
            if self.watch is not None and resync in self.watch.on_reconnect:
                self.watch.on_reconnect.remove(resync)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def approvals(self, revoke: str | None = None) -> ApprovalsReply:
        """Her standing approvals, or ``revoke`` one (docs/gate.md "Standing approvals"); a refusal if none answers."""
        req = ApprovalsRequest(op="revoke", scope_id=revoke) if revoke else ApprovalsRequest(op="list")
        try:
            msg = await self._guard(self.nc.request(approvals_subject(self.subjects.prefix, self.principal),
                                                    msgspec.json.encode(req), timeout=self.timeout))
            return approvals_reply_decoder.decode(msg.data)
        except (NoRespondersError, NatsTimeout):
            return ApprovalsReply(ok=False, refusal=Refusal(code="timeout", reason="the gateway did not answer"))

    async def resolve(self, moment_id: str, resolution: Resolution) -> ResolveReply:
        """Send the principal's answer; return the gateway's reply (accepted or why refused)."""
        body = encoder.encode(ResolveRequest(moment_id=moment_id, resolution=resolution))
        try:
            msg = await self.nc.request(self.subjects.resolve(self.principal), body, timeout=self.timeout)
        except NoRespondersError:
            return ResolveReply(status="refused", moment_id=moment_id, code="no_gateway",
                                reason="no gateway is answering; the answer was not recorded")
        except NatsTimeout:
            return ResolveReply(status="refused", moment_id=moment_id, code="timeout",
                                reason="the gateway did not reply in time; the answer may not be recorded")
        try:
            return resolve_reply_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return ResolveReply(status="refused", moment_id=moment_id, code="bad_reply", reason=str(e))
