"""``pgw streams``: create the contract's streams (idempotently) and show their state."""

from __future__ import annotations

import argparse

from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.streams import ensure_streams, stream_plans


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("streams", help="create missing streams and show each stream's state")
    p.add_argument("--check", action="store_true", help="only report; create nothing")
    p.add_argument("--replicas", type=int, default=None,
                   help="replicas for new streams (3 in a cluster; default: what PGW_INBOUND has, else 1)")
    p.set_defaults(handler=handle)


async def handle(args: argparse.Namespace, config: Config) -> int:
    nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name="pgw-streams", once=True)
    try:
        js = nc.jetstream()
        created: dict[str, str] = {}
        if not args.check:
            created = await ensure_streams(js, config.subjects, replicas=args.replicas,
                                           duplicate_window_s=config.gateway.duplicate_window_s)
        print(f"{'stream':<18} {'status':<8} {'messages':>9} {'bytes':>12} {'consumers':>9}  subjects")
        for plan in stream_plans(config.subjects):
            try:
                info = await js.stream_info(plan.name)
            except Exception:  # noqa: BLE001 - shown as missing
                print(f"{plan.name:<18} {'missing':<8}")
                continue
            s = info.state
            status = created.get(plan.name, "exists")
            print(f"{plan.name:<18} {status:<8} {s.messages:>9} {s.bytes:>12} {s.consumer_count:>9}  {' '.join(info.config.subjects or [])}")
    finally:
        await nc.close()
    return 0
