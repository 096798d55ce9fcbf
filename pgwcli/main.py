"""``pgw``: one command-line entry point with subcommands.

Global options: ``--server`` (or ``NATS_URL``), ``--creds`` (or ``NATS_CREDS``),
``--as ROLE:NAME``, ``--config`` (or ``PGW_CONFIG``), ``--data-dir`` (or
``PGW_DATA_DIR``), ``--log-format``. Environment overrides are read here only, at
the edge. Each command's credentials are chosen here too (``pgwcli.creds``), so a
refused or mismatched file is said in one line the same way for every command.

Each subcommand lives in a module under ``pgwcli/commands`` (or a consumer)
exposing ``register(subparsers)``; the module list is ``COMMAND_MODULES``.
A handler is ``async def handler(args, config) -> int``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from nats.errors import TimeoutError as NatsTimeout

from pgwcli.creds import Chosen, CredsError, choose, need_for, refusal, timeout_hint, with_creds
from pgwcore import loop, tracing
from pgwcore.config import DEFAULT_DATA_DIR, Config, default_data_dir, load_config
from pgwcore.connect import ConnectError
from pgwcore.logs import configure_logging
from subjects.errors import ConfigError, PgwError

COMMAND_MODULES: list[str] = [
    "pgwcli.commands.up",
    "pgwcli.commands.run_gateway",
    "pgwcli.commands.demo",
    "pgwcli.commands.schema",
    "pgwcli.commands.streams",
    "pgwcli.commands.ops",
    "pgwcli.commands.surfaces",
    "pgwcli.commands.approvals",
    "pgwcli.commands.capsules",
    "pgwcli.commands.notify",
    "pgwcli.commands.kernel",
    "pgwcli.commands.audit",
    "pgwcli.commands.security",
    "pgwcli.commands.accounts",
    "pgwcli.commands.mcp",
    "pgwcli.commands.mcp_gate",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgw",
        description="Principal Gateway: the gateway between AI agents and their human principals, on NATS.",
    )
    add_global_options(parser, None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    # Global options are accepted after the subcommand too (`pgw demo --server URL`).
    for p in sub.choices.values():
        add_global_options(p, argparse.SUPPRESS)
    return parser


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(value: str) -> str:
    if value.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r} is not a log level ({', '.join(LOG_LEVELS)})")
    return value.upper()


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a TCP port (0-65535)")
    return port


def add_global_options(parser: argparse.ArgumentParser, default: object) -> None:
    """The options every subcommand shares; ``default`` SUPPRESS keeps the top-level value."""

    def d(value: object) -> object:
        return default if default is argparse.SUPPRESS else value

    parser.add_argument("--server", "-s", default=d(None), help="NATS URL (default: $NATS_URL or the config's nats_url)")
    parser.add_argument("--creds", default=d(None),
                        help="NATS credentials file (default: $NATS_CREDS, else the file of the party the command "
                             "needs in the credentials folder; docs/operations.md \"Credentials\")")
    parser.add_argument("--as", dest="as_party", metavar="ROLE:NAME", default=d(None),
                        help="connect with this party's credentials from the credentials folder (e.g. ops:ops, agent:planner)")
    parser.add_argument("--config", "-c", default=d(None), help="TOML configuration file (default: $PGW_CONFIG)")
    parser.add_argument("--data-dir", default=d(None),
                        help="data folder (default: $PGW_DATA_DIR, else the config's data_dir, relative to the config "
                             "file, else .pgw here or beside the environment pgw runs from)")
    parser.add_argument("--log-format", default=d(None), choices=["auto", "json", "console"], help="log output format")
    parser.add_argument("--log-level", type=_log_level, default=d(os.environ.get("PGW_LOG_LEVEL", "INFO")),
                        help=f"{', '.join(LOG_LEVELS)} (default: $PGW_LOG_LEVEL or INFO)")
    parser.add_argument("--tls-ca", default=d(None), help="CA bundle of the NATS server's certificate (default: $NATS_CA or tls.ca)")
    parser.add_argument("--tls-cert", default=d(None), help="client certificate for a server that verifies clients ($NATS_CERT)")
    parser.add_argument("--tls-key", default=d(None), help="the client certificate's key ($NATS_KEY)")
    parser.add_argument("--metrics-port", type=_port, default=d(None),
                        help="serve Prometheus metrics on this port (default: $PGW_METRICS_PORT or ops.metrics_port)")


def config_from_args(args: argparse.Namespace) -> Config:
    """Load the configuration, then apply environment and command-line overrides."""
    path = args.config or os.environ.get("PGW_CONFIG")
    overrides: dict[str, object] = {
        "nats_url": args.server or os.environ.get("NATS_URL"),
        "creds": args.creds or os.environ.get("NATS_CREDS"),
        "data_dir": args.data_dir or os.environ.get("PGW_DATA_DIR"),
        "log_format": args.log_format,
    }
    config = load_config(path, **overrides)
    if not overrides["data_dir"] and config.data_dir == DEFAULT_DATA_DIR:  # named nowhere (load_config makes a file's absolute)
        import msgspec

        config = msgspec.structs.replace(config, data_dir=default_data_dir())
    tls = {k: v for k, v in (("ca", getattr(args, "tls_ca", None) or os.environ.get("NATS_CA")),
                             ("cert", getattr(args, "tls_cert", None) or os.environ.get("NATS_CERT")),
                             ("key", getattr(args, "tls_key", None) or os.environ.get("NATS_KEY"))) if v}
    if tls:  # nested section: the flags and the nats CLI's variables replace the file's values one by one
        import msgspec

        try:
            config = msgspec.structs.replace(config, tls=msgspec.convert(
                {**msgspec.to_builtins(config.tls), **tls}, type(config.tls)))
        except msgspec.ValidationError as e:
            raise ConfigError("tls", str(e)) from e
    metrics_port = getattr(args, "metrics_port", None)
    if metrics_port is None and os.environ.get("PGW_METRICS_PORT"):
        try:
            metrics_port = _port(os.environ["PGW_METRICS_PORT"])
        except argparse.ArgumentTypeError as e:
            raise ConfigError("PGW_METRICS_PORT", str(e)) from None
    if metrics_port:  # nested section: replaced field by field, keeping the file's other ops keys
        import msgspec

        config = msgspec.structs.replace(config, ops=msgspec.structs.replace(config.ops, metrics_port=metrics_port))
    return config


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # help and usage text too (argparse prints before any command runs)
        return _closed_pipe()


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    chosen: Chosen | None = None
    try:
        config = config_from_args(args)
        need = need_for(args)
        if need is not None:
            chosen = choose(args, config, need)
            config = with_creds(config, chosen)
        elif getattr(args, "as_party", None):
            print(f"pgw {args.command}: --as does not apply (it chooses its own credentials, or connects to "
                  "no server)", file=sys.stderr)
            return 2
    except CredsError as e:  # it names its command itself
        return _cannot_start(args, str(e))
    except PgwError as e:
        return _cannot_start(args, f"pgw: {e}")
    if chosen is not None and chosen.note:
        print(chosen.note, file=sys.stderr, flush=True)
    configure_logging(config.log_format, args.log_level)
    try:
        tracing.configure(f"pgw-{args.command}")  # the standard OTEL_* variables; off unless they ask
        code = loop.run(args.handler(args, config))
        if not sys.stdout.closed:  # an MCP server's stdio transport closes it on its way out
            sys.stdout.flush()  # inside the try: a reader that went away is a closed pipe, below
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _closed_pipe()
    except ConnectError as e:
        print(refusal(chosen, e.url, e.why) if e.auth and chosen is not None else f"pgw: {e}", file=sys.stderr)
        return 1
    except CredsError as e:  # pgw demo's pair
        print(e, file=sys.stderr)
        return 1
    except PgwError as e:
        print(f"pgw: {e}", file=sys.stderr)
        return 1
    except (NatsTimeout, TimeoutError) as e:  # nats' own, and a client's wait (subjects/client.py)
        # A request the server never answered. Most often the credentials may not make it: the
        # server drops what a user may not publish and tells the requester nothing.
        print(f"pgw: the server did not answer a request in time{_asked_at(e)}: these credentials may not be allowed it "
              f"(it spoke as {timeout_hint(chosen)}; ops users read, the services write; `pgw creds` lists the "
              "parties, --as ROLE:NAME chooses one), or the server is overloaded", file=sys.stderr)
        return 1
    except OSError as e:  # after the timeouts: Python's TimeoutError is an OSError too
        if e.errno == errno.EPIPE:
            return _closed_pipe()
        if e.errno != errno.EADDRINUSE:
            raise
        # A port this command serves on is taken (another surface, notifier or `pgw up`).
        print(f"pgw: {e.strerror or e}: another process (a second copy of this command?) listens there; "
              "stop it or choose another port", file=sys.stderr)
        return 1
    finally:
        tracing.shutdown()


_OURS = ("pgwcli", "pgwcore", "gateway", "consumers", "subjects", "integrations")


def _asked_at(e: BaseException) -> str:
    """`` (asked at gateway/kernel/revocation.py:113)``: where in this project the unanswered request was
    made (the innermost of its frames), so an operator can tell which request a service's start or a
    command was waiting on; "" when no frame of ours is in the traceback."""
    here = Path(__file__).resolve()
    root = here.parent.parent
    where = ""
    for frame in traceback.extract_tb(e.__traceback__):
        path = Path(frame.filename).resolve()
        try:
            rel = path.relative_to(root)
        except ValueError:
            continue
        if path != here and rel.parts and rel.parts[0] in _OURS:
            where = f" (asked at {rel.as_posix()}:{frame.lineno})"
    return where


def _cannot_start(args: argparse.Namespace, line: str) -> int:
    """A command whose configuration or credentials cannot serve it says why in one line and exits 2. An MCP
    server (``pgw mcp``, ``pgw mcp-gate``: ``serve_problem``) serves that line as a tool error instead, since
    its host would show an exit only as "Connection closed"."""
    serve = getattr(args, "serve_problem", None)
    if serve is None:
        print(line, file=sys.stderr)
        return 2
    try:
        return loop.run(serve(args, line))
    except KeyboardInterrupt:
        return 130


def _closed_pipe() -> int:
    """The reader of stdout went away (``pgw schema | head``): end quietly, as a command killed by
    SIGPIPE would, without a traceback. SIGPIPE itself stays ignored, as Python sets it: a NATS
    connection whose peer vanished must be an error, not the end of a service. stdout is pointed at
    /dev/null so that the interpreter's own flush at exit finds nothing to complain about."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
