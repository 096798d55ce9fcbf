"""A small MCP server (the SDK's FastMCP) whose tool list changes, with a prompt and a resource: the
upstream the gate's list_changed, prompt and resource handling is tested against (the reference servers
have no tool list that changes, no prompt and no resource)."""

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


@app.prompt()
def summarize(topic: str) -> str:
    """A prompt template."""
    return f"Summarize what is known about {topic}."


@app.resource("memo://notes")
def notes() -> str:
    """A resource."""
    return "secret notes"


if __name__ == "__main__":
    app.run("stdio")
