"""Standing approvals of gated actions (docs/gate.md "Standing approvals"; gateway/kernel/scopes.py).

A real gateway with the IDP kernel, Cedar and Ed25519 against a real nats-server, and a real
executor serving MCP-shaped calls (``{"tool", "arguments"}``, as ``pgw mcp-gate`` sends them).
Cedar denies every write, so each call goes as the MCP gate sends it: submitted, refused
``POLICY_DENY`` with ``hem_available``, resubmitted ``hem_urgency: REQUIRED`` and answered by the
principal on her surface; a call inside a standing approval runs on its first submission.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from consumers.capsule_map import capsule_from_verdict
from gateway.kernel import scopes as scopes_mod
from gateway.kernel.eventlog import check_signature, verify_stream
from subjects.approvals import ApprovalsRequest, approvals_reply_decoder, approvals_subject
from subjects.client import Surface
from subjects.executor import Executor
from subjects.gate import ActDone, act_result_decoder
from subjects.idp import EnrichedDeny, HemPending, Permit, Reject
from tests.kernel_support import Issuer, idp, policy_dir, read_log, running_gateway, stored_verdicts
from tests.polling import until
from tests.test_kernel_hem import _moment

PRINCIPAL, AGENT, OTHER = "alice", "bot", "bot2"
POLICY = 'permit(principal, action == Action::"ReadBooking", resource);\n'  # every WriteFile is denied
ALLOW, DENY, SESSION, HOUR = 0, 1, 2, 3


class Files:
    """An MCP-shaped executor: ``WriteFile`` with ``{"tool", "arguments": {"path", "content"}}``."""

    def __init__(self, nc: Any, *, echo: bool = True) -> None:
        """``echo``: its result names the path written (an executor's results are its own to keep)."""
        self.files: dict[str, str] = {}
        self.calls = 0
        self.ex = Executor(nc, "files")

        @self.ex.action("WriteFile")
        async def write(args: dict[str, Any]) -> Any:
            self.calls += 1
            inner = args["arguments"]
            self.files[inner["path"]] = inner["content"]
            return {"content": [{"type": "text", "text": f"wrote {inner['path']}" if echo else "written"}]}


class Env:
    def __init__(self, nc: Any, gw: Any, issuer: Issuer, files: Files) -> None:
        self.nc, self.gw, self.files, self.issuer = nc, gw, files, issuer
        self.js = nc.jetstream()
        self.so = str(uuid.uuid4())
        self.mandates = {a: issuer.mandate(agent=a, so_id=self.so, principal=PRINCIPAL, actions=["WriteFile", "ReadBooking"])
                         for a in (AGENT, OTHER)}
        self.step = 0
        self.surface = Surface(nc, PRINCIPAL)
        self.moments = 0  # moments the principal was asked to answer

    async def act(self, agent: str, args: dict[str, Any], session: str, **over: Any) -> tuple[dict[str, Any], Any]:
        token, jti = self.mandates[agent]
        self.step += 1
        rec = idp(so_id=self.so, mandate_id=jti, step=self.step, action="WriteFile", session=session, **over)
        body = {"mandate": token, "action": "WriteFile", "idp": rec, "arguments": args}
        msg = await self.nc.request(f"pgw.agent.{agent}.act", msgspec.json.encode(body), timeout=15)
        return rec, act_result_decoder.decode(msg.data)

    async def call(self, path: str, *, answer: int | None = ALLOW, tool: str = "write_file", agent: str = AGENT,
                   session: str = "s-1") -> tuple[str, str]:
        """One tool call as pgw mcp-gate makes it: ("ran" | "asked", its idp_id). Asked, the principal answers
        ``answer`` and the call has run (or not) before this returns; ``answer`` None leaves the moment open."""
        args = {"tool": tool, "arguments": {"path": path, "content": f"v{self.step}"}}
        rec, r = await self.act(agent, args, session)
        if isinstance(r, ActDone):
            assert r.status == "confirmed"
            return "ran", rec["idp_id"]
        assert isinstance(r, EnrichedDeny) and r.deny_code == "POLICY_DENY" and r.hem_available, r
        rec, r = await self.act(agent, args, session, hem_urgency="REQUIRED")
        assert isinstance(r, HemPending), r
        self.moments += 1
        item = await _moment(self.surface, rec["idp_id"])
        if answer is not None:
            before = self.files.calls
            assert (await self.surface.choose(item, answer)).status == "accepted"
            if answer != DENY:
                async def ran() -> bool:
                    return self.files.calls > before

                await until(ran, timeout=10, what="the approved call")
        return "asked", rec["idp_id"]

    async def approvals(self, req: ApprovalsRequest, principal: str = PRINCIPAL) -> Any:
        msg = await self.nc.request(approvals_subject("pgw", principal), msgspec.json.encode(req), timeout=10)
        return approvals_reply_decoder.decode(msg.data)


@pytest.fixture
async def env(make_config: Any, nc: Any, tmp_path: Path) -> AsyncIterator[Env]:
    """A gateway whose kernel dispatches WriteFile to the files executor; Cedar denies every WriteFile."""
    issuer = Issuer(tmp_path / "issuer")
    files = Files(nc)
    cfg = make_config(
        kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path, POLICY)),
                "executors": {"files": {"actions": ["WriteFile"], "timeout_s": 2.0}}, "gate_sweep_s": 0},
        agents={AGENT: {"principals": [PRINCIPAL]}, OTHER: {"principals": [PRINCIPAL]}},
    )
    async with files.ex, running_gateway(cfg, nc) as gw:
        yield Env(nc, gw, issuer, files)


def kernel(env: Env) -> Any:
    from gateway.kernel.service import KernelService

    return next(p for p in env.gw.parts if isinstance(p, KernelService))


async def _event(env: Env, event_type: str, **match: Any) -> Any:
    async def found() -> Any:
        return next((ev for _seq, ev in await read_log(env.js, event_type)
                     if all(ev.body.get(k) == v for k, v in match.items())), None)

    return await until(found, timeout=10, what=f"{event_type} {match}")


async def test_the_moment_offers_both_standing_approvals_within_the_grammar(env: Env) -> None:
    """A gated write that names a clean path is offered Approve, Deny, "Allow for this session" and "Allow for an
    hour" (Deny still recommended), naming the tool and the folder, and the moment passes spec 000's grammar and lints."""
    from gateway.stages import lints
    from gateway.stages.moment_grammar import check_binding_moment

    await env.call("/srv/notes/a.md", answer=None)
    item = await _moment(env.surface, (await read_log(env.js, "HEM_ESCALATED"))[-1][1].body["idp_id"])
    q = item.binding_moment.question
    assert [o.label for o in q.options] == ["Approve", "Deny", "Allow for this session", "Allow for an hour"]
    assert q.recommended_idx == DENY
    assert 'write_file by agent bot on files directly in "/srv/notes"' in q.options[SESSION].reasoning
    assert check_binding_moment(msgspec.to_builtins(item.binding_moment)) == []
    assert lints.check(item.binding_moment) == []
    offered = (await read_log(env.js, "HEM_ESCALATED"))[-1][1].body["approval_scope_offered"]
    assert offered["folder"] == "/srv/notes" and offered["tool"] == "write_file"


async def test_a_path_not_in_normal_form_is_offered_no_standing_approval(env: Env) -> None:
    """A call whose path climbs out (``..``) gets only Approve and Deny: nothing would bound a standing approval."""
    await env.call("/srv/notes/../etc/passwd", answer=None)
    item = await _moment(env.surface, (await read_log(env.js, "HEM_ESCALATED"))[-1][1].body["idp_id"])
    assert [o.label for o in item.binding_moment.question.options] == ["Approve", "Deny"]


async def test_session_scope_covers_the_folder_in_this_session_only(env: Env) -> None:
    """"Allow for this session" runs the asked call, then later writes by the same tool to files directly in that
    folder, in that session, run without a moment; a subfolder, another folder, another tool, another agent or
    another session still asks."""
    assert (await env.call("/srv/notes/a.md", answer=SESSION))[0] == "asked"
    assert env.files.files["/srv/notes/a.md"]
    for name in ("b.md", "c.md", "a.md"):
        assert (await env.call(f"/srv/notes/{name}"))[0] == "ran"
    assert (await env.call("/srv/notes/deep/d.md"))[0] == "asked"  # a subfolder
    assert (await env.call("/srv/other/e.md"))[0] == "asked"  # another folder
    assert (await env.call("/srv/notes/f.md", tool="edit_file"))[0] == "asked"  # another tool
    assert (await env.call("/srv/notes/g.md", agent=OTHER))[0] == "asked"  # another agent
    assert (await env.call("/srv/notes/h.md", session="s-2"))[0] == "asked"  # another session
    assert env.moments == 6


async def test_hour_scope_covers_other_sessions_and_expires(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """"Allow for an hour" covers the agent's other sessions on the object too, until the hour is over:
    past it the same write asks again."""
    assert (await env.call("/srv/notes/a.md", answer=HOUR))[0] == "asked"
    assert (await env.call("/srv/notes/b.md", session="s-9"))[0] == "ran"
    later = time.time() + scopes_mod.HOUR_S + 1

    class Later:
        @staticmethod
        def time() -> float:
            return later

    monkeypatch.setattr(scopes_mod, "time", Later)
    assert (await env.call("/srv/notes/b.md", session="s-9", answer=DENY))[0] == "asked"


async def test_hem_required_always_asks(env: Env) -> None:
    """An agent that itself asks for a human (hem_urgency REQUIRED) is asked about even inside a standing approval
    (spec 003 §4.4: the kernel MUST enter HEM_PENDING for it)."""
    await env.call("/srv/notes/a.md", answer=SESSION)
    _rec, r = await env.act(AGENT, {"tool": "write_file", "arguments": {"path": "/srv/notes/b.md", "content": "x"}},
                            "s-1", hem_urgency="REQUIRED")
    assert isinstance(r, HemPending)


async def test_grant_and_use_are_signed_log_events_and_capsuled(env: Env) -> None:
    """The grant is APPROVAL_SCOPE_GRANTED (after HEM_RESOLVED with the option, signed, in the chain) with a
    ``resolved`` verdict of its own; a covered call is APPROVAL_SCOPE_APPLIED (after its IDP_SUBMITTED, naming the
    grant and Cedar's DENY, no CEDAR_PERMIT_RECORDED) and its executed capsule names the scope."""
    _, asked = await env.call("/srv/notes/a.md", answer=SESSION)
    granted = await _event(env, "APPROVAL_SCOPE_GRANTED", idp_id=asked)
    keys = kernel(env).eventlog.keys
    assert check_signature(granted, keys) is None
    scope = granted.body["scope"]
    assert (scope["kind"], scope["agent"], scope["principal"], scope["folder"], scope["tool"], scope["session_id"]) == (
        "session", AGENT, PRINCIPAL, "/srv/notes", "write_file", "s-1")
    assert scope["expires_at"] - scope["granted_at"] <= scopes_mod.SESSION_MAX_S
    resolved = await _event(env, "HEM_RESOLVED", idp_id=asked)
    assert resolved.body["decision"] == "approve" and resolved.body["option_index"] == SESSION
    grant_v = (await stored_verdicts(env.js, "resolved", lambda v: v.action_id == granted.body["scope_id"]))[0]
    assert grant_v.approver == "human" and grant_v.human_disposed and grant_v.option_index == SESSION
    assert grant_v.action_type == "idp.approval_scope" and grant_v.decision == "accept"

    status, used = await env.call("/srv/notes/b.md")
    assert status == "ran"
    applied = await _event(env, "APPROVAL_SCOPE_APPLIED", idp_id=used)
    assert check_signature(applied, keys) is None
    assert applied.body["scope_id"] == granted.body["scope_id"] and applied.body["cedar"] == "DENY"
    seqs = {et: [s for s, ev in await read_log(env.js, et) if ev.body.get("idp_id") == used]
            for et in ("IDP_SUBMITTED", "APPROVAL_SCOPE_APPLIED", "GATE_DISPATCHED", "CEDAR_PERMIT_RECORDED")}
    assert seqs["IDP_SUBMITTED"][0] < seqs["APPROVAL_SCOPE_APPLIED"][0] < seqs["GATE_DISPATCHED"][0]
    assert seqs["CEDAR_PERMIT_RECORDED"] == []
    assert (await verify_stream(env.js, kernel(env).subjects, keys)).ok

    v = (await stored_verdicts(env.js, "executed", lambda v: v.idp_id == used))[0]
    assert v.details["approval_scope"]["scope_id"] == granted.body["scope_id"]
    assert v.approver == "human" and not v.human_disposed and v.moment_id is None
    capsule = capsule_from_verdict(v, operator="op", salt="s" * 32)
    pgw = msgspec.to_builtins(capsule)["pgw"]
    assert pgw["approval_scope"] == {"scope_id": granted.body["scope_id"], "kind": "session"}
    assert "/srv/notes" not in msgspec.json.encode(capsule).decode()  # the folder is hers: never in clear


async def test_she_lists_and_revokes_her_own_and_a_revoked_scope_asks_again(env: Env) -> None:
    """kernel.approvals.alice lists alice's live standing approvals; revoking one logs APPROVAL_SCOPE_REVOKED
    (signed) and a ``resolved`` reject verdict superseding the grant's; the next write asks again. Another
    principal's subject shows none of hers and cannot revoke it."""
    await env.call("/srv/notes/a.md", answer=HOUR)
    mine = await env.approvals(ApprovalsRequest(op="list"))
    assert mine.ok and len(mine.approvals) == 1
    a = mine.approvals[0]
    assert (a.kind, a.agent, a.folder, a.tool, a.action) == ("hour", AGENT, "/srv/notes", "write_file", "WriteFile")

    bob = await env.approvals(ApprovalsRequest(op="list"), principal="bob")
    assert bob.ok and bob.approvals == []
    refused = await env.approvals(ApprovalsRequest(op="revoke", scope_id=a.scope_id), principal="bob")
    assert not refused.ok and refused.refusal.code == "scope_not_found"
    assert (await env.call("/srv/notes/b.md"))[0] == "ran"

    done = await env.approvals(ApprovalsRequest(op="revoke", scope_id=a.scope_id))
    assert done.ok and done.revoked.scope_id == a.scope_id
    ev = await _event(env, "APPROVAL_SCOPE_REVOKED", scope_id=a.scope_id)
    assert check_signature(ev, kernel(env).eventlog.keys) is None and ev.body["revoked_by"] == "principal"
    v = (await stored_verdicts(env.js, "resolved", lambda v: v.action_id == a.scope_id and v.decision == "reject"))[0]
    assert v.supersedes == scopes_mod.grant_verdict_id(a.scope_id) and v.approver == "human"
    assert (await env.approvals(ApprovalsRequest(op="list"))).approvals == []
    again = await env.approvals(ApprovalsRequest(op="revoke", scope_id=a.scope_id))
    assert not again.ok and again.refusal.code == "scope_not_found"
    assert (await env.call("/srv/notes/c.md", answer=DENY))[0] == "asked"


async def test_the_approvals_subject_is_answered_to_its_principal_only(env: Env) -> None:
    """The reply rule (docs/contract.md §6): kernel.approvals.alice is answered on an inbox of alice's (here, on a
    server without per-party credentials, nats' shared one), never on another principal's inbox or a stream."""
    other = await env.nc.subscribe("_INBOX_principal_bob.x")
    await env.nc.publish(approvals_subject("pgw", PRINCIPAL), b'{"op":"list"}', reply="_INBOX_principal_bob.x")
    await env.nc.publish(approvals_subject("pgw", PRINCIPAL), b'{"op":"list"}', reply=f"pgw.principal.{PRINCIPAL}.surface")
    answered = await env.nc.request(approvals_subject("pgw", PRINCIPAL), b'{"op":"list"}', timeout=10)
    assert answered.data  # her own request is answered, after the two above were read
    # An answer to bob's inbox would have been sent first, on the same connection, and be queued by now.
    assert other.pending_msgs == 0


async def test_fifty_edits_in_one_folder_ask_once(env: Env) -> None:
    """The measure of docs/gate.md "Standing approvals": a scripted session of 50 writes to files of one folder
    asks the principal 50 times when she answers Approve, and once when she answers "Allow for this session"."""
    for i in range(50):
        await env.call(f"/srv/before/note-{i % 7}.md", answer=ALLOW)
    before = env.moments
    env.moments = 0
    for i in range(50):
        await env.call(f"/srv/after/note-{i % 7}.md", answer=SESSION, session="s-after")
    assert (before, env.moments) == (50, 1)
    assert sum(p.startswith("/srv/after/") for p in env.files.files) == 7 and env.files.calls == 100


@contextlib.asynccontextmanager
async def forbidding_deletes(make_config: Any, nc: Any, tmp_path: Path, ran: list[str]) -> AsyncIterator[Env]:
    """A gateway whose kernel dispatches WriteFile and DeleteFile to the files executor (each delete's path is
    appended to ``ran``); Cedar denies every WriteFile for want of a permit and forbids every DeleteFile."""
    issuer = Issuer(tmp_path / "issuer")
    files = Files(nc)

    @files.ex.action("DeleteFile")
    async def delete(args: dict[str, Any]) -> Any:
        ran.append(args["arguments"]["path"])
        return {"content": [{"type": "text", "text": "deleted"}]}

    policy = POLICY + 'forbid(principal, action == Action::"DeleteFile", resource);\n'
    cfg = make_config(
        kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path, policy)),
                "executors": {"files": {"actions": ["WriteFile", "DeleteFile"], "timeout_s": 2.0}}, "gate_sweep_s": 0},
        agents={AGENT: {"principals": [PRINCIPAL]}},
    )
    async with files.ex, running_gateway(cfg, nc) as gw:
        yield Env(nc, gw, issuer, files)


async def test_an_action_a_forbid_policy_denies_is_never_put_to_the_principal(make_config: Any, nc: Any,
                                                                               tmp_path: Path) -> None:
    """A Cedar ``forbid`` is final: the Enriched DENY says ``hem_available: false``, and a resubmission with
    ``hem_urgency: REQUIRED`` is denied again instead of asking her (before, an agent speaking the bus got a
    delete the gate's own rules refuse put to the principal as an ordinary card, and "Allow for this session"
    then let later deletes run unasked). A write, denied only for want of a permit, is still asked."""
    deleted: list[str] = []
    async with forbidding_deletes(make_config, nc, tmp_path, deleted) as env:
        env.mandates[AGENT] = env.issuer.mandate(agent=AGENT, so_id=env.so, principal=PRINCIPAL,
                                                 actions=["WriteFile", "DeleteFile"])

        async def act(action: str, **over: Any) -> tuple[dict[str, Any], Any]:
            token, jti = env.mandates[AGENT]
            env.step += 1
            rec = idp(so_id=env.so, mandate_id=jti, step=env.step, action=action, session="s-1", **over)
            args = {"tool": "delete_file" if action == "DeleteFile" else "write_file",
                    "arguments": {"path": "/notes/victim.txt", "content": "x"}}
            body = {"mandate": token, "action": action, "idp": rec, "arguments": args}
            msg = await nc.request(f"pgw.agent.{AGENT}.act", msgspec.json.encode(body), timeout=15)
            return rec, act_result_decoder.decode(msg.data)

        _, r = await act("DeleteFile")
        assert isinstance(r, EnrichedDeny) and r.deny_code == "POLICY_DENY" and r.hem_available is False, r
        assert "forbids DeleteFile" in r.deny_reason and "not escalated" in r.deny_reason
        rec, r = await act("DeleteFile", hem_urgency="REQUIRED")
        assert isinstance(r, EnrichedDeny) and r.deny_code == "POLICY_DENY" and r.hem_available is False, r
        # Still not asked, and a write (no permit, no forbid) in the same session still is: the kernel went on.
        wrec, w = await act("WriteFile", hem_urgency="REQUIRED")
        assert isinstance(w, HemPending), w
        await _moment(env.surface, wrec["idp_id"])
        escalated = [ev.body for _, ev in await read_log(env.js, "HEM_ESCALATED")]
        assert [b.get("idp_id") for b in escalated] == [wrec["idp_id"]], escalated
        assert deleted == [] and not any(
            (b.get("idp_id") == rec["idp_id"]) for _, ev in await read_log(env.js, "CEDAR_PERMIT_RECORDED")
            for b in [ev.body])



@pytest.mark.parametrize("path", ["act", "idp"])
async def test_an_action_the_mandate_does_not_grant_is_never_put_to_the_principal(
        make_config: Any, nc: Any, tmp_path: Path, path: str) -> None:
    """An action outside the mandate is ``DENY MANDATE_SCOPE`` with ``hem_available: false``, also declared with
    ``hem_urgency: REQUIRED`` (spec 003 §6.3 routes a POLICY_DENY to a human; an approval cannot widen the mandate
    its issuer signed). Before, such a declaration went to the principal with Cedar never run, so an agent whose
    mandate granted only writes had a delete the policy forbids put to her, and ran it on her Approve (a
    narrower mandate gave more power), and could name its action in free text ("read your calendar (nothing is
    changed)") for the card's question (found by an attack from the docs). A granted write is still asked; on
    the gate (``act``) and on the declaration path (``idp``) alike."""
    from tests.kernel_support import request

    ran: list[str] = []
    free_text = "read your calendar (nothing is changed)"
    async with forbidding_deletes(make_config, nc, tmp_path, ran) as env:
        token, jti = env.issuer.mandate(agent=AGENT, so_id=env.so, principal=PRINCIPAL, actions=["WriteFile"])

        async def declare(action: str, **over: Any) -> tuple[dict[str, Any], Any]:
            env.step += 1
            rec = idp(so_id=env.so, mandate_id=jti, step=env.step, action=action, session="s-1", **over)
            if path == "idp" or action == free_text:  # no executor serves a free-text action: declared only
                return rec, await request(nc, AGENT, {"mandate": token, "idp": rec})
            args = {"tool": "delete_file" if action == "DeleteFile" else "write_file",
                    "arguments": {"path": "/notes/victim.txt", "content": "x"}}
            body = {"mandate": token, "action": action, "idp": rec, "arguments": args}
            msg = await nc.request(f"pgw.agent.{AGENT}.act", msgspec.json.encode(body), timeout=15)
            return rec, act_result_decoder.decode(msg.data)

        refused = []
        for action in ("DeleteFile", free_text):
            _, r = await declare(action)
            assert isinstance(r, EnrichedDeny) and r.deny_code == "MANDATE_SCOPE" and r.hem_available is False, r
            rec, r = await declare(action, hem_urgency="REQUIRED")
            assert isinstance(r, EnrichedDeny) and r.deny_code == "MANDATE_SCOPE" and r.hem_available is False, r
            assert "not escalated" in r.deny_reason
            refused.append(rec["idp_id"])
        if path == "act":
            wrec, w = await declare("WriteFile", hem_urgency="REQUIRED")
            assert isinstance(w, HemPending), w  # a granted action is still put to her
            await _moment(env.surface, wrec["idp_id"])
            asked = [wrec["idp_id"]]
        else:
            asked = []
        escalated = [ev.body.get("idp_id") for _, ev in await read_log(env.js, "HEM_ESCALATED")]
        assert escalated == asked and not set(refused) & set(escalated), escalated
        assert ran == []


async def revoke(env: Env, nats_server: Any, tmp_path: Path, jti: str) -> None:
    """``pgw mandate revoke JTI``, signed with the mandate issuer's key, as ops run it."""
    from tests.test_kernel_revocation import _private_pem, _revoke

    rc, out = await _revoke(nats_server.client_url, tmp_path / "cli", jti, _private_pem(env.issuer.key, tmp_path / "issuer.pem"))
    assert rc == 0 and out["ok"], out


async def told(outcomes: Any, outcome: str, idp_id: str) -> dict[str, Any]:
    """The next ``outcome`` (``action_result``, ``hem_decision``) of step ``idp_id`` the agent's subscription sees."""
    while True:
        got = msgspec.json.decode((await outcomes.next_msg(timeout=10)).data)
        if got.get("outcome") == outcome and got.get("idp_id") == idp_id:
            return got


async def test_an_approval_after_the_mandate_was_revoked_runs_nothing(env: Env, nats_server: Any, tmp_path: Path) -> None:
    """A gated write waits for her answer; ops revoke the agent's mandate (`pgw mandate revoke`, "on every
    gateway at once"). Before, her Approve then dispatched the write all the same (found by an attack from the
    docs). Now her answer is logged as given, with why it did not count (``HEM_RESOLVED`` ``void:
    MANDATE_REVOKED``), the step is refused, nothing runs, and the agent is told why."""
    _, idp_id = await env.call("/srv/notes/late.md", answer=None)
    item = await _moment(env.surface, idp_id)
    _, jti = env.mandates[AGENT]
    await revoke(env, nats_server, tmp_path, jti)
    async def applied() -> bool:  # the gateway's live list (a new act of the mandate is refused)
        _, r = await env.act(AGENT, {"tool": "write_file", "arguments": {"path": "/srv/notes/x.md", "content": "x"}},
                             "s-2")
        return isinstance(r, EnrichedDeny) and r.deny_code == "MANDATE_REVOKED"

    await until(applied, timeout=10, what="the revocation applied")
    before = env.files.calls
    outcomes = await env.nc.subscribe(f"pgw.agent.{AGENT}.outcome")
    assert (await env.surface.choose(item, ALLOW)).status == "accepted"
    resolved = await _event(env, "HEM_RESOLVED", idp_id=idp_id)
    assert resolved.body["decision"] == "approve" and resolved.body["void"] == "MANDATE_REVOKED", resolved.body

    result = await told(outcomes, "action_result", idp_id)
    assert result["status"] == "not_run" and "revoked" in result["reason"], result
    assert env.files.calls == before and "/srv/notes/late.md" not in env.files.files
    [closing] = await stored_verdicts(env.js, "denied", lambda v: v.idp_id == idp_id)  # the step closed on the record
    assert closing.reason.code == "MANDATE_REVOKED" and closing.decision == "reject", closing


async def test_an_approval_after_the_mandate_was_revoked_is_told_void_on_the_declaration_path(
        env: Env, nats_server: Any, tmp_path: Path) -> None:
    """A declared step (``agent.{agent}.idp``, ``hem_urgency: REQUIRED``) waits for her answer; ops revoke the
    mandate; she approves. The agent acts on its own on this path, and its ``hem_decision`` outcome said
    ``approve`` (documented as a residual: the agent had to check its mandate again). Now her approval is judged
    as she gives it and stored with her answer: the outcome says ``deny`` with ``void: MANDATE_REVOKED``, the
    moment query says the same, the log records ``approve`` with the same ``void``, and the step's report is
    refused."""
    from subjects.momentquery import MomentQuery, moment_state_decoder
    from tests.kernel_support import request

    token, jti = env.mandates[AGENT]
    env.step += 1
    rec = idp(so_id=env.so, mandate_id=jti, step=env.step, action="ReadBooking", session="s-1", hem_urgency="REQUIRED")
    pending = await request(env.nc, AGENT, {"mandate": token, "idp": rec})
    assert isinstance(pending, HemPending), pending
    item = await _moment(env.surface, rec["idp_id"])
    await revoke(env, nats_server, tmp_path, jti)

    async def revoked() -> bool:
        return kernel(env).mandates.lapsed(jti, None) == "MANDATE_REVOKED"

    await until(revoked, timeout=10, what="the revocation applied")
    outcomes = await env.nc.subscribe(f"pgw.agent.{AGENT}.outcome")
    assert (await env.surface.choose(item, ALLOW)).status == "accepted"
    said = await told(outcomes, "hem_decision", rec["idp_id"])
    assert said["decision"] == "deny" and said["void"] == "MANDATE_REVOKED", said
    resolved = await _event(env, "HEM_RESOLVED", idp_id=rec["idp_id"])
    assert resolved.body["decision"] == "approve" and resolved.body["void"] == "MANDATE_REVOKED", resolved.body
    asked = await env.nc.request(f"pgw.agent.{AGENT}.moment",
                                 msgspec.json.encode(MomentQuery(moment_id=pending.moment_id)), timeout=10)
    state = moment_state_decoder.decode(asked.data)
    assert state.outcome is not None and state.outcome.decision == "deny" and state.outcome.void == "MANDATE_REVOKED", state
    await env.js.publish(f"pgw.agent.{AGENT}.transition", msgspec.json.encode(
        {"idp_id": rec["idp_id"], "executed_action": "ReadBooking", "effect": {"type": "booking.read",
                                                                               "status": "confirmed"}}),
        headers={"Nats-Msg-Id": f"{AGENT}:{rec['idp_id']}"})
    refused = await _event(env, "TRANSITION_REFUSED", idp_id=rec["idp_id"])
    assert refused.body["idp_id"] == rec["idp_id"]


async def test_arguments_the_kernel_cannot_record_are_refused_before_anything_is_committed(env: Env) -> None:
    """A gated call whose arguments hold an integer beyond +-(2**53 - 1) cannot be recorded (GATE_DISPATCHED and
    the verdict digest them as RFC 8785 JSON). Before, the kernel answered KERNEL_UNAVAILABLE after storing its
    open dispatch, and every gate sweep then failed on the key for good, also after a restart (found by an attack
    from the docs). Now it is REQUEST_MALFORMED before anything is committed; and an open dispatch such a gateway
    stored before is ended once by the sweep (the agent told nothing ran), not failed at every sweep."""
    from gateway.kernel.gate import BUCKET, OpenDispatch, idempotency_key

    big = 123456789012345678901234567890
    rec, r = await env.act(AGENT, {"tool": "write_file", "arguments": {"path": "/srv/notes/n.md", "n": big}}, "s-1")
    assert isinstance(r, Reject) and r.error_code == "REQUEST_MALFORMED" and "2**53" in r.reason, r
    assert not [ev for _, ev in await read_log(env.js, "IDP_SUBMITTED") if ev.body.get("idp_id") == rec["idp_id"]]
    gate_kv = await env.js.key_value(BUCKET)
    assert not await _has_keys(gate_kv)

    # As a gateway before this change stored it: permitted, dispatched, its arguments unrecordable.
    so, idp_id = env.so, str(uuid.uuid4())
    d = OpenDispatch(idempotency_key=idempotency_key(so, idp_id), state="dispatched", kind="files", action="WriteFile",
                     arguments={"tool": "write_file", "arguments": {"n": big}}, idp_id=idp_id, so_id=so, agent=AGENT,
                     principal=PRINCIPAL, session_id="s-9", step_sequence=1, submitted_seq=1, dispatched_at=0.0)
    await gate_kv.put(d.idempotency_key, msgspec.json.encode(d))
    outcomes = await env.nc.subscribe(f"pgw.agent.{AGENT}.outcome")
    assert await kernel(env).gate_sweep() == 1
    assert not await _has_keys(gate_kv)
    told = msgspec.json.decode((await outcomes.next_msg(timeout=10)).data)
    assert told["outcome"] == "action_result" and told["status"] == "not_run" and told["idp_id"] == idp_id, told
    assert await kernel(env).gate_sweep() == 0 and env.files.calls == 0


async def _has_keys(kv: Any) -> bool:
    from nats.js.errors import NoKeysError

    try:
        return bool(await kv.keys())
    except NoKeysError:
        return False


async def test_a_result_holding_a_large_integer_is_recorded_and_answered(make_config: Any, nc: Any, tmp_path: Path) -> None:
    """A tool that ran and answered with an integer beyond +-(2**53 - 1) (a database id, a nanosecond time): its
    digest failed, the agent got KERNEL_UNAVAILABLE, and every gate sweep failed on the step for good (found by
    a review). The result is now recorded with such an integer as its decimal string, and the agent gets it so;
    nothing is left open."""
    from gateway.kernel.gate import BUCKET

    big = 1733580000000000000123
    issuer = Issuer(tmp_path / "issuer")
    files = Files(nc)

    @files.ex.action("ReadRepo")
    async def read_repo(args: dict[str, Any]) -> Any:
        return {"structuredContent": {"id": big, "small": 7}}

    cfg = make_config(
        kernel={"issuers": {issuer.kid: str(issuer.pem_path)},
                "policy_dir": str(policy_dir(tmp_path, POLICY + 'permit(principal, action == Action::"ReadRepo", resource);\n')),
                "executors": {"files": {"actions": ["WriteFile", "ReadRepo"], "timeout_s": 2.0}}, "gate_sweep_s": 0},
        agents={AGENT: {"principals": [PRINCIPAL]}},
    )
    async with files.ex, running_gateway(cfg, nc) as gw:
        env = Env(nc, gw, issuer, files)
        env.mandates[AGENT] = issuer.mandate(agent=AGENT, so_id=env.so, principal=PRINCIPAL, actions=["ReadRepo"])
        token, jti = env.mandates[AGENT]
        rec = idp(so_id=env.so, mandate_id=jti, step=1, action="ReadRepo", session="s-1")
        body = {"mandate": token, "action": "ReadRepo", "idp": rec, "arguments": {"repo": "/srv/repo"}}
        msg = await nc.request(f"pgw.agent.{AGENT}.act", msgspec.json.encode(body), timeout=15)
        r = act_result_decoder.decode(msg.data)
        assert isinstance(r, ActDone) and r.status == "confirmed", r
        assert r.response == {"structuredContent": {"id": str(big), "small": 7}}, r.response
        assert (await _event(env, "STATE_TRANSITIONED", idp_id=rec["idp_id"])).body["effect"]["status"] == "confirmed"
        gate_kv = await env.js.key_value(BUCKET)

        async def closed() -> bool:
            from nats.js.errors import NoKeysError

            try:
                return not await gate_kv.keys()
            except NoKeysError:
                return True

        await until(closed, timeout=10, what="the step's open dispatch closed")


async def test_a_sweep_does_not_run_an_approval_whose_mandate_was_revoked_since(env: Env, nats_server: Any,
                                                                               tmp_path: Path) -> None:
    """A crash between her approval being applied (the step's entry ``hem_approved``) and its dispatch leaves the
    dispatch to the gate sweep. If the mandate was revoked meanwhile, the sweep ends it unrun (a review): the
    approval permits a step only under a mandate that still stands."""
    _, idp_id = await env.call("/srv/notes/crash.md", answer=None)
    await _moment(env.surface, idp_id)
    _, jti = env.mandates[AGENT]
    await kernel(env).state.advance_idp(env.so, idp_id, "hem_approved")  # as the crashed gateway left it
    await revoke(env, nats_server, tmp_path, jti)
    async def revoked() -> bool:
        return kernel(env).mandates.lapsed(jti, None) == "MANDATE_REVOKED"

    await until(revoked, timeout=10, what="the revocation applied")
    outcomes = await env.nc.subscribe(f"pgw.agent.{AGENT}.outcome")
    assert await kernel(env).gate_sweep() == 1
    told = msgspec.json.decode((await outcomes.next_msg(timeout=10)).data)
    assert told["outcome"] == "action_result" and told["status"] == "not_run" and "revoked" in told["reason"], told
    assert "before the call was sent" in told["reason"], told
    assert env.files.calls == 0


async def declared_read(env: Env) -> dict[str, Any]:
    """An earlier step of the session, declared and permitted (``ReadBooking``): its report can open a gap."""
    from tests.kernel_support import request

    token, jti = env.mandates[AGENT]
    env.step += 1
    read = idp(so_id=env.so, mandate_id=jti, step=env.step, action="ReadBooking", session="s-1")
    assert isinstance(await request(env.nc, AGENT, {"mandate": token, "idp": read}), Permit)
    return read


async def deny_the_gap(env: Env, read: dict[str, Any]) -> None:
    """``read``'s report names another action (a commitment gap on the same object), and she denies it: the
    mandate is ended (spec 003 §5.5.2: every session under it is refused)."""
    await env.js.publish(f"pgw.agent.{AGENT}.transition", msgspec.json.encode(
        {"idp_id": read["idp_id"], "executed_action": "CloseBooking", "effect": {"type": "booking.close",
                                                                                  "status": "dispatched"}}),
        headers={"Nats-Msg-Id": f"{AGENT}:{read['idp_id']}"})
    gap_item = await _moment(env.surface, read["idp_id"])
    assert (await env.surface.choose(gap_item, DENY)).status == "accepted"
    await _event(env, "HEM_RESOLVED", idp_id=read["idp_id"])


async def test_a_sweep_does_not_run_an_approval_whose_mandate_was_ended_since(env: Env) -> None:
    """The same crash, and meanwhile she ended the mandate by denying a commitment gap on the same object
    (spec 003 §5.5.2): the sweep ends the approved step unrun. Before, the sweep checked revocation only, apart
    from the answer's own check (a review); now both ask ``approval_void``."""
    read = await declared_read(env)
    _, write_id = await env.call("/srv/notes/ended-crash.md", answer=None)
    await _moment(env.surface, write_id)
    await kernel(env).state.advance_idp(env.so, write_id, "hem_approved")  # as the crashed gateway left it
    await deny_the_gap(env, read)
    outcomes = await env.nc.subscribe(f"pgw.agent.{AGENT}.outcome")
    assert await kernel(env).gate_sweep() == 1
    got = await told(outcomes, "action_result", write_id)
    assert got["status"] == "not_run" and "was ended" in got["reason"], got
    assert env.files.calls == 0


async def test_an_approval_after_its_mandate_was_ended_runs_nothing(env: Env) -> None:
    """Two escalations wait on one governed object: a gated write the agent asked her about, and a commitment gap
    of an earlier step. She denies the gap, which ends the mandate (spec 003 §5.5.2: every session under it is
    refused), then approves the write. Before, the write then ran under the ended mandate (found by a review);
    now her approval is logged void (``SESSION_TERMINATED``) and nothing runs."""
    read = await declared_read(env)
    _, write_id = await env.call("/srv/notes/ended.md", answer=None)
    write_item = await _moment(env.surface, write_id)
    await deny_the_gap(env, read)
    outcomes = await env.nc.subscribe(f"pgw.agent.{AGENT}.outcome")
    assert (await env.surface.choose(write_item, ALLOW)).status == "accepted"
    resolved = await _event(env, "HEM_RESOLVED", idp_id=write_id)
    assert resolved.body["decision"] == "approve" and resolved.body["void"] == "SESSION_TERMINATED", resolved.body
    got = await told(outcomes, "action_result", write_id)
    assert got["status"] == "not_run" and "ended" in got["reason"], got
    assert env.files.calls == 0
