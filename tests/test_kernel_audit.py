"""Audit access (spec 003 §4.2, §9): the audit role, `pgw audit session|idp`, audit_accessible honoured and recorded."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec

from gateway.kernel.eventlog import check_signature
from gateway.security import Party, embedded_auth
from pgwcore.config import load_config
from pgwcore.keys import public_keys
from pgwcore.server import EmbeddedServer
from subjects.idp import LogEvent, Permit
from tests.gauntlet.bed import flushed
from tests.kernel_support import (
    Issuer,
    idp,
    kernel_config,
    policy_dir,
    read_log,
    request,
    running_gateway,
)
from tests.test_security_matrix import open_conn

PGW = str(Path(sys.executable).parent / "pgw")
AGENT = "bot"
SECRET = "Quietly move the reserve to the side account"


async def _audit(url: str, *args: str) -> tuple[int, dict[str, Any]]:
    proc = await asyncio.create_subprocess_exec(
        PGW, "--server", url, "--log-format", "json", "audit", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert out, err.decode()
    return proc.returncode or 0, json.loads(out)


async def test_session_audit_record_withholds_restricted_idps_and_records_it(
    make_config: Any, nc: Any, nats_server: Any, tmp_path: Path
) -> None:
    """`pgw audit session` returns every event of the session, signed; an audit_accessible: false IDP's content is
    withheld and listed under restrictions; `pgw audit idp` refuses that IDP; every query is logged as AUDIT_QUERY."""
    issuer = Issuer(tmp_path / "issuer")
    cfg = kernel_config(make_config, issuer, policy_dir(tmp_path), checkpoint_interval_s=0)
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent=AGENT, so_id=so)
    open_ = idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")
    hidden = idp(so_id=so, mandate_id=jti, step=2, action="CloseBooking", audit_accessible=False,
                 declared_goal={"goal_id": str(uuid.uuid4()), "description": SECRET})
    other = idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking", session="s-2")
    url = nats_server.client_url
    async with running_gateway(cfg, nc):
        for rec in (open_, hidden, other):
            assert isinstance(await request(nc, AGENT, {"mandate": token, "idp": rec}), Permit)
        rc, out = await _audit(url, "session", "s-1", "--agent", AGENT, "--auditor", "carol")
        rc_idp, out_idp = await _audit(url, "idp", hidden["idp_id"], "--auditor", "carol")
        rc_ok, out_ok = await _audit(url, "idp", open_["idp_id"], "--auditor", "carol")
    assert rc == 0 and out["ok"], out
    rec = out["record"]
    assert rec["record_type"] == "pgw.session_audit_record/1" and rec["session_id"] == "s-1"
    assert SECRET not in json.dumps(out)
    ids = {e["event"]["body"].get("idp_id") for e in rec["events"]}
    assert ids == {open_["idp_id"], hidden["idp_id"]}  # nothing of session s-2
    keys = {k.kid: k.public for k in public_keys(cfg.data_path, "kernel")}
    full = [e for e in rec["events"] if not e.get("restricted")]
    assert full and all(check_signature(msgspec.convert(e["event"], LogEvent), keys) is None for e in full)
    assert all(msgspec.convert(e["event"], LogEvent).digest() == e["digest"] for e in full)
    submitted = next(e for e in full if e["event"]["event_type"] == "IDP_SUBMITTED")
    assert submitted["event"]["body"]["idp"] == open_
    [restriction] = rec["restrictions"]
    assert restriction["idp_id"] == hidden["idp_id"] and "idp" in restriction["withheld"]
    assert "audit_accessible" in restriction["rule"]
    assert sorted(restriction["event_seqs"]) == sorted(e["seq"] for e in rec["events"] if e.get("restricted"))
    assert rc_idp == 1 and out_idp["refusal"]["code"] == "AUDIT_RESTRICTED" and SECRET not in json.dumps(out_idp)
    assert rc_ok == 0 and out_ok["record"]["events"][0]["event"]["body"]["idp"] == open_
    queries = [(s, e.body) for s, e in await read_log(nc.jetstream(), "AUDIT_QUERY")]
    assert [b["kind"] for _s, b in queries] == ["session", "idp", "idp"]
    assert all(b["auditor"] == "carol" for _s, b in queries)
    assert queries[0][0] == rec["audit_query_seq"] and queries[0][1]["restricted_idp_ids"] == [hidden["idp_id"]]
    assert queries[1][1]["restricted_idp_ids"] == [hidden["idp_id"]] and queries[1][1]["events_returned"] == 0


async def test_audit_role_may_only_ask_the_kernel_under_its_own_name(tmp_path: Path) -> None:
    """`pgw creds` makes the audit principal a user that may publish only pgw.kernel.audit.<its name> (and be answered
    there); it may not read the event log, nor ask as another auditor; an agent may not ask at all."""
    config = load_config(None, data_dir=str(tmp_path / "data"), agents={"a1": {"principals": ["p1"]}},
                         security={"auditors": ["carol"]})
    auth = embedded_auth(config)
    carol = Party("audit", "carol")
    assert carol in auth.parties and auth.creds_for(carol).exists()
    server = EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=-1, websocket_port=-1, authorization=auth.server_block)
    await server.start()
    conns = []
    try:
        # The services take requests on their answering connection (docs/security.md "Replies").
        service = await open_conn(server, auth.creds_for(Party("responder", "services")), Party("responder", "services"))
        auditor = await open_conn(server, auth.creds_for(carol), carol)
        agent = await open_conn(server, auth.creds_for(Party("agent", "a1")), Party("agent", "a1"))
        conns = [service, auditor, agent]

        async def answer(msg: Any) -> None:
            await msg.respond(b'{"ok": true}')

        await service.nc.subscribe("pgw.kernel.audit.*", cb=answer)
        await flushed(service.nc)
        reply = await auditor.nc.request("pgw.kernel.audit.carol", b'{"kind": "idp", "id": "x"}', timeout=5)
        assert reply.data == b'{"ok": true}'
        await auditor.nc.publish("pgw.kernel.audit.dave", b"{}")
        await auditor.violation("pgw.kernel.audit.dave")
        await auditor.nc.subscribe("pgw.log.>")
        await flushed(auditor.nc)
        await auditor.violation("pgw.log.>")
        await agent.nc.publish("pgw.kernel.audit.carol", b"{}")
        await agent.violation("pgw.kernel.audit.carol")
    finally:
        for c in conns:
            await c.nc.close()
        await server.stop()


async def test_a_long_session_record_comes_in_pages(make_config: Any, nc: Any, tmp_path: Path) -> None:
    """A record larger than its page ends early with next_from_seq; asking from there returns the rest, no event twice."""
    from gateway.kernel.service import KernelService
    from subjects.kernelops import AuditRequest, audit_reply_decoder

    issuer = Issuer(tmp_path / "issuer")
    cfg = kernel_config(make_config, issuer, policy_dir(tmp_path), checkpoint_interval_s=0)
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent=AGENT, so_id=so)
    async with running_gateway(cfg, nc) as gw:
        kernel = next(p for p in gw.parts if isinstance(p, KernelService))
        kernel.audit.page_bytes = 6000  # two or three events a page
        for step in range(1, 6):
            await request(nc, AGENT, {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=step, action="CloseBooking")})
        seqs: list[int] = []
        start, pages = 0, 0
        while start is not None:
            req = AuditRequest(kind="session", id="s-1", agent=AGENT, from_seq=start)
            reply = audit_reply_decoder.decode(
                (await nc.request("pgw.kernel.audit.carol", msgspec.json.encode(req), timeout=10)).data)
            assert reply.ok and reply.record is not None
            seqs += [e["seq"] for e in reply.record["events"]]
            start, pages = reply.record["next_from_seq"], pages + 1
    assert pages > 1 and seqs == sorted(set(seqs)) and len(seqs) == 10  # 5 x IDP_SUBMITTED + CEDAR_PERMIT_RECORDED


async def test_a_secret_in_an_audit_query_is_not_kept_in_the_event_log(
    make_config: Any, nats_server: Any, tmp_path: Path
) -> None:
    """An auditor's query is logged first as AUDIT_QUERY, in the event log that is never deleted; a configured
    secret typed into its id (found by an attack from the docs: `pgw audit session s-<secret>`) was kept there
    as asked. It is kept redacted now, the rest of the query as asked; after a clean shutdown and a restart the
    secret is in no file under the server's store and no log line."""
    from pgwcore.config import Config
    from pgwcore.connect import connect
    from pgwcore.streams import ensure_streams
    from tests.logcapture import capture_logs_with_context
    from tests.test_data_at_rest import gone_after_restart

    secret = "Zq7PlumBaGo9xK-audit"
    issuer = Issuer(tmp_path / "issuer")
    cfg = make_config(kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path)),
                              "checkpoint_interval_s": 0},
                      pipeline={"secrets": {"values": [secret]}})
    url = nats_server.client_url
    nc = await connect(url, name="test")
    await ensure_streams(nc.jetstream(), Config().subjects)
    with capture_logs_with_context() as logs:
        try:
            async with running_gateway(cfg, nc):
                await _audit(url, "session", f"s-{secret}", "--agent", AGENT, "--auditor", "carol")
                await _audit(url, "idp", secret, "--auditor", "carol")
                queries = [e.body for _s, e in await read_log(nc.jetstream(), "AUDIT_QUERY")]
        finally:
            await nc.drain()
    assert [q["id"] for q in queries] == ["s-[REDACTED]", "[REDACTED]"], queries
    assert [q["auditor"] for q in queries] == ["carol", "carol"] and queries[0]["agent"] == AGENT
    await gone_after_restart(nats_server, tmp_path, logs, (secret,))
