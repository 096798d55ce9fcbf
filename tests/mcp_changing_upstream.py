"""A small MCP server (the SDK's FastMCP) whose tool list changes, with a prompt and a resource: the
upstream the gate's list_changed, prompt and resource handling is tested against (the reference servers
have no tool list that changes, no prompt and no resource). ``python mcp_changing_upstream.py`` serves
stdio; ``... http PORT`` serves streamable HTTP on 127.0.0.1:PORT/mcp, where ``whoami`` tells which
Authorization header the request carried."""

from __future__ import annotations

from mcp.server.fastmcp import Context, FastMCP

app = FastMCP("changing")


@app.tool()
async def add_tool(name: str, ctx: Context) -> str:  # type: ignore[type-arg]
    """Register a tool called NAME (it echoes its text) and tell the client the list changed."""

    def echo(text: str) -> str:
        return f"{name}: {text}"

    app.add_tool(echo, name=name, description=f"echo, registered as {name}")
    await ctx.session.send_tool_list_changed()
    return f"added {name}"


@app.tool()
def getenv(name: str) -> str:
    """The value of environment variable NAME in this server's process ("" when unset)."""
    import os

    return os.environ.get(name, "")


@app.tool()
async def slow(release: str) -> str:
    """Answer once a line is written to the named pipe RELEASE: the caller holds the call as long as it needs."""
    import asyncio

    def wait() -> str:
        with open(release) as pipe:  # a FIFO: blocks until the caller opens it to write
            return pipe.readline().strip()

    return f"released: {await asyncio.to_thread(wait)}"


@app.prompt()
def summarize(topic: str) -> str:
    """A prompt template."""
    return f"Summarize what is known about {topic}."


@app.resource("memo://notes")
def notes() -> str:
    """A resource."""
    return "secret notes"


@app.tool()
async def whoami(ctx: Context) -> str:  # type: ignore[type-arg]
    """The Authorization header of this HTTP request ("" over stdio)."""
    request = getattr(ctx.request_context, "request", None)
    return request.headers.get("authorization", "") if request is not None else ""


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["http"]:
        app.settings.host, app.settings.port = "127.0.0.1", int(sys.argv[2])
        app.run("streamable-http")
    else:
        app.run("stdio")
