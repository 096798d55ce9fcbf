"""The moments the gateway builds itself keep the discipline it enforces on agents (spec 000 §6.1, §6.3, §7.1).

Every binding moment the gateway or its kernel constructs (today the human-escalation
moment, ``gateway.kernel.hem.hem_moment``, for each of its three triggers) is run through
the same slot grammar and construction-discipline lints as an agent's moment, including
when the agent-authored text it quotes (action, goal, session id) is itself a hedge.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import msgspec
import pytest

from gateway.kernel.hem import hem_moment
from gateway.stages import lints
from gateway.stages.moment_grammar import check_binding_moment
from subjects.idp import IdpStandard, IdpThin
from tests.kernel_support import idp, thin

TRIGGERS = ["HEM_URGENCY_REQUIRED", "MISSION_REF_MISMATCH_THRESHOLD", "IDP_COMMITMENT_GAP", "SOME_FUTURE_TRIGGER"]
HOSTILE = dict(  # agent-authored text that would trip the lints if quoted in the synopsis or stem
    action="Maybe pay. Recommended", session="it depends. Surely",
    goal="Maybe pay the invoice. It depends on the client. Up to you?",
)


def _idp(profile: str, hostile: bool) -> Any:
    over = {"requested_action": HOSTILE["action"], "session_id": HOSTILE["session"],
            "declared_goal": {"goal_id": str(uuid.uuid4()), "description": HOSTILE["goal"]}} if hostile else {}
    rec = idp(so_id=str(uuid.uuid4()), mandate_id="m-1", step=1, action="ProcessPayment", **over)
    if profile == "thin":
        return msgspec.convert(thin(rec), IdpThin)
    return msgspec.convert(rec, IdpStandard)


def every_gateway_moment() -> list[tuple[str, Any]]:
    out = []
    for trigger, profile, hostile, cedar, agent in itertools.product(
            TRIGGERS, ["standard", "thin"], [False, True], [None, "PERMIT", "DENY"], ["planner", "perhaps-bot"]):
        verification = ({"match_result": "IDP_COMMITMENT_GAP", "executed_action": "RefundPayment"}
                        if trigger == "IDP_COMMITMENT_GAP" else None)
        m = hem_moment(agent=agent, idp=_idp(profile, hostile), trigger=trigger, cedar=cedar, verification=verification)
        out.append((f"{trigger}-{profile}-{'hostile' if hostile else 'plain'}-{cedar}-{agent}", m))
    return out


MOMENTS = every_gateway_moment()


@pytest.mark.parametrize("name,moment", MOMENTS, ids=[n for n, _ in MOMENTS])
def test_every_gateway_moment_passes_the_agents_grammar_and_lints(name: str, moment: Any) -> None:
    """Each moment the gateway can build is well-formed, raises no lint finding, commits to its
    recommended option in the synopsis and carries at least one recommendation."""
    assert check_binding_moment(msgspec.to_builtins(moment)) == []
    assert lints.check(moment) == []
    assert moment.recommendations, "spec 000 §6.3: at least one concrete move"
    recommended = moment.question.options[moment.question.recommended_idx].label
    # answer-first, as the gateway's policy's recommendation (never reading as a decision already taken)
    assert recommended == "Deny" and moment.synopsis.startswith("The gateway's policy recommends"), moment.synopsis
