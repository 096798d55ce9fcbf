"""``pgw gateway``: run the gateway alone against any NATS URL."""

from __future__ import annotations

import argparse

from gateway.app import Gateway
from pgwcore.config import Config
from pgwcore.service import serve_alone


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("gateway", help="run the gateway service against --server")
    p.set_defaults(handler=handle)


async def handle(args: argparse.Namespace, config: Config) -> int:
    # The collector's thresholds are set for every service process (pgwcore.service.freeze_startup_heap).
    return await serve_alone(config, Gateway, "gateway", streams=False)  # the gateway makes its streams itself
