"""The production recipe of docs/operations.md, run for real: three nats-server nodes in operator
mode (JWT accounts) with mutual TLS on the client port, R3 streams, two gateways, a signer and a
registrar (against the real scittles), each service with its own user JWT. A binding moment is
answered by its principal as herself and an IDP is permitted, end to end across the cluster.

Under load one node and one gateway are killed -9 and restarted: every acknowledged envelope gets
exactly one outcome (and a binding moment one surface item and one verdict), every verdict exactly
one capsule, and an agent user still cannot read another party's replies."""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path
from typing import Any

import pytest

from gateway.security import parties
from gateway.security.accounts import Operator
from pgwcore.config import Config, load_config
from pgwcore.connect import connect
from pgwcore.identity import Party
from pgwcore.streams import ensure_streams
from pgwcore.tls import make_dev_ca
from subjects.client import Agent, Surface
from subjects.idp import Permit
from subjects.wire import OptionChoice, ResolutionOutcome
from tests.chaos.checker import capsule_verdict_ids, check_streams
from tests.chaos.harness import (
    Load,
    ServiceProc,
    chaos_config,
    env_int,
    unsettled,
    wait_drained,
    wait_services,
    wait_settled,
)
from tests.chaos.test_chaos_cluster import _outcomes, _restart, _wait_outcomes, start_cluster
from tests.gauntlet.bed import flushed
from tests.kernel_support import Issuer, idp, policy_dir, request
from tests.moments import good_moment
from tests.polling import until
from tests.scittles_peer import Scittles

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

ENVELOPES = env_int("PGW_CHAOS_PRODUCTION_ENVELOPES", 600)
AGENT, PRINCIPAL = "prod", "alice"
E2E = "prod-e2e"  # its own agent for the end-to-end checks: its outcomes do not queue behind the burst's


async def test_operator_mode_tls_r3_cluster_two_gateways_kill9(tmp_path: Path, scittles: Scittles) -> None:
    """Operator mode + mutual TLS + R3 + two gateways, signer, registrar: kill -9 of a node and a gateway
    mid-burst loses nothing and doubles nothing, from envelope to registered capsule."""
    ca = make_dev_ca(tmp_path / "tls")
    cfg = load_config(None, data_dir=str(tmp_path / "accounts-data"), agents={AGENT: {"principals": [PRINCIPAL]}, E2E: {"principals": [PRINCIPAL]}})
    op = Operator(tmp_path / "accounts")
    auth = op.provision("acme", cfg.prefix, parties(cfg))

    def configure(n: Any) -> None:  # every node: the same operator block and mutual TLS on the client port
        n.authorization = auth.server_block
        n.tls_cert, n.tls_key, n.tls_ca = str(ca.server_cert), str(ca.server_key), str(ca.ca)
        n.health_client_cert, n.health_client_key = str(ca.client_cert), str(ca.client_key)
        n.health_creds = str(auth.service_creds)  # healthy = JetStream answers the tenant's account

    nodes = await start_cluster(tmp_path, configure=configure)
    url = ",".join(f"tls://127.0.0.1:{n.port}" for n in nodes)
    tls = ca.client_files()
    svc = await connect(url, creds=str(auth.service_creds), tls=tls, name="prod-check")
    agent_nc = await connect(url, creds=str(auth.creds_for(Party("agent", AGENT))), tls=tls, name="prod-agent")
    js = svc.jetstream(timeout=5)
    issuer = Issuer(tmp_path / "issuer")
    pdir = policy_dir(tmp_path)
    extra = (f'[tls]\nca = "{ca.ca}"\ncert = "{ca.client_cert}"\nkey = "{ca.client_key}"\n\n'
             f'[kernel]\npolicy_dir = "{pdir}"\n[kernel.issuers]\n"{issuer.kid}" = "{issuer.pem_path}"\n\n'
             f'[agents.{AGENT}]\nprincipals = ["{PRINCIPAL}"]\n[agents.{E2E}]\nprincipals = ["{PRINCIPAL}"]\n\n'
             f'[signer]\nack_wait_s = 2.0\nbatch = 16\n\n[registrar]\nts_url = "{scittles.url}"\n'
             'http_timeout_s = 2.0\npoll_timeout_s = 2.0\n')
    conf = chaos_config(tmp_path / "c.toml", extra=extra)
    creds = {role: auth.creds_for(Party("service", role)) for role in ("gateway", "signer", "registrar")}
    gws = [ServiceProc("gateway", url, tmp_path / f"gw{i}", conf, creds=creds["gateway"]) for i in range(2)]
    signer = ServiceProc("signer", url, tmp_path / "signer", conf, creds=creds["signer"])
    reg = ServiceProc("registrar", url, tmp_path / "registrar", conf, creds=creds["registrar"])
    procs = [*gws, signer, reg]
    try:
        await ensure_streams(js, Config().subjects, replicas=3)
        # The first gateway creates the R3 buckets; the others start against them (on two busy cores,
        # R3 bucket creation raced by several processes can outlast a JetStream API timeout).
        await gws[0].start()
        await wait_services(svc, "pgw-gateway", 1, procs, timeout=90)
        for p in procs[1:]:
            await p.start()
        await wait_services(svc, "pgw-gateway", 2, procs, timeout=90)
        await wait_services(svc, "pgw-signer", 1, procs, timeout=90)
        await wait_services(svc, "pgw-registrar", 1, procs, timeout=90)

        # An agent user cannot read its principal's replies, across the cluster too (operator mode).
        errors: asyncio.Queue[str] = asyncio.Queue()

        async def on_error(e: Exception) -> None:
            errors.put_nowait(str(e))

        spy = await connect(url, creds=str(auth.creds_for(Party("agent", AGENT))), tls=tls, name="spy",
                            error_cb=on_error)
        try:
            await spy.subscribe("_INBOX_principal_alice.>")
            await flushed(spy)
            err = await asyncio.wait_for(errors.get(), 10)
            assert "permissions violation" in err.lower(), err
        finally:
            await spy.close()

        load = Load(agent_nc, agent=AGENT)
        sending = asyncio.create_task(load.send(ENVELOPES, "p", retry_for=90, rate=ENVELOPES / 8.0))
        await _wait_outcomes(js, ENVELOPES // 5, timeout=90)
        dead = [g for g in gws if not g.alive]
        assert not dead, "a gateway died on its own before the kill:\n" + "\n".join(g.log_tail() for g in dead)
        node = random.choice(nodes)
        node.kill()
        gw = random.choice(gws)
        gw.kill9()
        await node._proc.wait()
        await gw.wait_dead()
        # Still serving on two nodes and one gateway: a further batch sent now is processed now. (Its own
        # envelopes: by the time the kill has settled a fast gateway may have finished the whole burst, so
        # waiting for "10 more outcomes" of the burst alone could wait for outcomes that do not exist.)
        down_at = await _outcomes(js)
        more = ENVELOPES // 20
        await load.send(more, "down", retry_for=60)
        await _wait_outcomes(js, down_at + more, timeout=90)
        await _restart(node)
        await gw.start()
        await sending
        await wait_drained(js, timeout=180)
        await wait_drained(js, "PGW_VERDICTS", "pgw-signer", timeout=180)

        async def registered() -> bool:
            info = await js.consumer_info("PGW_REGISTRATION", "pgw-registrar")
            return info.num_pending == 0 and info.num_ack_pending == 0

        await until(registered, timeout=180, interval=0.5,
                    what=lambda: "registration queue drained: " + "\n".join(p.log_tail() for p in procs))
        caps, ledger = await capsule_verdict_ids(js)
        report = await check_streams(js, load.acked, sent=load.sent, agents=[AGENT], capsules=caps)
        # The restarted node has caught up and every group has its leader before the end-to-end requests
        # (CI, once: the IDP sent after the drains timed out in the kernel's JetStream writes and failed
        # closed, KERNEL_UNAVAILABLE, while the kernel's consumer answered "service unavailable").
        await wait_settled(js)
        # End to end across the cluster, after the burst is checked (its records are not the burst's):
        # a moment answered by alice as herself, and an IDP permitted, with a node and a gateway restarted.
        alice_nc = await connect(url, creds=str(auth.creds_for(Party("principal", PRINCIPAL))), tls=tls, name="alice")
        e2e_nc = await connect(url, creds=str(auth.creds_for(Party("agent", E2E))), tls=tls, name="e2e-agent")
        try:
            agent = Agent(e2e_nc, E2E)
            surface = Surface(alice_nc, PRINCIPAL, presence=False)
            eid = await agent.send_moment(PRINCIPAL, good_moment())
            mid = (await agent.outcome_for(eid, timeout=60)).moment_id
            assert mid in {i.moment_id for i in await surface.pending()}  # alice reads it with her own JWT
            assert (await surface.resolve(mid, OptionChoice(index=1))).status == "accepted"
            res = await agent.resolution_for(mid, timeout=60)
            assert isinstance(res, ResolutionOutcome) and res.resolution == OptionChoice(index=1)
            so = str(uuid.uuid4())
            token, jti = issuer.mandate(agent=E2E, so_id=so, principal=PRINCIPAL)
            got = await request(e2e_nc, E2E, {"mandate": token, "action": "ReadBooking",
                                                  "idp": idp(so_id=so, mandate_id=jti, step=1, action="ReadBooking")},
                                timeout=30)
            assert isinstance(got, Permit), got
            await agent.close()
        finally:
            await alice_nc.close()
            await e2e_nc.close()

    except Exception as e:  # a failure names what each service logged (a timeout alone says little)
        e.add_note("cluster not settled: " + ("; ".join(await unsettled(js)) or "nothing"))
        e.add_note("services' logs:\n" + "\n".join(f"--- {p.role} {p.data_dir.name}\n{p.log_tail()}" for p in procs))
        raise
    finally:
        for p in procs:
            await p.stop()
        for c in (agent_nc, svc):
            await c.close()
        for n in nodes:
            await n.stop()
    print(f"\n[production recipe: operator mode + mTLS + R3, killed node {node.data_dir.name} and {gw.data_dir.name}] "
          f"{report.summary()}; publish retries {load.failures}")
    assert report.acked == ENVELOPES + more and report.ok, report.summary()
    assert report.capsuled_once == report.verdicts
    assert not [v for v, n in ledger.items() if n > 1], "a decision was signed twice"
