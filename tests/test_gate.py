"""Governed actions transit the gate (spec 003 §5.1, §8.7; spec 004 §5.2; docs/gate.md).

A real gateway with the IDP kernel, a real executor built with the SDK of
``subjects/executor.py`` (the worked example of docs/gate.md), Cedar and Ed25519,
against a real nats-server: the agent submits the transition and the
arguments on ``agent.{agent}.act``; the kernel dispatches the action itself
and records what it observed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from consumers import capsule_v4
from consumers.capsule_map import capsule_from_verdict
from consumers.signer import Signer
from consumers.verifier import payload_of, verify_many
from gateway.kernel.gate import _od_dec
from pgwcore.kvread import MARKER_KEEP_S, kv_keys
from subjects.client import Agent, Surface
from subjects.executor import ActionError, Executor
from subjects.gate import ActDispatched, ActDone, act_result_decoder, idempotency_key
from subjects.idp import EnrichedDeny, HemPending, Permit, Reject, json_digest
from subjects.wire import ActionResult, OptionChoice
from tests import refverifier
from tests.kernel_support import (
    Issuer,
    idp,
    policy_dir,
    read_log,
    read_verdicts,
    running_gateway,
    stored_verdicts,
)
from tests.polling import until
from tests.test_capsule_signer import signer_keys, stream_items
from tests.test_kernel_hem import LogWatch, _moment

AGENT, PRINCIPAL = "bot", "alice"
SECRET = "sk-live-4f9a1c77e2"  # a configured secret (pipeline.secrets): SR-1 keeps it off the surface
GATE_DOC = Path(__file__).resolve().parent.parent / "docs" / "gate.md"
ACTIONS = ["WriteNote", "FailNote", "SlowNote", "ReadBooking", "CloseBooking"]
POLICY = """
permit(principal, action == Action::"WriteNote", resource);
permit(principal, action == Action::"FailNote", resource);
permit(principal, action == Action::"SlowNote", resource);
permit(principal, action == Action::"ReadBooking", resource);
permit(principal, action == Action::"CloseBooking", resource);
"""


class NotesExecutor:
    """The example executor (docs/gate.md, "An executor and an agent, in Python"): writes notes, fails on FailNote, hangs on SlowNote."""

    def __init__(self, nc: Any) -> None:
        self.notes: dict[str, str] = {}
        self.calls: list[str] = []
        self.release = asyncio.Event()
        self.ex = Executor(nc, "notes")

        @self.ex.action("WriteNote")
        async def write(args: dict[str, Any], req: Any) -> Any:
            self.calls.append(req.idempotency_key)
            self.notes[args["name"]] = args["text"]
            return {"written": len(args["text"]), "name": args["name"]}

        @self.ex.action("FailNote")
        async def fail(args: dict[str, Any]) -> Any:
            raise ActionError("NOTE_LOCKED", f"note {args['name']} is locked")

        @self.ex.action("SlowNote")
        async def slow(args: dict[str, Any]) -> Any:
            await self.release.wait()
            return {"late": True}


async def _act_patched(genv: Any, action: str, arguments: dict[str, Any], *, reached: asyncio.Event | None = None,
                       **patches: Any) -> Any:
    """One act with kernel methods replaced (fault injection: a gateway dying at that point), put back
    before it returns; with ``reached``, only once the fault has been reached (the tail runs after the
    answer, so the answer alone does not say the replaced method was called)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, fn in patches.items():
            mp.setattr(kernel(genv), name, fn)
        r = await genv.act(action, arguments)
        if reached is not None:
            await asyncio.wait_for(reached.wait(), 10)
        return r


def kernel(env: Any) -> Any:
    from gateway.kernel.service import KernelService

    return next(p for p in env.gw.parts if isinstance(p, KernelService))


class GateEnv:
    def __init__(self, nc: Any, gw: Any, issuer: Issuer, watch: LogWatch, notes: NotesExecutor) -> None:
        self.nc, self.gw, self.issuer, self.watch, self.notes = nc, gw, issuer, watch, notes
        self.js = nc.jetstream()
        self.so = str(uuid.uuid4())
        self.token, self.jti = issuer.mandate(agent=AGENT, so_id=self.so, principal=PRINCIPAL, actions=ACTIONS)
        self.step = 0

    def idp(self, action: str, **over: Any) -> dict[str, Any]:
        self.step += 1
        return idp(so_id=self.so, mandate_id=self.jti, step=self.step, action=action, **over)

    async def act(self, action: str, arguments: dict[str, Any], rec: dict[str, Any] | None = None) -> Any:
        rec = rec or self.idp(action)
        body = {"mandate": self.token, "action": action, "idp": rec, "arguments": arguments}
        msg = await self.nc.request(f"pgw.agent.{AGENT}.act", msgspec.json.encode(body), timeout=15)
        return act_result_decoder.decode(msg.data)


def gate_config(make_config: Any, issuer: Issuer, tmp_path: Path, **executor: Any) -> Any:
    """The gate's sweep runs at start only (``gate_sweep_s = 0``): the tests drive it with ``gate_sweep()``, and a
    background pass that held a key meanwhile made a driven pass skip it (a flaky ``== 1``, a step still
    ``permitted``)."""
    notes = {"actions": ["WriteNote", "FailNote", "SlowNote"], "timeout_s": 1.0, **executor}
    return make_config(
        kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path, POLICY)),
                "executors": {"notes": notes}, "gate_sweep_s": 0},
        agents={AGENT: {"principals": [PRINCIPAL]}},
        pipeline={"secrets": {"values": [SECRET]}},
    )


@pytest.fixture
async def genv(make_config: Any, nc: Any, tmp_path: Path) -> AsyncIterator[GateEnv]:
    """A gateway whose kernel dispatches WriteNote/FailNote/SlowNote to the notes executor."""
    issuer = Issuer(tmp_path / "issuer")
    watch = LogWatch()
    await watch.start(nc)
    notes = NotesExecutor(nc)
    async with notes.ex, running_gateway(gate_config(make_config, issuer, tmp_path), nc) as gw:
        try:
            yield GateEnv(nc, gw, issuer, watch, notes)
        finally:
            notes.release.set()


def _reference_accepts(items: list[Any]) -> None:
    """The reference verifier of format "2" (0.1.0) accepts every capsule of the store, with no error finding."""
    payloads = [p for p in (payload_of(d) for _, d, _ in items) if p and "statement_type" not in p and "capsule_id" in p]
    ref = refverifier.run(payloads, version="0.1.0")
    bad = [(x.capsule_id, f.code) for x in ref for f in x.findings if f.severity == "error" or "overclaim" in f.code]
    assert ref and all(x.ok for x in ref) and not bad, bad


async def _events(js: Any, event_type: str, idp_id: str) -> list[tuple[int, Any]]:
    return [(seq, ev) for seq, ev in await read_log(js, event_type)
            if ev.body.get("idp_id", ev.body.get("record", {}).get("idp_id")) == idp_id]


async def _seq_of(js: Any, event_type: str, idp_id: str) -> int | None:
    got = await _events(js, event_type, idp_id)
    return got[0][0] if got else None


async def _event(js: Any, event_type: str, idp_id: str) -> Any:
    # The records after STATE_TRANSITIONED are written just after the agent's answer (docs/gate.md).
    async def found() -> Any:
        got = await _events(js, event_type, idp_id)
        return got[0][1] if got else None

    return await until(found, timeout=10, what=f"{event_type} for {idp_id}")


async def _capsule(env: GateEnv, idp_id: str, fmt: str, verdict_class: str = "executed") -> tuple[dict[str, Any], list[Any]]:
    config = msgspec.structs.replace(env.gw.config, signer=msgspec.structs.replace(env.gw.config.signer, capsule_format=fmt))

    def mine(p: dict[str, Any]) -> bool:
        return p.get("action_id") == idp_id and p.get("action_type") != "fyi" and "statement_type" not in p \
            and p["disposition"].get("verdict_class", "executed") == verdict_class

    async def found() -> list[Any] | None:
        items = await stream_items(env.js, "PGW_REGISTRATION")
        return items if any(mine(payload_of(d) or {}) for _, d, _ in items) else None

    async with Signer(config, env.nc):
        items = await until(found, timeout=20, what=f"the {verdict_class} capsule of {idp_id}")
    return next(p for p in (payload_of(d) or {} for _, d, _ in items) if mine(p)), items


async def test_permitted_action_runs_once_at_the_executor_and_is_gate_executed(genv: GateEnv) -> None:
    """PERMIT on agent.{agent}.act: the executor runs once, the agent gets its result, and the log and the
    verdict record kernel_dispatched / gate_executed / confirmed with the digest of the response the agent got."""
    r = await genv.act("WriteNote", {"name": "todo", "text": "buy milk"})
    assert isinstance(r, ActDone), r
    assert r.status == "confirmed" and r.response == {"written": 8, "name": "todo"}
    assert r.response_digest == json_digest(r.response)
    assert genv.notes.notes == {"todo": "buy milk"} and len(genv.notes.calls) == 1
    assert genv.notes.calls[0] == idempotency_key(genv.so, r.idp_id)
    disp = await _event(genv.js, "GATE_DISPATCHED", r.idp_id)
    assert disp.body["executor"] == "notes" and disp.body["idempotency_key"] == genv.notes.calls[0]
    st = await _event(genv.js, "STATE_TRANSITIONED", r.idp_id)
    assert st.body["executed_action_source"] == "kernel_dispatched"
    assert st.body["effect_attestation"] == "gate_executed"
    assert st.body["effect"]["status"] == "confirmed" and st.body["effect"]["response_digest"] == r.response_digest
    assert st.body["effect"]["request_digest"] == disp.body["request_digest"]
    ver = await _event(genv.js, "IDP_COMMITMENT_VERIFIED", r.idp_id)
    assert ver.body["record"]["executed_action_source"] == "kernel_dispatched"
    assert ver.body["record"]["match_result"] == "MATCHED" and ver.body["record"]["executed_action"] == "WriteNote"
    v = (await stored_verdicts(genv.js, "executed", lambda v: v.idp_id == r.idp_id))[0]
    assert v.verdict_id == r.verdict_id and v.details["effect_attestation"] == "gate_executed"
    # the open dispatch is closed: nothing left for the sweep
    assert await kernel(genv).gate_sweep() == 0
    # its key's delete marker stays a while, then a sweep removes it for good (every sweep would read it again)
    key = idempotency_key(genv.so, r.idp_id)
    assert await kv_keys(genv.js, "PGW_KERNEL_GATE", key) == [key]
    await kernel(genv).gate_sweep(now=time.time() + MARKER_KEEP_S + 1)
    assert await kv_keys(genv.js, "PGW_KERNEL_GATE", key) == []
    # the executor is a services-API service: `nats micro ls` lists pgw-exec-notes
    ping = msgspec.json.decode((await genv.nc.request("$SRV.PING.pgw-exec-notes", b"", timeout=5)).data)
    assert ping["name"] == "pgw-exec-notes" and ping["metadata"]["kind"] == "notes"


@pytest.mark.parametrize("fmt", ["2", "4"])
async def test_gate_executed_capsule_in_both_formats_and_reference_verifiers(genv: GateEnv, fmt: str) -> None:
    """The capsule of a gated action says executed, confirmed with the digest of the response the agent got,
    and gate_executed, in format "2" and "4"; our verifier and the reference verifier of that format accept it."""
    from tests.test_capsule_format4 import NEWEST

    r = await genv.act("WriteNote", {"name": f"n{fmt}", "text": "hello"})
    assert isinstance(r, ActDone) and r.status == "confirmed"
    cap, items = await _capsule(genv, r.idp_id, fmt)
    assert cap["format_version"] == fmt
    assert cap["effect"]["status"] == "confirmed"
    assert cap["effect"]["effect_attestation"] == "gate_executed"
    assert cap["effect"]["response_digest"] == r.response_digest
    assert cap["assurance"]["effect_mode"] == "confirmed"
    config = msgspec.structs.replace(genv.gw.config, signer=msgspec.structs.replace(genv.gw.config.signer, capsule_format=fmt))
    results = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(config))
    assert all(r.ok for r in results), [(x.source, x.findings) for x in results if not x.ok]
    assert any(x.capsule_id == cap["capsule_id"] and x.effect_grade == "gate_executed" for x in results)
    payloads = [p for p in (payload_of(d) for _, d, _ in items) if p and "statement_type" not in p and "capsule_id" in p]
    ref = refverifier.run(payloads, version="0.1.0" if fmt == "2" else NEWEST)
    bad = [(x.capsule_id, f.code, f.severity) for x in ref for f in x.findings
           if f.severity == "error" or "overclaim" in f.code]
    assert ref and all(x.ok for x in ref) and not bad, bad


async def test_pgw_verify_shows_the_grade(genv: GateEnv, capsys: Any) -> None:
    """`pgw verify` prints effect=confirmed effect_attestation=gate_executed for a gated action's capsule."""
    import argparse

    from pgwcli.commands import capsules as cli

    r = await genv.act("WriteNote", {"name": "v", "text": "x"})
    assert isinstance(r, ActDone)
    await _capsule(genv, r.idp_id, "2")
    config = msgspec.structs.replace(genv.gw.config, signer=msgspec.structs.replace(genv.gw.config.signer, capsule_format="2"))
    capsys.readouterr()
    args = argparse.Namespace(paths=[], stream=["PGW_REGISTRATION"], key=[], ts_key=[], store=[], json=False)
    assert await cli.handle_verify(args, config) == 0
    out = capsys.readouterr().out
    assert "effect=confirmed effect_attestation=gate_executed" in out, out


async def test_executor_error_is_failed(genv: GateEnv) -> None:
    """An executor that answers with an error: the agent gets DONE failed with the error object, the log and the
    capsule say failed (gate_executed), never confirmed."""
    r = await genv.act("FailNote", {"name": "x"})
    assert isinstance(r, ActDone) and r.status == "failed"
    assert r.response == {"code": "NOTE_LOCKED", "message": "note x is locked"}
    st = await _event(genv.js, "STATE_TRANSITIONED", r.idp_id)
    assert st.body["effect"]["status"] == "failed" and st.body["effect_attestation"] == "gate_executed"
    cap, items = await _capsule(genv, r.idp_id, "2")
    assert cap["effect"]["status"] == "failed" and cap["effect"]["effect_attestation"] == "gate_executed"
    assert cap["assurance"]["effect_mode"] == "dispatched_unconfirmed"
    assert cap["effect"]["response_digest"] == json_digest(r.response)
    _reference_accepts(items)


async def test_executor_timeout_is_dispatched_unconfirmed_never_confirmed(genv: GateEnv) -> None:
    """An executor that does not answer in time: DISPATCHED to the agent, a timeout capsule with
    dispatched_unconfirmed (gate_executed), and no confirmed effect anywhere while the result is unknown."""
    r = await genv.act("SlowNote", {"name": "s"})
    assert isinstance(r, ActDispatched)
    cap, items = await _capsule(genv, r.idp_id, "2", verdict_class="timeout")
    _reference_accepts(items)
    assert cap["effect"]["status"] == "dispatched" and "response_digest" not in cap["effect"]
    assert cap["effect"]["effect_attestation"] == "gate_executed"
    assert cap["assurance"]["effect_mode"] == "dispatched_unconfirmed"
    assert [ev for _s, ev in await read_log(genv.js, "STATE_TRANSITIONED") if ev.body["idp_id"] == r.idp_id] == []
    v4 = capsule_v4.from_verdict(
        (await stored_verdicts(genv.js, "timeout", lambda v: v.idp_id == r.idp_id))[0], operator="acme", salt="s" * 32
    ).body
    assert v4["effect"]["status"] == "dispatched" and v4["assurance"]["effect_mode"] == "dispatched_unconfirmed"


async def test_late_result_after_timeout_is_recorded_and_reaches_the_agent(genv: GateEnv) -> None:
    """A result that comes after the timeout is found by the sweep (the executor's _result endpoint): recorded
    confirmed, its executed verdict supersedes the timeout, and the agent gets it as an action_result outcome."""
    agent = Agent(genv.nc, AGENT)
    try:
        r = await genv.act("SlowNote", {"name": "s"})
        assert isinstance(r, ActDispatched)
        genv.notes.release.set()

        async def swept() -> Any:
            await kernel(genv).gate_sweep()
            got = [v for v in await stored_verdicts(genv.js, "*") if v.idp_id == r.idp_id and v.verdict_class == "executed"]
            return got or None

        executed = (await until(swept, timeout=15, what="the late result recorded"))[0]
        assert executed.supersedes == r.verdict_id and executed.effect.status == "confirmed"
        # Asked for by the id in another spelling (spec 003 §4.2: a UUID's hex digits are case-insensitive).
        out = await agent.action_result(r.idp_id.upper(), timeout=10)
        assert out.status == "confirmed" and out.response == {"late": True}
        assert out.response_digest == json_digest({"late": True})
    finally:
        await agent.close()


async def test_hem_approval_dispatches_and_the_result_is_an_outcome(genv: GateEnv) -> None:
    """hem_urgency REQUIRED on a gated action: HEM_PENDING, nothing runs; after the principal approves the
    kernel dispatches it once and the agent gets the result as an action_result outcome."""
    agent = Agent(genv.nc, AGENT)
    try:
        rec = genv.idp("WriteNote", hem_urgency="REQUIRED")
        r = await agent.act(genv.token, "WriteNote", rec, {"name": "hem", "text": "approved"})
        assert isinstance(r, HemPending)
        assert genv.notes.calls == []
        item = await _moment(Surface(genv.nc, PRINCIPAL), rec["idp_id"])
        assert (await Surface(genv.nc, PRINCIPAL).resolve(item.moment_id, OptionChoice(index=0))).status == "accepted"

        async def first() -> ActionResult:
            async for o in agent.outcomes():
                if isinstance(o, ActionResult) and o.idp_id == rec["idp_id"]:
                    return o
            raise AssertionError("outcomes ended")

        out = await asyncio.wait_for(first(), 15)
        assert out.status == "confirmed" and out.response == {"written": 8, "name": "hem"}
        assert genv.notes.notes == {"hem": "approved"} and len(genv.notes.calls) == 1
        v = (await stored_verdicts(genv.js, "executed", lambda v: v.idp_id == rec["idp_id"]))[0]
        assert v.approver == "human" and v.human_disposed and v.details["effect_attestation"] == "gate_executed"
    finally:
        await agent.close()


async def test_hem_rejection_does_not_run(genv: GateEnv) -> None:
    """A gated action the principal rejects never reaches the executor; the agent gets action_result not_run."""
    agent = Agent(genv.nc, AGENT)
    try:
        rec = genv.idp("WriteNote", hem_urgency="REQUIRED")
        assert isinstance(await genv.act("WriteNote", {"name": "no", "text": "rejected"}, rec), HemPending)
        item = await _moment(Surface(genv.nc, PRINCIPAL), rec["idp_id"])
        assert (await Surface(genv.nc, PRINCIPAL).resolve(item.moment_id, OptionChoice(index=1))).status == "accepted"

        async def first() -> ActionResult:
            async for o in agent.outcomes():
                if isinstance(o, ActionResult) and o.idp_id == rec["idp_id"]:
                    return o
            raise AssertionError("outcomes ended")

        out = await asyncio.wait_for(first(), 15)
        assert out.status == "not_run"
        assert genv.notes.calls == [] and genv.notes.notes == {}
        assert await kernel(genv).gate_sweep() == 0
    finally:
        await agent.close()


async def test_hem_moment_shows_the_arguments_redacted_and_bounded(genv: GateEnv) -> None:
    """The principal's moment for a gated action lists each argument the executor will get as a finding, with a
    configured secret redacted, a long value previewed with its length said and past twelve arguments a count (every
    value attached whole), within spec 000's grammar."""
    from gateway.stages.moment_grammar import SLOT_MAX, check_binding_moment
    from subjects.constraints import MAX_LIST_ITEMS

    rec = genv.idp("WriteNote", hem_urgency="REQUIRED")
    extra = {f"k{i:02}": "x" * 3000 for i in range(20)}
    args = {"name": "plan", "text": f"use key {SECRET} today", **extra}
    assert isinstance(await genv.act("WriteNote", args, rec), HemPending)
    findings = (await _moment(Surface(genv.nc, PRINCIPAL), rec["idp_id"])).binding_moment.findings
    assert 'Argument name: "plan"' in findings
    assert 'Argument text: "use key [REDACTED] today"' in findings
    assert not any(SECRET in f for f in findings)
    assert any(f.startswith('Argument k00 (3,000 characters; the first 300 here, the whole value attached to this card): "xxx')
               and len(f) < 500 for f in findings)
    assert "11 more arguments are attached to this card in full." in findings
    assert len(findings) <= MAX_LIST_ITEMS and all(len(f) <= SLOT_MAX for f in findings)
    moment = (await _moment(Surface(genv.nc, PRINCIPAL), rec["idp_id"])).binding_moment
    assert check_binding_moment(msgspec.to_builtins(moment)) == []
    assert genv.notes.calls == []  # nothing ran while the principal reads


async def test_gated_action_declared_on_the_report_path_is_denied_and_its_report_refused(genv: GateEnv) -> None:
    """An action served by an executor, declared on agent.{agent}.idp, is denied GATE_REQUIRED; a transition
    report claiming it (for a step permitted as something else, for its denied declaration, or for no
    declaration at all) is refused and logged as a CRITICAL GATE_REQUIRED finding, with no STATE_TRANSITIONED."""
    from tests.kernel_support import request

    rec = genv.idp("WriteNote")
    r = await request(genv.nc, AGENT, {"mandate": genv.token, "idp": rec})
    assert isinstance(r, EnrichedDeny) and r.deny_code == "GATE_REQUIRED"
    assert "WriteNote" not in r.available_actions
    ok = genv.idp("CloseBooking")
    assert isinstance(await request(genv.nc, AGENT, {"mandate": genv.token, "idp": ok}), Permit)
    body = {"idp_id": ok["idp_id"], "executed_action": "WriteNote", "effect": {"type": "note", "status": "confirmed",
                                                                               "response": {"written": 1}}}
    await genv.js.publish(f"pgw.agent.{AGENT}.transition", msgspec.json.encode(body),
                          headers={"Nats-Msg-Id": f"{AGENT}:{uuid.uuid4()}"})
    refused = await genv.watch.wait("TRANSITION_REFUSED", lambda ev: ev["body"]["idp_id"] == ok["idp_id"])
    assert refused["body"]["code"] == "GATE_REQUIRED"
    assert refused["body"]["alert"]["severity"] == "CRITICAL"
    # the denied declaration reported anyway, and a claim with no declaration at all: the same finding
    never = str(uuid.uuid4())
    for idp_id in (rec["idp_id"], never):
        body = {"idp_id": idp_id, "executed_action": "WriteNote", "effect": {"type": "note", "status": "dispatched"}}
        await genv.js.publish(f"pgw.agent.{AGENT}.transition", msgspec.json.encode(body),
                              headers={"Nats-Msg-Id": f"{AGENT}:{uuid.uuid4()}"})
        ev = await genv.watch.wait("TRANSITION_REFUSED", lambda ev, i=idp_id: ev["body"]["idp_id"] == i)
        assert ev["body"]["code"] == "GATE_REQUIRED" and ev["body"]["alert"]["alert_trigger"] == "GATE_REQUIRED"
    assert genv.notes.calls == []
    assert [e for _s, e in await read_log(genv.js, "STATE_TRANSITIONED")] == []


async def test_report_for_a_step_the_gate_ran_is_refused(genv: GateEnv) -> None:
    """A transition report for a step the kernel dispatched itself is refused GATE_REQUIRED and logged: the
    kernel's record stands, the agent's word is not taken."""
    r = await genv.act("WriteNote", {"name": "a", "text": "b"})
    assert isinstance(r, ActDone)
    body = {"idp_id": r.idp_id, "executed_action": "WriteNote", "effect": {"type": "note", "status": "failed"}}
    await genv.js.publish(f"pgw.agent.{AGENT}.transition", msgspec.json.encode(body),
                          headers={"Nats-Msg-Id": f"{AGENT}:{uuid.uuid4()}"})
    refused = await genv.watch.wait("TRANSITION_REFUSED", lambda ev: ev["body"]["idp_id"] == r.idp_id)
    assert refused["body"]["code"] == "GATE_REQUIRED"
    sts = [ev for _s, ev in await read_log(genv.js, "STATE_TRANSITIONED") if ev.body["idp_id"] == r.idp_id]
    assert len(sts) == 1 and sts[0].body["effect"]["status"] == "confirmed"


async def test_ungated_actions_keep_the_declare_and_report_path(genv: GateEnv) -> None:
    """An action no executor serves still goes declare -> PERMIT -> report, and its capsule stays runtime_claimed;
    submitted on agent.{agent}.act it is refused with a clear reason."""
    from tests.kernel_support import request

    rec = genv.idp("CloseBooking")
    assert isinstance(await request(genv.nc, AGENT, {"mandate": genv.token, "idp": rec}), Permit)
    body = {"idp_id": rec["idp_id"], "executed_action": "CloseBooking",
            "effect": {"type": "booking.close", "status": "confirmed", "response": {"ok": True}}}
    await genv.js.publish(f"pgw.agent.{AGENT}.transition", msgspec.json.encode(body),
                          headers={"Nats-Msg-Id": f"{AGENT}:{uuid.uuid4()}"})
    v = (await stored_verdicts(genv.js, "executed", lambda v: v.idp_id == rec["idp_id"]))[0]
    assert v.details["executed_action_source"] == "agent_reported"
    cap = capsule_from_verdict(v, operator="acme", salt="s" * 32, chained=False).to_dict()
    assert cap["effect"]["effect_attestation"] == "runtime_claimed"
    refused = await genv.act("CloseBooking", {})
    assert refused.error_code == "REQUEST_MALFORMED" and "no executor serves CloseBooking" in refused.reason
    # Its verdict, as every refusal's (before, this one had none, so no capsule recorded it: a review).
    denied = await stored_verdicts(genv.js, "denied", lambda v: v.reason is not None and
                                   "no executor serves CloseBooking" in v.reason.reason)
    assert len(denied) == 1 and denied[0].reason.code == "REQUEST_MALFORMED" and denied[0].agent == AGENT, denied


def test_only_the_kernels_marker_grades_up() -> None:
    """A verdict claiming gate_executed without the kernel's kernel_dispatched source is graded runtime_claimed."""
    from tests.test_capsule_model import SALT, verdict

    base = {"match_result": "MATCHED", "requested_action": "W", "executed_action": "W"}
    v = verdict("g1", "executed", decision="accept", idp_id="i", action_id="i", action_type="W",
                details={**base, "effect_attestation": "gate_executed", "executed_action_source": "agent_reported"})
    v = msgspec.structs.replace(v, effect=msgspec.convert({"type": "W", "status": "confirmed", "response": {"a": 1}},
                                                          type=type(v.effect) if v.effect else __import__("subjects.wire", fromlist=["ReportedEffect"]).ReportedEffect))
    assert capsule_from_verdict(v, operator="acme", salt=SALT, chained=False).to_dict()["effect"]["effect_attestation"] == "runtime_claimed"
    v2 = msgspec.structs.replace(v, details={**base, "effect_attestation": "gate_executed", "executed_action_source": "kernel_dispatched"})
    assert capsule_from_verdict(v2, operator="acme", salt=SALT, chained=False).to_dict()["effect"]["effect_attestation"] == "gate_executed"


async def test_documented_executor_example_runs(make_config: Any, nc: Any, tmp_path: Path) -> None:
    """docs/gate.md's executor example, run against a real gateway, returns what the page says."""
    import re

    section = GATE_DOC.read_text().split("## An executor and an agent, in Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    issuer = Issuer(tmp_path / "issuer")
    cfg = make_config(kernel={"issuers": {issuer.kid: str(issuer.pem_path)},
                              "policy_dir": str(policy_dir(tmp_path, POLICY)),
                              "executors": {"notes": {"actions": ["WriteNote"], "timeout_s": 10.0}}})
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent="bot", so_id=so, principal=PRINCIPAL, actions=["WriteNote"])
    ns: dict[str, Any] = {}
    exec(compile(code, "docs/gate.md", "exec"), ns)
    async with running_gateway(cfg, nc):
        got = await ns["main"](nc, token, so, jti)
    assert got == ("ActDone", "confirmed", {"written": 8}, {"todo": "buy milk"})


async def test_executor_sdk_runs_a_key_at_most_once(nc: Any) -> None:
    """The SDK claims a key before running: a repeated dispatch gets the stored answer without a second run, a key
    whose run has not finished answers `running`, and `_result` says `unknown` for a key never seen."""
    from subjects.gate import ExecRequest, ExecResponse, ResultQuery
    from subjects.names import Subjects

    s = Subjects()
    runs: list[str] = []
    gate = asyncio.Event()
    async with Executor(nc, "sdk") as ex:

        @ex.action("Do")
        async def do(args: dict[str, Any]) -> Any:
            runs.append(args["k"])
            if args["k"] == "slow":
                await gate.wait()
            return {"did": args["k"]}

        async def call(key: str, k: str) -> ExecResponse:
            req = ExecRequest(idempotency_key=key, action="Do", arguments={"k": k}, idp_id="i", so_id="s", agent="a",
                              principal="p")
            msg = await nc.request(s.exec("sdk", "Do"), msgspec.json.encode(req), timeout=5)
            return msgspec.json.decode(msg.data, type=ExecResponse)

        async def result(key: str) -> ExecResponse:
            msg = await nc.request(s.exec_result("sdk"), msgspec.json.encode(ResultQuery(idempotency_key=key)), timeout=5)
            return msgspec.json.decode(msg.data, type=ExecResponse)

        k1, k2, k3 = "a1" * 16, "b2" * 16, "c3" * 16
        first = await call(k1, "one")
        again = await call(k1, "one")
        assert first == again == ExecResponse(status="ok", result={"did": "one"}) and runs == ["one"]
        assert await result(k1) == first
        assert (await result(k2)).status == "unknown"
        slow = asyncio.ensure_future(call(k3, "slow"))

        async def claimed() -> bool:
            return (await result(k3)).status == "running"

        await until(claimed, timeout=5, what="the slow key claimed")
        # a second executor instance (another process) sees the claim: it never runs the action twice
        async with Executor(nc, "sdk") as other:
            other.handlers["Do"] = do
            assert msgspec.json.decode(await other.run("Do", ExecRequest(
                idempotency_key=k3, action="Do", arguments={"k": "slow"}, idp_id="i", so_id="s", agent="a",
                principal="p")), type=ExecResponse).status == "running"
        gate.set()
        assert (await slow).result == {"did": "slow"} and runs == ["one", "slow"]


async def test_the_sweep_stops_even_when_its_cancel_is_swallowed(genv: GateEnv) -> None:
    """drain() ends the gate sweep even when a cancel is turned into TimeoutError (Python 3.11's wait_for
    race inside a request): the loop reads the stop flag instead of running for ever."""
    k = kernel(genv)
    inside = asyncio.Event()

    async def swallowing(now: float | None = None) -> int:
        """Fault injection: a sweep whose request answers a cancel with TimeoutError, as nats-py's can."""
        inside.set()
        try:
            await asyncio.Event().wait()  # a request that never answers
        except asyncio.CancelledError:
            raise TimeoutError from None
        return 0

    k.gate_sweep = swallowing  # type: ignore[method-assign]
    k.cfg = msgspec.structs.replace(k.cfg, gate_sweep_s=0.2)  # a loop that goes on (genv's sweeps once)
    loop_task = asyncio.create_task(k._gate_loop())
    await asyncio.wait_for(inside.wait(), 10)  # the loop is inside its sweep
    k._stopping = True
    loop_task.cancel()
    await asyncio.wait_for(asyncio.gather(loop_task, return_exceptions=True), 10)
    assert loop_task.done()


async def test_the_answer_follows_the_commitment_record_and_the_sessions_next_step_does_not_wait_for_the_tail(
        genv: GateEnv) -> None:
    """The agent is answered once STATE_TRANSITIONED and its commitment record are durable (both sent in one
    round, the record chained right after the event), before the tail (verdict, index entry, key delete);
    the same session's next act is taken while the tail is still held, and the log already shows the
    previous step's commitment record before the next declaration (spec 003 §5.1 (6), §5.3, §5.5)."""
    k = kernel(genv)
    held = asyncio.Event()
    verdict = k._gate_verdict

    async def held_verdict(*a: Any, **kw: Any) -> Any:
        # Fault injection: the tail's verdict is held until the session's next step is answered.
        await asyncio.wait_for(held.wait(), 10)
        return await verdict(*a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(k, "_gate_verdict", held_verdict)
        r1 = await genv.act("WriteNote", {"name": "one", "text": "1"})
        assert isinstance(r1, ActDone) and r1.status == "confirmed"
        (st1, _), = await _events(genv.js, "STATE_TRANSITIONED", r1.idp_id)
        (v1, ver), = await _events(genv.js, "IDP_COMMITMENT_VERIFIED", r1.idp_id)  # stored before the answer
        assert st1 == r1.event_seq and v1 == st1 + 1
        assert ver.body["record"]["state_transition_seq"] == st1 and ver.body["record"]["match_result"] == "MATCHED"
        assert (await k.gate_kv.get(idempotency_key(genv.so, r1.idp_id))).value  # the tail is held: the key stands
        r2 = await genv.act("WriteNote", {"name": "two", "text": "2"})  # not held up by r1's tail
        assert isinstance(r2, ActDone) and r2.status == "confirmed"
        assert [v for v in await read_verdicts(genv.js, "executed") if v.idp_id == r1.idp_id] == []
        s2 = await _seq_of(genv.js, "IDP_SUBMITTED", r2.idp_id)
        assert s2 is not None and v1 < s2, (v1, s2)
        held.set()
        await stored_verdicts(genv.js, "executed", lambda v: v.idp_id == r1.idp_id)

        async def finished() -> Any:
            got = await k.state.idp(genv.so, r1.idp_id)
            return got if got is not None and got[0].status == "transitioned" else None

        got = await until(finished, timeout=10, what="r1's index entry transitioned")
        assert got[0].verification_seq == v1 and got[0].transition_seq == r1.event_seq


async def test_a_crash_after_the_answer_leaves_the_tail_to_the_sweep(genv: GateEnv) -> None:
    """A gateway that dies right after answering DONE (nothing after STATE_TRANSITIONED written): the
    sweep writes the commitment record, the executed verdict and the index entry once, from the
    open dispatch's key, without running the action again."""
    k = kernel(genv)

    gone = asyncio.Event()

    async def dies(*_a: Any, **_k: Any) -> None:
        gone.set()  # the process is gone: nothing of the tail is written

    r = await _act_patched(genv, "WriteNote", {"name": "crash", "text": "x"}, reached=gone, _gate_tail=dies)
    assert isinstance(r, ActDone) and r.status == "confirmed"
    key = idempotency_key(genv.so, r.idp_id)
    assert (await k.gate_kv.get(key)).value  # the open dispatch stands
    assert len(await _events(genv.js, "IDP_COMMITMENT_VERIFIED", r.idp_id)) == 1  # stored before the answer
    assert [v for v in await read_verdicts(genv.js, "executed") if v.idp_id == r.idp_id] == []
    assert await k.gate_sweep(now=time.time() + 5) == 1
    assert await k.gate_sweep(now=time.time() + 5) == 0  # finished: the key is gone
    assert len(await _events(genv.js, "STATE_TRANSITIONED", r.idp_id)) == 1
    (_s, ver), = await _events(genv.js, "IDP_COMMITMENT_VERIFIED", r.idp_id)
    assert ver.body["record"]["match_result"] == "MATCHED"
    v = await stored_verdicts(genv.js, "executed", lambda v: v.idp_id == r.idp_id)
    assert len(v) == 1 and v[0].verdict_id == r.verdict_id and v[0].details["response_digest"] == r.response_digest
    got = await k.state.idp(genv.so, r.idp_id)
    assert got is not None and got[0].status == "transitioned" and got[0].verification_seq is not None
    assert genv.notes.calls == [key]  # ran once


async def test_a_crash_before_the_index_entry_is_moved_on_by_the_sweep(genv: GateEnv) -> None:
    """A gated permit's index entry is stored ``dispatched`` by the permit's own round, with the open
    dispatch. An entry that still says ``permitted`` beside an open dispatch (an index rebuilt from the
    log after a crash between CEDAR_PERMIT_RECORDED and GATE_DISPATCHED, or written before this round
    stored it so) is moved on by the sweep's next pass at once, and the step is recorded once after
    the executor's timeout."""
    k = kernel(genv)

    tail_gone = asyncio.Event()

    async def tail_lost(*_a: Any, **_k: Any) -> None:
        tail_gone.set()

    r = await _act_patched(genv, "WriteNote", {"name": "early", "text": "y"}, reached=tail_gone, _gate_tail=tail_lost)
    assert isinstance(r, ActDone) and r.status == "confirmed"
    got = await k.state.idp(genv.so, r.idp_id)
    assert got is not None and got[0].status == "dispatched"  # stored so with the permit
    # The index as a rebuild from the log leaves it when the bucket lagged: the permit only.
    await k.state.put_idp(msgspec.structs.replace(got[0], status="permitted"), got[1])
    assert await k.gate_sweep() == 0  # within the executor's timeout: not finished yet, but...
    got = await k.state.idp(genv.so, r.idp_id)
    assert got is not None and got[0].status == "dispatched"  # ...no longer a permit waiting for a report
    assert await k.gate_sweep(now=time.time() + 5) == 1
    got = await k.state.idp(genv.so, r.idp_id)
    assert got is not None and got[0].status == "transitioned" and got[0].transition_seq == r.event_seq
    assert len(await _events(genv.js, "STATE_TRANSITIONED", r.idp_id)) == 1
    assert len(await _events(genv.js, "IDP_COMMITMENT_VERIFIED", r.idp_id)) == 1
    assert len(await stored_verdicts(genv.js, "executed", lambda v: v.idp_id == r.idp_id)) == 1
    assert genv.notes.calls == [idempotency_key(genv.so, r.idp_id)]


async def test_a_crash_before_gate_dispatched_is_stored_is_logged_by_the_sweep_first(genv: GateEnv) -> None:
    """GATE_DISPATCHED is written while the executor works: a gateway that dies after the request left
    and before GATE_DISPATCHED was stored leaves the open dispatch, and the sweep logs GATE_DISPATCHED
    once, before the step's STATE_TRANSITIONED, without running the action again."""
    k = kernel(genv)
    real = k._log_dispatch

    async def ran() -> bool:
        return bool(genv.notes.calls)

    async def dies(*_a: Any, **_k: Any) -> None:
        await until(ran, timeout=10, what="the executor ran the action")
        raise RuntimeError("the gateway died before GATE_DISPATCHED was stored")

    r = await _act_patched(genv, "WriteNote", {"name": "lost-log", "text": "z"}, _log_dispatch=dies)
    assert isinstance(r, Reject) and r.error_code == "KERNEL_UNAVAILABLE"
    assert k._log_dispatch == real
    key = genv.notes.calls[0]
    idp_id = (_od_dec.decode((await k.gate_kv.get(key)).value)).idp_id
    assert await _events(genv.js, "GATE_DISPATCHED", idp_id) == []
    assert await k.gate_sweep(now=time.time() + 5) == 1
    (gd_seq, _gd), = await _events(genv.js, "GATE_DISPATCHED", idp_id)
    (st_seq, st), = await _events(genv.js, "STATE_TRANSITIONED", idp_id)
    assert gd_seq < st_seq and st.body["effect_attestation"] == "gate_executed"
    assert len(await stored_verdicts(genv.js, "executed", lambda v: v.idp_id == idp_id)) == 1
    assert genv.notes.calls == [key]  # ran once


async def test_the_dispatch_moves_the_index_entry_without_reading_it(genv: GateEnv) -> None:
    """A permitted gated action moves its index entry to ``dispatched`` by one compare-and-set on the
    revision the permit stored it at: the entry is not read between the permit and the answer."""
    k = kernel(genv)
    reads: list[str] = []
    real = k.state.idp

    async def counted(so_id: str, idp_id: str) -> Any:
        reads.append(idp_id)
        return await real(so_id, idp_id)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(k.state, "idp", counted)
        r = await genv.act("WriteNote", {"name": "rev", "text": "r"})
    assert isinstance(r, ActDone) and r.status == "confirmed"
    assert reads == []
    assert await until(lambda: _transitioned(k, genv.so, r.idp_id), timeout=10, what="the entry transitioned")


async def _transitioned(k: Any, so: str, idp_id: str) -> bool:
    got = await k.state.idp(so, idp_id)
    return got is not None and got[0].status == "transitioned"


async def test_a_stale_revision_for_the_dispatch_reads_the_entry_and_never_moves_it_back(genv: GateEnv) -> None:
    """The index entry written since the permit (here: the step already transitioned): the move to
    ``dispatched`` on the permit's revision fails, the entry is read, and it stays ``transitioned``."""
    k = kernel(genv)
    r = await genv.act("WriteNote", {"name": "stale", "text": "s"})
    assert isinstance(r, ActDone)
    await until(lambda: _transitioned(k, genv.so, r.idp_id), timeout=10, what="the entry transitioned")
    (entry, rev) = await k.state.idp(genv.so, r.idp_id)
    d = _od_dec.decode(msgspec.json.encode({
        "idempotency_key": idempotency_key(genv.so, r.idp_id), "state": "dispatched", "kind": "notes",
        "action": "WriteNote", "idp_id": r.idp_id, "so_id": genv.so, "agent": AGENT, "principal": PRINCIPAL,
        "session_id": entry.session_id, "step_sequence": entry.step_sequence, "submitted_seq": entry.submitted_seq}))
    permitted = msgspec.structs.replace(entry, status="permitted", transition_seq=None, verification_seq=None)
    got = await k._index_dispatched(d, (permitted, 1))  # the revision the permit had, long gone
    assert got is not None and got[0].status == "transitioned" and got[1] == rev
    assert (await k.state.idp(genv.so, r.idp_id)) == (entry, rev)  # nothing written


async def test_the_dispatch_uses_the_revision_the_index_entry_was_stored_at_whatever_the_rounds_order(
        genv: GateEnv) -> None:
    """The revision the dispatch moves the index entry on is the one the entry's own write returned, also when the
    permit's round sends its writes in another order (here reversed, their results in that order too)."""
    from gateway.kernel import service

    k = kernel(genv)
    real_round, real_put, real_dispatch = service.gather_inline, k.state.put_idp, k._dispatch
    stored: list[int] = []
    used: list[Any] = []

    async def reversed_round(*aws: Any, **kw: Any) -> list[Any]:
        if kw.get("return_exceptions"):  # the first round (step reservation, IDP_SUBMITTED): as it is
            return await real_round(*aws, **kw)
        return await real_round(*reversed(aws), **kw)  # the permit's round, edited into another order

    async def put_idp(entry: Any, rev: int) -> int:
        new = await real_put(entry, rev)
        if rev == 0:  # the permit's own write of the entry (a gated one stores it ``dispatched`` at once)
            stored.append(new)
        return new

    async def dispatch(d: Any, **kw: Any) -> Any:
        used.append(kw.get("known"))
        return await real_dispatch(d, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service, "gather_inline", reversed_round)
        mp.setattr(k.state, "put_idp", put_idp)
        mp.setattr(k, "_dispatch", dispatch)
        r = await genv.act("WriteNote", {"name": "order", "text": "o"})
    assert isinstance(r, ActDone) and r.status == "confirmed"
    assert len(stored) == 1 and len(used) == 1 and used[0] is not None
    assert used[0][1] == stored[0]
    assert await until(lambda: _transitioned(k, genv.so, r.idp_id), timeout=10, what="the entry transitioned")
