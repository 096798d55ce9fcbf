"""LangGraph: ask the principal from inside a node, where the node would call ``interrupt()`` (issue 16).

    async def review(state, config):
        res = await ask_principal(pgw_agent, "alice", moment)          # ResolutionOutcome
        ok = await approve(pgw_agent, "alice", "send the invoice", ["total = 120 EUR"])  # Decision

The node waits for the principal's answer (a durable wait on the gateway, not
in the graph's memory). Where ``interrupt()`` would stop the graph and leave
the resume to someone else, this keeps the node running; what makes it safe
across a restart is the checkpointer plus a deterministic ``correlationId``:

- the correlation id is derived from the thread id, the node's checkpoint
  namespace (which holds LangGraph's task id, the same when the graph resumes
  the same step from the checkpointer) and the index of the ask within the node;
- a process killed while the principal thinks is restarted with
  ``graph.ainvoke(None, config)`` on the same thread: LangGraph re-runs the
  unfinished node from its checkpoint, the node asks again, and the gateway's
  dedup (stage 8, spec 002 "Replay determinism") answers with the SAME moment
  instead of opening a second one; the wait then asks the gateway for that
  moment's state (``agent.{agent}.moment``), so an answer given meanwhile is
  returned at once, even one the killed process had already read from the
  agent's outcome consumer before LangGraph checkpointed the node.
"""

from __future__ import annotations

from typing import Any, Literal
from weakref import WeakKeyDictionary

from langgraph.config import get_config
from langgraph.runtime import get_runtime

from subjects.approval import Decision, approval_moment, decision_of, stable_id
from subjects.client import Agent
from subjects.errors import RefusedError
from subjects.wire import BindingMoment, ResolutionOutcome

# Answers this process has already read, per client and correlation id: a node that LangGraph retries
# (RetryPolicy) asks again and gets the answer it had at once, without a round trip to the gateway.
_answers: WeakKeyDictionary[Agent, dict[str, ResolutionOutcome]] = WeakKeyDictionary()
_ASKS = "__pgw_asks"  # our counter of asks in the running task attempt, kept in the task's configurable dict


def moment_key(config: dict[str, Any] | None = None) -> str:
    """The deterministic correlation id of the next ask in the running node (see the module docstring).

    Reads LangGraph's public ``Runtime.execution_info`` (LangGraph >= 1.1): the
    thread id, the checkpoint namespace (which holds the task id of the step)
    and the attempt the node is in.
    """
    config = config or get_config()
    conf = config.setdefault("configurable", {})
    runtime = get_runtime()
    info = getattr(runtime, "execution_info", None)
    if info is None:
        raise ValueError("ask_principal must be called from a node of a running graph (LangGraph >= 1.1)")
    if info.thread_id is None:
        raise ValueError("ask_principal needs a checkpointer and a thread_id in the config: without them a restart cannot find the same moment")
    # The index of this ask within this attempt of the task. A retry (RetryPolicy) or a restart re-runs
    # the node from its first line, so the count starts again at 0 with each new attempt; LangGraph gives
    # every attempt its own Runtime (execution_info.node_attempt differs), which marks whose count it is.
    owner, idx = conf.get(_ASKS, (None, 0))
    if owner is not runtime:
        idx = 0
    conf[_ASKS] = (runtime, idx + 1)
    return "lg-" + stable_id("langgraph", str(info.thread_id), str(info.checkpoint_ns), str(idx))


async def ask_principal(
    agent: Agent,
    principal: str,
    moment: BindingMoment | dict[str, Any],
    *,
    key: str | None = None,
    expires_in_s: int | None = None,
    timeout: float | None = None,
) -> ResolutionOutcome:
    """Send ``moment`` to ``principal`` and wait for the resolution (all three kinds of spec 000 §7.3).

    Call it from an async node of a graph compiled with a checkpointer. ``key``
    overrides the derived correlation id. Raises ``RefusedError`` when the
    gateway refuses the moment (every violated rule in its details) or the
    moment expires (code ``expired``).
    """
    cid = key or moment_key()
    known = _answers.setdefault(agent, {})
    if cid in known:
        return known[cid]
    res = await agent.ask(principal, moment, timeout=timeout, correlation_id=cid, expires_in_s=expires_in_s)
    known[cid] = res
    if len(known) > 10_000:
        known.pop(next(iter(known)))
    return res


async def approve(
    agent: Agent,
    principal: str,
    action: str,
    findings: list[str],
    *,
    recommend: Literal["approve", "reject"] = "approve",
    key: str | None = None,
    expires_in_s: int | None = None,
    timeout: float | None = None,
) -> Decision:
    """The yes/no idiom (``if interrupt("ok?"):``) as a two-option moment; an expiry is a ``Decision("expired")``."""
    moment = approval_moment(action, findings, recommend=recommend)
    try:
        res = await ask_principal(agent, principal, moment, key=key, expires_in_s=expires_in_s, timeout=timeout)
    except RefusedError as e:
        if e.code == "expired":
            return decision_of(None)
        raise
    return decision_of(res)


__all__ = ["Decision", "approval_moment", "approve", "ask_principal", "moment_key"]
