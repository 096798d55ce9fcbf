"""A principal's standing approvals: list them, revoke one (docs/gate.md "Standing approvals").

A standing approval is what the principal chose on a gated action's approval
moment instead of a plain Approve: "Allow for this session" or "Allow for an
hour". The kernel turns it into a grant narrower than the mandate it extends
(one agent, one principal, one governed object, one action and tool, the files
of one folder, a bounded time; gateway/kernel/scopes.py) and logs it signed
(``APPROVAL_SCOPE_GRANTED``, spec 003 §5.3, §8.2).

* ``{prefix}.kernel.approvals.{principal}`` - ``ApprovalsRequest`` ->
  ``ApprovalsReply``: ``list`` her live standing approvals, or ``revoke`` one by
  its ``scope_id`` (logged ``APPROVAL_SCOPE_REVOKED``, signed; revoking twice
  logs once). Only that principal may publish on it, and the kernel answers
  only about her own approvals, whatever the request names.

Refusals are ``Refusal`` structs, never exception strings.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

from subjects.constraints import HexId
from subjects.wire import Refusal

ScopeKind = Literal["session", "hour"]


def approvals_subject(prefix: str, principal: str) -> str:
    """One principal's standing-approvals subject: the server lets only that principal publish on it."""
    return f"{prefix}.kernel.approvals.{principal}"


class ApprovalsRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """``list`` the principal's live standing approvals, or ``revoke`` the one named ``scope_id``."""

    op: Literal["list", "revoke"]
    scope_id: HexId | None = None


class StandingApproval(Struct, omit_defaults=True, kw_only=True):
    """One standing approval as its principal sees it (no mandate token, no arguments)."""

    scope_id: str
    kind: ScopeKind
    agent: str
    so_id: str
    action: str
    folder: str
    granted_at: str
    expires_at: str
    moment_id: str
    tool: str | None = None
    session_id: str | None = None  # kind "session": the one session it covers


class ApprovalsReply(Struct, omit_defaults=True):
    ok: bool
    approvals: list[StandingApproval] | None = None
    revoked: StandingApproval | None = None
    event_seq: int | None = None
    already: bool = False  # revoked before (or expired): nothing new was logged
    refusal: Refusal | None = None


approvals_request_decoder = msgspec.json.Decoder(ApprovalsRequest)
approvals_reply_decoder = msgspec.json.Decoder(ApprovalsReply)

WIRE_TYPES: dict[str, Any] = {
    "ApprovalsRequest": ApprovalsRequest,
    "ApprovalsReply": ApprovalsReply,
    "StandingApproval": StandingApproval,
}
