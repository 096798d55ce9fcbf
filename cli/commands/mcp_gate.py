"""``pgw mcp-gate --agent NAME --gate FILE``: MCP tool servers behind the IDP kernel (integrations/mcp_gate.py, docs/gate.md).

An MCP host spawns it (stdio) or connects over streamable HTTP, in place of the
upstream servers it fronts. It speaks the bus for the agent with the agent's
credentials (``--creds``, else ``{creds_dir}/agent-{NAME}.creds``) and serves
the gate's executor ``mcp-{name}`` with ``--executor-creds`` (default:
``{creds_dir}/executor-mcp-{name}.creds`` when it exists, else the same connection). Needs the extra: ``pip install 'principal-gateway[mcp]'``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cli.commands.mcp import _positive_seconds, agent_creds, serve_transport
from subjects.names import agent_token

if TYPE_CHECKING:
    from pgwcore.config import Config


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "mcp-gate",
        help="MCP gate: upstream MCP tool servers behind the IDP kernel, for one agent",
        description="Serve the tools of the upstream MCP servers named in --gate to agent NAME's MCP host; "
        "every tools/call is submitted to the kernel (agent.NAME.act) and runs only when it permits "
        "(or the principal approves). Needs the extra: pip install 'principal-gateway[mcp]'.",
    )
    p.add_argument("--agent", "-a", required=True, help="the agent this gate speaks for")
    p.add_argument("--gate", "-g", dest="gate_config", required=True,
                   help="the gate's TOML file: upstreams, tool rules, mandate (docs/gate.md); --config stays pgw's own")
    p.add_argument("--executor-creds", default=None,
                   help="credentials of the executor role executor:mcp-{name} (default: {creds_dir}/executor-mcp-{name}.creds "
                   "when `pgw creds` made it, else the agent's connection)")
    p.add_argument("--transport", choices=["stdio", "http"], default="stdio")
    p.add_argument("--host", default="127.0.0.1", help="with --transport http: address to listen on")
    p.add_argument("--port", type=int, default=8000, help="with --transport http: port (default 8000); the path is /mcp")
    p.add_argument("--progress-every", type=_positive_seconds, default=None,
                   help="seconds between progress notifications while a call waits (default: the file's, 2)")
    p.add_argument("--check", action="store_true",
                   help="start the upstreams, print the tools and the kernel's executor configuration, and exit")
    p.set_defaults(handler=run_mcp_gate)


def _executor_creds(config: Config, kind: str) -> str | None:
    """The file ``pgw creds`` wrote for the executor role ``executor:{kind}``, if there is one."""
    creds_dir = Path(config.security.creds_dir) if config.security.creds_dir else config.data_path / "creds"
    candidate = creds_dir / f"executor-{kind}.creds"
    return str(candidate) if candidate.exists() else None


async def run_mcp_gate(args: argparse.Namespace, config: Config) -> int:
    try:
        from integrations.mcp import serve_http
        from integrations.mcp_gate import (
            Gate,
            GateConfigError,
            Upstreams,
            load_gate_config,
            serve_stdio,
        )
    except ImportError as e:
        print(f"pgw mcp-gate: the MCP SDK is missing ({e}); install it with pip install 'principal-gateway[mcp]'", file=sys.stderr)
        return 2
    import msgspec

    from pgwcore.connect import connect

    try:
        gate_config = load_gate_config(args.gate_config)
        if args.progress_every is not None:
            gate_config = msgspec.structs.replace(gate_config, progress_every=args.progress_every)
    except GateConfigError as e:
        print(f"pgw mcp-gate: {e}", file=sys.stderr)
        return 2
    if args.check:
        async with Upstreams(gate_config) as ups:
            for t in ups.host_tools():
                print(f"{t.name}\t{ups.tools[t.name].action}")
            print(f"\n[kernel.executors.{gate_config.kind}]\nactions = {sorted(ups.actions())!r}".replace("'", '"'))
        return 0
    agent = agent_token(args.agent)
    nc = await connect(config.nats_url, creds=agent_creds(config, agent), tls=config.tls.files(), name=f"pgw-mcp-gate-{agent}")
    exec_nc = None
    try:
        executor_creds = args.executor_creds or _executor_creds(config, gate_config.kind)
        if executor_creds:
            exec_nc = await connect(config.nats_url, creds=executor_creds, tls=config.tls.files(),
                                    name=f"pgw-exec-{gate_config.kind}")
        try:
            gate = Gate(gate_config, nc, agent, prefix=config.prefix, exec_nc=exec_nc, base=Path(args.gate_config).parent)
        except GateConfigError as e:
            print(f"pgw mcp-gate: {e}", file=sys.stderr)
            return 2
        async with gate:
            return await serve_transport(gate.server(), args, f"MCP gate for agent {agent}", serve_stdio, serve_http)
    finally:
        for c in (exec_nc, nc):
            if c is not None:
                with contextlib.suppress(Exception):
                    await c.drain()
