"""Standing approvals: "allow this for the session" and "allow this tool in this folder for an hour".

A principal who must approve the tenth write to the same folder in a minute
learns to tap Approve without reading. So the approval moment of a gated
action (spec 003 §8.7, escalated to her through HEM, §4.4, §6.3) offers two
more answers besides Approve (index 0) and Deny (index 1): "Allow for this
session" (index 2) and "Allow for an hour" (index 3). Either runs the asked
call, as Approve does, and records a standing approval: a grant narrower than
the mandate it extends, which answers later calls inside it without asking
her again (docs/gate.md "Standing approvals").

What one covers (all of it, or the call asks as before):

- the same agent, principal and mandate (its ``jti``: a new mandate asks
  again, and the mandate's ``exp`` bounds the approval);
- the same governed object (``so_id``); for "session", the same session too;
- the same action, executor and tool (an MCP tool call through the gate is
  ``{"tool": NAME, "arguments": {...}}``);
- every argument that names a path (``subjects.gate.PATH_KEYS``) a file directly in
  the folder of the asked path: no subfolder, no ``..``, no path that is not
  in its normal form (so ``a/../b`` or ``a//b`` never match), and a call that
  names no path is not covered. A call whose asked path is not such a path is
  offered no standing approval at all (nothing would bound it);
- a bounded time: "session" at most :data:`SESSION_MAX_S`, "hour"
  :data:`HOUR_S`, neither past the mandate's ``exp``;
- only where the kernel would otherwise refuse the call with ``POLICY_DENY``
  (the action is among the mandate's actions, Cedar denied it, HEM is on and
  the session ``ACTIVE``): never an action outside the mandate, and never an
  IDP with ``hem_urgency: REQUIRED``, which asks the principal whatever she
  allowed before (§4.4: the kernel MUST enter HEM_PENDING for it).

What is written when (every log event signed and chained by the kernel,
spec 003 §8.2; every id deterministic, so a repeat doubles nothing):

- on her answer, after ``HEM_RESOLVED`` and before the asked call is
  dispatched: ``APPROVAL_SCOPE_GRANTED`` (the whole scope; ``scope_id`` is a
  stable id of the moment), the scope in ``PGW_KERNEL`` under
  ``scopes.{principal}.{digest(agent, so_id)}`` (compare-and-set), and a
  ``resolved`` verdict (approver human, the option index), so the grant has a
  capsule of its own;
- on a call it covers, after Cedar (spec 003 §5.3: IDP_SUBMITTED < Cedar
  evaluation) and before the permit is answered: ``APPROVAL_SCOPE_APPLIED``
  (the scope, the grant's sequence, the Cedar outcome it answered); the step
  then runs as any permitted gated step, and its ``executed`` verdict names the
  scope (``details.approval_scope``: approver human, not human-disposed: she
  decided in advance, nobody looked at this call), which the capsule carries
  as ``pgw.approval_scope``;
- on revocation (``kernel.approvals.{principal}``, subjects/approvals.py):
  ``APPROVAL_SCOPE_REVOKED``, then the scope leaves the bucket, then a
  ``resolved`` verdict (reject) superseding the grant's.

An expired scope is never used and is dropped at the next write of its key.
The bucket is the index, read afresh on every call it could cover (every
gateway sees a revocation at once). The kernel's rebuild from the log (spec
003 §8.4) does not bring standing approvals back: a lost key only makes a call
ask again, and a revoked one can never return.
A crash between ``HEM_RESOLVED`` and the grant loses the grant, never the
asked call (the gate sweep dispatches an approved step): the safe side.
"""

from __future__ import annotations

import contextlib
import posixpath
import time
from typing import Any

import msgspec
from msgspec import Struct

from gateway.kernel.hem import _clip
from gateway.kernel.state import BUCKET as STATE_BUCKET
from gateway.kernel.state import ConflictError
from gateway.security.text import marked, quoted
from pgwcore.kvread import kv_keys
from pgwcore.logs import get_logger
from subjects.approvals import (
    ApprovalsReply,
    ScopeKind,
    StandingApproval,
    approvals_request_decoder,
    approvals_subject,
)
from subjects.errors import SubjectError
from subjects.gate import PATH_KEYS
from subjects.names import principal_token
from subjects.util import now_rfc3339, stable_id, to_rfc3339
from subjects.wire import BindingMoment, MomentOption, OptionChoice, Refusal, Verdict

log = get_logger("pgw.kernel.scopes")

GRANTED = "APPROVAL_SCOPE_GRANTED"
APPLIED = "APPROVAL_SCOPE_APPLIED"
REVOKED = "APPROVAL_SCOPE_REVOKED"
SESSION_MAX_S = 8 * 3600
HOUR_S = 3600
# The options after Approve (0) and Deny (1) of hem.hem_moment, by index.
OPTION_KINDS: dict[int, ScopeKind] = {2: "session", 3: "hour"}
ACTION_TYPE = "idp.approval_scope"
_MAX_PATH = 1024


class ScopeOffer(Struct, kw_only=True, omit_defaults=True):
    """What a gated step's approval moment offers to allow standing (kept on its open dispatch)."""

    action: str
    executor: str
    folder: str
    mandate_id: str
    tool: str | None = None
    mandate_exp: float | None = None


class ApprovalScope(Struct, kw_only=True, omit_defaults=True):
    """One standing approval, as the kernel keeps and logs it."""

    scope_id: str
    kind: ScopeKind
    agent: str
    principal: str
    so_id: str
    mandate_id: str
    action: str
    executor: str
    folder: str
    granted_at: float
    expires_at: float
    moment_id: str
    idp_id: str  # the call she was asked about
    tool: str | None = None
    session_id: str | None = None
    grant_seq: int | None = None

    def view(self) -> StandingApproval:
        return StandingApproval(
            scope_id=self.scope_id, kind=self.kind, agent=self.agent, so_id=self.so_id, action=self.action,
            folder=self.folder, granted_at=to_rfc3339(self.granted_at), expires_at=to_rfc3339(self.expires_at),
            moment_id=self.moment_id, tool=self.tool, session_id=self.session_id,
        )


class ScopeSet(Struct, kw_only=True):
    scopes: list[ApprovalScope] = msgspec.field(default_factory=list)


_set_dec = msgspec.json.Decoder(ScopeSet)
_enc = msgspec.json.Encoder()


# -- what a call names ------------------------------------------------------------
def _clean_path(value: Any) -> str | None:
    """``value`` if it is a file path in normal form the folder rule can judge, else None."""
    if not isinstance(value, str) or not 0 < len(value) <= _MAX_PATH:
        return None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value) or "\\" in value or "://" in value:
        return None
    if posixpath.normpath(value) != value or ".." in value.split("/") or value in (".", "/", "//"):
        return None
    return value


def call_of(arguments: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(tool, its arguments) of a gated call: an MCP tool call is ``{"tool", "arguments"}``."""
    tool = arguments.get("tool")
    inner = arguments.get("arguments")
    if isinstance(tool, str) and isinstance(inner, dict) and set(arguments) == {"tool", "arguments"}:
        return tool, inner
    return None, arguments


def paths_of(args: dict[str, Any]) -> list[Any]:
    """The values of every argument that names a path (``subjects.gate.PATH_KEYS``, as the card shows them)."""
    return [v for k, v in args.items() if isinstance(k, str) and k.lower() in PATH_KEYS]


def folder_of(args: dict[str, Any]) -> str | None:
    """The one folder every path argument lies directly in; None if any is not a clean path, or none is named."""
    paths = paths_of(args)
    if not paths:
        return None
    folders = set()
    for p in paths:
        clean = _clean_path(p)
        if clean is None:
            return None
        folders.add(posixpath.dirname(clean))
    return folders.pop() if len(folders) == 1 else None


def offer_for(*, action: str, executor: str, arguments: dict[str, Any], mandate: Any,
              redactor: Any) -> ScopeOffer | None:
    """The standing approval a gated call's moment may offer, or None (no clean path: ask every time).

    None too where the folder or the tool holds a secret (spec 002 SR-1, as ``redactor`` judges it):
    an offer names both in the option the principal reads, in ``HEM_ESCALATED`` and
    ``APPROVAL_SCOPE_GRANTED`` (the event log keeps them for good), on the open dispatch and in the
    scope's key; redacted, it would allow nothing the next call names. Such a call is asked each time."""
    if not offered():
        return None
    try:
        principal_token(mandate.principal)
    except SubjectError:
        return None
    tool, args = call_of(arguments)
    folder = folder_of(args)
    if folder is None:
        return None
    if redactor.holding([folder, tool or ""]):
        return None
    return ScopeOffer(action=action, executor=executor, folder=folder, mandate_id=mandate.jti, tool=tool,
                      mandate_exp=float(mandate.exp) if getattr(mandate, "exp", None) else None)


def offered() -> bool:
    """The moment desk reads options 2 and 3 as approvals (``moment_record.hem_decision_of``).

    Were it to read them as a denial, the principal who chose one would see the call refused and the
    agent told "deny": so the options are offered only where the desk says approve for them."""
    from gateway.moment_record import hem_decision_of

    return all(hem_decision_of(OptionChoice(index=i)) == "approve" for i in OPTION_KINDS)


def covers(scope: ApprovalScope, *, agent: str, principal: str, so_id: str, session_id: str, mandate_id: str,
           action: str, executor: str, arguments: dict[str, Any], now: float) -> bool:
    """Whether a gated call lies wholly inside ``scope`` (the module docstring's list)."""
    if now >= scope.expires_at:
        return False
    if (scope.agent, scope.principal, scope.so_id.lower(), scope.mandate_id, scope.action, scope.executor) != (
            agent, principal, so_id.lower(), mandate_id, action, executor):
        return False
    if scope.kind == "session" and scope.session_id != session_id:
        return False
    tool, args = call_of(arguments)
    if tool != scope.tool:
        return False
    return folder_of(args) == scope.folder


# -- the moment's two options -----------------------------------------------------------
def with_options(moment: BindingMoment, offer: ScopeOffer, agent: str) -> BindingMoment:
    """``moment`` (hem.hem_moment's, wording untouched) with the two standing-approval options after Approve and Deny."""
    what = f"{_clip(marked(offer.tool), 100)}" if offer.tool else f"{_clip(marked(offer.action), 100)}"
    # As a JSON string: a quote in the folder's name is escaped, never the end of the gateway's quotes (hem._ask).
    where = quoted(_clip(marked(offer.folder), 300)) if offer.folder else "the folder the agent started in"
    same = (f"Later calls of {what} by agent {agent} on files directly in {where} run without asking you")
    rest = ("; another tool, another folder, a subfolder or another agent still asks you. "
            "You can list and revoke it at any time.")
    options = [
        *moment.question.options,
        MomentOption(label="Allow for this session",
                     reasoning=f"This call runs now. {same}, in this session only, for at most "
                               f"{SESSION_MAX_S // 3600} hours{rest}"),
        MomentOption(label="Allow for an hour",
                     reasoning=f"This call runs now. {same}, in any of its sessions on this object, "
                               f"for one hour{rest}"),
    ]
    question = msgspec.structs.replace(moment.question, options=options)
    return msgspec.structs.replace(moment, question=question)


# -- the kernel part ---------------------------------------------------------------------
def _key(principal: str, agent: str, so_id: str) -> str:
    return f"scopes.{principal_token(principal)}.{stable_id('scopes', agent, so_id.lower())}"


def grant_verdict_id(scope_id: str) -> str:
    return stable_id("approval-scope-granted", scope_id)


class Scopes:
    """The kernel's standing approvals: grant, look up, list and revoke (a part of ``KernelService``)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._sub: Any = None

    async def start(self, queue: str) -> None:
        k = self.kernel
        self._sub = await k.gw.rnc.subscribe(approvals_subject(k.subjects.prefix, "*"), queue=queue,
                                             cb=self._on_request)

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.drain()
            self._sub = None

    # -- the bucket -------------------------------------------------------------
    async def _read(self, key: str) -> tuple[ScopeSet, int]:
        got = await self.kernel.state._get(key)
        if got is None:
            return ScopeSet(), 0
        return _set_dec.decode(got[0]), got[1]

    async def _update(self, key: str, fn: Any) -> ScopeSet:
        """Apply ``fn(set) -> bool`` (True: changed) by compare-and-set; expired scopes are dropped on the way."""
        for _ in range(20):
            s, rev = await self._read(key)
            now = time.time()
            live = [x for x in s.scopes if x.expires_at > now]
            changed = len(live) != len(s.scopes)
            s.scopes = live
            if not (fn(s) or changed):
                return s
            try:
                await self.kernel.state._cas(key, _enc.encode(s), rev)
                return s
            except ConflictError:
                continue
        raise ConflictError(key)

    async def _add(self, scope: ApprovalScope) -> None:
        def add(s: ScopeSet) -> bool:
            if any(x.scope_id == scope.scope_id for x in s.scopes) or scope.expires_at <= time.time():
                return False
            s.scopes.append(scope)
            return True

        await self._update(_key(scope.principal, scope.agent, scope.so_id), add)

    # -- grant -------------------------------------------------------------------
    async def grant(self, d: Any, option: int, tp: str | None) -> ApprovalScope | None:
        """Her answer ``option`` (2 or 3) to the moment of open dispatch ``d``: log, keep and capsule the scope."""
        offer: ScopeOffer | None = d.scope_offer
        kind = OPTION_KINDS.get(option)
        if offer is None or kind is None or d.moment_id is None:
            return None
        now = time.time()
        span = SESSION_MAX_S if kind == "session" else HOUR_S
        expires = now + span if offer.mandate_exp is None else min(now + span, offer.mandate_exp)
        if expires <= now:
            return None
        scope = ApprovalScope(
            scope_id=stable_id("approval-scope", d.moment_id), kind=kind, agent=d.agent, principal=d.principal,
            so_id=d.so_id.lower(), mandate_id=offer.mandate_id, action=offer.action, executor=offer.executor,
            folder=offer.folder, granted_at=now, expires_at=expires, moment_id=d.moment_id, idp_id=d.idp_id,
            tool=offer.tool, session_id=d.session_id if kind == "session" else None,
        )
        k = self.kernel
        body = {"scope_id": scope.scope_id, "kind": kind, "agent": d.agent, "principal": d.principal,
                "so_id": scope.so_id, "session_id": d.session_id, "idp_id": d.idp_id, "moment_id": d.moment_id,
                "option_index": option, "scope": msgspec.to_builtins(scope)}
        ev = await k.eventlog.append(GRANTED, body, msg_id=stable_id(GRANTED, scope.scope_id), traceparent=tp)
        # What the log recorded first stands (a repeat of the answer after a crash finds it).
        scope = msgspec.convert(ev.event.body["scope"], ApprovalScope)
        scope.grant_seq = ev.seq
        await self._add(scope)
        await k.publisher.verdict(Verdict(
            verdict_id=grant_verdict_id(scope.scope_id), verdict_class="resolved", decision="accept",
            approver="human", human_disposed=True, ts=now_rfc3339(), agent=d.agent, principal=d.principal,
            action_type=ACTION_TYPE, action_id=scope.scope_id, moment_id=d.moment_id, idp_id=d.idp_id,
            resolution_kind="option", option_index=option, traceparent=tp,
            details={"approval_scope": scope_detail(scope), "event_seq": ev.seq},
        ))
        log.info("standing approval granted", scope_id=scope.scope_id, kind=kind, agent=d.agent,
                 moment_id=d.moment_id, expires_at=to_rfc3339(scope.expires_at))
        return scope

    # -- use ----------------------------------------------------------------------
    async def covering(self, *, agent: str, mandate: Any, idp: Any, executor: str,
                       arguments: dict[str, Any]) -> ApprovalScope | None:
        """A live standing approval that covers this gated call, or None (the call asks as before)."""
        try:
            key = _key(mandate.principal, agent, idp.so_id)
        except SubjectError:
            return None
        s, _ = await self._read(key)
        now = time.time()
        for scope in s.scopes:
            if covers(scope, agent=agent, principal=mandate.principal, so_id=idp.so_id, session_id=idp.session_id,
                      mandate_id=mandate.jti, action=idp.requested_action, executor=executor,
                      arguments=arguments, now=now):
                return scope
        return None

    async def applied(self, scope: ApprovalScope, entry: Any, cedar: str, tp: str | None) -> int:
        """``APPROVAL_SCOPE_APPLIED``: the log's record of why this step is permitted; its sequence."""
        body = {"idp_id": entry.idp_id, "so_id": entry.so_id, "session_id": entry.session_id, "agent": entry.agent,
                "principal": entry.principal, "requested_action": entry.requested_action,
                "scope_id": scope.scope_id, "kind": scope.kind, "grant_seq": scope.grant_seq,
                "moment_id": scope.moment_id, "cedar": cedar, "idp_submitted_seq": entry.submitted_seq}
        ev = await self.kernel.eventlog.append(
            APPLIED, body, msg_id=stable_id(APPLIED, entry.so_id.lower(), entry.idp_id.lower()), traceparent=tp)
        return int(ev.seq)

    # -- list and revoke (kernel.approvals.{principal}) ------------------------------------
    async def mine(self, principal: str) -> list[ApprovalScope]:
        """Her live standing approvals, soonest to expire first (her keys only, from the server's
        per-subject index: ``kv_keys``, not a watcher, which missed a just-granted one now and then)."""
        keys = await kv_keys(self.kernel.js, STATE_BUCKET, f"scopes.{principal_token(principal)}.*")
        now = time.time()
        out: list[ApprovalScope] = []
        for key in keys:
            s, _ = await self._read(key)
            out += [x for x in s.scopes if x.expires_at > now]
        return sorted(out, key=lambda x: (x.expires_at, x.scope_id))

    async def revoke(self, principal: str, scope_id: str, tp: str | None = None) -> ApprovalsReply:
        found = next((x for x in await self.mine(principal) if x.scope_id == scope_id), None)
        if found is None:
            # The same answer for an id that is not hers, expired or already revoked: no oracle.
            return ApprovalsReply(ok=False, refusal=Refusal(
                code="scope_not_found", reason="none of your live standing approvals has this scope_id"))
        k = self.kernel
        body = {"scope_id": scope_id, "principal": found.principal, "agent": found.agent, "so_id": found.so_id,
                "kind": found.kind, "grant_seq": found.grant_seq, "revoked_by": "principal"}
        ev = await k.eventlog.append(REVOKED, body, msg_id=stable_id(REVOKED, scope_id), traceparent=tp)
        await self._update(_key(found.principal, found.agent, found.so_id), _without(scope_id))
        await k.publisher.verdict(Verdict(
            verdict_id=stable_id("approval-scope-revoked", scope_id), verdict_class="resolved", decision="reject",
            approver="human", human_disposed=True, ts=now_rfc3339(), agent=found.agent, principal=found.principal,
            action_type=ACTION_TYPE, action_id=scope_id, moment_id=found.moment_id,
            supersedes=grant_verdict_id(scope_id), traceparent=tp,
            details={"approval_scope": scope_detail(found), "event_seq": ev.seq, "revoked": True},
        ))
        log.info("standing approval revoked", scope_id=scope_id, principal=found.principal)
        return ApprovalsReply(ok=True, revoked=found.view(), event_seq=ev.seq, already=ev.duplicate)

    async def _on_request(self, msg: Any) -> None:
        k = self.kernel
        if not k.responder.admits(msg):  # the reply rule, before any work (docs/security.md "Replies")
            return
        principal = msg.subject.rsplit(".", 1)[-1]
        try:
            req = approvals_request_decoder.decode(msg.data)
            if req.op == "revoke":
                if req.scope_id is None:
                    reply = ApprovalsReply(ok=False, refusal=Refusal(code="REQUEST_MALFORMED",
                                                                     reason="revoke names the scope_id to revoke"))
                else:
                    reply = await self.revoke(principal, req.scope_id, await self.kernel.gw.traceparent(msg.headers))
            else:
                reply = ApprovalsReply(ok=True, approvals=[x.view() for x in await self.mine(principal)])
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            reply = ApprovalsReply(ok=False, refusal=Refusal(
                code="REQUEST_MALFORMED", reason=f"the body must be an ApprovalsRequest {{op, scope_id?}}: {e}"[:500]))
        except SubjectError:
            reply = ApprovalsReply(ok=False, refusal=Refusal(code="REQUEST_MALFORMED", reason="not a principal token"))
        except Exception:
            log.exception("standing approvals request failed", principal=principal[:64])
            reply = ApprovalsReply(ok=False, refusal=Refusal(code="KERNEL_UNAVAILABLE",
                                                             reason="the kernel could not answer; nothing was revoked"))
        await k.responder.answer(msg, msgspec.json.encode(reply))


def _without(scope_id: str) -> Any:
    def fn(s: ScopeSet) -> bool:
        kept = [x for x in s.scopes if x.scope_id != scope_id]
        changed, s.scopes = len(kept) != len(s.scopes), kept
        return changed

    return fn


def scope_detail(scope: ApprovalScope) -> dict[str, Any]:
    """What a verdict says of a scope (``details.approval_scope``); the capsule keeps its id and kind only."""
    return {"scope_id": scope.scope_id, "kind": scope.kind, "grant_seq": scope.grant_seq,
            "moment_id": scope.moment_id, "expires_at": to_rfc3339(scope.expires_at)}

