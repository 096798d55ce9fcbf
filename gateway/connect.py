"""Connecting a service to NATS with the standard options."""

from __future__ import annotations

from typing import Any

import nats
from nats.aio.client import Client

from gateway.logs import get_logger

log = get_logger("pgw.nats")


async def _quiet_error(e: Exception) -> None:
    # nats-py's default prints a traceback for every failed (re)connect attempt.
    log.warning("nats connection error", error=f"{type(e).__name__}: {e}"[:300])


async def connect(url: str, *, creds: str | None = None, name: str = "pgw", **kw: Any) -> Client:
    """Connect with reconnects on, the service name set, and credentials if given."""
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
        from gateway.security.identity import creds_connect_options

        opts.update(creds_connect_options(creds))
    opts.update(kw)
    return await nats.connect(**opts)
