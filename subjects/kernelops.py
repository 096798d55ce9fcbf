"""The kernel's request-reply subjects for people rather than agents: revocation and audit.

* ``{prefix}.kernel.revoke`` - ``RevokeRequest`` -> ``RevokeReply``: revoke a
  mandate now, on every gateway (gateway/kernel/revocation.py,
  ``pgw mandate revoke``).
* ``{prefix}.kernel.audit.{auditor}`` - ``AuditRequest`` -> ``AuditReply``: the Session
  Audit Record of a session, or one IDP's record (spec 003 §4.2, §9;
  gateway/kernel/audit.py, ``pgw audit``).

Refusals are ``Refusal`` structs, never exception strings.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from subjects.wire import Refusal

# A revocation is signed by a key the kernel trusts to issue mandates (or by a
# configured revoker): a compact JWS whose claims are {"revoke_jti", "iat", "reason"?}.
RevocationToken = Annotated[str, Meta(min_length=1, max_length=8192)]
Jti = Annotated[str, Meta(min_length=1, max_length=256)]
AgentName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


def revoke_subject(prefix: str) -> str:
    return f"{prefix}.kernel.revoke"


def audit_subject(prefix: str, auditor: str) -> str:
    """One audit principal's query subject: the server lets only that principal publish on it."""
    return f"{prefix}.kernel.audit.{auditor}"


class RevokeRequest(Struct, forbid_unknown_fields=True):
    token: RevocationToken


class RevokeReply(Struct, omit_defaults=True):
    ok: bool
    jti: str | None = None
    event_seq: int | None = None
    already: bool = False
    refusal: Refusal | None = None


class AuditRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """One Audit Principal query: a session of an agent, or one IDP by id."""

    kind: Literal["session", "idp"]
    id: Jti
    agent: AgentName | None = None  # sessions are per agent; required for kind "session"
    # Paging: a record larger than half the server's max payload ends early and names
    # ``next_from_seq``; ask again with it for the rest.
    from_seq: Annotated[int, Meta(ge=0)] = 0


class AuditReply(Struct, omit_defaults=True):
    ok: bool
    record: dict[str, Any] | None = None
    refusal: Refusal | None = None


revoke_request_decoder = msgspec.json.Decoder(RevokeRequest)
revoke_reply_decoder = msgspec.json.Decoder(RevokeReply)
audit_request_decoder = msgspec.json.Decoder(AuditRequest)
audit_reply_decoder = msgspec.json.Decoder(AuditReply)

WIRE_TYPES: dict[str, Any] = {
    "RevokeRequest": RevokeRequest,
    "RevokeReply": RevokeReply,
    "AuditRequest": AuditRequest,
    "AuditReply": AuditReply,
}
