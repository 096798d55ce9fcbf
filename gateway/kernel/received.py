"""``IDP_RECEIVED``: a valid IDP the session does not admit, committed before its answer.

spec 003 §5.3 commits every IDP before Cedar runs, as ``IDP_SUBMITTED``. An
IDP that passes validation (§5.2 (a)-(e)) while its session is HEM_PENDING
(§6.2: no transition proceeds) or TERMINATED is never evaluated, yet it is
still a declaration of intent the agent made: it is committed to the log,
signed and server-acknowledged, before the kernel answers (Enriched DENY
``HEM_PENDING`` or REJECT ``SESSION_TERMINATED``) and before its verdict.

The same holds for a well-formed IDP (it passed §5.2 (a) and (b)) that
validation then refuses: a duplicate idp_id (a replay, §8.4), a mandate that
is invalid, expired or revoked, a so_id or mandate_id that does not match, a
step already taken, an IDP_THIN where it is not accepted. It is committed as
``IDP_RECEIVED`` with ``code`` = the REJECT code and ``session_state`` null
(not read, or not reached), before the REJECT and its verdict. An IDP that is
missing or malformed (``IDP_MISSING``, ``IDP_MALFORMED``: this includes
personal data in ``pii = "reject"`` mode, which must not enter an append-only
log, §9) is not an IDP: only its ``denied`` verdict records it.

It is its own event type, not an ``IDP_SUBMITTED``: it takes no step of the
session and does not make its idp_id taken (the index rebuilt from the log,
``state.apply``, ignores it), so the agent may send the same step again once
the human has decided, exactly as before. Its body is an ``IDP_SUBMITTED``
body (the full IDP as submitted, both timestamps, mandate_id, session_id,
audit_accessible) plus the session state and the answer's code.
"""

from __future__ import annotations

from typing import Any

from subjects.idp import decode_idp, profile_of
from subjects.util import stable_id

EVENT = "IDP_RECEIVED"


_NOT_AN_IDP = frozenset({"IDP_MISSING", "IDP_MALFORMED", "REQUEST_MALFORMED", "SESSION_TERMINATED"})


async def commit_refused(kernel: Any, agent: str, idp_raw: Any, receipt: str, code: str, tp: str | None) -> int | None:
    """Commit a well-formed IDP that validation refused with ``code``; its sequence, or None.

    ``SESSION_TERMINATED`` is committed where it is found, with the mandate's
    principal (``commit_received``); the codes of ``_NOT_AN_IDP`` are not IDPs.
    """
    if code in _NOT_AN_IDP:
        return None
    try:
        idp = decode_idp(idp_raw)
    except Exception:  # noqa: BLE001 - not decodable: not an IDP, nothing to commit
        return None
    body = {
        "idp": idp_raw, "kernel_receipt_ts": receipt, "agent_ts": idp.timestamp, "idp_id": idp.idp_id,
        "so_id": idp.so_id, "session_id": idp.session_id, "mandate_id": idp.mandate_id,
        "step_sequence": idp.step_sequence, "requested_action": idp.requested_action,
        "audit_accessible": idp.audit_accessible, "profile": profile_of(idp), "agent": agent,
        "principal": None,  # the mandate may be the very thing refused
    }
    return await commit_received(kernel, body, session_state=None, code=code, moment_id=None, tp=tp)


async def commit_received(
    kernel: Any, submitted_body: dict[str, Any], *, session_state: str | None, code: str,
    moment_id: str | None, tp: str | None,
) -> int:
    """Append ``IDP_RECEIVED`` and wait for the server's ack; its sequence."""
    body = {**submitted_body, "session_state": session_state, "code": code, "hem_moment_id": moment_id}
    so, idp_id = submitted_body["so_id"].lower(), submitted_body["idp_id"].lower()
    # One event per IDP and session situation: a retried request is deduplicated,
    # the same IDP sent again after the human decided is a new receipt.
    ev = await kernel.eventlog.append(
        EVENT, body, msg_id=stable_id(EVENT, so, idp_id, session_state or "", code, moment_id or ""), traceparent=tp,
    )
    return ev.seq
