"""Connecting a service to NATS with the standard options."""

from __future__ import annotations

from typing import Any

import nats
from nats.aio.client import Client


async def connect(url: str, *, creds: str | None = None, name: str = "pgw", **kw: Any) -> Client:
    """Connect with reconnects on, the service name set, and credentials if given."""
    opts: dict[str, Any] = {
        "servers": [u.strip() for u in url.split(",")],
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": 5,
    }
    if creds:
        opts["user_credentials"] = creds
    opts.update(kw)
    return await nats.connect(**opts)
