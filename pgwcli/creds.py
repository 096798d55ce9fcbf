"""Which NATS credentials a ``pgw`` command connects with (docs/operations.md "Credentials").

On a server that enforces per-party permissions (docs/security.md §1) each party
has its own file, ``{role}-{name}.creds`` in the credentials folder
(``security.creds_dir``, else ``{data folder}/creds``), written by ``pgw up`` and
``pgw creds``. A command takes, in this order:

1. ``--creds FILE`` (or ``$NATS_CREDS``, or the configuration's ``creds``), as given;
2. ``--as ROLE:NAME``: that party's file in the credentials folder, which must exist;
3. its own default (:func:`need_for`): the first file of its list that exists. The
   ops commands take an ops user's, and the services' own (``service-services.creds``,
   which may do everything) only when the folder holds no ops user's; ``pgw mcp``
   and ``pgw surface`` the agent's or principal's they name; a service its own.

A command that speaks for one party (``pgw mcp --agent A``, ``pgw surface -p P``,
``pgw audit --auditor A``) refuses, in one line, a file that belongs to another:
the server would drop everything it publishes under the other name and each
request would end in a timeout. When no file serves, the command connects
without credentials (a server that asks for none); if the server refuses, the
line names the file that would serve and where it was looked for (:func:`refusal`).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import msgspec

from gateway.security import BLOCK_FILE, Party, creds_dir, creds_party
from pgwcore.config import Config
from subjects.errors import PgwError
from subjects.names import agent_token, principal_token


class CredsError(PgwError):
    """The credentials a command was given, or would take, cannot serve it: one line, which starts
    with the command (``pgw mcp --agent x: ...``)."""


@dataclass(frozen=True)
class Need:
    """The parties whose credentials serve a command, best first.

    ``ops``: any ops user's file serves, before ``parties``. ``exact``: the command speaks
    for this one party (its name is in the subjects it uses), so another party's file is
    refused. ``what``: who serves, in words, for the line said when none does.
    """

    command: str
    parties: tuple[Party, ...]
    what: str
    exact: Party | None = None
    ops: bool = False
    choose: str = "--as ROLE:NAME or --creds FILE"  # how to choose another file, for the refusal


@dataclass(frozen=True)
class Chosen:
    """The file a command connects with (None: none) and the party it belongs to (None: unknown)."""

    need: Need
    path: str | None
    party: Party | None
    folder: Path
    note: str | None = None  # said on stderr before the command runs


SERVICES = Party("service", "services")  # every service of one `pgw up` process: may do everything


def _ops(command: str) -> Need:
    return Need(command, (SERVICES,), 'an ops user\'s (ops-NAME.creds; `[security] ops = ["ops"]`)', ops=True)


def need_for(args: argparse.Namespace) -> Need | None:
    """Whose credentials serve this command line; None for one that connects to no server, or
    chooses its own (``pgw up``, ``pgw demo`` and its pair, ``pgw surface-slack``)."""
    command = args.command
    match command:
        case "streams" | "tail" | "replay" | "capsules" | "notifications":
            # Ops users read every stream; a replay that publishes is refused to them, deliberately
            # (docs/operations.md §2): it says to run it --as the gateway.
            return _ops(f"pgw {command}")
        case "verify":
            reads_streams = args.stream or args.ledger or any(s.startswith("stream:") for s in args.store)
            return _ops("pgw verify") if reads_streams else None
        case "log" if getattr(args, "log_command", None) == "quarantine":
            # It appends to the event log, which only the gateway's own user may (docs/operations.md §5).
            gateway = Party("service", "gateway")
            return Need("pgw log quarantine", (gateway, SERVICES), f"the gateway's ({gateway.filename})")
        case "log":
            return _ops("pgw log verify")
        case "keys" if getattr(args, "rotate", None):
            return _ops("pgw keys --rotate")  # asks the running signers which key they sign with ($SRV.STATS)
        case "mandate" if getattr(args, "mandate_command", None) == "revoke":
            return _ops("pgw mandate revoke")
        case "audit" if getattr(args, "audit_command", None):
            auditor = Party("audit", args.auditor)
            return Need("pgw audit", (auditor,), f"the auditor {auditor.name}'s ({auditor.filename}; "
                        "`[security] auditors`)", exact=auditor)
        case "mcp" | "mcp-gate":
            if not args.agent:  # said to the host as a tool error (pgwcli/commands/mcp.py serve_problem)
                raise CredsError(f"pgw {command}: give --agent NAME, the agent it speaks for")
            agent = Party("agent", agent_token(args.agent))
            return Need(f"pgw {command} --agent {agent.name}", (agent,),
                        f"agent {agent.name}'s ({agent.filename}; `[agents.{agent.name}]` binds it)", exact=agent)
        case "surface" | "surface-web" | "approvals":
            p = Party("principal", principal_token(args.principal))
            return Need(f"pgw {command} --principal {p.name}", (p,),
                        f"~{p.name}'s ({p.filename}; a principal of an `[agents.NAME]` binding)", exact=p)
        case "gateway" | "signer" | "registrar" | "notifier":
            own = Party("service", command)
            return Need(f"pgw {command}", (own, SERVICES), f"the {command}'s own ({own.filename})")
    return None


def ops_users(config: Config, folder: Path) -> list[Party]:
    """The ops users: the configuration's in its order, then any other ops user's file in the
    folder (``pgw up --quickstart`` makes ``ops`` with no configuration naming it) that the folder's
    server block still lets in: a file an earlier run left behind would only be refused."""
    named = [Party("ops", o) for o in config.security.ops]
    found: list[Party] = []
    if folder.is_dir():
        users = block_users(folder)
        for f in sorted(folder.glob("ops-*.creds")):
            party = creds_party(f)
            if party is not None and party.role == "ops" and (users is None or party.label in users):
                found.append(party)
    return list(dict.fromkeys(named + found))


def block_users(folder: Path) -> set[str] | None:
    """The parties (``role:name``) of the server block ``pgw up`` / ``pgw creds`` last wrote into the
    folder (gateway/security ``authorization_block``), or None when there is none (operator mode)."""
    try:
        text = (folder / BLOCK_FILE).read_text()
    except OSError:
        return None
    return set(re.findall(r"^\s*# (\S+:\S+) \(inbox ", text, re.MULTILINE))


def choose(args: argparse.Namespace, config: Config, need: Need) -> Chosen:
    """The credentials ``need`` takes (module docstring), or a CredsError saying why none can."""
    folder = creds_dir(config).resolve()  # said in full: the reader may be an MCP host's log, elsewhere
    label = getattr(args, "as_party", None)
    note = None
    if config.creds and label:
        raise CredsError(f"{need.command}: give --creds FILE or --as ROLE:NAME, not both")
    if config.creds:
        path: str | None = config.creds
        party = creds_party(path)
    elif label:
        try:
            party = Party.parse(label)
        except ValueError as e:
            raise CredsError(f"{need.command}: --as {label}: {e}") from None
        file = folder / party.filename
        if not file.exists():
            raise CredsError(f"{need.command}: --as {label}: no credentials file {file} (`pgw creds` lists the parties of this "
                             "configuration; --data-dir or $PGW_DATA_DIR names another data folder)")
        path = str(file)
    else:
        path, party = None, None
        for candidate in (ops_users(config, folder) if need.ops else []) + list(need.parties):
            file = folder / candidate.filename
            if file.exists():
                path, party = str(file), candidate
                break
        if need.ops and party == SERVICES:
            note = (f"{need.command}: no ops user's credentials in {folder}: using {SERVICES.filename}, which may do "
                    'everything; an ops user reads with less (`[security] ops = ["ops"]`, then `pgw creds`)')
    if need.exact is not None and party is not None and party != need.exact:
        raise CredsError(mismatch(need, path or "", party, folder))
    return Chosen(need, path, party, folder, note)


def mismatch(need: Need, path: str, party: Party, folder: Path) -> str:
    exact = need.exact
    assert exact is not None
    own = folder / exact.filename
    where = f"{own}" if own.exists() else f"{exact.filename}, which is not in {folder}"
    flag = {"agent": "--agent", "principal": "--principal", "audit": "--auditor"}.get(party.role)
    same_role = f", or {flag} {party.name} with these" if flag and party.role == exact.role else ""
    return (f"{need.command}: {path} holds {party.label}'s credentials, not {exact.label}'s: use {exact.name}'s own "
            f"({where}){same_role}")


def with_creds(config: Config, chosen: Chosen) -> Config:
    return msgspec.structs.replace(config, creds=chosen.path)


def refusal(chosen: Chosen, url: str, why: str) -> str:
    """The line for a server that refused the connection's credentials (or their absence)."""
    need, folder = chosen.need, chosen.folder
    if chosen.path:
        who = f"{chosen.party.label}'s credentials" if chosen.party else "the credentials"
        return (f"{need.command}: the server at {url} refused {who} ({chosen.path}): {why}. They are not among "
                f"its users: is {folder} the credentials folder of the `pgw up` (or `pgw creds`) that serves "
                "it? --data-dir or $PGW_DATA_DIR names another data folder")
    missing = "" if folder.is_dir() else " (no such folder: --data-dir or $PGW_DATA_DIR names the data folder `pgw up` wrote)"
    return (f"{need.command}: the server at {url} requires credentials and none serve here: it takes "
            f"{need.what}, looked for in {folder}{missing}; or choose with {need.choose}")


def timeout_hint(chosen: Chosen | None) -> str:
    """Who the connection spoke as, for the line said when a request went unanswered."""
    if chosen is None or not chosen.path:
        return "no credentials"
    return f"{chosen.party.label if chosen.party else 'the credentials'} ({chosen.path})"
