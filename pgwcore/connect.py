"""Connecting a service to NATS with the standard options."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import nats
from nats.aio.client import Client

from pgwcore.headerparse import install as _fast_headers
from pgwcore.logs import get_logger
from pgwcore.tls import TlsFiles
from subjects.errors import PgwError

log = get_logger("pgw.nats")


async def _quiet_error(e: Exception) -> None:
    # nats-py's default prints a traceback for every failed (re)connect attempt.
    log.warning("nats connection error", error=f"{type(e).__name__}: {e}"[:300])


class ConnectError(PgwError):
    """The server refused us (credentials) or, for a one-shot command, was not there."""

    def __init__(self, url: str, why: str, *, auth: bool) -> None:
        self.url = url
        self.why = why
        self.auth = auth
        # Not a file name: which party's file serves depends on who connects (a command's role, a
        # service's name); the command line names it (pgwcli/creds.py).
        hint = (
            "; the server requires credentials: pass this party's own file with --creds FILE (each party has "
            "one, {role}-{name}.creds, in the credentials folder `pgw up` and `pgw creds` write; `pgw creds` "
            "lists them)"
            if auth
            else ""
        )
        super().__init__(f"cannot connect to {url}: {why}{hint}")


@dataclass(frozen=True)
class ConnectArgs:
    """How a connection was made (URL, credentials file, TLS, name): what a second connection of
    the same process to the same server needs (``pgwcore.respond``'s answering connection)."""

    url: str
    creds: str | None
    tls: TlsFiles | None
    name: str


_ARGS: weakref.WeakKeyDictionary[Client, ConnectArgs] = weakref.WeakKeyDictionary()


def connect_args(nc: Client) -> ConnectArgs | None:
    """The arguments ``nc`` was made with by :func:`connect` (None for one made otherwise)."""
    return _ARGS.get(nc)


def _is_auth_error(e: BaseException) -> bool:
    return "authorization" in str(e).lower()


async def connect(url: str, *, creds: str | None = None, name: str = "pgw", once: bool = False,
                  tls: TlsFiles | None = None, wait_for_server: bool = True, **kw: Any) -> Client:
    """Connect with the service name set, and credentials and TLS (pgwcore/tls.py) if given.

    Services reconnect forever; ``once=True`` (one-shot commands) fails at
    once instead. Either way a refusal of our credentials is a ConnectError
    at start, never an endless retry loop. ``wait_for_server=False`` (a
    long-running command a person starts, such as ``pgw tail``): a server
    that is not there at start is a ConnectError too, and once connected the
    connection reconnects like a service's.
    """
    opts: dict[str, Any] = {
        "servers": [u.strip() for u in url.split(",")],
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 5,
        "error_cb": _quiet_error,
    }
    if creds:
        # A JWT .creds file, or the nkey-seed file `pgw creds` writes (with its inbox prefix).
        from pgwcore.identity import creds_connect_options

        opts.update(creds_connect_options(creds))
    if tls:
        # A CA (private PKI) and/or a client certificate for a server that verifies clients.
        opts["tls"] = tls.client_context()
    opts.update(kw)
    probe_opts = {**opts, "allow_reconnect": False, "max_reconnect_attempts": 1, "error_cb": _silent}
    args = ConnectArgs(url, creds, tls, name)
    if once:
        try:
            nc = _fast_headers(await nats.connect(**probe_opts))
        except Exception as e:  # noqa: BLE001 - reported with the URL and a hint
            raise ConnectError(url, f"{type(e).__name__}: {e}", auth=_is_auth_error(e)) from None
        _ARGS[nc] = args
        return nc
    try:
        probe = await nats.connect(**probe_opts)
    except Exception as e:  # noqa: BLE001 - not up yet is fine for a service; refused is not
        if _is_auth_error(e):
            raise ConnectError(url, str(e), auth=True) from None
        if not wait_for_server:
            raise ConnectError(url, f"{type(e).__name__}: {e}", auth=False) from None
    else:
        await probe.close()
    nc = _fast_headers(await nats.connect(**opts))  # the same header dicts, cheaper (pgwcore.headerparse)
    _ARGS[nc] = args
    return nc


async def _silent(e: Exception) -> None:
    """Probe errors are reported by the caller, not logged twice."""


async def close_quietly(nc: Client, timeout: float = 10.0) -> None:
    """Drain the connection; with the server gone there is nothing to drain: close, no traceback,
    and no reconnect loop left behind (:func:`end_reconnecting`)."""
    try:
        await asyncio.wait_for(nc.drain(), timeout)
    except Exception as e:  # noqa: BLE001 - ConnectionReconnectingError etc. when the server is gone
        log.info("connection closed without draining", reason=type(e).__name__)
        with contextlib.suppress(Exception):
            await nc.close()
    await end_reconnecting(nc)


async def end_reconnecting(nc: Client, *, attempts: int = 100) -> None:
    """End nats-py's reconnect loop of a closed connection, which can outlive ``close()``.

    ``close()`` cancels the loop once. On Python 3.11 ``asyncio.wait_for`` loses
    a cancellation that lands as the awaited connect attempt fails (it raises the
    attempt's own error instead), and nats-py's loop takes that error for one more
    failed attempt and goes on reconnecting, for ever: then ``asyncio.run`` (which
    also cancels once) never returns, and a service told to stop with its server
    gone hangs (tests/test_connect.py reproduces it). So: cancel until it ends.
    """
    task: asyncio.Task[None] | None = getattr(nc, "_reconnection_task", None)  # nats-py 2.x
    for _ in range(attempts):
        if task is None or task.done():
            return
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    log.warning("the NATS client's reconnect loop did not end; it is left running", attempts=attempts)
