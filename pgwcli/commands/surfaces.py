"""``pgw surface`` (terminal) and ``pgw surface-web`` (browser): principal surfaces.

Both speak only the bus contract (DESIGN §4) with the principal's own
credentials: ``--creds FILE`` (global option, before or after the subcommand), else
``{creds_dir}/principal-{P}.creds`` when ``pgw creds`` made one, else none.
See docs/surfaces.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from typing import TYPE_CHECKING

from pgwcore.service import run_services, stop_event
from subjects.names import principal_token

if TYPE_CHECKING:
    from pgwcore.config import Config


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "surface",
        help="terminal surface: read and answer a principal's binding moments",
        description="Show a principal's pending moments and answer them: arrow keys pick an option, "
        "f answers in your own words, d rejects the question, Enter answers. "
        "--json prints items as JSON lines and reads answers (ResolveRequest JSON lines) from stdin.",
    )
    p.add_argument("--principal", "-p", required=True, help="principal handle (alice or ~alice)")
    p.add_argument("--json", action="store_true", help="non-interactive: JSON lines out, answers from stdin")
    p.add_argument("--follow", action="store_true", help="with --json: keep running after stdin ends")
    p.add_argument("--no-color", action="store_true", help="no ANSI colours")
    p.set_defaults(handler=run_surface)

    w = sub.add_parser(
        "surface-web",
        help="browser surface: serve the page on localhost for a principal",
        description="Serve the browser surface on 127.0.0.1. The page connects to NATS over the "
        "server's WebSocket listener with the principal's credentials.",
    )
    w.add_argument("--principal", "-p", required=True, help="principal handle (alice or ~alice)")
    w.add_argument("--port", type=int, help="HTTP port on 127.0.0.1 (default: surfaces.web_port, 8765; 0 = any)")
    w.add_argument("--ws-url", help="NATS WebSocket URL (default: surfaces.ws_url or the embedded server's)")
    w.add_argument("--open", action="store_true", help="open the page in the default browser")
    w.add_argument("--new-token", action="store_true",
                   help="replace the page token kept in {data_dir}/surface-web/ (installed apps must be opened "
                   "once with the new URL)")
    w.set_defaults(handler=run_surface_web)

    k = sub.add_parser(
        "surface-slack",
        help="Slack surface: post a principal's moments to Slack and take the answers from there",
        description="Post every binding moment, question and notice of the principals in [slack.principals] "
        "to Slack (a DM or a channel) and take their answers from Slack's buttons and modals. The bot token "
        "and signing secret come from the files [slack] names or $PGW_SLACK_BOT_TOKEN / "
        "$PGW_SLACK_SIGNING_SECRET ($PGW_SLACK_APP_TOKEN for Socket Mode). See docs/surfaces.md.",
    )
    k.add_argument("--principal", "-p", action="append",
                   help="serve only this principal (repeatable; default: every one in [slack.principals])")
    k.set_defaults(handler=run_surface_slack)


def principal_creds(args: argparse.Namespace, config: Config, principal: str) -> str | None:
    """The credentials to use: explicit, else the file ``pgw creds`` wrote for this principal."""
    from gateway.security import Party, party_creds

    if config.creds:  # --creds (before or after the subcommand) or $NATS_CREDS
        return config.creds
    return party_creds(config, Party("principal", principal))


def ws_url_of(args: argparse.Namespace, config: Config) -> str:
    if getattr(args, "ws_url", None):
        return args.ws_url
    if config.surfaces.ws_url:
        return config.surfaces.ws_url
    return f"ws://{config.server.host}:{config.server.websocket_port}"


async def run_surface(args: argparse.Namespace, config: Config) -> int:
    from consumers.surfaces.feed import ConnectionWatch, SurfaceFeed, connect_principal
    from consumers.surfaces.terminal import TerminalSurface, run_json
    from subjects.client import Presence

    principal = principal_token(args.principal)
    creds = principal_creds(args, config, principal)
    if not args.json and not sys.stdin.isatty():
        print("pgw surface: stdin is not a terminal; use --json for scripts", file=sys.stderr)
        return 2
    watch = ConnectionWatch()
    nc = await connect_principal(config.nats_url, creds=creds, name=f"pgw-surface-{principal}", watch=watch,
                                tls=config.tls.files())
    try:
        feed = SurfaceFeed(nc, principal, prefix=config.prefix, watch=watch)
        if args.json and not args.follow:
            return await run_json(feed, follow=False)
        # An open surface keeps presence, so the notifier stays quiet (issue 17, docs/notifications.md).
        async with Presence(nc, principal, surface="terminal", prefix=config.prefix):
            if args.json:
                return await run_json(feed, follow=True)
            ui = TerminalSurface(feed, color=not args.no_color and sys.stdout.isatty())
            loop = asyncio.get_running_loop()
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(signal.SIGTERM, ui.quit.set)
                loop.add_signal_handler(signal.SIGHUP, ui.quit.set)
            return await ui.run()
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()


def page_time_zone(config: Config, principal: str) -> str | None:
    """The zone the page shows times in: the principal's ``[notifier.principals.P] timezone``, or None
    (the browser's) when it is left at its default, "UTC" (write "Etc/UTC" to have UTC on the page)."""
    listed = config.notifier.principals.get(principal)
    return listed.timezone if listed is not None and listed.timezone != "UTC" else None


async def run_surface_web(args: argparse.Namespace, config: Config) -> int:
    from consumers.surfaces.feed import browser_auth
    from consumers.surfaces.web import WebSurfaceServer, stored_token

    principal = principal_token(args.principal)
    creds = principal_creds(args, config, principal)
    from gateway.security import creds_dir as creds_folder

    folder = creds_folder(config)
    if creds is None and folder.is_dir():
        # `pgw up` wrote credentials for its parties, and this principal is not one of them: the
        # page would connect to its server without any and be refused.
        print(f"pgw surface-web: no credentials for ~{principal} in {folder}: it is not a principal of "
              "this configuration ([agents.NAME] principals, [security] principals); the page can only reach "
              "a server that asks for none", file=sys.stderr)
    if args.port is not None and args.port != config.surfaces.web_port and not (args.ws_url or config.surfaces.ws_url):
        # issue 19: `pgw up` allows browsers only from http://127.0.0.1:{surfaces.web_port}.
        print(f"pgw surface-web: --port {args.port} is not surfaces.web_port ({config.surfaces.web_port}); "
              "the embedded server refuses WebSocket connections from this page's origin "
              "(set surfaces.web_port and restart pgw up)", file=sys.stderr)
    server = WebSurfaceServer(
        principal=principal,
        ws_url=ws_url_of(args, config),
        prefix=config.prefix,
        auth=browser_auth(config.nats_url, creds),
        host=config.surfaces.web_host,
        port=config.surfaces.web_port if args.port is None else args.port,
        token=stored_token(config.data_path / "surface-web" / f"{principal}.token", renew=args.new_token),
        # The page's own notifications follow the notifier's opt-in (docs/notifications.md).
        notify_synopsis=config.notifier.for_principal(principal).show_synopsis,
        time_zone=page_time_zone(config, principal),
    )

    def announce() -> None:
        print(f"Browser surface for ~{principal}: {server.url}", flush=True)
        if config.surfaces.public_origin:  # the same page through the TLS proxy (docs/surfaces.md)
            print(f"Through HTTPS (install the app from here): {config.surfaces.public_origin}/?t={server.token}", flush=True)
        print(f"(NATS WebSocket {server.ws_url}; Ctrl-C stops)", flush=True)
        if args.open:
            import webbrowser

            webbrowser.open(server.url)

    await run_services([server], stop_event(), on_started=announce)
    return 0


async def run_surface_slack(args: argparse.Namespace, config: Config) -> int:
    from consumers.slack.service import SlackConfigError, SlackSurface

    try:
        surface = SlackSurface(config, principals=args.principal)
    except SlackConfigError as e:
        print(f"pgw surface-slack: {e}", file=sys.stderr)
        return 2

    def announce() -> None:
        where = (f"interactions on http://{config.slack.http_host}:{surface.port}{config.slack.path}"
                 if config.slack.mode == "http" else "Socket Mode")
        print(f"Slack surface for {', '.join('~' + p for p in surface.names)}: {where} (Ctrl-C stops)", flush=True)

    await run_services([surface], stop_event(), on_started=announce)
    return 0
