"""Operator mode (decentralized JWT auth) on a real nats-server: the NATS that operations teams run.

The server trusts one operator (``gateway/security/accounts.py``); each tenant is a
NATS account, each party a user JWT carrying exactly the permissions the nkey block
grants, with its own reply inbox prefix. The isolation matrix itself runs over these
JWT users too (tests/test_security_matrix.py, ``bed`` parametrized ``operator``).
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.security.accounts import Operator, decode_jwt_claims, operator_auth
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.identity import Party, creds_connect_options, jwt_creds_inbox_prefix
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams
from subjects.client import Agent, Surface, ensure_agent_consumer
from subjects.idp import Permit
from subjects.wire import OptionChoice, ResolutionOutcome
from tests.gauntlet.bed import flushed
from tests.kernel_support import Issuer, idp, policy_dir, request

WAIT = 20.0
REPO = Path(__file__).resolve().parent.parent


def _creds_text(name: str, header: str | None = None) -> str:
    op = Operator(Path(os.environ.get("TMPDIR", "/tmp")) / f"op-{uuid.uuid4().hex}")
    path = op.mint_user("acme", "pgw", Party("agent", "x"), Path(op.root) / "x.creds")
    text = path.read_text()
    token = text.split("-----BEGIN NATS USER JWT-----\n")[1].split("\n")[0]
    # Re-sign the same user with another name claim, the way `nsc add user --name NAME` would.
    from gateway.security.accounts import encode_jwt

    claims = decode_jwt_claims(token)
    claims["name"] = name
    new = encode_jwt({k: v for k, v in claims.items() if k not in ("jti", "iat", "iss")}, op.account_seed("acme"))
    lines = [ln for ln in text.splitlines() if not ln.startswith("# inbox-prefix")]
    if header:
        lines.insert(0, f"# inbox-prefix: {header}")
    return "\n".join(lines).replace(token, new)


def test_jwt_creds_inbox_prefix_from_header_or_name() -> None:
    """A JWT creds file's inbox prefix comes from its header, else from a party-naming JWT name; else none."""
    assert jwt_creds_inbox_prefix(_creds_text("agent:planner")) == "_INBOX_agent_planner"
    assert jwt_creds_inbox_prefix(_creds_text("agent-planner")) == "_INBOX_agent_planner"  # nsc's naming
    assert jwt_creds_inbox_prefix(_creds_text("principal-alice-2")) == "_INBOX_principal_alice-2"
    assert jwt_creds_inbox_prefix(_creds_text("agent:planner", header="_INBOX_custom")) == "_INBOX_custom"
    assert jwt_creds_inbox_prefix(_creds_text("some-user")) is None  # not a role: no prefix is invented


def test_minted_user_jwt_carries_the_block_permissions(tmp_path: Path) -> None:
    """The user JWT grants exactly the permission builders' lists, and the creds file names its inbox."""
    from gateway.security.permissions import permissions_for

    op = Operator(tmp_path / "accounts")
    party = Party("agent", "planner")
    path = op.mint_user("acme", "pgw", party, tmp_path / party.filename)
    assert path.stat().st_mode & 0o777 == 0o600
    opts = creds_connect_options(path)
    assert opts == {"user_credentials": str(path), "inbox_prefix": "_INBOX_agent_planner"}
    token = path.read_text().split("-----BEGIN NATS USER JWT-----\n")[1].split("\n")[0]
    claims = decode_jwt_claims(token)
    perms = permissions_for("pgw", party)
    assert claims["name"] == "agent:planner" and claims["iss"] == Operator(tmp_path / "accounts").account_public("acme")
    assert claims["nats"]["pub"] == {"allow": list(perms.pub_allow), "deny": list(perms.pub_deny)}
    assert claims["nats"]["sub"] == {"allow": list(perms.sub_allow)}
    assert "_INBOX.>" not in claims["nats"]["sub"]["allow"]
    # Re-minting keeps the user's key (its seed stays in the file): only the JWT is re-signed.
    again = op.mint_user("acme", "pgw", party, path)
    assert decode_jwt_claims(again.read_text().split("-----BEGIN NATS USER JWT-----\n")[1].split("\n")[0])["sub"] == claims["sub"]


def test_missing_seeds_refused_without_create(tmp_path: Path) -> None:
    """With create=False (production), a missing operator seed is an error naming the file, not a new key."""
    from pgwcore.identity import CredentialsError

    with pytest.raises(CredentialsError, match=r"operator\.seed"):
        Operator(tmp_path / "nowhere", create=False)


@pytest.fixture
async def operator_system(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """An operator-mode nats-server, the gateway with the kernel connected as its JWT service user."""
    issuer = Issuer(tmp_path / "issuer")
    pdir = policy_dir(tmp_path)
    kw: dict[str, Any] = {
        "data_dir": str(tmp_path / "data"),
        "agents": {"planner": {"principals": ["alice"]}},
        "security": {"principals": ["bob"]},
        "kernel": {"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(pdir)},
    }
    auth = operator_auth(load_config(None, **kw), tenant="acme")
    assert "operator:" in auth.server_block and "authorization" not in auth.server_block
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1,
                            authorization=auth.server_block)
    await server.start()
    config = load_config(None, nats_url=server.client_url, **kw)
    conns = []
    try:
        from gateway.app import Gateway

        gw_nc = await connect(server.client_url, creds=str(auth.service_creds), name="gateway")
        conns.append(gw_nc)
        async with Gateway(config, gw_nc) as gw:
            yield {"server": server, "auth": auth, "config": config, "gateway": gw, "issuer": issuer,
                   "conns": conns, "tmp": tmp_path}
    finally:
        for c in conns:
            await c.drain()
        await server.stop()


async def test_binding_moment_and_idp_end_to_end_in_operator_mode(operator_system: dict[str, Any]) -> None:
    """Gateway, agent and principal as JWT users: a moment is answered, an IDP is permitted, each on its own inbox."""
    auth, server = operator_system["auth"], operator_system["server"]
    agent_nc = await connect(server.client_url, creds=str(auth.creds_for(Party("agent", "planner"))), name="agent")
    alice_nc = await connect(server.client_url, creds=str(auth.creds_for(Party("principal", "alice"))), name="alice")
    operator_system["conns"] += [agent_nc, alice_nc]
    assert agent_nc._inbox_prefix.decode() == "_INBOX_agent_planner"  # type: ignore[attr-defined]
    agent = Agent(agent_nc, "planner")
    surface = Surface(alice_nc, "alice", presence=False)
    from tests.moments import good_moment

    ask = asyncio.create_task(agent.ask("alice", good_moment(), timeout=WAIT))
    items = surface.items()
    item = await asyncio.wait_for(items.__anext__(), WAIT)
    reply = await surface.choose(item, 1)
    assert reply.status == "accepted", reply
    res = await ask
    assert isinstance(res, ResolutionOutcome) and res.resolution == OptionChoice(index=1)
    await items.aclose()
    await agent.close()

    issuer: Issuer = operator_system["issuer"]
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent="planner", so_id=so)
    rec = idp(so_id=so, mandate_id=jti, step=1, action="ReadBooking")
    got = await request(agent_nc, "planner", {"mandate": token, "action": "ReadBooking", "idp": rec}, timeout=WAIT)
    assert isinstance(got, Permit), got


async def test_new_user_needs_no_server_reload(operator_system: dict[str, Any], tmp_path: Path) -> None:
    """`pgw accounts --user agent:NEW` mints a user while the server runs; it connects and publishes at once."""
    server = operator_system["server"]
    root = operator_system["tmp"] / "data" / "accounts"
    out = tmp_path / "newbot.creds"
    env = dict(os.environ, PGW_DATA_DIR=str(operator_system["tmp"] / "data"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pgwcli", "accounts", "--tenant", "acme", "--dir", str(root),
        "--user", "agent:newbot", "--out", str(out), cwd=str(REPO), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), WAIT)
    assert proc.returncode == 0, stderr.decode()
    assert "_INBOX_agent_newbot" in stdout.decode() and "no server reload" in stdout.decode()
    nc = await connect(server.client_url, creds=str(out), name="newbot")
    operator_system["conns"].append(nc)
    svc = operator_system["gateway"].nc.jetstream()
    await ensure_agent_consumer(svc, "newbot")
    ack = await nc.jetstream().publish("pgw.agent.newbot.envelope", b"{}", headers={"Nats-Msg-Id": "newbot:1"})
    assert ack.stream == "PGW_INBOUND"


async def test_two_tenants_share_a_server_and_never_meet(tmp_path: Path) -> None:
    """Two accounts of one operator: both create the same streams, and one's traffic never reaches the other."""
    op = Operator(tmp_path / "accounts")
    cfg = load_config(None, data_dir=str(tmp_path / "data"), agents={"a1": {"principals": ["p1"]}})
    from gateway.security import parties

    acme = op.provision("acme", cfg.prefix, parties(cfg))
    globex = op.provision("globex", cfg.prefix, parties(cfg))
    assert acme.account_public != globex.account_public
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1,
                            authorization=globex.server_block)  # the block names every tenant's account
    await server.start()
    conns = []
    try:
        for t in (acme, globex):
            svc = await connect(server.client_url, creds=str(t.service_creds), name=f"svc-{t.tenant}")
            conns.append(svc)
            await ensure_streams(svc.jetstream(), cfg.subjects)  # same names in each account: no conflict
            await ensure_agent_consumer(svc.jetstream(), "a1")
        a1_globex = await connect(server.client_url, creds=str(globex.creds_for(Party("agent", "a1"))))
        conns.append(a1_globex)
        sub = await a1_globex.subscribe("pgw.agent.a1.outcome")  # its own subject, in its own account
        await flushed(a1_globex)
        await conns[0].jetstream().publish("pgw.agent.a1.outcome", b'{"for": "acme"}')  # acme's service
        await flushed(conns[0])
        await flushed(a1_globex)
        assert sub.pending_msgs == 0, "acme's outcome reached globex's agent"
        info = await conns[1].jetstream().stream_info("PGW_OUTBOUND")
        assert info.state.messages == 0, "acme's publish landed in globex's stream"
    finally:
        for c in conns:
            await c.drain()
        await server.stop()


def _concrete(pattern: str) -> str:
    return ".".join("x" if t == "*" else "x.y" if t == ">" else t for t in pattern.split("."))


@pytest.mark.security
async def test_tenant_isolation_matrix(tmp_path: Path, security_table) -> None:
    """Two tenants (NATS accounts) of one operator, the same parties in each: every subject a party of one tenant
    may subscribe to stays silent when the other tenant's services publish there, in both directions."""
    from gateway.security import parties
    from gateway.security.permissions import permissions_for

    op = Operator(tmp_path / "accounts")
    cfg = load_config(None, data_dir=str(tmp_path / "d"), agents={"a1": {"principals": ["p1"]}},
                      security={"ops": ["oncall"]})
    tenants = {t: op.provision(t, cfg.prefix, parties(cfg)) for t in ("acme", "globex")}
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=None, websocket_port=None,
                            authorization=tenants["globex"].server_block)
    await server.start()
    conns = []
    try:
        # In each tenant a probe user that may publish anywhere in its own account: whatever leaks across
        # accounts, it is not held back by the publisher's own permissions.
        from gateway.security.permissions import Permissions

        services = {}
        for t in tenants:
            probe = op.mint_user(t, cfg.prefix, Party("ops", "probe"), tmp_path / f"probe-{t}.creds",
                                 perms=Permissions(pub_allow=(">",), sub_allow=("_INBOX_ops_probe.>",)))
            services[t] = await connect(server.client_url, creds=str(probe), name=f"probe-{t}")
            conns.append(services[t])
        for listener_t, publisher_t in (("globex", "acme"), ("acme", "globex")):
            auth = tenants[listener_t]
            for party in auth.parties:
                if party.role == "service":
                    continue
                nc = await connect(server.client_url, creds=str(auth.creds_for(party)), name=f"{listener_t}-{party.label}")
                conns.append(nc)
                perms = permissions_for(cfg.prefix, party)
                subjects = [s for s in perms.sub_allow if s.startswith((f"{cfg.prefix}.", "_INBOX_"))]
                subs = [await nc.subscribe(s) for s in subjects]
                await flushed(nc)
                pub = services[publisher_t]
                for s in subjects:
                    await pub.publish(_concrete(s), b'{"from": "the other tenant"}')
                await flushed(pub)
                await flushed(nc)
                leaked = {s.subject: s.pending_msgs for s in subs if s.pending_msgs}
                ok = not leaked
                security_table.record("tenant isolation (operator mode)", f"{publisher_t} publishes on every subject",
                                      party.label, listener_t, "0 delivered", f"{sum(leaked.values())} delivered", ok)
                assert ok, f"{publisher_t} reached {listener_t}'s {party.label}: {leaked}"
                # Positive control: its own tenant's probe, publishing the same, reaches every subscription.
                own = services[listener_t]
                for s in subjects:
                    await own.publish(_concrete(s), b'{"from": "its own tenant"}')
                await flushed(own)
                await flushed(nc)
                deaf = [s.subject for s in subs if s.pending_msgs < 1]
                assert not deaf, f"{party.label} hears nothing on {deaf}: the check would prove nothing there"
    finally:
        for c in conns:
            await c.close()
        await server.stop()
