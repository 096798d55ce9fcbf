"""The MCP server of one agent: ``pgw mcp --agent NAME`` (issue 16, docs/integrations.md).

Built on the official ``mcp`` SDK's low-level ``Server`` so that the tools'
input schemas are the wire types' own (``msgspec.json.schema``, see
``agent_tools.TOOLS``) rather than schemas derived from Python signatures.
The SDK's own input validation is off on purpose: a malformed moment must
reach the gateway, whose refusal lists every violated rule (spec 000 §6),
and comes back as a tool error (``isError``) the model can act on.

Transports: stdio (an MCP host spawns ``pgw mcp``) and streamable HTTP
(``--transport http``, on 127.0.0.1 with the SDK's DNS-rebinding protection).
While a tool waits for the principal, a progress notification goes out every
``progress_every`` seconds when the client asked for progress.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from mcp import types
from mcp.server.lowlevel import Server
from nats.aio.client import Client

from integrations.agent_tools import (
    EMITS_BINDING_MOMENT,
    TOOLS,
    AgentTools,
    ToolAnswer,
    input_schema,
)
from subjects.client import Agent

SERVER_NAME = "principal-gateway"
HTTP_PATH = "/mcp"


def tool_list() -> list[types.Tool]:
    return [
        types.Tool(
            name=name, description=description, inputSchema=input_schema(struct),
            # spec 000 §8.2: advertised in tools/list (advisory; every result is still a tool result).
            annotations=types.ToolAnnotations(emits_binding_moment=name in EMITS_BINDING_MOMENT),
        )
        for name, (struct, description) in TOOLS.items()
    ]


def to_result(answer: ToolAnswer) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=json.dumps(answer.body, ensure_ascii=False))],
        structuredContent=answer.body,
        isError=answer.is_error,
    )


def build_server(tools: AgentTools) -> Server[Any, Any]:
    """The MCP server whose tools are ``tools``' calls."""
    server: Server[Any, Any] = Server(
        SERVER_NAME,
        instructions=f"Reach the human principal of agent {tools.agent.agent!r} through Principal Gateway.",
    )

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        return tool_list()

    @server.call_tool(validate_input=False)
    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        ctx = server.request_context
        token = ctx.meta.progressToken if ctx.meta else None

        async def progress(elapsed: float, message: str) -> None:
            if token is not None:
                await ctx.session.send_progress_notification(
                    token, elapsed, None, message, related_request_id=str(ctx.request_id)
                )

        return to_result(await tools.call(name, arguments or {}, progress))

    return server


@asynccontextmanager
async def agent_tools(nc: Client, agent: str, *, prefix: str = "pgw", progress_every: float = 2.0) -> AsyncIterator[AgentTools]:
    """The agent's tools over ``nc``; the agent's outcome reader is closed on exit."""
    client = Agent(nc, agent, prefix=prefix)
    try:
        yield AgentTools(client, progress_every=progress_every)
    finally:
        await client.close()


async def serve_stdio(server: Server[Any, Any]) -> None:
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


async def serve_http(server: Server[Any, Any], *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Streamable HTTP at ``http://{host}:{port}/mcp`` until cancelled."""
    import uvicorn
    from mcp.server.fastmcp.server import StreamableHTTPASGIApp
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
    from mcp.server.transport_security import TransportSecuritySettings
    from starlette.applications import Starlette
    from starlette.routing import Route

    security = None
    if host in ("127.0.0.1", "localhost", "::1"):
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
        )
    manager = StreamableHTTPSessionManager(app=server, security_settings=security)
    app = Starlette(
        routes=[Route(HTTP_PATH, endpoint=StreamableHTTPASGIApp(manager))],
        lifespan=lambda _app: manager.run(),
    )
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", log_config=None)
    await uvicorn.Server(config).serve()
