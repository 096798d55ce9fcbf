"""A transition report is judged against its session and the holds on it (spec 003 §4.4, §5.5.2), and ids as the
kernel keys them (§4.2); a refused report's verdict carries no executed action in clear (spec 004 §8.1)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from consumers import capsule_v4
from consumers.capsule_map import capsule_from_verdict
from subjects.client import Surface
from subjects.idp import Permit
from subjects.kernelops import AuditReply
from subjects.wire import NoticeItem, OptionChoice
from tests.kernel_support import Issuer, policy_dir, read_log, running_gateway, stored_verdicts
from tests.test_kernel_hem import AGENT, PRINCIPAL, Env, LogWatch, _moment


@pytest.fixture
async def env(make_config: Any, nc: Any, tmp_path: Path) -> AsyncIterator[Env]:
    """A gateway with the kernel; agent bot is bound to principal alice."""
    issuer = Issuer(tmp_path / "issuer")
    cfg = make_config(
        kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path))},
        agents={AGENT: {"principals": [PRINCIPAL]}},
    )
    watch = LogWatch()
    await watch.start(nc)
    async with running_gateway(cfg, nc) as gw:
        yield Env(nc, gw, issuer, watch)


async def test_a_permit_taken_before_a_gap_is_refused_while_held_and_after_deny(env: Env) -> None:
    """Permits for steps 2 and 3 are taken, step 1's report is a commitment gap: step 2's report during the pending
    escalation and step 3's after the principal's Deny are each TRANSITION_REFUSED with a CRITICAL alert, with no
    STATE_TRANSITIONED or verification, and a denied verdict that names no executed action."""
    recs = [env.idp(i) for i in (1, 2, 3)]
    for r in recs:
        assert isinstance(await env.send(r), Permit)
    await env.report(recs[0]["idp_id"], "CloseBooking ")
    await env.watch.wait("IDP_COMMITMENT_GAP")
    item = await _moment(Surface(env.nc, PRINCIPAL), recs[0]["idp_id"])

    await env.report(recs[1]["idp_id"], "CloseBooking")
    held = await env.watch.wait("TRANSITION_REFUSED", lambda e: e["body"]["idp_id"] == recs[1]["idp_id"])
    assert held["body"]["code"] == "HEM_PENDING"
    assert held["body"]["alert"] == {"severity": "CRITICAL", "alert_trigger": "TRANSITION_WHILE_HELD", "held_by": "HEM_PENDING"}

    assert (await Surface(env.nc, PRINCIPAL).resolve(item.moment_id, OptionChoice(index=1))).status == "accepted"
    await env.watch.wait("HEM_RESOLVED")
    await env.report(recs[2]["idp_id"], "CloseBooking")
    ended = await env.watch.wait("TRANSITION_REFUSED", lambda e: e["body"]["idp_id"] == recs[2]["idp_id"])
    assert ended["body"]["code"] == "SESSION_TERMINATED"

    transitioned = {ev.body["idp_id"] for _, ev in await read_log(env.js, "STATE_TRANSITIONED")}
    assert transitioned == {recs[0]["idp_id"]}
    assert await read_log(env.js, "IDP_COMMITMENT_VERIFIED") == []
    for r in recs[1:]:
        await env.watch.wait("verdict:denied", lambda v, r=r: v.get("idp_id") == r["idp_id"])
    denied = await stored_verdicts(env.js, "denied", lambda v: v.idp_id in {recs[1]["idp_id"], recs[2]["idp_id"]})
    assert len(denied) == 2
    for v in denied:
        assert v.action_type == "idp.transition" and "CloseBooking" not in msgspec.json.encode(v).decode()
        # and the capsules the signer makes of them, in both formats (spec 004 §8.1: only digests of what was checked)
        for capsule in (capsule_from_verdict(v, operator="op", salt="s" * 32),
                        capsule_v4.from_verdict(v, operator="op", salt="s" * 32)):
            text = msgspec.json.encode(capsule).decode()
            assert "CloseBooking" not in text and "idp.transition" in text, text[:500]


async def test_the_principal_is_told_of_a_report_refused_while_held(env: Env) -> None:
    """A report of an earlier permit while a commitment gap's escalation is pending reaches alice as a moment of its
    own whose first finding says what was reported (the same report again adds none), and one after her Deny
    reaches her as a notice saying it was refused and nothing is asked (spec 003 §4.4, §5.5.2)."""
    recs = [env.idp(i) for i in (1, 2, 3)]
    for r in recs:
        assert isinstance(await env.send(r), Permit)
    surface = Surface(env.nc, PRINCIPAL)
    await env.report(recs[0]["idp_id"], "CloseBooking ")
    gap = await _moment(surface, recs[0]["idp_id"])

    for _ in range(2):
        await env.report(recs[1]["idp_id"], "CloseBooking")
    told = await _moment(surface, recs[1]["idp_id"])
    assert told.moment_id != gap.moment_id
    first = told.binding_moment.findings[0]
    assert "while this session was stopped for your decision" in first and "reported doing CloseBooking" in first
    assert "refused the report" in first
    refused = [ev for _, ev in await read_log(env.js, "TRANSITION_REFUSED") if ev.body["idp_id"] == recs[1]["idp_id"]]
    while len(refused) < 2:
        await env.watch.wait("TRANSITION_REFUSED", lambda e: e["body"]["idp_id"] == recs[1]["idp_id"])
        refused = [ev for _, ev in await read_log(env.js, "TRANSITION_REFUSED") if ev.body["idp_id"] == recs[1]["idp_id"]]
    pending = [i for i in await surface.pending() if getattr(i, "envelope_id", None) == recs[1]["idp_id"]]
    assert [i.moment_id for i in pending] == [told.moment_id]

    assert (await surface.resolve(gap.moment_id, OptionChoice(index=1))).status == "accepted"
    await env.watch.wait("HEM_RESOLVED")
    await env.report(recs[2]["idp_id"], "CloseBooking")

    async def notice() -> NoticeItem:
        async for item in surface.items():
            if isinstance(item, NoticeItem) and item.envelope_id == recs[2]["idp_id"]:
                return item
        raise AssertionError("surface closed")

    said = await asyncio.wait_for(notice(), 10)
    assert said.diagnostic.startswith("After you ended this session, agent ") and "CloseBooking" in said.diagnostic
    assert "Nothing is asked of you." in said.diagnostic


async def test_a_report_naming_the_idp_in_capitals_is_the_same_idp_everywhere(env: Env) -> None:
    """A second, different report naming the IDP in capitals is a second report of that IDP: its TRANSITION_REFUSED
    names the id as the kernel keys it, and an audit query in capitals answers that IDP's events, the refusal included."""
    rec = env.idp(1)
    assert isinstance(await env.send(rec), Permit)
    await env.report(rec["idp_id"], "CloseBooking")
    await env.watch.wait("IDP_COMMITMENT_VERIFIED")
    await env.report(rec["idp_id"].upper(), "ReadBooking")
    twice = await env.watch.wait("TRANSITION_REFUSED")
    assert twice["body"]["idp_id"] == rec["idp_id"]
    assert twice["body"]["alert"]["alert_trigger"] == "TRANSITION_REPORTED_TWICE"
    msg = await env.nc.request("pgw.kernel.audit.auditor", msgspec.json.encode({"kind": "idp", "id": rec["idp_id"].upper()}),
                               timeout=10)
    reply = msgspec.json.decode(msg.data, type=AuditReply)
    assert reply.ok, reply.refusal
    types = [e["event"]["event_type"] for e in reply.record["events"]]
    assert "STATE_TRANSITIONED" in types and "TRANSITION_REFUSED" in types


async def test_an_idp_submitted_in_capitals_is_one_id_in_kernel_log_and_audit(env: Env) -> None:
    """An IDP whose UUID idp_id is sent in capitals (audit_accessible false) is canonicalised where it enters (spec
    003 §4.2): the permit, IDP_SUBMITTED, the report's STATE_TRANSITIONED and the Session Audit Record's events and
    restrictions all name it in lower case, the IDP as sent is kept in IDP_SUBMITTED.idp, and the same id resent in
    lower case is IDP_DUPLICATE."""
    rec = env.idp(1, audit_accessible=False)
    rec["idp_id"] = rec["idp_id"].upper()
    canonical = rec["idp_id"].lower()
    permit = await env.send(rec)
    assert isinstance(permit, Permit) and permit.idp_id == canonical
    submitted = await env.watch.wait("IDP_SUBMITTED")
    assert submitted["body"]["idp_id"] == canonical and submitted["body"]["idp"]["idp_id"] == rec["idp_id"]
    await env.report(rec["idp_id"], "CloseBooking")
    transitioned = await env.watch.wait("STATE_TRANSITIONED")
    assert transitioned["body"]["idp_id"] == canonical
    again = await env.send({**env.idp(2), "idp_id": canonical})
    assert getattr(again, "error_code", None) == "IDP_DUPLICATE"
    msg = await env.nc.request("pgw.kernel.audit.auditor",
                               msgspec.json.encode({"kind": "session", "id": rec["session_id"], "agent": AGENT}), timeout=10)
    reply = msgspec.json.decode(msg.data, type=AuditReply)
    assert reply.ok, reply.refusal
    named = {e["event"]["body"].get("idp_id") for e in reply.record["events"]} - {None}
    assert named == {canonical}, named
    assert [r["idp_id"] for r in reply.record["restrictions"]] == [canonical]
