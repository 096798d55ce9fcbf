"""OpenAI Agents SDK (issue 16): a ``needs_approval`` tool becomes a binding moment; the principal's answer on the
bus approves, rejects, or is handed back to the model as the rejection's message. A real Agent and Runner, a
scripted model, a real nats-server and gateway."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("agents")

from agents import Agent as SdkAgent
from agents import function_tool, set_tracing_disabled

from integrations.openai_agents import PrincipalApprovals
from subjects.client import Agent, Surface
from subjects.wire import BindingMomentItem, DialogueVeto, FreeTextAnswer, OptionChoice, Resolution
from tests.polling import until
from tests.scripted_model import ScriptedModel

set_tracing_disabled(True)  # no trace export: nothing leaves the machine


def payer(paid: list[tuple[str, int]]) -> tuple[SdkAgent, ScriptedModel]:
    @function_tool(needs_approval=True)
    def pay_invoice(invoice: str, amount_eur: int) -> str:
        """Pay an invoice."""
        paid.append((invoice, amount_eur))
        return f"paid {invoice}"

    model = ScriptedModel("pay_invoice", {"invoice": "INV-7", "amount_eur": 120})
    return SdkAgent(name="payer", instructions="Pay what you are asked to.", tools=[pay_invoice], model=model), model


async def run_answered(nc, answer: Resolution) -> tuple[list[tuple[str, int]], ScriptedModel, BindingMomentItem, PrincipalApprovals, str]:
    paid: list[tuple[str, int]] = []
    sdk_agent, model = payer(paid)
    pgw = Agent(nc, "payer")
    approvals = PrincipalApprovals(pgw, "alice", run_key="run-1", timeout=60)
    surface = Surface(nc, "alice")
    run = asyncio.ensure_future(approvals.run(sdk_agent, "pay INV-7"))
    try:
        items = await until(surface.pending, timeout=30, what="the approval moment")
        item = items[0]
        assert isinstance(item, BindingMomentItem)
        assert (await surface.resolve(item.moment_id, answer)).status == "accepted"
        result = await asyncio.wait_for(run, 60)
    finally:
        run.cancel()
        await pgw.close()
    return paid, model, item, approvals, str(result.final_output)


async def test_a_needs_approval_tool_call_is_a_two_option_moment_and_approve_runs_it(nats_server, gateway, nc):
    """The call is put as Approve/Reject with the tool and each argument as findings, hatches open; option 0 runs the tool."""
    paid, _model, item, approvals, final = await run_answered(nc, OptionChoice(index=0))
    q = item.binding_moment.question
    assert [o.label for o in q.options] == ["Approve", "Reject"] and q.recommended_idx == 0
    assert q.hatches.free_text and q.hatches.dialogue
    assert item.binding_moment.findings == ["tool = pay_invoice", 'invoice = "INV-7"', "amount_eur = 120"]
    assert paid == [("INV-7", 120)]
    assert final == "tool said: paid INV-7"
    assert [d.kind for _, d in approvals.decisions] == ["approve"]


async def test_reject_does_not_run_the_tool(nats_server, gateway, nc):
    """Option 1 rejects: the tool never runs and the model is told so."""
    paid, model, _, approvals, _ = await run_answered(nc, OptionChoice(index=1))
    assert paid == []
    assert [d.kind for _, d in approvals.decisions] == ["reject"]
    assert len(model.seen_tool_outputs) == 1 and "paid" not in model.seen_tool_outputs[0]


async def test_a_free_text_answer_is_handed_back_as_the_rejections_message(nats_server, gateway, nc):
    """A free-text answer is not a consent: the tool does not run and the model reads the principal's words."""
    paid, model, _, _, final = await run_answered(nc, FreeTextAnswer(text="only pay 100 EUR, the rest is disputed"))
    assert paid == []
    assert "only pay 100 EUR, the rest is disputed" in model.seen_tool_outputs[0]
    assert "only pay 100 EUR" in final


async def test_a_dialogue_veto_is_handed_back_as_the_rejections_message(nats_server, gateway, nc):
    """A dialogue veto rejects the framing: the tool does not run and the model reads the objection."""
    paid, model, _, _, _ = await run_answered(nc, DialogueVeto(objection="why is this invoice paid by an agent at all?"))
    assert paid == []
    assert "rejected the question itself" in model.seen_tool_outputs[0]
    assert "why is this invoice paid by an agent at all?" in model.seen_tool_outputs[0]


async def test_asking_again_for_the_same_call_finds_the_same_moment(nats_server, gateway, nc):
    """A run lost while the principal thinks and started again with the same run_key asks about the same call_id:
    the gateway's dedup gives the same moment, so there is one item and the answer reaches the new run (only a
    wait on the first moment can get it)."""
    paid: list[tuple[str, int]] = []
    surface = Surface(nc, "alice")
    lost_agent, _ = payer(paid)
    lost_pgw = Agent(nc, "payer")
    lost = asyncio.ensure_future(PrincipalApprovals(lost_pgw, "alice", run_key="run-2").run(lost_agent, "pay INV-7"))
    first = (await until(surface.pending, timeout=30, what="the approval moment"))[0]
    lost.cancel()  # the process is gone: its run and its outcome reader with it
    await lost_pgw.close()
    pgw = Agent(nc, "payer")
    again_agent, _ = payer(paid)
    approvals = PrincipalApprovals(pgw, "alice", run_key="run-2", timeout=60)
    again = asyncio.ensure_future(approvals.run(again_agent, "pay INV-7"))
    try:
        assert (await surface.resolve(first.moment_id, OptionChoice(index=0))).status == "accepted"
        result = await asyncio.wait_for(again, 60)
    finally:
        again.cancel()
        await pgw.close()
    assert paid == [("INV-7", 120)] and str(result.final_output) == "tool said: paid INV-7"
    assert await surface.pending() == []


class Died(Exception):
    """Stands for the end of the process (SystemExit would stop pytest's event loop itself)."""


class DiesAfterReading(PrincipalApprovals):
    """A run whose process dies right after its client read (and acknowledged) the principal's answer,
    before the answer was recorded on the RunState."""

    async def decide(self, item):  # type: ignore[no-untyped-def]
        self.read = await super().decide(item)
        raise Died("the process dies here")


async def test_an_answer_read_by_a_run_that_died_reaches_the_run_started_again(nats_server, gateway, nc):
    """The first run reads alice's answer and dies before acting on it; its outcome consumer will not deliver the
    answer again. The run started again with the same run_key gets the same moment and that answer from the
    gateway's moment query: the tool runs once, and alice was asked once."""
    paid: list[tuple[str, int]] = []
    surface = Surface(nc, "alice")
    first_agent, _ = payer(paid)
    first_pgw = Agent(nc, "payer")
    dying = DiesAfterReading(first_pgw, "alice", run_key="run-4", timeout=60)
    first = asyncio.ensure_future(dying.run(first_agent, "pay INV-7"))
    item = (await until(surface.pending, timeout=30, what="the approval moment"))[0]
    assert (await surface.resolve(item.moment_id, OptionChoice(index=0))).status == "accepted"
    with pytest.raises(Died):
        await asyncio.wait_for(first, 60)
    assert dying.read.kind == "approve" and paid == []
    await first_pgw.close()
    pgw = Agent(nc, "payer")
    again_agent, _ = payer(paid)
    try:
        result = await asyncio.wait_for(PrincipalApprovals(pgw, "alice", run_key="run-4", timeout=60).run(again_agent, "pay INV-7"), 60)
    finally:
        await pgw.close()
    assert paid == [("INV-7", 120)] and str(result.final_output) == "tool said: paid INV-7"
    moments = await nc.jetstream().stream_info("KV_PGW_MOMENTS", subjects_filter="$KV.PGW_MOMENTS.alice.*")
    assert list(moments.state.subjects or {}) == [f"$KV.PGW_MOMENTS.alice.{item.moment_id}"]


async def test_an_expired_moment_rejects_the_call_and_says_so(nats_server, gateway, nc):
    """Nobody answers before expiry: the tool does not run (an expiry is never a consent) and the model is told why."""
    paid: list[tuple[str, int]] = []
    sdk_agent, model = payer(paid)
    pgw = Agent(nc, "payer")
    approvals = PrincipalApprovals(pgw, "alice", run_key="run-3", expires_in_s=1, timeout=60)
    try:
        await asyncio.wait_for(approvals.run(sdk_agent, "pay INV-7"), 60)
    finally:
        await pgw.close()
    assert paid == []
    assert [d.kind for _, d in approvals.decisions] == ["expired"]
    assert "did not answer before the request expired" in model.seen_tool_outputs[0]
