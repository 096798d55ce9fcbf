"""The one responder path of every service (docs/contract.md §6 "Replies", docs/security.md "Replies").

Every request a service answers (the gateway's ``idp``, ``act``, ``moment``, ``resolve``,
``pending``, ``capabilities``, ``kernel.revoke`` and ``kernel.audit``; the notifier's
``push.*``; each service's services-API endpoints) goes through a :class:`Responder`:

- ``admits(msg)`` first, before any work: a request whose reply subject is no inbox of the
  party that may send it (``subjects/replies.py``) is not served. One security log line
  (the request subject, the reply subject, who may ask) and ``pgw_replies_refused_total``.
- ``answer(msg, payload)``: the reply, on the connection the request came in on, with no
  header of the request's (nats-py's ``Msg.respond`` copies them all).

``subjects.replies.GuardedService`` is nats' services-API ``Service`` whose PING, INFO and
STATS answers take the same path (nats-py answers them with ``Msg.respond``).
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from pgwcore.connect import close_quietly, connect, connect_args
from pgwcore.logs import get_logger
from pgwcore.metrics import REPLIES_REFUSED, child
from pgwcore.pubbatch import publish_one, publish_soon
from subjects.replies import Asker, GuardedService, ReplyGate, describe, request_kind

__all__ = ["GuardedService", "Responder"]

log = get_logger("pgw.security")

_LOGGED_MAX = 200  # a reply subject is the requester's text: logged cut to this length


class Responder(ReplyGate):
    """:class:`subjects.replies.ReplyGate` with the platform's log line and metric; ``soon=True``
    sends each answer with :func:`pgwcore.pubbatch.publish_soon` (the kernel's hot path)."""

    def __init__(self, prefix: str, service: str, *, soon: bool = False) -> None:
        super().__init__(prefix, self._refused)
        self.service = service
        self._publish = publish_soon if soon else publish_one

    def _refused(self, msg: Any, who: tuple[Asker, ...]) -> None:
        kind = request_kind(self.prefix, msg.subject)
        child(REPLIES_REFUSED, self.service, kind).inc()
        log.warning(
            "request not answered: its reply subject is no inbox of the party that may send it",
            service=self.service,
            request=msg.subject[:_LOGGED_MAX],
            reply=msg.reply[:_LOGGED_MAX],
            party=describe(who),
        )

    async def _send(self, nc: Any, reply: str, payload: bytes) -> None:
        try:
            await self._publish(nc, reply, payload)
        except Exception as e:  # noqa: BLE001 - the asker's retry is the remedy; the service goes on
            log.warning("reply not sent", service=self.service, reply=reply[:_LOGGED_MAX], error=f"{type(e).__name__}: {e}"[:200])


# -- the answering connection ------------------------------------------------------------
#
# Defence in depth at the server (docs/security.md "Replies"): a service that connected as
# ``service:{name}`` with ``service-{name}.creds`` takes requests on a second connection, as
# ``responder:{name}`` (``responder-{name}.creds`` in the same folder, made with the others by
# `pgw creds` / `pgw accounts`). That user may subscribe to the service's request subjects and
# publish nothing on the contract's subjects, streams, buckets or APIs (``pgw.>``, ``$JS.>``,
# ``$KV.>``...), and has no ``allow_responses`` (which would let it publish on any reply subject
# it is handed, denied or not). So even a handler that skipped the reply rule could not write a
# stream. The service connection keeps its writes and takes no request at all.


@dataclass
class _Shared:
    conn: Client
    users: int = 0


_SHARED: weakref.WeakKeyDictionary[Client, _Shared] = weakref.WeakKeyDictionary()
_LOCKS: weakref.WeakKeyDictionary[Client, asyncio.Lock] = weakref.WeakKeyDictionary()


def responder_creds(service_creds: str | None) -> Path | None:
    """``…/responder-{name}.creds`` beside ``…/service-{name}.creds``; None for any other file."""
    if not service_creds:
        return None
    p = Path(service_creds)
    if not (p.name.startswith("service-") and p.name.endswith(".creds")):
        return None
    return p.with_name("responder-" + p.name[len("service-"):])


async def requests_connection(nc: Client) -> Client:
    """The connection a service of ``nc`` takes requests on: the process's ``responder`` connection
    when ``nc`` is a service's with a responder credentials file beside it (one per process,
    shared by its services), else ``nc`` itself (a server without per-party credentials, or a
    deployment whose credentials predate the responder: then said once, with the fix).
    Give it back with :func:`release_requests_connection`."""
    args = connect_args(nc)
    path = responder_creds(args.creds if args else None)
    if args is None or path is None:
        return nc
    if not path.exists():
        log.warning(
            "no responder credentials: requests are taken on the service connection, without the server's "
            "confinement of answers; run `pgw creds` (or `pgw accounts`) to create them",
            expected=str(path),
        )
        return nc
    lock = _LOCKS.setdefault(nc, asyncio.Lock())
    async with lock:
        shared = _SHARED.get(nc)
        if shared is None or shared.conn.is_closed:
            conn = await connect(args.url, creds=str(path), tls=args.tls, name=f"{args.name}-replies")
            shared = _SHARED[nc] = _Shared(conn)
        shared.users += 1
        return shared.conn


async def release_requests_connection(nc: Client, conn: Client | None) -> None:
    """Give back what :func:`requests_connection` lent; the last user closes it (drained first)."""
    if conn is None or conn is nc:
        return
    shared = _SHARED.get(nc)
    if shared is None or shared.conn is not conn:
        await close_quietly(conn)
        return
    shared.users -= 1
    if shared.users <= 0:
        _SHARED.pop(nc, None)
        await close_quietly(conn)
