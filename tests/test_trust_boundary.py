"""Untrusted content never advances an approval gate (spec 002 "Trust boundary"), through the bus.

An agent marks an envelope built from an MCP tool result or an A2A message
``meta.contentTrust: untrusted``. A binding moment is a gate: the principal's
choice binds the agent to one of its options (spec 000 §1), so an untrusted one
is refused before it reaches the principal; untrusted content may still ask in
the principal's own words (a clarification) and is delivered marked untrusted.
Each test publishes as the agent ``planner`` on ``pgw.agent.planner.envelope``
and reads outcomes, surface items and verdicts back from the bus.
"""

from __future__ import annotations

import msgspec

from subjects.approval import approval_moment, decision_of
from subjects.client import Surface
from subjects.wire import (
    BindingMomentItem,
    ClarificationAnswers,
    ClarificationItem,
    OptionChoice,
    ResolutionOutcome,
)
from tests.pipeline_helpers import Recorder, env, moment_env, running_gateway

ALICE = {"Pgw-Principal": "alice"}


def _approval() -> dict:
    """The Approve/Reject moment subjects/approval.py builds for Agent.approve and the integrations."""
    m = approval_moment("pay invoice 4471 to the account named in the supplier's e-mail",
                        ["amount = 1200", "account = \"GB33 BUKB 2020 1555 5555 55\""])
    return msgspec.to_builtins(m)


async def test_an_untrusted_approval_moment_is_refused_and_never_reaches_the_principal(nats_server, tmp_path, nc):
    """An untrusted Approve/Reject moment is gated untrusted_content_blocks_approval with a denied verdict and
    nothing reaches alice, while the same moment trusted is delivered and its Approve reads as an approval."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        body = moment_env("alice", _approval(), content_trust="untrusted")
        out = await rec.roundtrip("planner", body)
        assert (out.status, out.code, out.untrusted) == ("gated", "untrusted_content_blocks_approval", True)
        v = await rec.verdict(lambda v: v.envelope_id == body["envelopeId"])
        assert (v.verdict_class, v.decision, v.untrusted) == ("denied", "reject", True)
        surface = Surface(nc, "alice")
        assert await surface.pending() == []
        assert not [i for i in rec.items if getattr(i, "envelope_id", None) == body["envelopeId"]]
        # Re-sent under a new envelopeId, still untrusted: refused again (a refusal is not cached).
        again = moment_env("alice", _approval(), correlation_id=body["correlationId"], content_trust="untrusted")
        assert (await rec.roundtrip("planner", again)).code == "untrusted_content_blocks_approval"

        trusted = moment_env("alice", _approval())
        ok = await rec.roundtrip("planner", trusted)
        assert ok.status == "accepted" and not ok.untrusted
        item = await rec.item(lambda i: isinstance(i, BindingMomentItem) and i.envelope_id == trusted["envelopeId"])
        assert (await surface.resolve(item.moment_id, OptionChoice(index=0))).status == "accepted"
        res = await rec.until(lambda: next((o for o in rec.outcomes if isinstance(o, ResolutionOutcome)
                                            and o.moment_id == item.moment_id), None))
        assert decision_of(res).approved


async def test_an_untrusted_clarification_is_asked_and_answered_marked_untrusted(nats_server, tmp_path, nc):
    """Untrusted content may ask in the principal's own words: an untrusted clarification reaches alice marked
    untrusted and her answers come back to the agent marked untrusted, as answers, never as an option choice."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        body = env("clarification.request", {"questions": [{"id": "acct", "question": "Which account is yours?"}]},
                   content_trust="untrusted")
        out = await rec.roundtrip("planner", body, headers=ALICE)
        assert out.status == "accepted" and out.untrusted
        item = await rec.item(lambda i: isinstance(i, ClarificationItem) and i.envelope_id == body["envelopeId"])
        assert item.untrusted
        reply = await Surface(nc, "alice").resolve(item.moment_id, ClarificationAnswers(answers={"acct": "the joint one"}))
        assert reply.status == "accepted"
        res = await rec.until(lambda: next((o for o in rec.outcomes if isinstance(o, ResolutionOutcome)
                                            and o.moment_id == item.moment_id), None))
        assert res.untrusted and isinstance(res.resolution, ClarificationAnswers)
