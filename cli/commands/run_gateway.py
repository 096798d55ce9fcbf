"""``pgw gateway``: run the gateway alone against any NATS URL."""

from __future__ import annotations

import argparse
import gc

from gateway.app import Gateway
from pgwcore.config import Config
from pgwcore.service import serve_alone

# Container allocations between two collections of the youngest generation (CPython's default:
# 700). A binding moment allocates a hundred or so (dicts, Structs, futures, tasks) that nearly
# all die with its turn; at the default the collector ran every seven envelopes and promoted the
# turns in flight to the older generations, about 5 % of the gateway's CPU at 1,000 envelopes/s
# (docs/performance-changes.md, "Gateway CPU per envelope"). Cycles are still collected, only in larger steps.
GC_YOUNG, GC_MIDDLE, GC_OLD = 20_000, 20, 20


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("gateway", help="run the gateway service against --server")
    p.set_defaults(handler=handle)


async def handle(args: argparse.Namespace, config: Config) -> int:
    gc.set_threshold(GC_YOUNG, GC_MIDDLE, GC_OLD)
    return await serve_alone(config, Gateway, "gateway", streams=False)  # the gateway makes its streams itself
