"""The ``Nats-Msg-Id`` binding of DESIGN §7: the id names its sender.

JetStream drops a message whose ``Nats-Msg-Id`` was already seen by the
stream within the duplicate window, and the publisher chooses the header.
All agents share ``PGW_INBOUND``, so agent B could pre-use ``A:{envelopeId}``
on its own subject and A's real envelope would be dropped by the server.
Two halves close this:

1. This stage: an envelope whose ``Nats-Msg-Id`` has the form
   ``{token}:...`` with a token other than the agent token *of the subject
   it arrived on* (which the server authenticated, DESIGN §7 permissions) is
   refused as ``invalid_msg_id``, with a verdict naming the real sender. For
   the first envelope of a turn the rest of the id must be its
   ``envelopeId`` (optionally ``:{suffix}``: the salt of 2, or the
   ``:replay:{seq}`` of ``pgw replay``). Ids without ``:`` claim no
   identity and cannot collide with an agent's id; ``replay:{stream}:{seq}``
   is reserved for ``pgw replay``.
2. ``subjects.client.Agent.send``: a first publish whose PubAck says
   ``duplicate`` (the id was pre-used by someone) is re-sent once under
   ``{agent}:{envelopeId}:{random salt}``, which nobody can guess. The
   gateway's correlationId dedup (spec 002 step 8) keeps a genuine retry of
   the agent's own earlier publish from being acted on twice.
"""

from __future__ import annotations

from gateway.stages.base import Ctx, Refuse
from subjects.wire import Detail

CODE = "invalid_msg_id"
REPLAY_PREFIX = "replay:"


def expected_prefix(agent: str) -> str:
    return f"{agent}:"


def check(agent: str, msg_id: str | None, envelope_id: str | None, *, first: bool) -> str | None:
    """Why ``msg_id`` is not a valid id for ``agent``'s envelope; None when it is."""
    if msg_id is None or ":" not in msg_id:
        # No identity claimed: it cannot collide with any agent's '{agent}:...' id.
        return None
    head = expected_prefix(agent)
    if msg_id.startswith(REPLAY_PREFIX) and not msg_id.startswith(head):
        return None  # ops replays (consumers/replay.py) of messages that carried no id
    if not msg_id.startswith(head):
        return f"Nats-Msg-Id claims another sender; it must start with the sending agent's token {head!r}"
    if first and envelope_id is not None:
        rest = msg_id[len(head) :]
        if rest != envelope_id and not rest.startswith(envelope_id + ":"):
            return "Nats-Msg-Id must be '{agent}:{envelopeId}' of the turn's first envelope"
    return None


async def run(ctx: Ctx) -> None:
    """Pipeline stage, right after shape (the envelope id is known)."""
    why = check(ctx.agent, ctx.turn.msg_id, ctx.envelope_id, first=ctx.index == 0)
    if why:
        raise Refuse(CODE, why, details=[Detail(message=why, path="header:Nats-Msg-Id", rule="DESIGN §7")])
