"""The MCP gate: any MCP tool server behind the IDP kernel, with no change to the agent (docs/gate.md).

``pgw mcp-gate --agent NAME --config FILE`` is one process with two halves:

1. **The server the agent's MCP host sees** (stdio or streamable HTTP, like
   ``pgw mcp``). It lists the upstream servers' tools (``{upstream}__{tool}``
   when there are several, so two upstreams' ``read_file`` stay apart), each
   with an optional ``intent`` object added to its input schema, and follows
   ``notifications/tools/list_changed`` of every upstream (it lists again and
   tells the host). Every ``tools/call`` becomes an ``ActRequest`` on
   ``agent.{agent}.act`` (spec 003 §5.1: the agent submits the transition to
   the kernel): the Cedar action is the tool's (or the configured one, so
   several tools can share one action), the resource comes from an argument
   when configured, and the IDP is the thin profile of spec 003 §7 unless the
   model states its intent, which makes it the standard profile (§4.1).
2. **The executor** the kernel dispatches a permitted call to (kind
   ``mcp-{name}``): it calls the upstream tool with the arguments the kernel
   sent and answers with the upstream's actual result, whose JSON-DIGEST is
   what the capsule's ``confirmed`` effect is bound to (spec 004 §5.2). It
   refuses a request whose tool is not one the configured action covers, so a
   direct ``act`` with a read action cannot run a write tool, and one whose path
   argument goes through a symbolic link (:func:`path_refusal`), so the server
   acts on the file the kernel judged. What it refuses with is kept: it never
   quotes the caller's text, and the upstream's words are redacted (SR-1).

The upstreams' commands, environment and HTTP headers (their credentials)
live only in the gate's configuration; the host sees tool names and schemas.

What a host meets (docs/gate.md "What a host meets"): ``initialize`` is answered
at once; the bus is reached in the background, and until it is every call is the
tool error ``kernel_unavailable`` saying why; an upstream that exits is started
again (at most ``restart_limit`` times in a row) and its tools listed again; a
refusal is a tool error in text content only, never ``structuredContent``, which
is the upstream's and must satisfy its ``outputSchema`` (MCP 2025-06-18, Tools,
"Output Schema"); stdin's end ends the gate.

Resources and prompts: an upstream's prompts are passed through (a prompt is
text for the model and changes nothing); its resources are refused
(``resources = false``, the default) because a resource read is a read the
kernel does not see. An operator who accepts ungoverned reads of one upstream
sets ``resources = true`` for it. Logging and list-changed notifications of
the upstreams are forwarded to the host.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import json
import os
import re
import sys
import time
import tomllib
import urllib.parse
import urllib.request
import uuid
import weakref
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Annotated, Any, TextIO

import anyio
import msgspec
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import McpError
from msgspec import Meta, Struct
from nats.errors import Error as NatsError

from subjects.gate import PATH_KEYS, ExecRequest
from subjects.idp import canonical_id
from subjects.util import now_rfc3339

SERVER_NAME = "principal-gateway-mcp-gate"
NAMESPACE_SEP = "__"
INTENT_ARG = "intent"
# A Cedar action that is also one subject token (the executor subject's last token).
_ACTION_RE = r"^[A-Za-z0-9_-]{1,128}$"
ActionName = Annotated[str, Meta(pattern=_ACTION_RE)]
GateName = Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9_-]{0,40}$")]
UpstreamName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
# A Cedar entity type: one identifier, or a ::-path of them.
EntityType = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(::[A-Za-z_][A-Za-z0-9_]*)*$")]


class GateConfigError(ValueError):
    """The gate's configuration is wrong; the message names the field."""

    def __init__(self, field: str, reason: str) -> None:
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


# ---------------------------------------------------------------------------
# Configuration (one TOML file; STYLE.md "Configuration")
# ---------------------------------------------------------------------------


class Upstream(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One upstream MCP server: a stdio ``command`` (with ``args``, ``env``, ``cwd``) or a streamable-HTTP ``url``
    (with ``headers``). ``env`` and ``headers`` are where its credentials go: the host never sees them."""

    command: str | None = None
    args: list[str] = []
    env: dict[str, str] = {}
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = {}
    resources: bool = False  # pass resources through (ungoverned reads); refused by default
    prompts: bool = True

    def check(self, where: str) -> None:
        if (self.command is None) == (self.url is None):
            raise GateConfigError(where, "give exactly one of command (stdio) and url (streamable HTTP)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise GateConfigError(f"{where}.url", "must start with http:// or https://")
        if self.command is not None and self.headers:
            raise GateConfigError(f"{where}.headers", "headers are for an HTTP upstream")
        if self.url is not None and (self.args or self.env or self.cwd):
            raise GateConfigError(where, "args, env and cwd are for a stdio upstream")


class ResourceFrom(Struct, frozen=True, forbid_unknown_fields=True):
    """The Cedar resource of a call: ``{type}::"{value of argument}"`` (spec 003 §5.4 evaluation input)."""

    type: EntityType
    argument: str


class ToolRule(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """How one tool (by the name the host sees before renaming) is governed.

    ``action``: the Cedar action (several tools may share one: grouping);
    ``rename``: the name the host sees instead; ``resource``: the Cedar resource
    from an argument; ``escalate``: when Cedar denies and the kernel says a
    human may be asked (``hem_available``), resubmit with ``hem_urgency:
    REQUIRED`` (spec 003 §6.3) so the principal decides, and wait for the answer;
    ``hidden``: not listed and not callable.
    """

    action: ActionName | None = None
    rename: UpstreamName | None = None
    resource: ResourceFrom | None = None
    escalate: bool = False
    hidden: bool = False


class GateConfig(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The gate's configuration file (TOML). ``mandate`` or ``mandate_file``: the agent's mandate (JWT);
    ``session_id``: the IDP session (default: one per gate process)."""

    name: GateName
    upstreams: dict[UpstreamName, Upstream]
    tools: dict[str, ToolRule] = {}
    mandate: str | None = None
    mandate_file: str | None = None
    session_id: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    # How long a call waits for an answer that did not come with the kernel's reply (a
    # principal deciding, an executor that timed out), in seconds.
    wait_s: Annotated[float, Meta(gt=0, le=30 * 86400)] = 3600.0
    progress_every: Annotated[float, Meta(ge=0.05, le=3600)] = 2.0
    # An upstream that exits is started again at most this many times in a row (Upstreams).
    restart_limit: Annotated[int, Meta(ge=0, le=100)] = 5

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise GateConfigError("upstreams", "name at least one upstream MCP server")
        for name, up in self.upstreams.items():
            if NAMESPACE_SEP in name:
                raise GateConfigError(f"upstreams.{name}", f"an upstream name may not contain {NAMESPACE_SEP!r}")
            up.check(f"upstreams.{name}")
        if self.mandate is not None and self.mandate_file is not None:
            raise GateConfigError("mandate", "give mandate or mandate_file, not both")

    @property
    def kind(self) -> str:
        """The executor kind the kernel dispatches this gate's actions to."""
        return f"mcp-{self.name}"

    def mandate_token(self, base: Path | None = None) -> str:
        if self.mandate is not None:
            return self.mandate.strip()
        if self.mandate_file is None:
            raise GateConfigError("mandate", "the gate needs the agent's mandate (mandate or mandate_file)")
        path = Path(self.mandate_file)
        if base is not None and not path.is_absolute():
            path = base / path
        try:
            return path.read_text().strip()
        except OSError as e:
            raise GateConfigError("mandate_file", f"cannot read {path}: {e.strerror}") from None


def load_gate_config(path: str | Path) -> GateConfig:
    """Read and validate the gate's TOML file (a bad value fails here, with the field named)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as e:
        raise GateConfigError(str(path), f"cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise GateConfigError(str(path), f"not valid TOML: {e}") from None
    return parse_gate_config(raw)


def parse_gate_config(raw: dict[str, Any]) -> GateConfig:
    try:
        return msgspec.convert(raw, GateConfig)
    except msgspec.ValidationError as e:
        raise GateConfigError("config", str(e)) from None


def mandate_claims(token: str) -> dict[str, Any]:
    """The mandate's claims, unverified: the gate needs ``so_id`` and ``jti`` for the IDP; the kernel verifies."""
    import base64

    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError) as e:
        raise GateConfigError("mandate", f"not a JWT: {e}") from None
    if not isinstance(claims, dict) or not isinstance(claims.get("so_id"), str) or not isinstance(claims.get("jti"), str):
        raise GateConfigError("mandate", "the mandate carries no so_id and jti")
    return claims


# ---------------------------------------------------------------------------
# The upstream half: sessions to the real servers, the tool table
# ---------------------------------------------------------------------------


class GatedTool(Struct, frozen=True):
    """A tool as the host sees it, and how it reaches its upstream and the kernel."""

    name: str  # as the host sees it
    upstream: str
    tool: types.Tool  # the upstream's own definition
    action: str  # the Cedar action
    resource: ResourceFrom | None
    escalate: bool


def _default_action(name: str) -> str:
    """The Cedar action of a tool without a rule: its name, made one subject token."""
    action = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:128]
    return action or "_"


Notify = Callable[[types.ServerNotification], Awaitable[None]]


class UpstreamError(Exception):
    """An upstream could not be started (``--check``, or ``Upstreams(strict=True)``); the message says which and why."""


# How long an upstream may take to answer ``initialize`` (an ``npx -y`` fetching its package on first use).
UPSTREAM_START_S = 120.0
# An upstream that served this long before it exited counts as healthy: its restart budget starts again.
UPSTREAM_HEALTHY_S = 60.0
PROBLEM_TOOL = "gate_problem"
# How long entering waits for the upstreams' first start before the gate serves what is up.
UPSTREAM_FIRST_WAIT_S = 20.0
# How long a dispatched call waits for an upstream being started again before it is refused unrun.
UPSTREAM_WAIT_S = 15.0


class Upstreams:
    """Client sessions to every upstream, held open for the gate's life; the tool table built from their lists.

    An async context manager: entering starts (or connects to) every upstream and
    lists its tools; leaving closes the sessions and ends the stdio processes.
    Each upstream is run by a task of its own, which owns its transport and session
    (anyio's scopes are left in the task that entered them). An upstream that exits
    (or whose HTTP session ends) is started again after a pause that doubles from
    0.5 s, at most ``restart_limit`` times in a row (an upstream that served
    ``UPSTREAM_HEALTHY_S`` before it exited starts a new row); when it is back its
    tools are listed again and the host is told (``tools/list_changed``). While it
    is down, ``down[name]`` says why (with the last lines of its stderr), which is
    what a call of its tools, and the ``gate_problem`` tool, tell the host.

    ``strict``: entering raises ``UpstreamError`` when an upstream does not start
    (``pgw mcp-gate --check``); otherwise the gate serves what started and says
    what did not.
    """

    def __init__(self, config: GateConfig, *, notify: Notify | None = None, strict: bool = False) -> None:
        self.config = config
        self.sessions: dict[str, ClientSession] = {}
        self.capabilities: dict[str, types.ServerCapabilities] = {}
        self.tools: dict[str, GatedTool] = {}
        self.down: dict[str, str] = {}  # upstream -> why it is not serving now
        self.restarts: dict[str, int] = dict.fromkeys(config.upstreams, 0)  # starts after the first, per upstream
        self.strict = strict
        self._by_upstream: dict[str, list[types.Tool]] = {}
        self._notify = notify
        self._changed = asyncio.Event()
        self._up: dict[str, asyncio.Event] = {name: asyncio.Event() for name in config.upstreams}
        self._ended: dict[str, asyncio.Event] = {}  # set when the upstream's current session's stream ends
        self._first: dict[str, asyncio.Future[None]] = {}
        self._first_deadline = 0.0  # no call waits for a first start past it (started())
        self._runners: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Future[None]] = set()
        self.list_changes = 0  # how many tools/list_changed of the upstreams were followed
        self._entered = False

    @property
    def namespaced(self) -> bool:
        return len(self.config.upstreams) > 1

    def host_name(self, upstream: str, tool: str) -> str:
        return f"{upstream}{NAMESPACE_SEP}{tool}" if self.namespaced else tool

    async def __aenter__(self) -> Upstreams:
        loop = asyncio.get_running_loop()
        self._first_deadline = loop.time() + UPSTREAM_START_S
        for name, up in self.config.upstreams.items():
            self._first[name] = loop.create_future()
            self._runners[name] = asyncio.create_task(self._run(name, up), name=f"upstream-{name}")
        # The host's initialize waits for the upstreams' first start, but not long: one still starting (an
        # `npx -y` fetching its package) is served when it is up, and the host told (tools/list_changed).
        await asyncio.wait(self._first.values(), timeout=None if self.strict else UPSTREAM_FIRST_WAIT_S)
        self._entered = True
        if self.strict and self.down:
            await self.__aexit__()
            raise UpstreamError("; ".join(self.down.values()))
        return self

    async def __aexit__(self, *exc: object) -> None:
        runners = list(self._runners.values())
        for task in runners:
            task.cancel()
        for task in list(self._tasks):
            task.cancel()
        if runners:
            await asyncio.wait(runners, timeout=15)

    @property
    def started_all(self) -> bool:
        """Whether every upstream's first start has ended (:meth:`started`)."""
        return all(f.done() for f in self._first.values())

    async def started(self) -> None:
        """Wait until every upstream's first start has ended, up or not, but not past ``UPSTREAM_START_S`` after
        the gate began starting them (an upstream that never lists its tools makes no call wait again). The
        gate begins serving after ``UPSTREAM_FIRST_WAIT_S``, so a host may call a tool of an upstream still
        starting (an ``npx -y`` fetching its package, a loaded machine): that call is served once the upstream
        is up, or told why it is down, not told the tool is unknown (found by a loaded run of the quick start:
        "no tool 'read_text_file' behind this gate")."""
        pending = [f for f in self._first.values() if not f.done()]
        left = self._first_deadline - asyncio.get_running_loop().time()
        if pending and left > 0:
            await asyncio.wait(pending, timeout=left)

    async def session(self, upstream: str, wait: float = 0.0) -> ClientSession | None:
        """The upstream's session; waiting up to ``wait`` s for one being restarted."""
        task = self._runners.get(upstream)
        if upstream not in self.sessions and wait > 0 and task is not None and not task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._up[upstream].wait(), wait)
        return self.sessions.get(upstream)

    async def _run(self, name: str, up: Upstream) -> None:
        """Run one upstream for the gate's life: start it, serve until it ends, start it again (with a limit)."""
        failures = 0
        limit = self.config.restart_limit
        while True:
            tail: collections.deque[str] = collections.deque(maxlen=8)
            began = time.monotonic()
            try:
                why = await self._serve_once(name, up, tail)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - said to the host (tool errors, gate_problem) and on stderr
                why = _why(e)
            finally:
                self.sessions.pop(name, None)
                self._up[name].clear()
            said = f"upstream {name} {why}" + (f" (its stderr: {' | '.join(tail)[-600:]})" if tail else "")
            if time.monotonic() - began >= UPSTREAM_HEALTHY_S:
                failures = 0
            failures += 1
            if self.strict:
                self.down[name] = said
            elif failures > limit:
                self.down[name] = f"{said}; stopped {failures} times in a row, not started again (limit {limit}): " \
                    "mend it and restart the gate"
            else:
                self.down[name] = f"{said}; starting it again ({failures} of {limit})"
            if not self.strict:  # strict: the caller says it, once
                print(f"pgw mcp-gate: {self.down[name]}", file=sys.stderr, flush=True)
            first = self._first[name]
            if not first.done():
                first.set_result(None)
            if self.strict or failures > limit:
                await self._announce()
                return
            await asyncio.sleep(min(30.0, 0.5 * 2 ** (failures - 1)))

    async def _serve_once(self, name: str, up: Upstream, tail: collections.deque[str]) -> str:
        """Start the upstream, list its tools, and serve until its stream ends; what ended it."""
        async with AsyncExitStack() as stack:
            if up.command is not None:
                errlog = await _stderr_pipe(stack, name, tail, forward=not self.strict)
                params = StdioServerParameters(command=up.command, args=list(up.args), env=dict(up.env) or None, cwd=up.cwd)
                try:
                    read, write = await stack.enter_async_context(stdio_client(params, errlog=errlog))
                finally:
                    errlog.close()  # the child holds its own copy: the pipe ends when the child does
            else:
                import httpx
                from mcp.client.streamable_http import streamable_http_client

                http = await stack.enter_async_context(httpx.AsyncClient(headers=dict(up.headers), timeout=httpx.Timeout(30, read=300)))
                read, write, _ = await stack.enter_async_context(streamable_http_client(up.url or "", http_client=http))
            # The session reads through a relay, so the gate sees the upstream's stream end (an exit).
            ended = self._ended[name] = asyncio.Event()
            relay_send, relay_read = anyio.create_memory_object_stream[Any](0)

            async def relay() -> None:
                try:
                    async with relay_send:
                        async for message in read:
                            await relay_send.send(message)
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass
                finally:
                    ended.set()

            tg = await stack.enter_async_context(anyio.create_task_group())
            tg.start_soon(relay)

            async def on_message(message: Any, upstream: str = name) -> None:
                await self._on_message(upstream, message)

            session = await stack.enter_async_context(ClientSession(relay_read, write, message_handler=on_message))
            try:
                with anyio.fail_after(UPSTREAM_START_S):
                    init = await session.initialize()
            except McpError as e:
                if e.error.message == "Connection closed":
                    return "exited before it answered initialize" if up.command is not None else \
                        "closed its session before it answered initialize"
                return f"did not start: {e.error.message}"
            except TimeoutError:
                return f"did not answer initialize within {UPSTREAM_START_S:g} s"
            self.capabilities[name] = init.capabilities
            self.sessions[name] = session
            await self.refresh(name)
            self.down.pop(name, None)
            self._up[name].set()
            first = self._first[name]
            if first.done():
                self.restarts[name] += 1
                await self._announce()  # its tools are back
            else:
                first.set_result(None)
                if self._entered:
                    await self._announce()  # up after the gate began serving
            await ended.wait()
            tg.cancel_scope.cancel()
            return "exited" if up.command is not None else "closed its session"

    async def _announce(self) -> None:
        self.list_changes += 1
        self._changed.set()
        if self._notify is not None:
            await self._notify(types.ServerNotification(types.ToolListChangedNotification(method="notifications/tools/list_changed")))


    async def _on_message(self, upstream: str, message: Any) -> None:
        if not isinstance(message, types.ServerNotification):
            return
        root = message.root
        if isinstance(root, types.ToolListChangedNotification):
            # Followed: listed again in a task of its own (a request from inside the
            # session's receive loop would wait on the loop itself).
            task = asyncio.ensure_future(self._follow(upstream))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        if isinstance(root, types.ResourceListChangedNotification | types.ResourceUpdatedNotification) \
                and not self.config.upstreams[upstream].resources:
            return
        if isinstance(root, types.PromptListChangedNotification) and not self.config.upstreams[upstream].prompts:
            return
        if isinstance(root, types.ProgressNotification | types.CancelledNotification):
            return  # these belong to a request of the gate's own; the gate sends its own progress
        if self._notify is not None:
            await self._notify(message)

    async def _follow(self, upstream: str) -> None:
        if upstream not in self.sessions:
            return  # gone meanwhile: listed again when it is back
        await self.refresh(upstream)
        await self._announce()

    async def changed(self, after: int) -> None:
        """Wait until more than ``after`` tools/list_changed of the upstreams have been followed
        (``after``: ``list_changes`` read when the caller starts waiting, so a change followed
        before this coroutine first runs is not missed)."""
        while self.list_changes <= after:
            self._changed.clear()
            await self._changed.wait()

    async def refresh(self, upstream: str) -> None:
        """List the upstream's tools (every page) and rebuild the table."""
        session = self.sessions[upstream]
        tools: list[types.Tool] = []
        cursor: str | None = None
        while True:
            page = await session.list_tools(cursor=cursor) if cursor else await session.list_tools()
            tools.extend(page.tools)
            cursor = page.nextCursor
            if not cursor:
                break
        self._by_upstream[upstream] = tools
        self._rebuild()

    def _rebuild(self) -> None:
        table: dict[str, GatedTool] = {}
        for upstream in self.config.upstreams:
            for tool in self._by_upstream.get(upstream, []):
                listed = self.host_name(upstream, tool.name)
                rule = self.config.tools.get(listed, ToolRule())
                if rule.hidden:
                    continue
                name = rule.rename or listed
                table[name] = GatedTool(
                    name=name, upstream=upstream, tool=tool, action=rule.action or _default_action(name),
                    resource=rule.resource, escalate=rule.escalate,
                )
        self.tools = table

    def actions(self) -> dict[str, list[str]]:
        """Cedar action -> the host names of the tools it covers (what the kernel's executor config lists)."""
        out: dict[str, list[str]] = {}
        for t in self.tools.values():
            out.setdefault(t.action, []).append(t.name)
        return out

    def host_tools(self) -> list[types.Tool]:
        """The tools as the host lists them: the upstream's definition, renamed, with the optional ``intent``;
        and, while an upstream is down, the ``gate_problem`` tool that says why (what a host shows its user)."""
        tools = [
            t.tool.model_copy(update={"name": t.name, "inputSchema": with_intent(t.tool.inputSchema)})
            for t in self.tools.values()
        ]
        if self.down:
            tools.append(problem_tool("; ".join(self.down.values())))
        return tools

    # the executor half ------------------------------------------------------
    async def call(self, action: str, arguments: dict[str, Any], *, resource: str | None = None) -> dict[str, Any]:
        """Run one dispatched action: ``arguments`` is ``{"tool": host name, "arguments": {...}}``;
        ``resource``: the Cedar resource the kernel judged it against, as declared (``ExecRequest.resource``).

        Returns the upstream's ``CallToolResult`` as JSON (what the kernel digests);
        raises ``ExecutionRefused`` when the tool is unknown or not covered by ``action``, or when
        ``resource`` is not the one the tool's rule takes from its arguments (``resource_of``).
        """
        tool_name = arguments.get("tool")
        tool_args = arguments.get("arguments", {})
        gated = self.tools.get(tool_name) if isinstance(tool_name, str) else None
        # What a refusal says is kept (the executor's bucket, the kernel's records): it names the gate's own
        # tools and actions, never the text the caller sent, which may hold a secret the arguments' redaction
        # would have caught (docs/gate.md "What the executor refuses").
        if gated is None:
            names = ", ".join(sorted(self.tools))
            raise ExecutionRefused("unknown_tool", _clip(f"no such tool behind this gate; it serves {len(self.tools)}: {names}"))
        if gated.action != action:
            raise ExecutionRefused("action_mismatch", f"tool {gated.name!r} is governed as {gated.action!r}, not {action!r}")
        if not isinstance(tool_args, dict):
            raise ExecutionRefused("invalid_arguments", "arguments must be an object")
        # The kernel judged the call against the resource the agent declared, and does not read the arguments;
        # an agent speaking agent.{agent}.act itself could declare File::"a.txt" for a call whose path is
        # b.txt, or no resource at all (the governed object) and so pass a policy that forbids by resource.
        # What runs is what was judged: the rule's resource from these arguments, or none without a rule.
        try:
            expected = resource_of(gated, tool_args)
        except ValueError as e:
            raise ExecutionRefused("invalid_arguments", f"{e}; the tool did not run") from None
        if expected != resource:
            said = (f"its argument {gated.resource.argument!r} as a {gated.resource.type}" if gated.resource
                    else "none: its rule names no resource")
            raise ExecutionRefused(
                "resource_mismatch",
                f"the kernel judged this call against {'another resource' if resource else 'no declared resource'}, "
                f"but tool {gated.name!r} acts on {said}; the tool did not run (declare the resource the gate's "
                "rule takes from the arguments: docs/gate.md)")
        if self.config.upstreams[gated.upstream].command is not None:
            # A stdio upstream runs on this host and opens these very paths (an HTTP one's are another host's).
            refused = await asyncio.to_thread(path_refusal, tool_args)
            if refused is not None:
                raise refused
        session = await self.session(gated.upstream, wait=UPSTREAM_WAIT_S)
        if session is None:
            raise ExecutionRefused("upstream_unavailable",
                                   f"{self.down.get(gated.upstream, f'upstream {gated.upstream} is not running')}; the tool did not run")
        ended = self._ended.get(gated.upstream)
        call = asyncio.ensure_future(session.call_tool(gated.tool.name, tool_args))
        # Raced with the upstream's end: the session is closed as the upstream goes, and a request it
        # never answered would otherwise wait for ever.
        gone = asyncio.ensure_future(ended.wait()) if ended is not None else None
        try:
            await asyncio.wait({call, gone} - {None}, return_when=asyncio.FIRST_COMPLETED)  # type: ignore[arg-type]
        finally:
            if gone is not None:
                gone.cancel()
        if not call.done():
            call.cancel()
            raise ExecutionRefused("upstream_exited", f"upstream {gated.upstream} exited during the call "
                                   "(it may have acted before it did); it is being started again")
        try:
            result = call.result()
        except McpError as e:
            if gated.upstream not in self.sessions or e.error.message == "Connection closed":
                # It ran, or not: the upstream went away before it answered.
                raise ExecutionRefused("upstream_exited", f"upstream {gated.upstream} exited during the call "
                                       "(it may have acted before it did); it is being started again") from None
            raise ExecutionRefused("upstream_error", e.error.message) from None
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise ExecutionRefused("upstream_exited", f"upstream {gated.upstream} went away before the call "
                                   "reached it; it is being started again") from None
        return result_json(result)

    # passthrough -------------------------------------------------------------
    def _with(self, capability: str) -> list[str]:
        out = []
        for name, up in self.config.upstreams.items():
            if not getattr(up, capability):
                continue
            if getattr(self.capabilities[name], capability, None) is not None:
                out.append(name)
        return out

    async def list_prompts(self) -> list[types.Prompt]:
        out = []
        for up in self._with("prompts"):
            for p in (await self.sessions[up].list_prompts()).prompts:
                out.append(p.model_copy(update={"name": self.host_name(up, p.name)}))
        return out

    async def get_prompt(self, name: str, arguments: dict[str, str] | None) -> types.GetPromptResult:
        up, inner = self._split(name, self._with("prompts"))
        return await self.sessions[up].get_prompt(inner, arguments)

    async def list_resources(self) -> list[types.Resource]:
        out = []
        for up in self._with("resources"):
            out.extend((await self.sessions[up].list_resources()).resources)
        return out

    async def read_resource(self, uri: str) -> types.ReadResourceResult:
        ups = self._with("resources")
        if not ups:
            raise McpError(types.ErrorData(code=types.INVALID_REQUEST, message=RESOURCES_REFUSED))
        last: McpError | None = None
        for up in ups:  # the first upstream that knows the URI
            try:
                return await self.sessions[up].read_resource(uri)  # type: ignore[arg-type]
            except McpError as e:
                last = e
        assert last is not None
        raise last

    def _split(self, name: str, allowed: list[str]) -> tuple[str, str]:
        if self.namespaced:
            up, sep, inner = name.partition(NAMESPACE_SEP)
            if sep and up in allowed:
                return up, inner
        elif allowed:
            return allowed[0], name
        raise McpError(types.ErrorData(code=types.INVALID_PARAMS, message=f"no prompt {name!r} behind this gate"))


RESOURCES_REFUSED = (
    "resources are not passed through this gate: a resource read is not governed by the kernel "
    "(set resources = true for an upstream to allow its ungoverned reads)"
)


async def _stderr_pipe(stack: AsyncExitStack, name: str, tail: collections.deque[str], *, forward: bool) -> TextIO:
    """A pipe for an upstream's stderr: each line goes on to the gate's stderr (which hosts log), and the
    last few are kept for the message that says why the upstream stopped."""
    rfd, wfd = os.pipe()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(rfd, "rb", 0))

    async def pump() -> None:
        while line := await reader.readline():
            text = line.decode(errors="replace").rstrip()
            if text:
                tail.append(text[:300])
                if forward:
                    print(f"[{name}] {text}", file=sys.stderr, flush=True)

    task = asyncio.create_task(pump())

    async def close() -> None:
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, 2)  # the last lines of a child that just exited
        transport.close()

    stack.push_async_callback(close)
    return os.fdopen(wfd, "w")


def _why(e: BaseException) -> str:
    """What stopped an upstream, in one line (the innermost error of an exception group)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    if isinstance(e, McpError):
        return f"failed: {e.error.message}"
    if isinstance(e, FileNotFoundError):
        return f"could not be started: {e.strerror}: {e.filename}"
    if isinstance(e, OSError):
        return f"could not be started: {e.strerror or e}"
    return f"failed: {type(e).__name__}: {e}"[:500]


class ExecutionRefused(Exception):
    """The executor half will not run a request; ``code`` and ``message`` go into the executor's error."""

    def __init__(self, code: str, message: str) -> None:
        self.code, self.message = code, message
        super().__init__(f"{code}: {message}")


def _clip(text: str, n: int = 1000) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def path_refusal(arguments: dict[str, Any]) -> ExecutionRefused | None:
    """Why a call's path arguments may not reach a server on this host, or ``None``.

    The kernel judges a path as sent (its standing approvals cover "a file directly in
    this folder", docs/gate.md "Standing approvals"); a server opens what the path
    resolves to. So every argument named in ``PATH_KEYS`` (a string, or a list of
    them; a ``file://`` URL as its path; any other URL is not a path here) must be an
    absolute path that goes through no symbolic link: its real path (every link
    resolved) is its normal form. A relative path is refused too: what it is
    resolved against is the server's choice (the reference server tries each of its
    allowed folders), so the gate cannot check it.

    What this cannot close: the check runs just before the upstream is called, so a
    link made between the two by someone else on the host (the reference server's
    tools make none) is followed; and a hard link is a file like any other.
    """
    for key, value in arguments.items():
        if not isinstance(key, str) or key.lower() not in PATH_KEYS:
            continue
        name = key.lower()  # one of PATH_KEYS: said in the refusal, the caller's own spelling is not
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, str):
                continue  # not a path: the server refuses it
            why = _path_problem(item)
            if why == "path_not_absolute":
                return ExecutionRefused(why, f"argument {name!r} is not an absolute path: what a server resolves a "
                                        "relative path against is its own choice, so the gate cannot check that it "
                                        "names no symbolic link; name the file by its absolute path. The tool did not run")
            if why == "symbolic_link":
                return ExecutionRefused(why, f"argument {name!r} goes through a symbolic link (or is one): the tool "
                                        "would act on another file than the path the kernel judged; name the file by "
                                        "its real path. The tool did not run")
    return None


def _path_problem(value: str) -> str | None:
    """``symbolic_link``, ``path_not_absolute``, or ``None`` for a path a server on this host may open."""
    if value.startswith("file://"):
        parts = urllib.parse.urlsplit(value)
        if parts.netloc not in ("", "localhost"):
            return None  # a file of another host
        value = urllib.request.url2pathname(parts.path)
    elif _URL.match(value):
        return None  # a URL, not a path on this host
    if not value.startswith("/"):
        return "path_not_absolute"
    norm = os.path.normpath(value)
    norm = "/" + norm.lstrip("/")  # POSIX keeps a leading "//" apart; the system reads it as "/"
    # The real path resolves every link on the way, whether ``..`` is read lexically (the reference server's
    # path.resolve) or by the system (after a link, ``..`` leaves the link's target): equal to the normal form
    # only when no component is a link. A missing tail is kept as it is (a file about to be written).
    if os.path.realpath(value) != norm:
        return "symbolic_link"
    return None


def result_json(result: types.CallToolResult) -> dict[str, Any]:
    """A CallToolResult as JSON, the form the kernel digests and the host gets back."""
    return result.model_dump(mode="json", by_alias=True, exclude_none=True)


INTENT_REASONING_TYPES = ("RULE_BASED", "INFERENCE", "UNCERTAINTY_REDUCTION")


def intent_schema() -> dict[str, Any]:
    """The optional ``intent`` argument: the model's stated goal, reasoning and confidence (spec 003 §4.1-§4.2)."""
    return {
        "type": "object",
        "description": "Optional: why you call this tool. Given in full (goal, reasoning, confidence) it is "
        "recorded as your declared intent and shown to the principal if they are asked.",
        "properties": {
            "goal": {"type": "string", "minLength": 1, "maxLength": 500, "description": "what this call is for"},
            "reasoning": {"type": "string", "minLength": 1, "maxLength": 1000, "description": "why this call serves it"},
            # INSTRUCTION must name its source by mandate_id or session_id (spec 003 §4.3), which the model
            # does not know, and MISSION_STAGE needs a mission_ref: neither is offered.
            "reasoning_type": {"type": "string", "enum": list(INTENT_REASONING_TYPES),
                               "description": "the kind of reasoning (default INFERENCE)"},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "additionalProperties": False,
    }


def with_intent(schema: dict[str, Any]) -> dict[str, Any]:
    out = dict(schema)
    props = dict(out.get("properties") or {})
    if INTENT_ARG not in props:
        props[INTENT_ARG] = intent_schema()
    out["properties"] = props
    out.setdefault("type", "object")
    return out


# ---------------------------------------------------------------------------
# The agent half: tools/call -> ActRequest on agent.{agent}.act
# ---------------------------------------------------------------------------


class IdpBuilder:
    """IDPs for the gate's calls: one session, strictly increasing steps (spec 003 §5.2(f)).

    The step is the time in microseconds (and one more than the last when two
    calls fall in the same microsecond), so a gate restarted with the same
    ``session_id`` continues above every step it took before.
    """

    def __init__(self, mandate: str, session_id: str | None = None) -> None:
        claims = mandate_claims(mandate)
        self.mandate = mandate
        self.so_id, self.jti = claims["so_id"], claims["jti"]
        exp = claims.get("exp")
        self.expires: float | None = float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else None
        self.session_id = session_id or str(uuid.uuid4())
        self._last = 0

    def renew(self, mandate: str) -> None:
        """Take a renewed mandate (the same session and steps go on)."""
        claims = mandate_claims(mandate)
        exp = claims.get("exp")
        self.mandate = mandate
        self.so_id, self.jti = claims["so_id"], claims["jti"]
        self.expires = float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else None

    def step(self) -> int:
        self._last = max(self._last + 1, time.time_ns() // 1000)
        return self._last

    def idp(self, action: str, intent: dict[str, Any] | None, *, hem_required: bool = False) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "idp_id": str(uuid.uuid4()), "session_id": self.session_id, "so_id": self.so_id,
            "mandate_id": self.jti, "step_sequence": self.step(), "requested_action": action,
            "timestamp": now_rfc3339(),
        }
        intent = intent or {}
        if intent.get("goal"):
            rec["declared_goal"] = {"goal_id": str(uuid.uuid4()), "description": str(intent["goal"])[:500]}
        if intent.get("reasoning"):
            kind = intent.get("reasoning_type")
            rec["reasoning_basis"] = {"type": kind if kind in INTENT_REASONING_TYPES else "INFERENCE",
                                      "description": str(intent["reasoning"])[:1000]}
        if isinstance(intent.get("confidence"), int | float) and not isinstance(intent.get("confidence"), bool):
            rec["confidence_level"] = float(intent["confidence"])
        if hem_required:
            rec["hem_urgency"] = "REQUIRED"  # spec 003 §6.3: the resubmission that asks for a human
        full = {"declared_goal", "reasoning_basis", "confidence_level"} <= rec.keys()
        if full:
            rec.setdefault("hem_urgency", "NONE")  # the standard profile (spec 003 §4.1)
        else:
            rec["profile"] = "IDP_THIN"  # spec 003 §7: the model stated no (full) intent
        return rec


Progress = Callable[[float, str], Awaitable[None]]
STEP_RETRIES = 32


def tool_error(body: dict[str, Any]) -> types.CallToolResult:
    """A refusal or failure of the gate as the host gets it: the body as JSON text, ``isError``, and no
    ``structuredContent``. A tool's advertised ``outputSchema`` describes the upstream's results, not the
    gate's refusals: structured content MUST conform to it (MCP 2025-06-18, Server Features, Tools,
    "Output Schema"), and a client that validates it (the TypeScript SDK's, the Inspector's) would reject
    the refusal instead of showing it; tool execution errors are reported in the result with ``isError``
    ("Error Handling")."""
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=json.dumps(body, ensure_ascii=False))], isError=True,
    )


def problem_tool(problem: str, what: str = "MCP gate") -> types.Tool:
    """The one tool a gate (or ``pgw mcp``) that cannot serve its tools lists: its description (and any call)
    says why, so the host shows the user the server's own words instead of a closed connection."""
    return types.Tool(
        name=PROBLEM_TOOL,
        description=f"This {what} cannot serve its tools: {problem[:1500]}. Calling this tool returns the same.",
        inputSchema={"type": "object", "properties": {}},
    )


def problem_server(problem: str, what: str = "MCP gate") -> Server[Any, Any]:
    """The MCP server of a gate whose configuration is wrong (``pgw mcp-gate`` could not read its file, the
    mandate, its credentials; ``pgw mcp`` its credentials, ``what`` names it): it answers ``initialize``, lists
    the ``gate_problem`` tool, and every call is a tool error that says what is wrong, until the host stops it
    (stdin closed)."""
    server: Server[Any, Any] = Server(SERVER_NAME, instructions=f"This {what} is misconfigured: {problem}")

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        return [problem_tool(problem, what)]

    @server.call_tool(validate_input=False)
    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        return tool_error({"status": "unavailable", "code": "gate_misconfigured", "reason": problem})

    return server


class ArgumentsTooLarge(Exception):
    """A call whose request could not travel on the bus; nothing was sent."""


def resource_of(gated: GatedTool, arguments: dict[str, Any]) -> str | None:
    """The call's Cedar resource ``Type::"value"`` from the rule's argument; ``None`` without a rule.

    Raises ``ValueError`` when the argument is missing or cannot be an entity id (a quote, a
    backslash, over 256 characters): the call is refused rather than evaluated against the
    governed object instead of the resource the rule names.
    """
    if gated.resource is None:
        return None
    value = arguments.get(gated.resource.argument)
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValueError(f"argument {gated.resource.argument!r} (the Cedar resource) is missing or not a string")
    text = str(value)
    if not 1 <= len(text) <= 256 or '"' in text or "\\" in text:
        raise ValueError(f"argument {gated.resource.argument!r} cannot name a Cedar resource (1-256 characters, no quote or backslash)")
    if text.startswith("/") and "/" + os.path.normpath(text).lstrip("/") != text:
        # One file, one name: /x/./f, /x/../x/f and //x/f name /x/f, which a policy's resource == File::"/x/f"
        # would not match (a review found the forbidden file read so).
        raise ValueError(f"argument {gated.resource.argument!r} is not in normal form (no ., .. or // in it, no "
                         "trailing /): name the file by its normal path")
    return f'{gated.resource.type}::"{text}"'


def build_server(upstreams: Upstreams, call: Callable[[GatedTool, dict[str, Any], dict[str, Any] | None, Progress], Awaitable[types.CallToolResult]]) -> Server[Any, Any]:
    """The MCP server the host sees: the upstreams' tools, each call handed to ``call`` (the kernel path)."""
    server: Server[Any, Any] = Server(
        SERVER_NAME,
        instructions="Tools behind Principal Gateway: every call is decided by the agent's principal's policy; "
        "a call may wait for the principal's approval. Pass `intent` (goal, reasoning, confidence) to state why.",
    )
    hosts: weakref.WeakSet[Any] = weakref.WeakSet()
    upstreams._notify = _forwarder(hosts)

    def seen() -> None:
        with contextlib.suppress(LookupError):
            hosts.add(server.request_context.session)

    @server.list_tools()
    async def list_tools() -> list[types.Tool]:
        seen()
        return upstreams.host_tools()

    @server.call_tool(validate_input=False)
    async def call_tool(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        seen()
        ctx = server.request_context
        token = ctx.meta.progressToken if ctx.meta else None

        async def progress(elapsed: float, message: str) -> None:
            if token is not None:
                await ctx.session.send_progress_notification(token, elapsed, None, message, related_request_id=str(ctx.request_id))

        gated = upstreams.tools.get(name)
        if gated is None and not upstreams.started_all:
            await upstreams.started()
            gated = upstreams.tools.get(name)  # looked up again whatever the wait found: it may have ended meanwhile
        if gated is None:
            if upstreams.down:  # the gate_problem tool, or a tool of an upstream that never started
                return tool_error({"status": "unavailable", "code": "upstream_unavailable",
                                   "reason": "; ".join(upstreams.down.values())})
            return tool_error({"status": "invalid", "code": "unknown_tool", "reason": f"no tool {name!r} behind this gate"})
        args = dict(arguments or {})
        intent = args.pop(INTENT_ARG, None) if INTENT_ARG not in (gated.tool.inputSchema.get("properties") or {}) else None
        if intent is not None and not isinstance(intent, dict):
            return tool_error({"status": "invalid", "code": "invalid_arguments", "reason": "intent must be an object"})
        try:
            resource_of(gated, args)
        except ValueError as e:
            return tool_error({"status": "invalid", "code": "invalid_arguments", "reason": str(e)})
        return await call(gated, args, intent, progress)

    @server.list_prompts()
    async def list_prompts() -> list[types.Prompt]:
        seen()
        return await upstreams.list_prompts()

    @server.get_prompt()
    async def get_prompt(name: str, arguments: dict[str, str] | None) -> types.GetPromptResult:
        return await upstreams.get_prompt(name, arguments)

    @server.list_resources()
    async def list_resources() -> list[types.Resource]:
        seen()
        return await upstreams.list_resources()

    @server.read_resource()
    async def read_resource(uri: Any) -> Any:
        result = await upstreams.read_resource(str(uri))
        from mcp.server.lowlevel.helper_types import ReadResourceContents

        out = []
        for c in result.contents:
            if isinstance(c, types.TextResourceContents):
                out.append(ReadResourceContents(content=c.text, mime_type=c.mimeType))
            else:
                import base64

                out.append(ReadResourceContents(content=base64.b64decode(c.blob), mime_type=c.mimeType))
        return out

    return server


def _forwarder(hosts: weakref.WeakSet[Any]) -> Notify:
    async def forward(note: types.ServerNotification) -> None:
        for session in list(hosts):
            with contextlib.suppress(Exception):  # a host gone away is no reason to stop the gate
                await session.send_notification(note)

    return forward


# ---------------------------------------------------------------------------
# The gate: both halves over the bus
# ---------------------------------------------------------------------------


Bus = tuple[Any, Any]  # the agent's connection, and the executor's (None: the agent's)
# Between two attempts to reach the bus: doubling from 1 s up to this.
BUS_RETRY_MAX_S = 30.0
# How long a call made as the gate starts waits for the first attempt to reach the bus.
FIRST_CONNECT_WAIT_S = 15.0


class Gate:
    """Both halves of the MCP gate for one agent; an async context manager.

    Entering opens the upstream sessions and starts reaching the bus in the
    background (``connect``, again and again until it succeeds), so a host's
    ``initialize`` is answered at once; once connected it starts the executor
    ``mcp-{name}`` (``subjects.executor``: results kept by idempotency key, so
    a re-dispatch of one call never runs the upstream tool twice) with one
    action per Cedar action of the tool table, and the agent's outcome reader.
    Until then every call is the tool error ``kernel_unavailable`` saying why
    (nothing runs: an action runs only when the kernel dispatches it).
    ``connect`` returns the agent's connection and the executor's (``None``:
    the agent's).
    """

    def __init__(self, config: GateConfig, agent: str, *, connect: Callable[[], Awaitable[Bus]], prefix: str = "pgw",
                 base: Path | None = None, request_timeout: float = 30.0, where: str = "the bus",
                 redact: Callable[[str], str] | None = None) -> None:
        from subjects.names import Subjects, agent_token

        self.config = config
        # The configured secrets' redaction (SR-1, ``pipeline.secrets``), applied to the executor's error
        # messages: an upstream's words may quote the arguments, and the executor's answer is kept.
        self.redact: Callable[[str], str] = redact or (lambda text: text)
        self._base = base
        self.builder = IdpBuilder(config.mandate_token(base), config.session_id)
        self.agent_name = agent_token(agent)
        self.agent: Any = None
        self.nc: Any = None
        self.exec_nc: Any = None
        self.subject = Subjects(prefix).act(self.agent_name)
        self.prefix = prefix
        self.request_timeout = request_timeout
        self.upstreams = Upstreams(config)
        self.executor: Any = None
        self.bus_problem: str | None = f"connecting to {where}"
        self.connected = asyncio.Event()
        self._tried = asyncio.Event()  # the first attempt to reach the bus (and start the executor) is over
        self._connect = connect
        self._where = where
        self._bus_task: asyncio.Task[None] | None = None
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> Gate:
        try:
            await self._stack.enter_async_context(self.upstreams)
        except BaseException:
            await self._stack.aclose()
            raise
        self._bus_task = asyncio.create_task(self._reach_bus(), name="gate-bus")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._bus_task is not None and not self._bus_task.done():
            self._bus_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._bus_task
        await self._stack.aclose()

    async def _reach_bus(self) -> None:
        """Connect (retrying), then start the executor and the outcome reader."""
        from subjects.client import Agent
        from subjects.executor import Executor

        pause = 1.0
        while True:
            try:
                nc, exec_nc = await self._connect()
                break
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - said to the host in every call until it mends
                self.bus_problem = f"cannot reach the gateway's bus at {self._where}: {e}"
                print(f"pgw mcp-gate: {self.bus_problem}; trying again in {pause:g} s", file=sys.stderr, flush=True)
                self._tried.set()
            await asyncio.sleep(pause)
            pause = min(BUS_RETRY_MAX_S, pause * 2)
        for c in {id(nc): nc, id(exec_nc): exec_nc}.values():
            if c is not None:
                self._stack.push_async_callback(_close_quietly, c)
        self.nc, self.exec_nc = nc, exec_nc or nc
        self.agent = Agent(nc, self.agent_name, prefix=self.prefix)
        self.executor = Executor(self.exec_nc, self.config.kind, prefix=self.prefix)
        self._register()
        try:
            await self._stack.enter_async_context(self.executor)
            self._stack.push_async_callback(self.agent.close)
            await self.agent._ensure_pump()  # outcomes that arrive before a wait are kept for it
        except Exception as e:  # noqa: BLE001 - e.g. credentials that may not serve the executor
            self.bus_problem = f"connected to {self._where}, but the gate's executor {self.config.kind} could not start: " \
                f"{type(e).__name__}: {e}"
            print(f"pgw mcp-gate: {self.bus_problem}", file=sys.stderr, flush=True)
            self._tried.set()
            return
        self.bus_problem = None
        self.connected.set()
        self._tried.set()

    def _register(self) -> None:
        """One executor action per Cedar action (again after a list change: new actions are added)."""
        if self.executor is None:
            return
        for action in self.upstreams.actions():
            if action not in self.executor.handlers:
                self.executor.action(action)(self._handler(action))

    def _handler(self, action: str) -> Callable[[dict[str, Any], ExecRequest], Awaitable[Any]]:
        from subjects.executor import ActionError

        async def run(arguments: dict[str, Any], request: ExecRequest) -> Any:
            try:
                result = await self.upstreams.call(action, arguments, resource=request.resource)
            except ExecutionRefused as e:
                raise ActionError(e.code, self.redact(e.message)) from None
            if result.get("isError"):
                # The tool ran and failed: the kernel records failed (spec 004 §5.2), with its words, which
                # may quote the arguments (the reference server's "Access denied - path outside ...: PATH").
                text = " ".join(c.get("text", "") for c in result.get("content", []) if isinstance(c, dict))
                raise ActionError("tool_error", self.redact(text)[:2000])
            return result

        return run

    def server(self) -> Server[Any, Any]:
        ups = self.upstreams
        server = build_server(ups, self.call)
        notify = ups._notify

        async def on_change(note: types.ServerNotification) -> None:
            if isinstance(note.root, types.ToolListChangedNotification):
                self._register()
            if notify is not None:
                await notify(note)

        ups._notify = on_change
        return server

    # the agent half ----------------------------------------------------------
    async def call(self, gated: GatedTool, args: dict[str, Any], intent: dict[str, Any] | None,
                   progress: Progress) -> types.CallToolResult:
        """One tools/call through the kernel (spec 003 §5.1): DONE, DENY, HEM_PENDING or DISPATCHED."""
        from subjects.gate import ActDispatched, ActDone
        from subjects.idp import EnrichedDeny, HemPending, Reject

        if not self._tried.is_set():  # a call as the gate starts waits for its first attempt to reach the bus
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._tried.wait(), FIRST_CONNECT_WAIT_S)
        refused = self._unready(gated)
        if refused is not None:
            return refused
        try:
            result = await self._act(gated, args, intent, hem_required=False)
            if isinstance(result, EnrichedDeny) and result.hem_available and gated.escalate:
                # spec 003 §6.3: after a DENY with hem_available the agent may resubmit with
                # hem_urgency REQUIRED; this tool's rule says its denials go to the principal.
                await progress(0.0, f"{gated.action} needs the principal's approval; asking")
                result = await self._act(gated, args, intent, hem_required=True)
        except ArgumentsTooLarge as e:
            return tool_error({"status": "invalid", "code": "arguments_too_large", "reason": str(e)})
        except (NatsError, TimeoutError) as e:
            # Nothing ran: an action runs only when the kernel dispatches it.
            return tool_error({"status": "unavailable", "code": "kernel_unavailable",
                               "reason": f"the gateway did not answer on {self.subject} ({type(e).__name__}); nothing ran"})
        except msgspec.ValidationError as e:
            return tool_error({"status": "unavailable", "code": "kernel_unavailable",
                               "reason": f"the gateway's answer is not an act result: {e}"})
        match result:
            case ActDone(status="confirmed"):
                return await self._confirmed(result.idp_id, result.response)
            case ActDone():
                return tool_error({"status": "failed", "idp_id": result.idp_id, "error": result.response,
                                   "response_digest": result.response_digest})
            case EnrichedDeny():
                return tool_error({"status": "denied", **msgspec.to_builtins(result)})
            case Reject():
                return tool_error({"status": "rejected", **msgspec.to_builtins(result)})
            case HemPending():
                return await self._await_result(result.idp_id, f"waiting for the principal (moment {result.moment_id})", progress)
            case ActDispatched():
                return await self._await_result(result.idp_id, f"dispatched, waiting for the result ({result.reason})", progress)
        return tool_error({"status": "failed", "reason": "unexpected kernel answer"})  # pragma: no cover

    def _unready(self, gated: GatedTool) -> types.CallToolResult | None:
        """A tool error when the call cannot be submitted now (the mandate expired, no bus, its upstream
        down): said before anything is sent, so nothing is declared and nothing runs."""
        exp = self.builder.expires
        if exp is not None and exp <= time.time() and self.config.mandate_file is not None:
            # A mandate renewed in its file (`pgw mcp-gate init` again) is taken without a restart.
            with contextlib.suppress(GateConfigError):
                self.builder.renew(self.config.mandate_token(self._base))
            exp = self.builder.expires
        if exp is not None and exp <= time.time():
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(exp))
            return tool_error({"status": "unavailable", "code": "mandate_expired",
                               "reason": f"the agent's mandate expired at {when}; nothing ran. Issue a new one "
                               "(`pgw mcp-gate init` again, or `pgw mandate issue` into the gate's mandate_file, which is read again)"})
        if self.bus_problem is not None or self.nc is None or not self.nc.is_connected:
            why = self.bus_problem or f"the connection to {self._where} is down; reconnecting"
            return tool_error({"status": "unavailable", "code": "kernel_unavailable",
                               "reason": f"{why}; nothing ran (the gate keeps trying)"})
        if gated.upstream in self.upstreams.down:
            return tool_error({"status": "unavailable", "code": "upstream_unavailable",
                               "reason": f"{self.upstreams.down[gated.upstream]}; nothing ran"})
        return None

    async def _confirmed(self, idp_id: str, response: Any) -> types.CallToolResult:
        """The upstream's result as the host gets it: the response, or the result the executor kept
        because it did not fit in one message of the bus (``subjects.executor``, "Large results"), read
        back and checked against the digest the kernel recorded with the reference."""
        from subjects.executor import LargeResultError, is_large_result

        if is_large_result(response):
            try:
                response = await self.executor.read_large(response)
            except LargeResultError as e:
                return tool_error({"status": "failed", "code": "large_result_unreadable", "idp_id": idp_id,
                                   "reason": f"the tool ran; its result is kept by the executor but could not be read "
                                   f"back: {e}"})
        try:
            return types.CallToolResult.model_validate(response)
        except ValueError as e:
            return tool_error({"status": "failed", "code": "not_a_tool_result", "idp_id": idp_id,
                               "reason": f"the tool ran; its recorded result is not an MCP tool result: {e}"[:2000]})

    async def _act(self, gated: GatedTool, args: dict[str, Any], intent: dict[str, Any] | None, *, hem_required: bool) -> Any:
        """Submit the call; a step overtaken by a concurrent call of this gate is declared again.

        Calls of one host run concurrently, each its own step of the gate's session, and the
        kernel takes a step only above the last it committed (spec 003 §5.2(f)): a call whose
        step a later one overtook is refused IDP_STEP_SEQUENCE before anything is evaluated, so
        it is declared again with a new IDP and a higher step (at most ``STEP_RETRIES`` times).
        """
        from subjects.gate import ActRequest, act_result_decoder
        from subjects.idp import Reject

        for _ in range(STEP_RETRIES):
            request = ActRequest(
                mandate=self.builder.mandate, action=gated.action,
                idp=self.builder.idp(gated.action, intent, hem_required=hem_required),
                arguments={"tool": gated.name, "arguments": args}, resource=resource_of(gated, args),
            )
            data = msgspec.json.encode(request)
            # The kernel keeps the arguments in records of its own (the open dispatch, the executor's
            # request), each one message of the bus: a call that cannot fit is said so, before anything.
            limit = self.nc.max_payload // 2
            if len(data) > limit:
                raise ArgumentsTooLarge(f"the call's arguments take {len(data)} bytes; the bus carries the kernel's "
                                        f"records of a call in messages of at most {self.nc.max_payload} bytes "
                                        f"(max_payload), so a call may take at most {limit}; nothing ran")
            msg = await self.nc.request(self.subject, data, timeout=self.request_timeout)
            result = act_result_decoder.decode(msg.data)
            if not (isinstance(result, Reject) and result.error_code == "IDP_STEP_SEQUENCE"):
                return result
        return result

    async def _await_result(self, idp_id: str, what: str, progress: Progress) -> types.CallToolResult:
        """Wait (with progress) for the ``action_result`` outcome of ``idp_id``, at most ``wait_s``."""
        from subjects.wire import ActionResult, HemDecision

        want = canonical_id(idp_id)  # the kernel names results by the id's one form (spec 003 §4.2)
        fut = self.agent._expect(lambda o: isinstance(o, ActionResult) and canonical_id(o.idp_id) == want)
        # The principal's own words (an answer or an objection) come in the moment's hem_decision outcome.
        said = self.agent._expect(lambda o: isinstance(o, HemDecision) and canonical_id(o.idp_id) == want)
        start = time.monotonic()
        await progress(0.0, what)
        while True:
            elapsed = time.monotonic() - start
            left = self.config.wait_s - elapsed
            if left <= 0:
                fut.cancel()
                said.cancel()
                return tool_error({"status": "timeout", "idp_id": idp_id,
                                   "reason": f"no result within {self.config.wait_s:g} s; the action may still run"})
            done, _ = await asyncio.wait({fut}, timeout=min(self.config.progress_every, left))
            if done:
                break
            await progress(time.monotonic() - start, what)
        out = fut.result()
        assert isinstance(out, ActionResult)
        if out.status == "confirmed":
            said.cancel()
            return await self._confirmed(idp_id, out.response)
        body = {"status": out.status, "idp_id": idp_id, "reason": out.reason, "error": out.response, "moment_id": out.moment_id}
        if out.status == "not_run" and out.moment_id is not None:
            # Her words go to the model with the refusal, as the OpenAI Agents SDK's rejection message does.
            with contextlib.suppress(TimeoutError):
                decided = await asyncio.wait_for(asyncio.shield(said), 5.0)
                if isinstance(decided, HemDecision) and decided.text:
                    body["principal_answer"] = decided.text
        said.cancel()
        return tool_error(body)


async def serve_stdio(server: Server[Any, Any]) -> None:
    """Serve the host over stdio, announcing that the tool list may change."""
    from mcp.server.lowlevel import NotificationOptions
    from mcp.server.stdio import stdio_server

    options = server.create_initialization_options(NotificationOptions(tools_changed=True, prompts_changed=True))
    # Streams of their own over copies of fds 0 and 1: the SDK's wrappers would close the process's own
    # stdin and stdout when collected, and pgw flushes stdout after the command.
    stdin = anyio.wrap_file(io.TextIOWrapper(os.fdopen(os.dup(0), "rb"), encoding="utf-8", errors="replace"))
    stdout = anyio.wrap_file(io.TextIOWrapper(os.fdopen(os.dup(1), "wb"), encoding="utf-8"))
    async with stdio_server(stdin, stdout) as (read, write):
        # The host reads the gate through a relay, so that stdin's end (the host closed it, or went away)
        # ends the gate at once: the server alone would first wait for the calls in flight, a call
        # waiting for the principal up to wait_s, with nobody left to answer.
        relay_send, relay_read = anyio.create_memory_object_stream[Any](0)
        async with anyio.create_task_group() as tg:

            async def relay() -> None:
                with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                    async with relay_send:
                        async for message in read:
                            await relay_send.send(message)
                tg.cancel_scope.cancel()

            tg.start_soon(relay)
            await server.run(relay_read, write, options)
            tg.cancel_scope.cancel()


async def _close_quietly(nc: Any) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.drain(), 10)
    with contextlib.suppress(Exception):
        await nc.close()
