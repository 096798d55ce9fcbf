"""The agent's moment query: ``{prefix}.agent.{agent}.moment`` (request-reply, served by the gateway).

An addition to the bus contract (DESIGN §2 lists the agent's other subjects):
``MomentQuery`` -> ``MomentState``, the state of one moment the agent opened
(a binding moment, a clarification or a HEM escalation) and, once it is
closed, the very outcome the gateway published on ``agent.{agent}.outcome``
when it closed (``resolution``, ``moment_expired`` or ``hem_decision``).

The list form (``{"list": "open"}``, an addition): the agent's own moments,
newest first, at most ``limit`` of them (status ``listed``), so a process
that lost track of a moment's id (an MCP host whose server restarted before
it saw the id) finds it and waits on it again.

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

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from subjects.constraints import HexId, PrincipalToken, Timestamp
from subjects.wire import HemDecision, MomentExpired, Refusal, ResolutionOutcome

# The outcomes that close a moment (DESIGN §4.3).
ClosingOutcome = ResolutionOutcome | MomentExpired | HemDecision


# How many moments one list query returns at most, and by default.
MAX_LIST_LIMIT = 50
DEFAULT_LIST_LIMIT = 20
ListWhich = Literal["open", "closed", "all"]


class MomentQuery(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Request on ``agent.{agent}.moment``: one moment (``moment_id``) or a list (``list``), never both.

    ``principal`` is optional: when the agent knows whom it asked, the gateway
    reads the record directly instead of looking the moment up by id; with
    ``list`` it keeps only the moments sent to that principal.
    ``list``: ``open`` (pending), ``closed`` (answered or expired) or ``all``,
    newest first, at most ``limit`` (default 20, at most 50).
    """

    moment_id: HexId | None = None
    principal: PrincipalToken | None = None
    list_: ListWhich | None = msgspec.field(default=None, name="list")
    limit: Annotated[int, Meta(ge=1, le=MAX_LIST_LIMIT)] | None = None

    def __post_init__(self) -> None:
        # msgspec turns these into a ValidationError: the gateway refuses with invalid_query.
        if (self.moment_id is None) == (self.list_ is None):
            raise ValueError("a moment query has exactly one of moment_id (one moment) and list (open, closed or all)")
        if self.limit is not None and self.list_ is None:
            raise ValueError("limit goes with list, not with moment_id")


class MomentSummary(Struct, omit_defaults=True):
    """One moment of a list reply: enough to recognise it and wait on it again (``moment_id``).

    ``status`` is the desk's: ``pending``, ``resolved`` or ``expired`` (an
    expiry due but not yet recorded is still ``pending``). ``synopsis`` is the
    moment's synopsis, or a clarification's first question, cut to 200 characters.
    """

    moment_id: str
    principal: str
    kind: Literal["binding_moment", "clarification", "hem"]
    status: Literal["pending", "resolved", "expired"]
    created_at: Timestamp
    correlation_id: str
    synopsis: str | None = None
    expires_at: Timestamp | None = None
    closed_at: Timestamp | None = None


class MomentState(Struct, omit_defaults=True):
    """Reply on ``agent.{agent}.moment``.

    ``pending``: the principal has not answered and it has not expired (an
    expiry due but not yet recorded is still ``pending``; its outcome follows).
    ``closed``: ``outcome`` is the outcome that closed it, the same message the
    agent's outcome subject carried. ``unknown``: no such moment of this agent
    (never opened, another agent's, or older than the desk keeps records).
    ``refused``: the query itself was malformed; ``refusal`` says why.
    ``listed``: the reply to a ``list`` query: ``moments``, newest first, and
    ``more`` when the agent has more moments of that kind than were returned.
    """

    status: Literal["pending", "closed", "unknown", "refused", "listed"]
    moment_id: str | None = None
    outcome: ClosingOutcome | None = None
    refusal: Refusal | None = None
    moments: list[MomentSummary] | None = None
    more: bool = False


moment_query_decoder = msgspec.json.Decoder(MomentQuery)
moment_state_decoder = msgspec.json.Decoder(MomentState)

WIRE_TYPES: dict[str, type] = {"MomentQuery": MomentQuery, "MomentState": MomentState, "MomentSummary": MomentSummary}

__all__ = [
    "DEFAULT_LIST_LIMIT",
    "MAX_LIST_LIMIT",
    "ClosingOutcome",
    "ListWhich",
    "MomentQuery",
    "MomentState",
    "MomentSummary",
    "moment_query_decoder",
    "moment_state_decoder",
]
