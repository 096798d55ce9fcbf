"""``pgw replay`` and ``pgw tail``: the ops tools of issue 8.

Both connect with the global ``--server``/``--creds`` options and only read
streams (by message get: no consumer, no ack; consumers/history.py); ``replay`` writes
only to the target it is given, and nothing at all with ``--dry-run``.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime, timedelta

from consumers.replay import GATEWAY, Replayer, ReplayError, ReplayRange, format_action
from consumers.tail import check_subject, string_redactor, tail
from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.service import stop_event
from subjects.util import parse_rfc3339


def _when(value: str) -> datetime:
    """RFC 3339 (``2026-01-02T03:04:05Z``) or a relative age (``90s``, ``15m``, ``2h``, ``1d``)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if value and value[-1] in units and value[:-1].replace(".", "", 1).isdigit():
        return datetime.now(UTC) - timedelta(seconds=float(value[:-1]) * units[value[-1]])
    try:
        return parse_rfc3339(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{value!r}: not RFC 3339 nor an age like 15m ({e})") from e


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "replay",
        help="re-drive a range of a stream through the gateway or to another subject",
        description=(
            "Re-drive a range of a JetStream stream. --to gateway republishes agent envelopes on "
            "their inbound subject: the gateway answers a seen correlationId from its dedup cache "
            "(no new surface items, verdicts or capsules). --dry-run shows what would happen."
        ),
    )
    r.add_argument("--stream", help="stream name (default: the stream holding --subject)")
    r.add_argument("--subject", help="subject filter, wildcards allowed (e.g. pgw.agent.bot.envelope)")
    r.add_argument("--from-seq", type=int, help="first stream sequence (inclusive)")
    r.add_argument("--to-seq", type=int, help="last stream sequence (inclusive)")
    r.add_argument("--since", type=_when, help="start time: RFC 3339 or an age (15m, 2h)")
    r.add_argument("--until", type=_when, help="end time: RFC 3339 or an age")
    r.add_argument("--limit", type=int, help="at most this many messages")
    r.add_argument("--to", dest="target", default=GATEWAY,
                   help="'gateway' (default) or a subject to republish to")
    r.add_argument("--fresh-msg-id", action="store_true",
                   help="gateway target: use a replay Nats-Msg-Id so the stream's duplicate "
                        "window does not drop the republish and the dedup cache answers")
    r.add_argument("--dry-run", action="store_true", help="show what would happen; publish nothing")
    r.set_defaults(handler=replay_command)

    t = sub.add_parser("tail", help="pretty, redacted live view of any subject")
    t.add_argument("subject", help="subject, wildcards allowed (e.g. 'pgw.verdict.>')")
    g = t.add_mutually_exclusive_group()
    g.add_argument("--all", action="store_true", help="start with the whole stream history")
    g.add_argument("--since", type=_when, help="start with history from this time (RFC 3339 or 15m)")
    g.add_argument("--last", type=int, help="start with the last N stored messages")
    t.add_argument("--count", type=int, help="exit after N messages")
    t.add_argument("--json", action="store_true", help="one JSON object per line")
    t.set_defaults(handler=tail_command)


async def _dedup_lookup(nc, prefix: str):
    """A dry-run hint: the dedup stage's own lookup if it exposes one, else None."""
    try:
        from gateway.stages import dedup
    except ImportError:
        return None
    fn = getattr(dedup, "cached_outcome_exists", None)
    if fn is None:
        return None
    js = nc.jetstream()

    async def lookup(agent: str, correlation_id: str) -> bool:
        return bool(await fn(js, agent, correlation_id))

    return lookup


async def replay_command(args: argparse.Namespace, config: Config) -> int:
    nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name="pgw-replay", once=True)
    try:
        rng = ReplayRange(stream=args.stream, subject=args.subject, from_seq=args.from_seq,
                          to_seq=args.to_seq, since=args.since, until=args.until, limit=args.limit)
        replayer = Replayer(nc, config.subjects, dedup_lookup=await _dedup_lookup(nc, config.prefix))
        try:
            report = await replayer.replay(rng, args.target, dry_run=args.dry_run,
                                           fresh_msg_id=args.fresh_msg_id)
        except ReplayError as e:
            print(f"pgw replay: {e.why}", file=sys.stderr)
            return 2
        for a in report.actions:
            print(format_action(a, dry_run=args.dry_run))
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(report.counts().items())) or "nothing in range"
        print(f"{'dry run: ' if args.dry_run else ''}{len(report.actions)} message(s) from "
              f"{report.stream} ({counts})")
        return 0
    finally:
        await nc.drain()


async def tail_command(args: argparse.Namespace, config: Config) -> int:
    check_subject(args.subject)  # before connecting: a typo is said at once
    nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name="pgw-tail",
                       wait_for_server=False)
    stop = stop_event()
    pipeline = getattr(config, "pipeline", None)
    redact = string_redactor(secrets_config=getattr(pipeline, "secrets", None))
    try:
        await tail(nc, args.subject, redact=redact,
                   history="all" if args.all else None, since=args.since, last=args.last,
                   count=args.count, fmt="json" if args.json else "pretty", stop=stop)
        return 0
    finally:
        await nc.drain()
