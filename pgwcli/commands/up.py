"""``pgw up``: the whole system on the embedded default.

Starts a local nats-server (JetStream, ``sync_interval: always``, file store
under the data folder, loopback only), waits until it is healthy, creates the
streams idempotently, runs every service of ``UP_SERVICES``, prints where to
connect and what to try, and on Ctrl-C drains in-flight work and stops
everything, the server last.

Each party gets its own credentials file (docs/security.md §1); every ``pgw``
command then finds the one its role needs (pgwcli/creds.py). ``--quickstart`` (what
``make run`` runs) binds the quick start's parties (``QUICKSTART_AGENTS``,
``QUICKSTART_OPS``) where the configuration names none.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import sys
from pathlib import Path

import msgspec

from gateway.security import DEMO_AGENT, DEMO_PRINCIPAL
from pgwcore.config import AgentConfig, Config, default_data_dir, open_mode_message
from pgwcore.connect import close_quietly, connect
from pgwcore.logs import get_logger
from pgwcore.server import EmbeddedServer
from pgwcore.service import ServiceFactory, run_services, stop_event
from pgwcore.streams import ensure_streams
from pgwcore.tls import make_dev_ca

log = get_logger("pgw.up")

# name -> "module:attribute" of a ServiceFactory; imported lazily so that a
# service's dependencies load only when it runs.
UP_SERVICES: dict[str, str] = {
    "gateway": "gateway.app:Gateway",
    "signer": "consumers.signer:Signer",
    "registrar": "consumers.registrar:Registrar",
    "notifier": "consumers.notify.service:Notifier",  # issue 17 (notifier.enabled = false: not run)
    "surface-slack": "consumers.slack.service:SlackSurface",  # docs/surfaces.md (slack.enabled = false: not run)
}


# `pgw up --quickstart` (what `make run` runs): the parties of the README's quick start, bound for real
# rather than open mode (spec 000 §8.4): agent planner and `pgw demo`'s agent both address ~alice, and
# the ops user `ops` reads the streams for the ops commands. It fills in only what the configuration
# leaves empty, so a configuration's own bindings and ops users always win.
QUICKSTART_AGENTS: dict[str, tuple[str, ...]] = {"planner": ("alice",), DEMO_AGENT: (DEMO_PRINCIPAL,)}
QUICKSTART_OPS: tuple[str, ...] = ("ops",)


def quickstart(config: Config) -> Config:
    """``config`` with the quick start's bindings and ops user where it has none of its own."""
    agents = config.agents or {a: AgentConfig(principals=list(ps)) for a, ps in QUICKSTART_AGENTS.items()}
    security = config.security if config.security.ops else msgspec.structs.replace(config.security, ops=list(QUICKSTART_OPS))
    return msgspec.structs.replace(config, agents=agents, security=security)


def load_factory(name: str) -> ServiceFactory:
    module, _, attr = UP_SERVICES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("up", help="start nats-server and every service locally (what `make run` runs)")
    p.add_argument("--only", help="comma-separated services to run (default: all of them)")
    p.add_argument("--dev-tls", action="store_true",
                   help="serve TLS with client certificates, from a local development CA in {data_dir}/tls "
                        "(also [server] tls = true)")
    p.add_argument("--open", action="store_true", help="allow open mode (no [agents] bindings; development only)")
    p.add_argument("--quickstart", action="store_true",
                   help="what `make run` runs: bind agents planner and demo-agent to ~alice and make the ops user "
                        "ops, unless the configuration binds agents or names ops users itself; writes their credentials")
    p.set_defaults(handler=handle)


def pgw_command() -> str:
    """This ``pgw``'s absolute path, for commands printed to run elsewhere (``pgw`` may not be on PATH)."""
    beside = Path(sys.executable).parent / "pgw"
    return str(beside) if beside.exists() else "pgw"


def banner(config: Config, server: EmbeddedServer, names: list[str], creds_folder: Path | None = None) -> str:
    t = config.tls
    tls = f" --tls-ca {t.ca} --tls-cert {t.cert} --tls-key {t.key}" if server.tls_cert else ""
    data = config.data_path.resolve()
    # A command finds the data folder (and the credentials in it) by itself when it is the default one.
    where = "" if Path(default_data_dir()).resolve() == data else f" --data-dir {data}"
    pgw = pgw_command()
    lines = [
        "",
        "Principal Gateway is up.",
        f"  NATS          {server.client_url}" + ("  (TLS, client certificates required)" if tls else ""),
        *([f"  TLS           development CA {t.ca}; a client pair {t.cert}"] if tls else []),
        f"  monitoring    {server.monitor_url or '(off; [server] monitor_port to turn on)'}",
        f"  websocket     {server.websocket_url or '(off)'}",
        f"  data folder   {data}",
        f"  services      {', '.join(names)}",
    ]
    if creds_folder is not None:
        bound = ", ".join(f"{a} -> {', '.join('~' + p for p in c.principals)}" for a, c in sorted(config.agents.items()))
        lines.append(f"  credentials   {creds_folder.resolve()} (each pgw command takes the file its role needs)")
        if bound:
            lines.append(f"  agents        {bound}")
        if config.security.ops:
            lines.append(f"  ops users     {', '.join(config.security.ops)}")
    lines += [
        "",
        "Try, in another terminal:",
        f"  {pgw} demo --server {server.client_url}{where}{tls}",
        f"  {pgw} streams --server {server.client_url}{where}{tls}",
    ]
    if "planner" in config.agents:
        host = {"command": pgw, "args": ["mcp", "--agent", "planner"],
                "env": {"PGW_DATA_DIR": str(data), "NATS_URL": server.client_url}}
        lines += ["", "An MCP host speaks for agent planner with:", "  " + json.dumps({"mcpServers": {"pgw": host}})]
    return "\n".join([*lines, "", "Ctrl-C drains in-flight work and stops everything.", ""])


def browser_origins(config: Config) -> tuple[str, ...]:
    """The browser surface's page origins, the only ones allowed on the WebSocket port.

    ``surfaces.web_port = 0`` (a free port each run) cannot be known in advance: no
    origin is then allowed, so browsers are refused and native clients (no Origin
    header) still connect.
    """
    port = config.surfaces.web_port
    public = (config.surfaces.public_origin,) if config.surfaces.public_origin else ()  # behind TLS (issue 17)
    if not port:
        return public or ("http://pgw-browser-surface.invalid",)
    hosts = {config.surfaces.web_host, "127.0.0.1", "localhost"}
    return tuple(sorted(f"http://{h}:{port}" for h in hosts if h != "::1")) + (
        (f"http://[::1]:{port}",) if config.surfaces.web_host == "::1" else ()) + public


async def handle(args: argparse.Namespace, config: Config) -> int:
    optional = {"notifier": config.notifier.enabled, "surface-slack": config.slack.enabled}
    names = [n for n in UP_SERVICES if optional.get(n, True)]
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in UP_SERVICES]
        if unknown:
            print(f"pgw: unknown service(s) {unknown}; known: {list(UP_SERVICES)}", file=sys.stderr)
            return 2
    if getattr(args, "open", False):
        config = msgspec.structs.replace(config, open=True)
    if getattr(args, "quickstart", False):
        config = quickstart(config)
    if "gateway" in names and (open_mode := open_mode_message(config)) is not None and open_mode[0]:
        # spec 000 §8.4: refused before anything starts. Allowed, the gateway says so once in its log.
        print(open_mode[1], file=sys.stderr, flush=True)
        return 2
    s = config.server
    auth = None
    if config.security.enabled and not config.creds:
        # Secure by default (docs/security.md §1): every party needs its own credentials.
        from gateway.security import embedded_auth

        auth = embedded_auth(config)
        config = msgspec.structs.replace(config, creds=str(auth.service_creds))
        print(f"Isolation on: per-party NATS credentials in {auth.party_creds_dir.resolve()}", flush=True)
    tls: dict[str, str] = {}
    if args.dev_tls or s.tls:
        # A development CA (pgwcore/tls.py): mutual TLS on the client port, TLS on the WebSocket port;
        # every in-process service and the printed commands use its client pair.
        ca = make_dev_ca(config.data_path / "tls")
        tls = {"tls_cert": str(ca.server_cert), "tls_key": str(ca.server_key), "tls_ca": str(ca.ca),
               "health_client_cert": str(ca.client_cert), "health_client_key": str(ca.client_key)}
        config = msgspec.structs.replace(config, tls=msgspec.structs.replace(
            config.tls, ca=str(ca.ca), cert=str(ca.client_cert), key=str(ca.client_key)))
    server = EmbeddedServer(
        config.data_path / "nats",
        host=s.host,
        port=s.port,
        monitor_port=s.monitor_port,
        websocket_port=s.websocket_port,
        websocket_origins=browser_origins(config),
        max_payload=s.max_payload,
        authorization=auth.server_block if auth else None,
        # A `pgw up` killed outright (SIGKILL, a closed terminal's SIGHUP) runs none of its own stop: its
        # server, in a session of its own, would hold the ports and store for the next `pgw up`.
        stop_with_parent=True,
        **tls,  # type: ignore[arg-type]
    )
    await server.start()  # AlreadyRunning / ServerError are reported by the CLI
    supervisor: asyncio.Task[str | None] | None = None
    try:
        config = msgspec.structs.replace(config, nats_url=server.client_url)
        nc = await connect(server.client_url, creds=config.creds, tls=config.tls.files(), name="pgw-up")
        try:
            created = await ensure_streams(nc.jetstream(), config.subjects,
                                           duplicate_window_s=config.gateway.duplicate_window_s)
            log.info("streams ready", **created)
            services = [load_factory(n)(config, nc) for n in names]
            stop = stop_event()
            supervisor = asyncio.create_task(supervise(server, stop, s.restart_limit))
            await run_services(services, stop, on_started=lambda: print(banner(config, server, names, auth and auth.party_creds_dir), flush=True))
        finally:
            await close_quietly(nc)
    finally:
        failure = await _supervisor_result(supervisor)
        await server.stop()
        log.info("stopped")
    if failure:
        print(f"pgw up: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


async def _supervisor_result(task: asyncio.Task[str | None] | None) -> str | None:
    if task is None:
        return None
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def supervise(server: EmbeddedServer, stop: asyncio.Event, limit: int) -> str | None:
    """Restart the embedded nats-server when it dies, up to ``limit`` times; then stop everything.

    Returns the one line ``pgw up`` exits with when it gives up (None when stopped normally).
    The services ride out a restart on their reconnecting connection: what they publish while
    the server is down fails its PubAck and is retried by their own delivery rules.
    """
    restarts = 0
    while not stop.is_set():
        code = await server.wait_exit()
        if stop.is_set():
            return None
        restarts += 1
        if restarts > limit:
            stop.set()
            return (f"the embedded nats-server exited (code {code}) {restarts} times; gave up after "
                    f"{limit} restarts (server.restart_limit). Its log: {server.data_dir / 'nats-server.log'}")
        log.warning("embedded nats-server exited; restarting it", code=code, restart=restarts, limit=limit)
        try:
            await server.restart()
        except Exception as e:  # noqa: BLE001 - reported in one line, then everything stops
            stop.set()
            return f"the embedded nats-server exited (code {code}) and could not be restarted: {e}".splitlines()[0]
        log.info("embedded nats-server restarted", url=server.client_url, restart=restarts)
    return None
