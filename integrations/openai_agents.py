"""OpenAI Agents SDK: tools marked ``needs_approval`` are approved or rejected by the principal (issue 16).

    approvals = PrincipalApprovals(pgw_agent, "alice")
    result = await approvals.run(agent, "pay the invoice")          # Runner.run until no interruption

Each pending ``ToolApprovalItem`` becomes a binding moment (subjects/approval.py):
options ``Approve`` / ``Reject``, the tool's name in the synopsis and stem, one
finding per argument, hatches open (spec 000 §6.8). The principal's answer
resumes the run through ``RunState.approve`` / ``RunState.reject``:

- option 0 approves, option 1 rejects (the SDK's default rejection text);
- a free-text answer or a dialogue veto rejects the call and hands the
  principal's words back to the model as the rejection's message, so the
  agent can act on them (the SDK sends that exact text as the tool's output);
- an expiry rejects with a message saying nobody answered (never a consent).

The correlation id of each moment is derived from ``run_key`` and the tool
call's ``call_id``, so asking again after a restart (from a saved
``RunState``) finds the same moment through the gateway's dedup.
"""

from __future__ import annotations

from typing import Any, Literal

from agents import Agent as SdkAgent
from agents import Runner, RunResult, RunState, ToolApprovalItem

from subjects.approval import (
    Decision,
    approval_moment,
    argument_findings,
    stable_id,
)
from subjects.client import Agent
from subjects.wire import BindingMoment


def call_id_of(item: ToolApprovalItem) -> str:
    raw = item.raw_item
    if isinstance(raw, dict):
        cid = raw.get("call_id") or raw.get("id")
    else:
        cid = getattr(raw, "call_id", None) or getattr(raw, "id", None)
    if not cid:
        raise ValueError(f"the approval item for {item.tool_name!r} carries no call_id: cannot key its moment")
    return str(cid)


class PrincipalApprovals:
    """Ask ``principal`` through the gateway for every tool call an Agents SDK run wants approved."""

    def __init__(
        self,
        agent: Agent,
        principal: str,
        *,
        run_key: str = "",
        recommend: Literal["approve", "reject"] = "approve",
        expires_in_s: int | None = None,
        timeout: float | None = None,
    ) -> None:
        self.agent = agent
        self.principal = principal
        self.run_key = run_key
        self.recommend: Literal["approve", "reject"] = recommend
        self.expires_in_s = expires_in_s
        self.timeout = timeout
        self.decisions: list[tuple[str, Decision]] = []  # (tool name, decision), in order

    def moment_for(self, item: ToolApprovalItem) -> BindingMoment:
        """The approval moment of one tool call: its name, one finding per argument."""
        name = item.tool_name or "an unnamed tool"
        args: Any = item.arguments
        return approval_moment(
            f"call the tool {name}",
            [f"tool = {name}", *argument_findings(args if args is not None else {})],
            recommend=self.recommend,
            approve_reasoning=f"{name} runs with exactly these arguments.",
            reject_reasoning=f"{name} does not run; the agent is told it was rejected.",
        )

    async def decide(self, item: ToolApprovalItem) -> Decision:
        """Ask the principal about one tool call; wait for the answer (an expiry is ``Decision("expired")``)."""
        cid = "oa-" + stable_id("openai-agents", self.run_key, self.principal, call_id_of(item))
        return await self.agent.decide(self.principal, self.moment_for(item), timeout=self.timeout,
                                       correlation_id=cid, expires_in_s=self.expires_in_s)

    async def apply(self, state: RunState[Any], interruptions: list[ToolApprovalItem]) -> None:
        """Decide each pending call and record it on ``state`` (approve, or reject with the principal's words)."""
        for item in interruptions:
            d = await self.decide(item)
            self.decisions.append((item.tool_name or "", d))
            if d.approved:
                state.approve(item)
            elif d.kind == "reject":
                state.reject(item)
            else:
                state.reject(item, rejection_message=d.message())

    async def run(self, agent: SdkAgent[Any], input: str | list[Any] | RunState[Any], *, max_rounds: int = 32, **runner_kw: Any) -> RunResult:
        """``Runner.run`` until the run has no pending approval; each one is put to the principal."""
        result = await Runner.run(agent, input, **runner_kw)
        for _ in range(max_rounds):
            if not result.interruptions:
                return result
            state = result.to_state()
            await self.apply(state, list(result.interruptions))
            result = await Runner.run(result.last_agent, state, **runner_kw)
        raise RuntimeError(f"the run still asked for approval after {max_rounds} rounds")


__all__ = ["Decision", "PrincipalApprovals", "call_id_of"]
