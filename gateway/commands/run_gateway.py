"""``pgw gateway``: run the gateway alone against any NATS URL."""

from __future__ import annotations

import argparse
import asyncio
import signal

from gateway.app import Gateway
from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.logs import get_logger
from pgwcore.service import run_services

log = get_logger("pgw.cli")


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (the second Ctrl-C is left to Python)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("gateway", help="run the gateway service against --server")
    p.set_defaults(handler=handle)


async def handle(args: argparse.Namespace, config: Config) -> int:
    nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name="pgw-gateway")
    stop = stop_event()
    try:
        await run_services([Gateway(config, nc)], stop, on_started=lambda: log.info("gateway ready", server=config.nats_url))
    finally:
        await nc.drain()
    return 0
