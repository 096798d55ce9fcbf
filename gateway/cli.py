"""``pgw``: one command-line entry point with subcommands.

Global options: ``--server`` (or ``NATS_URL``), ``--creds``, ``--config`` (or
``PGW_CONFIG``), ``--data-dir`` (or ``PGW_DATA_DIR``), ``--log-format``.
Environment overrides are read here only, at the edge.

Each subcommand lives in a module under ``gateway/commands`` (or a consumer)
exposing ``register(subparsers)``; the module list is ``COMMAND_MODULES``.
A handler is ``async def handler(args, config) -> int``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from collections.abc import Sequence

from gateway.config import Config, load_config
from gateway.logs import configure_logging
from subjects.errors import PgwError

COMMAND_MODULES: list[str] = [
    "gateway.commands.up",
    "gateway.commands.run_gateway",
    "gateway.commands.demo",
    "gateway.commands.schema",
    "gateway.commands.streams",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgw",
        description="Principal Gateway: the gateway between AI agents and their human principals, on NATS.",
    )
    parser.add_argument("--server", "-s", help="NATS URL (default: $NATS_URL or the config's nats_url)")
    parser.add_argument("--creds", help="NATS credentials file (default: $NATS_CREDS)")
    parser.add_argument("--config", "-c", help="TOML configuration file (default: $PGW_CONFIG)")
    parser.add_argument("--data-dir", help="data folder (default: $PGW_DATA_DIR or .pgw)")
    parser.add_argument("--log-format", choices=["auto", "json", "console"], help="log output format")
    parser.add_argument("--log-level", default=os.environ.get("PGW_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def config_from_args(args: argparse.Namespace) -> Config:
    """Load the configuration, then apply environment and command-line overrides."""
    path = args.config or os.environ.get("PGW_CONFIG")
    overrides: dict[str, object] = {
        "nats_url": args.server or os.environ.get("NATS_URL"),
        "creds": args.creds or os.environ.get("NATS_CREDS"),
        "data_dir": args.data_dir or os.environ.get("PGW_DATA_DIR"),
        "log_format": args.log_format,
    }
    return load_config(path, **overrides)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        config = config_from_args(args)
    except PgwError as e:
        print(f"pgw: {e}", file=sys.stderr)
        return 2
    configure_logging(config.log_format, args.log_level)
    try:
        return asyncio.run(args.handler(args, config))
    except KeyboardInterrupt:
        return 130
    except PgwError as e:
        print(f"pgw: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
