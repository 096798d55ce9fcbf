"""``pgw mcp --agent NAME``: one agent's MCP server (integrations/mcp.py, docs/integrations.md).

An MCP host (Claude Desktop, an IDE, an agent framework) spawns it over stdio,
or connects over streamable HTTP (``--transport http``), in any folder. It speaks
the bus with the agent's credentials, chosen by pgwcli/creds.py: ``--creds FILE``,
``--as agent:NAME``, else ``agent-{NAME}.creds`` in the credentials folder of the
data folder (``--data-dir``, ``$PGW_DATA_DIR``, the configuration's); another
agent's file is refused in one line. Needs the optional extra:
``pip install 'principal-gateway[mcp]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from subjects.names import agent_token

if TYPE_CHECKING:
    from pgwcore.config import Config


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "mcp",
        help="MCP server for one agent: ask_principal, clarify, declare_intent, report_transition",
        description="Serve the Model Context Protocol for agent NAME, so an MCP host reaches the "
        "agent's principal through the gateway: ask_principal (a binding moment), clarify, "
        "declare_intent and report_transition (the IDP kernel), await_moment. "
        "Needs the extra: pip install 'principal-gateway[mcp]'.",
    )
    # Not required by argparse: a host's JSON without it gets the gate_problem tool saying so (serve_problem).
    p.add_argument("--agent", "-a", help="the agent this server speaks for (required)")
    p.add_argument("--transport", choices=["stdio", "http"], default="stdio",
                   help="stdio (an MCP host spawns this command; default) or streamable HTTP")
    p.add_argument("--host", default="127.0.0.1", help="with --transport http: address to listen on")
    p.add_argument("--port", type=int, default=8000, help="with --transport http: port (default 8000); the path is /mcp")
    p.add_argument("--progress-every", type=_positive_seconds, default=2.0,
                   help="seconds between progress notifications while waiting for the principal")
    p.set_defaults(handler=run_mcp, serve_problem=serve_problem)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.05 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0.05 and 3600 seconds, not {text}")
    return value


def agent_creds(config: Config, agent: str) -> str | None:
    """The credentials pgwcli/creds.py chose (``config.creds``), else the file ``pgw creds`` wrote for this agent."""
    from gateway.security import Party, party_creds

    return config.creds or party_creds(config, Party("agent", agent))


async def serve_transport(server: Any, args: argparse.Namespace, what: str,
                          serve_stdio: Callable[[Any], Awaitable[None]],
                          serve_http: Callable[..., Awaitable[None]]) -> int:
    """Serve ``server`` on stdio, or on streamable HTTP until SIGINT/SIGTERM (``pgw mcp``, ``pgw mcp-gate``)."""
    if args.transport == "stdio":
        await serve_stdio(server)
        return 0
    serving = asyncio.ensure_future(serve_http(server, host=args.host, port=args.port))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, serving.cancel)
    print(f"{what}: http://{args.host}:{args.port}/mcp", file=sys.stderr, flush=True)
    with contextlib.suppress(asyncio.CancelledError):
        await serving
    return 0


async def serve_problem(args: argparse.Namespace, line: str) -> int:
    """What ``pgw mcp`` and ``pgw mcp-gate`` do when they cannot start (no ``--agent``, another agent's
    credentials, a gate file that cannot be read, a configuration that does not load): ``line`` on stderr,
    which hosts log, and an MCP server whose ``gate_problem`` tool and every call say it, until the host
    closes stdin; then exit 2. A host shows the user a tool error; an exit it shows only as "Connection
    closed". ``pgw mcp-gate --check``, run by a person, only says the line and exits 2."""
    if getattr(args, "check", False):
        print(line, file=sys.stderr)
        return 2
    try:
        from integrations.mcp import serve_http, serve_stdio
        from integrations.mcp_gate import problem_server
    except ImportError as e:
        print(f"{line}\npgw {args.command}: the MCP SDK is missing ({e}); install it with pip install "
              "'principal-gateway[mcp]'", file=sys.stderr)
        return 2
    what = "MCP gate" if args.command == "mcp-gate" else "MCP server"
    print(f"{line}; serving only the gate_problem tool that says so", file=sys.stderr, flush=True)
    await serve_transport(problem_server(line, what), args, f"{what} (misconfigured)", serve_stdio, serve_http)
    return 2


async def run_mcp(args: argparse.Namespace, config: Config) -> int:
    try:
        from integrations.mcp import agent_tools, build_server, serve_http, serve_stdio
    except ImportError as e:
        print(f"pgw mcp: the MCP SDK is missing ({e}); install it with pip install 'principal-gateway[mcp]'",
              file=sys.stderr)
        return 2
    from pgwcore.connect import connect

    agent = agent_token(args.agent)
    nc = await connect(config.nats_url, creds=agent_creds(config, agent), tls=config.tls.files(), name=f"pgw-mcp-{agent}")
    try:
        async with agent_tools(nc, agent, prefix=config.prefix, progress_every=args.progress_every) as tools:
            return await serve_transport(build_server(tools), args, f"MCP server for agent {agent}",
                                         serve_stdio, serve_http)
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()
