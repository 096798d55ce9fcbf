"""``IDP_RECEIVED``: a valid IDP the session does not admit, committed before its answer.

spec 003 §5.3 commits every IDP before Cedar runs, as ``IDP_SUBMITTED``. An
IDP that passes validation (§5.2 (a)-(e)) while its session is HEM_PENDING
(§6.2: no transition proceeds) or TERMINATED is never evaluated, yet it is
still a declaration of intent the agent made: it is committed to the log,
signed and server-acknowledged, before the kernel answers (Enriched DENY
``HEM_PENDING`` or REJECT ``SESSION_TERMINATED``) and before its verdict.

It is its own event type, not an ``IDP_SUBMITTED``: it takes no step of the
session and does not make its idp_id taken (the index rebuilt from the log,
``state.apply``, ignores it), so the agent may send the same step again once
the human has decided, exactly as before. Its body is an ``IDP_SUBMITTED``
body (the full IDP as submitted, both timestamps, mandate_id, session_id,
audit_accessible) plus the session state and the answer's code.
"""

from __future__ import annotations

from typing import Any

from subjects.util import stable_id

EVENT = "IDP_RECEIVED"


async def commit_received(
    kernel: Any, submitted_body: dict[str, Any], *, session_state: str, code: str,
    moment_id: str | None, tp: str | None,
) -> int:
    """Append ``IDP_RECEIVED`` and wait for the server's ack; its sequence."""
    body = {**submitted_body, "session_state": session_state, "code": code, "hem_moment_id": moment_id}
    so, idp_id = submitted_body["so_id"].lower(), submitted_body["idp_id"].lower()
    # One event per IDP and session situation: a retried request is deduplicated,
    # the same IDP sent again after the human decided is a new receipt.
    ev = await kernel.eventlog.append(
        EVENT, body, msg_id=stable_id(EVENT, so, idp_id, session_state, moment_id or ""), traceparent=tp,
    )
    return ev.seq
