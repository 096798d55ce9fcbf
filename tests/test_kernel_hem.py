"""HEM round trips through a real surface client, transition reports and commitment verification (spec 003 §4.4, §5.5, §6.3)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gateway.kernel.service import KernelService
from gateway.kernel.state import session_key
from subjects.client import Agent, Surface
from subjects.idp import EnrichedDeny, HemPending, Permit, Reject
from subjects.util import stable_id
from subjects.wire import BindingMomentItem, HemDecision, OptionChoice
from tests.kernel_support import (
    Issuer,
    idp,
    policy_dir,
    read_log,
    read_verdicts,
    request,
    running_gateway,
    stored_verdicts,
)

AGENT, PRINCIPAL = "bot", "alice"


class LogWatch:
    """Futures for kernel log events as they are published (no sleeps)."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.waiters: list[tuple[str, Any, asyncio.Future[Any]]] = []

    async def start(self, nc: Any) -> None:
        async def on(msg: Any) -> None:
            ev = msgspec.json.decode(msg.data)
            if msg.subject.startswith("pgw.verdict."):
                ev["event_type"] = "verdict:" + ev["verdict_class"]
            self.events.append(ev)
            for et, pred, fut in self.waiters:
                if not fut.done() and ev["event_type"] == et and pred(ev):
                    fut.set_result(ev)

        self.subs = [await nc.subscribe(subj, cb=on) for subj in ("pgw.log.>", "pgw.verdict.>")]
        await nc.flush()

    async def wait(self, event_type: str, pred: Any = lambda ev: True, timeout: float = 10) -> Any:
        for ev in self.events:
            if ev["event_type"] == event_type and pred(ev):
                return ev
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiters.append((event_type, pred, fut))
        return await asyncio.wait_for(fut, timeout)


class Env:
    def __init__(self, nc: Any, gw: Any, issuer: Issuer, watch: LogWatch) -> None:
        self.nc, self.gw, self.watch, self.issuer = nc, gw, watch, issuer
        self.js = nc.jetstream()
        self.so = str(uuid.uuid4())
        self.token, self.jti = issuer.mandate(agent=AGENT, so_id=self.so, principal=PRINCIPAL)

    def idp(self, step: int, action: str = "CloseBooking", **over: Any) -> dict[str, Any]:
        return idp(so_id=self.so, mandate_id=self.jti, step=step, action=action, **over)

    async def send(self, rec: dict[str, Any]) -> Any:
        return await request(self.nc, AGENT, {"mandate": self.token, "idp": rec})

    async def report(self, idp_id: str, executed: str, effect: dict[str, Any] | None = None, msg_id: str | None = None) -> None:
        body = {"idp_id": idp_id, "executed_action": executed, "effect": effect or {"type": "booking.close", "status": "dispatched"}}
        await self.js.publish(f"pgw.agent.{AGENT}.transition", msgspec.json.encode(body),
                              headers={"Nats-Msg-Id": msg_id or f"{AGENT}:{uuid.uuid4()}"})

    async def outcome(self, pred: Any, agent: Agent) -> Any:
        async def first() -> Any:
            async for o in agent.outcomes():
                if pred(o):
                    return o
            return None

        return await asyncio.wait_for(first(), 10)


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


async def _moment(surface: Surface, idp_id: str, seen: set[str] = frozenset()) -> BindingMomentItem:
    async def first() -> BindingMomentItem:
        async for item in surface.items():
            if isinstance(item, BindingMomentItem) and item.envelope_id == idp_id and item.moment_id not in seen:
                return item
        raise AssertionError("surface closed")

    return await asyncio.wait_for(first(), 10)


async def test_hem_approve_round_trip(env: Env) -> None:
    """hem_urgency REQUIRED reaches the principal as a gateway-built moment; approve reaches the agent and permits exactly that idp_id once."""
    rec = env.idp(1, "ProcessPayment", reasoning_basis={"type": "INFERENCE", "description": "The invoice looks due today"},
                  confidence_level=0.62, hem_urgency="REQUIRED")
    r = await env.send(rec)
    assert isinstance(r, HemPending)
    item = await _moment(Surface(env.nc, PRINCIPAL), rec["idp_id"])
    bm = item.binding_moment
    assert item.hem and item.moment_id == r.moment_id
    # spec 000 §6.1, §6.3: answer-first, as the gateway's policy's recommendation; what is asked, in words
    assert bm.synopsis.startswith("The gateway's policy recommends Deny: agent bot asks to do ProcessPayment")
    assert bm.recommendations
    assert any(rec["declared_goal"]["description"] in f for f in bm.findings)
    assert "The agent's reasoning: \"The invoice looks due today\"" in bm.findings  # its type is for auditors
    assert not any("INFERENCE" in f for f in bm.findings)
    assert "The agent says it is 62% confident in this step." in bm.findings
    assert [o.label for o in bm.question.options] == ["Approve", "Deny"]
    assert all(o.reasoning for o in bm.question.options)
    assert bm.question.hatches.free_text and bm.question.hatches.dialogue
    blocked = await env.send(env.idp(2, "ReadBooking"))
    assert isinstance(blocked, EnrichedDeny) and blocked.deny_code == "HEM_PENDING"

    agent = Agent(env.nc, AGENT)
    try:
        reply = await Surface(env.nc, PRINCIPAL).resolve(item.moment_id, OptionChoice(index=0))
        assert reply.status == "accepted"
        decision = await env.outcome(lambda o: isinstance(o, HemDecision), agent)
        # The moment query returns the same hem_decision (a restarted agent re-reads it; docs/integrations.md).
        state = await agent.moment_state(item.moment_id)
        assert state.status == "closed" and state.outcome == decision
    finally:
        await agent.close()
    assert decision.decision == "approve" and decision.idp_id == rec["idp_id"]

    await env.report(rec["idp_id"], "ProcessPayment")
    await env.watch.wait("IDP_COMMITMENT_VERIFIED", lambda ev: ev["body"]["record"]["idp_id"] == rec["idp_id"])
    await env.watch.wait("verdict:executed", lambda v: v["idp_id"] == rec["idp_id"])
    executed = await stored_verdicts(env.js, "executed", lambda v: v.idp_id == rec["idp_id"])
    # spec 004 §5.4.2: the execution closes the dispatch; the approval is no `resolved` closure of its own
    assert executed[0].supersedes == stable_id("dispatch", item.moment_id) and executed[0].approver == "human"
    assert await read_verdicts(env.js, "resolved") == []
    assert executed[0].human_disposed is True
    assert isinstance(await env.send(env.idp(2, "ReadBooking")), Permit)
    # Exactly once: a second, different report for the same idp_id is refused, a critical finding that goes to HEM.
    await env.report(rec["idp_id"], "ProcessPayment", {"type": "booking.close", "status": "failed"})
    refused = await env.watch.wait("TRANSITION_REFUSED", lambda ev: ev["body"]["idp_id"] == rec["idp_id"])
    assert "already reported" in refused["body"]["reason"]
    assert refused["body"]["alert"] == {"severity": "CRITICAL", "alert_trigger": "TRANSITION_REPORTED_TWICE"}
    await _moment(Surface(env.nc, PRINCIPAL), rec["idp_id"])
    blocked = await env.send(env.idp(3, "ReadBooking"))
    assert isinstance(blocked, EnrichedDeny) and blocked.deny_code == "HEM_PENDING"


async def test_hem_deny_round_trip(env: Env) -> None:
    """A denied HEM moment reaches the agent as hem_decision deny; the IDP may not transition; the session resumes."""
    rec = env.idp(1, hem_urgency="REQUIRED")
    assert isinstance(await env.send(rec), HemPending)
    item = await _moment(Surface(env.nc, PRINCIPAL), rec["idp_id"])
    agent = Agent(env.nc, AGENT)
    try:
        assert (await Surface(env.nc, PRINCIPAL).resolve(item.moment_id, OptionChoice(index=1))).status == "accepted"
        decision = await env.outcome(lambda o: isinstance(o, HemDecision), agent)
    finally:
        await agent.close()
    assert decision.decision == "deny"
    await env.report(rec["idp_id"], "CloseBooking")
    refused = await env.watch.wait("TRANSITION_REFUSED")
    assert "not permitted" in refused["body"]["reason"]
    assert await read_log(env.js, "STATE_TRANSITIONED") == []
    resolved = await env.watch.wait("HEM_RESOLVED")
    assert resolved["body"]["decision"] == "deny"
    assert isinstance(await env.send(env.idp(2, "ReadBooking")), Permit)


async def test_commitment_verified_with_effect_as_reported(env: Env) -> None:
    """A matching report yields STATE_TRANSITIONED then a signed IDP_COMMITMENT_VERIFIED, and an executed verdict that never claims more than reported."""
    rec = env.idp(1)
    assert isinstance(await env.send(rec), Permit)
    await env.report(rec["idp_id"], "CloseBooking", {"type": "booking.close", "status": "confirmed"})
    ver = await env.watch.wait("IDP_COMMITMENT_VERIFIED")
    st = await env.watch.wait("STATE_TRANSITIONED")
    assert ver["body"]["record"]["match_result"] == "MATCHED"
    assert ver["body"]["record"]["state_transition_id"] == st["event_id"] and ver["body"]["record"]["kernel_signature"]
    assert ver["prev_seq"] > st["prev_seq"]
    await env.watch.wait("verdict:executed")
    v = (await stored_verdicts(env.js, "executed"))[0]
    assert v.approver == "policy" and not v.human_disposed
    assert v.details["effect_attestation"] == "runtime_claimed"
    assert v.effect.status == "dispatched" and v.details["effect_status_reported"] == "confirmed"

    rec2 = env.idp(2)
    assert isinstance(await env.send(rec2), Permit)
    await env.report(rec2["idp_id"], "CloseBooking", {"type": "booking.close", "status": "confirmed", "response": {"ok": True}})
    await env.watch.wait("verdict:executed", lambda v: v["idp_id"] == rec2["idp_id"])
    v2 = (await stored_verdicts(env.js, "executed", lambda x: x.idp_id == rec2["idp_id"]))[0]
    assert v2.effect.status == "confirmed" and len(v2.details["response_digest"]) == 64


async def test_commitment_gap_goes_to_hem(env: Env) -> None:
    """An executed action differing by one character is IDP_COMMITMENT_GAP: critical alert, session HEM_PENDING, a moment to the principal; deny ends the session."""
    rec = env.idp(1)
    assert isinstance(await env.send(rec), Permit)
    await env.report(rec["idp_id"], "CloseBooking ")
    gap = await env.watch.wait("IDP_COMMITMENT_GAP")
    assert gap["body"]["record"]["match_result"] == "IDP_COMMITMENT_GAP"
    assert gap["body"]["alert"] == {"severity": "CRITICAL", "alert_trigger": "IDP_COMMITMENT_GAP"}
    esc = await env.watch.wait("HEM_ESCALATED")
    assert esc["body"]["trigger"] == "IDP_COMMITMENT_GAP"
    # The report is processed asynchronously: the logged HEM_ESCALATED precedes
    # the session's move to HEM_PENDING, and the moment is sent after it.
    item = await _moment(Surface(env.nc, PRINCIPAL), rec["idp_id"])
    blocked = await env.send(env.idp(2, "ReadBooking"))
    assert isinstance(blocked, EnrichedDeny) and blocked.deny_code == "HEM_PENDING"
    assert any("IDP_COMMITMENT_GAP" in f for f in item.binding_moment.findings)
    assert (await Surface(env.nc, PRINCIPAL).resolve(item.moment_id, OptionChoice(index=1))).status == "accepted"
    await env.watch.wait("HEM_RESOLVED")
    r = await env.send(env.idp(2, "ReadBooking"))
    assert isinstance(r, Reject) and r.error_code == "SESSION_TERMINATED"


async def test_transition_without_idp_is_refused(env: Env) -> None:
    """A report naming no committed IDP is refused and logged; no STATE_TRANSITIONED appears (spec 003 §5.3)."""
    ghost = str(uuid.uuid4())
    await env.report(ghost, "CloseBooking")
    refused = await env.watch.wait("TRANSITION_REFUSED")
    assert refused["body"]["idp_id"] == ghost and "no IDP_SUBMITTED" in refused["body"]["reason"]
    assert await read_log(env.js, "STATE_TRANSITIONED") == []
    await env.watch.wait("verdict:denied", lambda v: v["reason"]["code"] == "TRANSITION_REFUSED")
    denied = await stored_verdicts(env.js, "denied", lambda v: v.reason.code == "TRANSITION_REFUSED")
    assert denied[-1].reason.code == "TRANSITION_REFUSED"


async def test_redelivered_report_is_not_doubled(env: Env) -> None:
    """Processing the same report twice (a redelivery) yields one STATE_TRANSITIONED, one verification and one verdict."""
    rec = env.idp(1)
    assert isinstance(await env.send(rec), Permit)
    kernel = next(p for p in env.gw.parts if isinstance(p, KernelService))
    data = msgspec.json.encode({"idp_id": rec["idp_id"], "executed_action": "CloseBooking",
                                "effect": {"type": "booking.close", "status": "failed"}})
    assert await kernel.handle_transition(AGENT, data, 999) == "verified"
    assert await kernel.handle_transition(AGENT, data, 999) == "verified"
    assert len(await read_log(env.js, "STATE_TRANSITIONED")) == 1
    assert len(await read_log(env.js, "IDP_COMMITMENT_VERIFIED")) == 1
    # spec 004 §5.4.2: "failed" is the effect status of an executed action, never the class errored
    assert await read_verdicts(env.js, "errored") == []
    executed = await stored_verdicts(env.js, "executed")
    assert len(executed) == 1 and executed[0].effect.status == "failed"


async def test_hem_expiry_is_a_refusal(make_config: Any, nc: Any, tmp_path: Path) -> None:
    """A HEM moment that expires unanswered is a denial: the IDP may not transition and the agent hears 'expired'."""
    issuer = Issuer(tmp_path / "issuer")
    cfg = make_config(
        kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path)), "hem_expires_in_s": 1},
        agents={AGENT: {"principals": [PRINCIPAL]}},
    )
    watch = LogWatch()
    await watch.start(nc)
    async with running_gateway(cfg, nc) as gw:
        env = Env(nc, gw, issuer, watch)
        rec = env.idp(1, hem_urgency="REQUIRED")
        assert isinstance(await env.send(rec), HemPending)
        resolved = await watch.wait("HEM_RESOLVED")
        assert resolved["body"]["decision"] == "expired"
        await env.report(rec["idp_id"], "CloseBooking")
        refused = await watch.wait("TRANSITION_REFUSED")
        assert "not permitted" in refused["body"]["reason"]


async def test_no_step_goes_through_while_the_escalation_is_being_logged(env: Env) -> None:
    """§5.5.2 "enters HEM_PENDING immediately": the session is HEM_PENDING from the moment the escalation is
    decided, not from the ack of its HEM_ESCALATED append, so a request arriving in between is denied.
    (A request that reserved its step before the session's move was first, and goes through: the test sends
    its second request once the move is stored, the append still unacknowledged.)"""
    kernel = next(p for p in env.gw.parts if isinstance(p, KernelService))
    real, real_escalate = kernel.eventlog.append, kernel.state.escalate
    appending, moved, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def append(event_type: str, body: Any, **kw: Any) -> Any:
        if event_type == "HEM_ESCALATED":
            appending.set()
            await release.wait()
        return await real(event_type, body, **kw)

    async def escalate(body: dict[str, Any]) -> Any:
        prior = await real_escalate(body)
        moved.set()
        return prior

    kernel.eventlog.append = append  # type: ignore[method-assign]
    kernel.state.escalate = escalate  # type: ignore[method-assign]
    escalating = asyncio.create_task(env.send(env.idp(1, hem_urgency="REQUIRED")))
    # The append is held; the session's move (sent alongside it) is stored while it is held.
    # A kernel that moved the session only after the append's ack would time out here.
    try:
        await asyncio.wait_for(asyncio.gather(appending.wait(), moved.wait()), 10)
        during = await env.send(env.idp(2, "ReadBooking"))
    finally:
        release.set()
    assert isinstance(await escalating, HemPending)
    assert isinstance(during, EnrichedDeny) and during.deny_code == "HEM_PENDING", during


async def test_an_escalation_that_cannot_be_logged_leaves_the_session_as_it_was(env: Env) -> None:
    """If HEM_ESCALATED cannot be appended, the request fails closed (KERNEL_UNAVAILABLE) and the session,
    moved to HEM_PENDING alongside the append, is put back: the agent's next step is decided normally."""
    kernel = next(p for p in env.gw.parts if isinstance(p, KernelService))
    real = kernel.eventlog.append

    async def append(event_type: str, body: Any, **kw: Any) -> Any:
        if event_type == "HEM_ESCALATED":
            raise RuntimeError("log unavailable")
        return await real(event_type, body, **kw)

    kernel.eventlog.append = append  # type: ignore[method-assign]
    failed = await env.send(env.idp(1, hem_urgency="REQUIRED"))
    assert isinstance(failed, Reject) and failed.error_code == "KERNEL_UNAVAILABLE", failed
    sess, _ = await kernel.state.session(AGENT, "s-1")
    assert (sess.state, sess.hem_moment_id) == ("ACTIVE", None)
    kernel.eventlog.append = real  # type: ignore[method-assign]
    assert isinstance(await env.send(env.idp(2, "ReadBooking")), Permit)


async def _gaps(env: Env, steps: int) -> list[BindingMomentItem]:
    """``steps`` escalations queued in one session, in order: a permitted step reported naming another action (a
    commitment gap), then reported again differently (a second report). A report of another permit while the first
    escalation is pending is refused, not a second gap (spec 003 §4.4; tests/test_kernel_holds.py)."""
    rec = env.idp(1)
    assert isinstance(await env.send(rec), Permit)
    items: list[BindingMomentItem] = []
    for i in range(steps):
        await env.report(rec["idp_id"], f"DeleteEverything{i or ''}")
        # The moment is dispatched after the escalation is stored (log, session and hold).
        items.append(await _moment(Surface(env.nc, PRINCIPAL), rec["idp_id"], {m.moment_id for m in items}))
    return items


async def test_a_new_session_does_not_escape_an_escalation(env: Env) -> None:
    """After a commitment gap, a new session_id of the same agent on the same governed object is held HEM_PENDING, under
    the same or another mandate; once the principal denies the gap, every session of that mandate is SESSION_TERMINATED
    (spec 003 §4.2, §5.5.2)."""
    [item] = await _gaps(env, 1)
    fresh = await env.send(env.idp(1, "ReadBooking", session="s-new"))
    assert isinstance(fresh, EnrichedDeny) and fresh.deny_code == "HEM_PENDING", fresh
    token2, jti2 = env.issuer.mandate(agent=AGENT, so_id=env.so, principal=PRINCIPAL)
    other = idp(so_id=env.so, mandate_id=jti2, step=1, action="ReadBooking", session="s-other")
    held = await request(env.nc, AGENT, {"mandate": token2, "idp": other})
    assert isinstance(held, EnrichedDeny) and held.deny_code == "HEM_PENDING", held

    assert (await Surface(env.nc, PRINCIPAL).resolve(item.moment_id, OptionChoice(index=1))).status == "accepted"
    await env.watch.wait("HEM_RESOLVED", lambda ev: ev["body"]["moment_id"] == item.moment_id)
    for session in ("s-new", "s-newer"):
        r = await env.send(env.idp(1, "ReadBooking", session=session))
        assert isinstance(r, Reject) and r.error_code == "SESSION_TERMINATED", (session, r)
    # The termination ends that mandate; a mandate issued apart from it is a new authorisation.
    assert isinstance(await request(env.nc, AGENT, {"mandate": token2, "idp": other}), Permit)


async def test_a_second_gap_does_not_erase_the_answer_to_the_first(env: Env) -> None:
    """Two gaps in one session queue two moments: the principal's deny of the first is logged and ends the session
    even though the second, answered after it, is approved (spec 003 §5.5.2)."""
    first, second = await _gaps(env, 2)
    assert first.moment_id != second.moment_id

    surface = Surface(env.nc, PRINCIPAL)
    assert (await surface.resolve(first.moment_id, OptionChoice(index=1))).status == "accepted"
    denied = await env.watch.wait("HEM_RESOLVED", lambda ev: ev["body"]["moment_id"] == first.moment_id)
    assert denied["body"]["decision"] == "deny"
    assert (await surface.resolve(second.moment_id, OptionChoice(index=0))).status == "accepted"
    approved = await env.watch.wait("HEM_RESOLVED", lambda ev: ev["body"]["moment_id"] == second.moment_id)
    assert approved["body"]["decision"] == "approve"
    r = await env.send(env.idp(2, "ReadBooking"))
    assert isinstance(r, Reject) and r.error_code == "SESSION_TERMINATED", r


async def test_the_session_is_held_until_every_queued_escalation_is_answered(env: Env) -> None:
    """With two gaps queued, approving one leaves the session HEM_PENDING; approving the other frees it (spec 003 §5.5.2)."""
    first, second = await _gaps(env, 2)
    surface = Surface(env.nc, PRINCIPAL)
    assert (await surface.resolve(second.moment_id, OptionChoice(index=0))).status == "accepted"
    await env.watch.wait("HEM_RESOLVED", lambda ev: ev["body"]["moment_id"] == second.moment_id)
    r = await env.send(env.idp(2, "ReadBooking"))
    assert isinstance(r, EnrichedDeny) and r.deny_code == "HEM_PENDING", r
    assert (await surface.resolve(first.moment_id, OptionChoice(index=0))).status == "accepted"
    await env.watch.wait("HEM_RESOLVED", lambda ev: ev["body"]["moment_id"] == first.moment_id)
    assert isinstance(await env.send(env.idp(2, "ReadBooking")), Permit)


async def test_a_second_report_past_the_duplicate_window_is_a_critical_finding(env: Env) -> None:
    """A second, different report of one IDP arriving after the event log's duplicate window has forgotten the first
    STATE_TRANSITIONED writes no second STATE_TRANSITIONED (each is followed by its verification, spec 003 §5.3, §5.5):
    it is logged as a CRITICAL finding and the session goes to HEM."""
    kernel = next(p for p in env.gw.parts if isinstance(p, KernelService))
    rec = env.idp(1)
    assert isinstance(await env.send(rec), Permit)
    await env.report(rec["idp_id"], "CloseBooking")
    await env.watch.wait("IDP_COMMITMENT_VERIFIED", lambda ev: ev["body"]["record"]["idp_id"] == rec["idp_id"])
    real = kernel.eventlog.append

    async def past_the_window(event_type: str, body: Any, *, msg_id: str, **kw: Any) -> Any:
        # The server has forgotten the first STATE_TRANSITIONED's Nats-Msg-Id: an append is stored anew.
        if event_type == "STATE_TRANSITIONED":
            msg_id = f"{msg_id}-after-window"
        return await real(event_type, body, msg_id=msg_id, **kw)

    kernel.eventlog.append = past_the_window  # type: ignore[method-assign]
    await env.report(rec["idp_id"], "DeleteEverything")
    refused = await env.watch.wait("TRANSITION_REFUSED", lambda ev: ev["body"]["idp_id"] == rec["idp_id"])
    assert refused["body"]["alert"] == {"severity": "CRITICAL", "alert_trigger": "TRANSITION_REPORTED_TWICE"}
    assert refused["body"]["executed_action"] == "DeleteEverything"
    esc = await env.watch.wait("HEM_ESCALATED", lambda ev: ev["body"]["trigger"] == "TRANSITION_REPORTED_TWICE")
    assert esc["body"]["executed_action"] == "DeleteEverything"
    item = await _moment(Surface(env.nc, PRINCIPAL), rec["idp_id"])
    assert "DeleteEverything" in item.binding_moment.findings[0]  # what happened, first (the synopsis commits)
    transitioned = await read_log(env.js, "STATE_TRANSITIONED")
    assert len(transitioned) == 1
    verified = await read_log(env.js, "IDP_COMMITMENT_VERIFIED") + await read_log(env.js, "IDP_COMMITMENT_GAP")
    assert len(verified) == len(transitioned)
    blocked = await env.send(env.idp(2, "ReadBooking"))
    assert isinstance(blocked, EnrichedDeny) and blocked.deny_code == "HEM_PENDING"


async def test_the_hold_is_rebuilt_from_the_log(make_config: Any, nc: Any, tmp_path: Path) -> None:
    """With PGW_KERNEL lost, the rebuild from the log holds a new session of the escalated object again, and after the
    principal's deny it rebuilds the mandate's termination (spec 003 §8.4, §5.5.2)."""
    issuer = Issuer(tmp_path / "issuer")
    cfg = make_config(
        kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path))},
        agents={AGENT: {"principals": [PRINCIPAL]}},
    )
    watch = LogWatch()
    await watch.start(nc)
    js = nc.jetstream()
    async with running_gateway(cfg, nc) as gw:
        env = Env(nc, gw, issuer, watch)
        [item] = await _gaps(env, 1)
    await js.delete_key_value("PGW_KERNEL")
    async with running_gateway(cfg, nc):
        held = await env.send(env.idp(1, "ReadBooking", session="s-new"))
        assert isinstance(held, EnrichedDeny) and held.deny_code == "HEM_PENDING", held
        assert (await Surface(nc, PRINCIPAL).resolve(item.moment_id, OptionChoice(index=1))).status == "accepted"
        await watch.wait("HEM_RESOLVED", lambda ev: ev["body"]["moment_id"] == item.moment_id)
    await js.delete_key_value("PGW_KERNEL")
    async with running_gateway(cfg, nc):
        r = await env.send(env.idp(1, "ReadBooking", session="s-newer"))
        assert isinstance(r, Reject) and r.error_code == "SESSION_TERMINATED", r


async def test_a_session_stored_before_queues_is_held_and_settled(env: Env) -> None:
    """A session record written before escalations queued (HEM_PENDING with one hem_moment_id, no hem_queue) still
    denies HEM_PENDING, and the answer to its moment is logged and frees it."""
    kernel = next(p for p in env.gw.parts if isinstance(p, KernelService))
    idp_id, moment_id = str(uuid.uuid4()), stable_id("hem", "legacy")
    legacy = {"agent": AGENT, "session_id": "s-old", "last_step": 1, "state": "HEM_PENDING", "hem_idp_id": idp_id,
              "hem_moment_id": moment_id, "hem_trigger": "HEM_URGENCY_REQUIRED", "hem_principal": PRINCIPAL}
    await kernel.state.kv.put(session_key(AGENT, "s-old"), msgspec.json.encode(legacy))
    r = await env.send(env.idp(2, "ReadBooking", session="s-old"))
    assert isinstance(r, EnrichedDeny) and r.deny_code == "HEM_PENDING", r
    await kernel._apply_hem(AGENT, "s-old", idp_id, moment_id, "deny")
    resolved = await env.watch.wait("HEM_RESOLVED", lambda ev: ev["body"]["moment_id"] == moment_id)
    assert resolved["body"]["decision"] == "deny"
    assert isinstance(await env.send(env.idp(2, "ReadBooking", session="s-old")), Permit)
