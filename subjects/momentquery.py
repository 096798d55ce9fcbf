"""The agent's moment query: ``{prefix}.agent.{agent}.moment`` (request-reply, served by the gateway).

An addition to the bus contract (DESIGN §2 lists the agent's other subjects):
``MomentQuery`` -> ``MomentState``, the state of one moment the agent opened
(a binding moment, a clarification or a HEM escalation) and, once it is
closed, the very outcome the gateway published on ``agent.{agent}.outcome``
when it closed (``resolution``, ``moment_expired`` or ``hem_decision``).

Why it exists: outcomes reach an agent through its durable consumer, which
hands each message out once. A process that read (and acknowledged) an answer
and died before acting on it (an MCP server restarted, a LangGraph process
killed before its checkpoint) would otherwise wait for an answer that will
never come again. The query re-reads it from the moment desk, whose record
is durable (KV ``PGW_MOMENTS``) for 30 days. ``subjects.client.Agent`` asks
it whenever it starts waiting on a moment.

Only the agent that opened the moment learns anything: the server lets only
agent A publish on ``agent.A.moment`` (DESIGN §7), and the gateway answers
``unknown`` for a moment of another agent, exactly as for one that does not
exist (no existence oracle).
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import Struct

from subjects.constraints import HexId, PrincipalToken
from subjects.wire import HemDecision, MomentExpired, Refusal, ResolutionOutcome

# The outcomes that close a moment (DESIGN §4.3).
ClosingOutcome = ResolutionOutcome | MomentExpired | HemDecision


class MomentQuery(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Request on ``agent.{agent}.moment``.

    ``principal`` is optional: when the agent knows whom it asked, the gateway
    reads the record directly instead of looking the moment up by id.
    """

    moment_id: HexId
    principal: PrincipalToken | None = None


class MomentState(Struct, omit_defaults=True):
    """Reply on ``agent.{agent}.moment``.

    ``pending``: the principal has not answered and it has not expired (an
    expiry due but not yet recorded is still ``pending``; its outcome follows).
    ``closed``: ``outcome`` is the outcome that closed it, the same message the
    agent's outcome subject carried. ``unknown``: no such moment of this agent
    (never opened, another agent's, or older than the desk keeps records).
    ``refused``: the query itself was malformed; ``refusal`` says why.
    """

    status: Literal["pending", "closed", "unknown", "refused"]
    moment_id: str | None = None
    outcome: ClosingOutcome | None = None
    refusal: Refusal | None = None


moment_query_decoder = msgspec.json.Decoder(MomentQuery)
moment_state_decoder = msgspec.json.Decoder(MomentState)

WIRE_TYPES: dict[str, type] = {"MomentQuery": MomentQuery, "MomentState": MomentState}

__all__ = ["ClosingOutcome", "MomentQuery", "MomentState", "moment_query_decoder", "moment_state_decoder"]
