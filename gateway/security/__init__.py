"""Server-enforced isolation (docs/security.md §1): nkey users, permissions, credentials.

``pgw creds`` and ``pgw up`` both call :func:`embedded_auth`: it derives the
parties from the configuration (every agent, every principal an agent is bound
to plus ``security.principals``, the services, ``security.ops``), creates each
party's credentials file on first start (0600, never logged), reuses them
afterwards, and renders the nats-server ``authorization`` block with one nkey
user per party. The same block works for a deployed server (``include`` it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.security.permissions import (
    JS_BYPASS_DENY,
    Permissions,
    agent_durable,
    permissions_for,
    principal_durable,
)
from pgwcore.identity import (
    SERVICE_NAMES,
    Credentials,
    CredentialsError,
    Party,
    jwt_creds_inbox_prefix,
    load_or_create_creds,
    read_creds,
    rotate_creds,
    write_private,
)
from subjects.names import principal_token

if TYPE_CHECKING:
    from pgwcore.config import Config

__all__ = [
    "JS_BYPASS_DENY",
    "Credentials",
    "CredentialsError",
    "EmbeddedAuth",
    "Party",
    "Permissions",
    "agent_durable",
    "authorization_block",
    "creds_dir",
    "creds_party",
    "embedded_auth",
    "parties",
    "party_creds",
    "permissions_for",
    "principal_durable",
    "read_creds",
    "rotate_creds",
]

BLOCK_FILE = "authorization.conf"
DEMO_AGENT, DEMO_PRINCIPAL = "demo-agent", "alice"  # pgwcli/commands/demo.py defaults


def party_creds(config: Config, party: Party) -> str | None:
    """The party's credentials file under the configuration's creds folder, if it exists."""
    path = creds_dir(config) / party.filename
    return str(path) if path.exists() else None


def creds_party(path: str | os.PathLike[str]) -> Party | None:
    """The party a credentials file belongs to: its ``pgw-party`` header (pgw's nkey files), or for a JWT
    ``.creds`` file the party its inbox prefix or user name names (``pgw accounts``, nsc); None when the
    file does not say, or cannot be read (connecting reports that)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    if "BEGIN NATS USER JWT" in text:
        prefix = jwt_creds_inbox_prefix(text) or ""
        role, sep, name = prefix.removeprefix("_INBOX_").partition("_")
        if not (prefix.startswith("_INBOX_") and sep):
            return None
        try:
            return Party(role, name)  # type: ignore[arg-type]
        except ValueError:
            return None
    try:
        return read_creds(path).party
    except CredentialsError:
        return None


def creds_dir(config: Config) -> Path:
    return Path(config.security.creds_dir).expanduser() if config.security.creds_dir else config.data_path / "creds"


def parties(config: Config) -> list[Party]:
    """Every NATS user the configuration implies, in a stable order."""
    principals: dict[str, None] = {}
    for agent_cfg in config.agents.values():
        for p in agent_cfg.principals:
            principals[principal_token(p)] = None
    for p in config.security.principals:
        principals[principal_token(p)] = None
    agents = sorted(config.agents)
    if not config.agents and config.security.demo:
        # Open mode: `pgw up` then `pgw demo` works out of the box (DEMO_AGENT -> DEMO_PRINCIPAL).
        agents = [DEMO_AGENT]
        principals[DEMO_PRINCIPAL] = None
    out = [Party("service", s) for s in SERVICE_NAMES]
    out += [Party("responder", s) for s in SERVICE_NAMES]  # each service's answering connection
    out += [Party("agent", a) for a in agents]
    out += [Party("principal", p) for p in sorted(principals)]
    out += [Party("ops", o) for o in sorted(dict.fromkeys(config.security.ops))]
    out += [Party("audit", a) for a in sorted(dict.fromkeys(config.security.auditors))]
    if config.slack.enabled:  # one identity per principal on Slack (docs/surfaces.md)
        out += [Party("slack", principal_token(p)) for p in sorted(config.slack.principals)]
    out += [Party("executor", k) for k in sorted(config.kernel.executors)]  # docs/gate.md
    return out


def _q(s: str) -> str:
    return json.dumps(s)  # a double-quoted nats-server config string


def _list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(_q(i) for i in items) + "]"


def render_user(public_nkey: str, party: Party, perms: Permissions) -> str:
    lines = [f"    # {party.label} (inbox {party.inbox_prefix})", "    {", f"      nkey: {_q(public_nkey)}"]
    lines.append("      permissions: {")
    pub = [f"allow: {_list(perms.pub_allow)}"] + ([f"deny: {_list(perms.pub_deny)}"] if perms.pub_deny else [])
    sub = [f"allow: {_list(perms.sub_allow)}"] + ([f"deny: {_list(perms.sub_deny)}"] if perms.sub_deny else [])
    lines.append("        publish: { " + ", ".join(pub) + " }")
    lines.append("        subscribe: { " + ", ".join(sub) + " }")
    if perms.allow_responses:
        lines.append("        allow_responses: true")
    lines += ["      }", "    }"]
    return "\n".join(lines)


def authorization_block(prefix: str, users: list[tuple[Party, str]]) -> str:
    """The nats-server ``authorization`` block for ``(party, public nkey)`` pairs."""
    body = "\n".join(render_user(pub, party, permissions_for(prefix, party)) for party, pub in users)
    return (
        "# Generated by `pgw creds` (docs/security.md). Every connection must authenticate\n"
        "# with one of these nkeys; each user may touch only its own subjects.\n"
        "authorization {\n  users = [\n" + body + "\n  ]\n}\n"
    )


@dataclass(frozen=True)
class EmbeddedAuth:
    """What `pgw up` needs: the block for the server and the credentials to connect with."""

    server_block: str
    service_creds: Path
    party_creds_dir: Path
    block_path: Path
    parties: tuple[Party, ...]

    def creds_for(self, party: Party) -> Path:
        return self.party_creds_dir / party.filename


def embedded_auth(config: Config, *, service: str = "services") -> EmbeddedAuth:
    """Create missing credentials, reuse existing ones, and render the block (written 0600)."""
    d = creds_dir(config)
    ps = parties(config)
    users = [(p, load_or_create_creds(d, p).public_nkey) for p in ps]
    block = authorization_block(config.prefix, users)
    block_path = d / BLOCK_FILE
    write_private(block_path, block)
    return EmbeddedAuth(block, d / Party("service", service).filename, d, block_path, tuple(ps))
