"""``pgw mcp-gate --agent NAME --gate FILE``: MCP tool servers behind the IDP kernel (integrations/mcp_gate.py, docs/gate.md).

An MCP host spawns it (stdio) or connects over streamable HTTP, in place of the
upstream servers it fronts. It speaks the bus for the agent with the agent's
credentials (``--creds``, else ``{creds_dir}/agent-{NAME}.creds``) and serves
the gate's executor ``mcp-{name}`` with ``--executor-creds`` (default:
``{creds_dir}/executor-mcp-{name}.creds`` when it exists, else the same connection). Needs the extra: ``pip install 'principal-gateway[mcp]'``.

What a host meets: ``initialize`` is answered at once, whatever state the bus and
the file are in. A gate file that cannot be read serves one tool,
``gate_problem``, whose description and every call say what is wrong; while the
bus cannot be reached every call is the tool error ``kernel_unavailable`` saying
why (the gate keeps trying). The gate ends when the host closes its stdin.

``pgw mcp-gate init FOLDER`` sets a gate up in one command: the gate file for the
reference filesystem server on FOLDER, the agent's mandate (lifetime
``--mandate-ttl``, said when issued; running it again renews it for the same
governed object), the gateway settings the gate needs (the agent bound to its
principal, the dev issuer trusted, the example policy, the executor) in a
configuration file beside it (its folders absolute), the credentials, and the
host's JSON with absolute paths (on stdout). The three files are 0600 from their
first byte: the configuration may hold inline secrets, the mandate is a bearer
token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import sys
import time
import tomllib
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pgwcli.commands.mcp import _positive_seconds, agent_creds, serve_problem, serve_transport
from subjects.names import agent_token

if TYPE_CHECKING:
    from pgwcore.config import Config

FILESYSTEM_SERVER = "@modelcontextprotocol/server-filesystem@2026.8.31"
REPO = Path(__file__).resolve().parents[2]
GATE_ACTIONS = ["DeleteFile", "ReadFile", "WriteFile"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "mcp-gate",
        help="MCP gate: upstream MCP tool servers behind the IDP kernel, for one agent (init: set one up)",
        description="Serve the tools of the upstream MCP servers named in --gate to agent NAME's MCP host; "
        "every tools/call is submitted to the kernel (agent.NAME.act) and runs only when it permits "
        "(or the principal approves). `pgw mcp-gate init FOLDER` sets one up for a folder. "
        "Needs the extra: pip install 'principal-gateway[mcp]'.",
    )
    p.add_argument("--agent", "-a", help="the agent this gate speaks for")
    p.add_argument("--gate", "-g", dest="gate_config",
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
    p.set_defaults(handler=run_mcp_gate, gate_command=None, serve_problem=serve_problem)
    gsub = p.add_subparsers(dest="gate_command", metavar="ACTION")
    i = gsub.add_parser(
        "init", help="set up a gate for a folder: gate file, mandate, gateway settings, credentials, the host's JSON",
        description="Write a working gate for FOLDER (the reference filesystem server behind the kernel: reads run, "
        "writes wait for the principal, deletes are refused): the gate file, the agent's mandate, the gateway "
        "settings it needs and the credentials; print the MCP host's JSON (stdout) with absolute paths.")
    i.add_argument("folder", help="the folder the agent's tools may reach")
    i.add_argument("--agent", "-a", dest="init_agent", default="planner", help="the agent (default planner)")
    i.add_argument("--principal", "-p", default="alice", help="the principal who approves its writes (default alice)")
    i.add_argument("--name", default="files", help="the gate's name; its executor kind is mcp-NAME (default files)")
    i.add_argument("--mandate-ttl", type=_duration, default=30 * 86400, metavar="DURATION",
                   help="the mandate's lifetime: 3600, 90m, 12h, 30d (default 30d); run init again to renew it")
    i.add_argument("--out", help="the folder for the gate's files (default: {data_dir}/gates/NAME)")
    i.add_argument("--upstream-command",
                   help=f"the filesystem server's command, the folder appended (default: npx -y {FILESYSTEM_SERVER})")
    # Its own command name: it connects to no server, so it takes no agent's credentials (pgwcli/creds.py).
    i.set_defaults(command="mcp-gate-init", serve_problem=None)  # run by a person: a problem is one line
    # The global options are accepted after `init` too (`pgw mcp-gate init FOLDER --data-dir D`).
    from pgwcli.main import add_global_options

    add_global_options(i, argparse.SUPPRESS)


def _duration(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 3600, 90m, 12h, 30d)")
    seconds = int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    if not 60 <= seconds <= 366 * 86400:
        raise argparse.ArgumentTypeError(f"{text!r}: a mandate lives between a minute and a year")
    return seconds


def _executor_creds(config: Config, kind: str) -> str | None:
    """The file ``pgw creds`` wrote for the executor role ``executor:{kind}``, if there is one."""
    creds_dir = Path(config.security.creds_dir) if config.security.creds_dir else config.data_path / "creds"
    candidate = creds_dir / f"executor-{kind}.creds"
    return str(candidate) if candidate.exists() else None


async def run_mcp_gate(args: argparse.Namespace, config: Config) -> int:
    if args.gate_command == "init":
        return await init_gate(args, config)
    if not args.gate_config:  # --agent was asked for before the credentials were chosen (pgwcli/creds.py)
        return await serve_problem(args, "pgw mcp-gate: give --gate FILE (or set one up: pgw mcp-gate init FOLDER)")
    try:
        from integrations.mcp import serve_http
        from integrations.mcp_gate import (
            Gate,
            GateConfigError,
            UpstreamError,
            Upstreams,
            load_gate_config,
            mandate_claims,
            serve_stdio,
        )
    except ImportError as e:
        print(f"pgw mcp-gate: the MCP SDK is missing ({e}); install it with pip install 'principal-gateway[mcp]'", file=sys.stderr)
        return 2
    import msgspec

    from pgwcore.connect import connect

    base = Path(args.gate_config).parent
    problem: str | None = None
    mandate_problem: str | None = None
    gate_config = None
    try:
        gate_config = load_gate_config(args.gate_config)
        if args.progress_every is not None:
            gate_config = msgspec.structs.replace(gate_config, progress_every=args.progress_every)
    except GateConfigError as e:
        problem = f"{args.gate_config}: {e}"
    if gate_config is not None:
        try:
            mandate_claims(gate_config.mandate_token(base))
        except GateConfigError as e:
            mandate_problem = f"{args.gate_config}: {e}"
    try:
        agent = agent_token(args.agent)
    except ValueError as e:
        problem = problem or f"--agent {args.agent!r}: {e}"
    if args.check:  # a problem is one line on stderr, exit 2 (the upstreams are started to list their tools)
        if problem is not None or gate_config is None:
            print(f"pgw mcp-gate --check: {problem}", file=sys.stderr)
            return 2
        try:
            async with Upstreams(gate_config, strict=True) as ups:
                for t in ups.host_tools():
                    print(f"{t.name}\t{ups.tools[t.name].action}")
                print(f"\n[kernel.executors.{gate_config.kind}]\nactions = {sorted(ups.actions())!r}".replace("'", '"'))
        except UpstreamError as e:
            print(f"pgw mcp-gate --check: {e}", file=sys.stderr)
            return 2
        if mandate_problem is not None:
            # Not a failure: the kernel section above is what the mandate is issued for.
            print(f"pgw mcp-gate --check: note: {mandate_problem} (the gate needs it to serve)", file=sys.stderr)
            return 0
        note = _mandate_note(gate_config.mandate_token(base))
        if note:
            print(f"pgw mcp-gate --check: {note}", file=sys.stderr)
        return 0
    problem = problem or mandate_problem
    if problem is not None or gate_config is None:
        # Said to the host as a tool error (and here, on stderr, which hosts log), never a closed connection.
        return await serve_problem(args, f"pgw mcp-gate: {problem or 'no gate file'}")
    kind = gate_config.kind
    creds = agent_creds(config, agent)
    executor_creds = args.executor_creds or _executor_creds(config, kind)

    async def connect_bus() -> tuple[Any, Any]:
        from pgwcore.connect import ConnectError

        try:
            nc = await connect(config.nats_url, creds=creds, tls=config.tls.files(), name=f"pgw-mcp-gate-{agent}",
                               wait_for_server=False)
        except ConnectError as e:
            if e.auth:
                raise ConnectError(config.nats_url, f"the server refused the agent's credentials "
                                   f"({creds or 'none found: `pgw mcp-gate init` or `pgw creds` makes agent-' + agent + '.creds'})",
                                   auth=False) from None
            raise
        try:
            exec_nc = None
            if executor_creds:
                exec_nc = await connect(config.nats_url, creds=executor_creds, tls=config.tls.files(),
                                        name=f"pgw-exec-{kind}", wait_for_server=False)
        except BaseException:
            with contextlib.suppress(Exception):
                await nc.close()
            raise
        return nc, exec_nc

    from gateway.stages.redaction import Redactor
    from subjects.errors import ConfigError

    try:
        # The executor's error messages are kept (its bucket, the kernel's records): the configured secrets
        # are redacted from them, as from everything else pgw keeps (SR-1, docs/gate.md).
        redactor = Redactor.from_config(config.pipeline.secrets)
    except ConfigError as e:
        return await serve_problem(args, f"pgw mcp-gate: {e}")
    try:
        gate = Gate(gate_config, agent, connect=connect_bus, prefix=config.prefix, base=base, where=config.nats_url,
                    redact=redactor.text)
    except GateConfigError as e:
        return await serve_problem(args, f"pgw mcp-gate: {args.gate_config}: {e}")
    async with gate:
        return await serve_transport(gate.server(), args, f"MCP gate for agent {agent}", serve_stdio, serve_http)


def _mandate_note(token: str) -> str | None:
    """When the mandate expires (or that it has), for ``--check``."""
    from integrations.mcp_gate import mandate_claims

    exp = mandate_claims(token).get("exp")
    if not isinstance(exp, int | float):
        return None
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(exp))
    if exp <= time.time():
        return f"the mandate expired at {when}: every call will be refused until it is renewed"
    return f"the mandate expires at {when} (in {_span(exp - time.time())})"


def _span(seconds: float) -> str:
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} seconds"


# ---------------------------------------------------------------------------
# pgw mcp-gate init FOLDER
# ---------------------------------------------------------------------------

# The reference filesystem server's tools, grouped into the example policy's actions (deploy/mcp-gate.toml).
_READS = ["read_text_file", "read_file", "read_media_file", "list_directory", "list_directory_with_sizes",
          "directory_tree", "search_files", "get_file_info"]
_WRITES = ["write_file", "edit_file", "create_directory"]


def _gate_file(name: str, folder: Path, command: list[str], mandate_file: str, expires: str) -> str:
    lines = [
        f"# Made by `pgw mcp-gate init {folder}` (docs/gate.md, \"The MCP gate\"): the reference filesystem server",
        "# on that folder behind the kernel; reads run, writes wait for the principal, moves (deletes) are refused.",
        f'name = "{name}"                       # the executor kind is mcp-{name}',
        f'mandate_file = "{mandate_file}"    # expires {expires}; `pgw mcp-gate init` again renews it',
        "",
        "[upstreams.fs]",
        f"command = {json.dumps(command[0])}",
        f"args = [{', '.join(json.dumps(a) for a in [*command[1:], str(folder)])}]",
        "",
        "# Cedar actions (several tools share one), and the Cedar resource from the path argument.",
    ]
    for tool in _READS:
        lines += [f"[tools.{tool}]", 'action = "ReadFile"', 'resource = { type = "File", argument = "path" }']
    lines += ["[tools.read_multiple_files]", 'action = "ReadFile"', "[tools.list_allowed_directories]", 'action = "ReadFile"']
    for tool in _WRITES:
        lines += [f"[tools.{tool}]", 'action = "WriteFile"', 'resource = { type = "File", argument = "path" }',
                  "escalate = true                      # denied by Cedar -> the principal decides (spec 003 §6.3)"]
    lines += ["# move_file removes the file at its source path: governed as a delete.",
              "[tools.move_file]", 'action = "DeleteFile"', 'resource = { type = "File", argument = "source" }']
    return "\n".join(lines) + "\n"


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise ValueError(f"cannot write {type(v).__name__} as TOML")


def _toml(doc: dict[str, Any], path: tuple[str, ...] = ()) -> list[str]:
    """A TOML document of ``doc`` (tables as sections, everything else inline)."""
    lines: list[str] = []
    scalars = {k: v for k, v in doc.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in doc.items() if isinstance(v, dict)}
    if path and (scalars or not tables):
        lines.append("[" + ".".join(_toml_key(p) for p in path) + "]")
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items()]
    for k, v in tables.items():
        lines += ["", *_toml(v, (*path, k))] if lines else _toml(v, (*path, k))
    return lines


def _pgw_command() -> list[str]:
    """How a host starts this same ``pgw``, by absolute path (a host's PATH is not the user's shell's)."""
    argv0 = Path(sys.argv[0])
    if argv0.name == "pgw" and argv0.exists():
        return [str(argv0.resolve())]
    beside = Path(sys.executable).parent / "pgw"
    if beside.exists():
        return [str(beside)]
    return [sys.executable, "-m", "pgwcli.main"]


async def init_gate(args: argparse.Namespace, config: Config) -> int:
    """``pgw mcp-gate init FOLDER`` (module docstring). Every refusal is one line naming what to mend."""
    import asyncio

    return await asyncio.to_thread(_init_gate, args, config)


def _init_gate(args: argparse.Namespace, config: Config) -> int:
    from gateway.kernel.mandate import DEV_ISSUER_ROLE, issue_mandate
    from gateway.security import embedded_auth
    from pgwcore.config import _relative_to, load_config
    from pgwcore.identity import write_private
    from pgwcore.keys import load_or_create
    from subjects.errors import ConfigError
    from subjects.names import principal_token

    def fail(why: str) -> int:
        print(f"pgw mcp-gate init: {why}", file=sys.stderr)
        return 2

    folder = Path(args.folder).expanduser().resolve()
    if not folder.is_dir():
        return fail(f"{folder} is not a folder (name an existing folder the agent's tools may reach)")
    try:
        agent = agent_token(args.init_agent)
        principal = principal_token(args.principal)
    except ValueError as e:
        return fail(str(e))
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,40}", args.name):
        return fail(f"--name {args.name!r}: lowercase letters, digits, - and _, at most 41")
    if args.upstream_command:
        command = shlex.split(args.upstream_command)
    else:
        npx = shutil.which("npx")
        if npx is None:
            return fail("npx is not installed, which starts the filesystem server (Debian: apt-get install npm), "
                        "or name the server's command with --upstream-command")
        command = [npx, "-y", FILESYSTEM_SERVER]
    policies = REPO / "policies" / "mcp-gate"
    if not (policies / "files.cedar").is_file():
        return fail(f"the example policy {policies / 'files.cedar'} is missing (run from a checkout of the repository)")
    data = config.data_path.resolve()
    out = Path(args.out).expanduser().resolve() if args.out else data / "gates" / args.name
    out.mkdir(parents=True, exist_ok=True)
    kind = f"mcp-{args.name}"

    # The gateway's settings this gate needs, on top of the configuration pgw was given (which is not changed).
    given = getattr(args, "config", None) or os.environ.get("PGW_CONFIG")
    raw: dict[str, Any] = {}
    source = given or ""
    if given:
        try:
            raw = tomllib.loads(Path(given).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            return fail(f"cannot read the configuration {given}: {e}")
        # The folders it names relative to itself (data_dir, security.creds_dir, keys.dir) would name others
        # beside the new file: written absolute, resolved as pgw resolves them (docs/configuration.md).
        _relative_to(raw, Path(given).resolve().parent)
    added: list[str] = []
    agents = raw.setdefault("agents", {})
    bound = agents.setdefault(agent, {}).setdefault("principals", [])
    if principal not in bound:
        bound.append(principal)
        added.append(f"agents.{agent}.principals += {principal!r} (the binding, spec 000 §8.4)")
    kernel = raw.setdefault("kernel", {})
    if not kernel.get("trust_dev_issuer"):
        kernel["trust_dev_issuer"] = True
        added.append("kernel.trust_dev_issuer = true (the agent's mandate is signed by this data folder's dev issuer)")
    if kernel.get("policy_dir"):
        print(f"pgw mcp-gate init: note: kernel.policy_dir stays {kernel['policy_dir']}: it must permit ReadFile and "
              f"not WriteFile (see {policies / 'files.cedar'})", file=sys.stderr)
    else:
        shutil.copytree(policies, out / "policies", dirs_exist_ok=True)
        kernel["policy_dir"] = str(out / "policies")
        added.append(f"kernel.policy_dir = {out / 'policies'} (reads permitted, writes asked, deletes forbidden)")
    executors = kernel.setdefault("executors", {})
    ex = executors.setdefault(kind, {})
    actions = sorted(set(ex.get("actions", [])) | set(GATE_ACTIONS))
    if ex.get("actions") != actions:
        ex["actions"] = actions
        added.append(f"kernel.executors.{kind}.actions = {actions} (the gate's executor)")
    raw["data_dir"] = str(data)  # the data folder of this run (--data-dir, $PGW_DATA_DIR, the file's), absolute
    if config.nats_url and "nats_url" not in raw:
        raw["nats_url"] = config.nats_url
    text = "\n".join(_toml(raw)) + "\n"
    assert tomllib.loads(text) == raw, "the TOML writer lost something"
    conf_path = out / "pgw.toml"
    header = f"# The gateway's configuration with the settings gate {args.name!r} needs (pgw mcp-gate init)" + \
        (f", made from {Path(source).resolve()}" if source else "") + ".\n"
    try:
        gw_config = load_config(None, **raw)
    except ConfigError as e:
        return fail(f"the merged configuration does not load: {e}")
    write_private(conf_path, header + text, private_dir=False)  # it may hold inline secrets (pipeline.secrets.values)

    # The mandate: the same governed object as before when renewing (its so_id), a new one the first time.
    mandate_path = out / f"{agent}.mandate"
    so_id = str(uuid.uuid4())
    if mandate_path.exists():
        from integrations.mcp_gate import GateConfigError, mandate_claims

        with contextlib.suppress(GateConfigError, OSError):
            so_id = mandate_claims(mandate_path.read_text().strip())["so_id"]
    key = load_or_create(gw_config.data_path, DEV_ISSUER_ROLE, keys_dir=gw_config.keys_path)
    token = issue_mandate(key.private, key.kid, agent=agent, so_id=so_id, principal=principal,
                          actions=GATE_ACTIONS, ttl_s=args.mandate_ttl)
    write_private(mandate_path, token + "\n", private_dir=False)
    expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + args.mandate_ttl))

    gate_path = out / "gate.toml"
    write_private(gate_path, _gate_file(args.name, folder, command, mandate_path.name, expires), private_dir=False)

    # The credentials the gateway will accept with this configuration (agent and executor among them).
    auth = embedded_auth(gw_config)
    from gateway.security import Party

    creds = [auth.creds_for(Party("agent", agent)), auth.creds_for(Party("executor", kind))]

    pgw = _pgw_command()
    host = {"mcpServers": {args.name: {"command": pgw[0], "args": [
        *pgw[1:], "--config", str(conf_path), "mcp-gate", "--agent", agent, "--gate", str(gate_path)]}}}
    say = [
        f"pgw mcp-gate init: {folder} is behind gate {args.name!r} for agent {agent} (principal {principal})",
        f"  gate file       {gate_path}",
        f"  mandate         {mandate_path}: expires {expires} (in {_span(args.mandate_ttl)}); run this command "
        "again to renew it (same governed object)",
        f"  gateway config  {conf_path}",
        *[f"                  adds {a}" for a in added],
        f"  credentials     {', '.join(str(c) for c in creds)}",
        "Start (or restart) the gateway with this configuration:",
        f"  {shlex.join([*pgw, '--config', str(conf_path), 'up'])}",
        "Then put this in your MCP host's configuration (Claude Desktop: claude_desktop_config.json), printed on stdout:",
    ]
    print("\n".join(say), file=sys.stderr)
    print(json.dumps(host, indent=2))
    return 0
