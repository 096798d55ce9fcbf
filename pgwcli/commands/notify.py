"""``pgw notifier`` (run the notifier) and ``pgw notifications`` (its status and dead letters).

Issue 17, docs/notifications.md. ``pgw up`` runs the notifier too (``UP_SERVICES``).
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime

import msgspec

from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.service import serve_alone

_enc = msgspec.json.Encoder()


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("notifier", help="run the notifier: tell principals a moment waits (web push, e-mail, webhook)")
    p.set_defaults(handler=handle_notifier)
    p = sub.add_parser("notifications", help="the notifier's jobs by status, push subscriptions, dead letters")
    p.add_argument("--dead", action="store_true", help="list the dead letters (newest 100)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=handle_notifications)


async def handle_notifier(args: argparse.Namespace, config: Config) -> int:
    from consumers.notify.service import Notifier

    return await serve_alone(config, Notifier, "notifier")  # a bad channel file fails before anything runs


async def handle_notifications(args: argparse.Namespace, config: Config) -> int:
    from consumers.notify.store import dead_letters, status

    nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name="pgw-notifications", once=True)
    try:
        js = nc.jetstream()
        if args.dead:
            rows = await dead_letters(js)
            for d in rows:
                if args.json:
                    print(_enc.encode(d).decode())
                else:
                    at = datetime.fromtimestamp(d.ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                    print(f"{at}  {d.job.principal:<16} {d.job.channel:<40} {d.job.moment_id}  {d.reason}")
            if not args.json:
                print(f"{len(rows)} dead letter(s) (PGW_NOTIFY_DLQ)")
            return 0
        s = await status(js, config.subjects)
    finally:
        await nc.close()
    if args.json:
        print(_enc.encode(s).decode())
        return 0
    for name in ("scheduled", "sending", "sent", "suppressed", "skipped", "dropped", "dead"):
        print(f"{name:<12}{s.jobs.get(name, 0):>8}")
    print(f"{'push subs':<12}{s.push_subscriptions:>8}\n{'dead letters':<12}{s.dead_letters:>8}   "
          f"(pgw notifications --dead)  as of {time.strftime('%H:%M:%S')}")
    return 0
