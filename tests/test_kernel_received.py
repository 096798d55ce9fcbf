"""Every IDP the kernel receives is committed to the event log before its answer, in every session state (spec 003 §5.3)."""

from __future__ import annotations

from typing import Any

from gateway.kernel.service import KernelService
from subjects.idp import EnrichedDeny, HemPending, Permit
from tests.kernel_support import read_log
from tests.test_kernel_hem import Env, env

__all__ = ["env"]


async def test_an_idp_sent_while_hem_pending_is_committed_before_its_denial(env: Env) -> None:
    """A valid IDP sent while the session is HEM_PENDING is in the log (full IDP, signed) before its DENY verdict;
    it takes no step, so the same step goes through once the session is back."""
    kernel = next(p for p in env.gw.parts if isinstance(p, KernelService))
    order: list[str] = []
    real_append, real_verdict = kernel.eventlog.append, kernel.publisher.verdict

    async def append(event_type: str, body: Any, **kw: Any) -> Any:
        res = await real_append(event_type, body, **kw)
        order.append(f"log:{event_type}:{body.get('idp_id')}")
        return res

    async def verdict(v: Any) -> Any:
        order.append(f"verdict:{v.verdict_class}:{v.idp_id}")
        return await real_verdict(v)

    kernel.eventlog.append = append  # type: ignore[method-assign]
    kernel.publisher.verdict = verdict  # type: ignore[method-assign]
    assert isinstance(await env.send(env.idp(1, hem_urgency="REQUIRED")), HemPending)
    held = env.idp(2, "ReadBooking", metadata={"ticket": "T-7"})
    blocked = await env.send(held)
    assert isinstance(blocked, EnrichedDeny) and blocked.deny_code == "HEM_PENDING"
    got = await read_log(env.js, "IDP_RECEIVED")
    assert len(got) == 1, got
    seq, ev = got[0]
    assert blocked.event_seq == seq
    assert ev.body["idp"] == held and ev.body["session_state"] == "HEM_PENDING" and ev.body["code"] == "HEM_PENDING"
    assert ev.body["kernel_receipt_ts"] and ev.body["agent_ts"] == held["timestamp"]
    assert ev.body["audit_accessible"] is True and ev.body["mandate_id"] == env.jti
    mine = [o for o in order if o.endswith(held["idp_id"])]
    assert mine == [f"log:IDP_RECEIVED:{held['idp_id']}", f"verdict:denied:{held['idp_id']}"], order
    # Not an IDP_SUBMITTED: the step and the idp_id stay free.
    assert all(e.body["idp_id"] != held["idp_id"] for _s, e in await read_log(env.js, "IDP_SUBMITTED"))


async def test_an_idp_for_a_terminated_session_is_committed(env: Env) -> None:
    """A valid IDP for a session its principal ended is committed as IDP_RECEIVED (TERMINATED) before the REJECT."""
    from gateway.kernel.state import SessionEntry

    kernel = next(p for p in env.gw.parts if isinstance(p, KernelService))
    assert isinstance(await env.send(env.idp(1, "ReadBooking")), Permit)

    def end(s: SessionEntry) -> bool:
        s.state = "TERMINATED"
        return True

    await kernel.state.update_session("bot", "s-1", end)
    rec = env.idp(2, "ReadBooking")
    res = await env.send(rec)
    assert res.error_code == "SESSION_TERMINATED"  # type: ignore[union-attr]
    got = [e for _s, e in await read_log(env.js, "IDP_RECEIVED")]
    assert [e.body["idp"] for e in got] == [rec] and got[0].body["session_state"] == "TERMINATED"


async def test_a_well_formed_idp_refused_by_validation_is_committed_but_a_malformed_one_is_not(env: Env) -> None:
    """A replayed idp_id and an IDP under another agent's mandate are committed as IDP_RECEIVED with their REJECT
    code before the answer; an IDP_MALFORMED one is not."""
    ok = env.idp(1, "ReadBooking")
    assert isinstance(await env.send(ok), Permit)
    replay = await env.send(ok)
    assert replay.error_code == "IDP_DUPLICATE"  # type: ignore[union-attr]
    wrong_mandate = {**env.idp(2, "ReadBooking"), "mandate_id": "not-the-jti"}
    assert (await env.send(wrong_mandate)).error_code == "IDP_MANDATE_MISMATCH"  # type: ignore[union-attr]
    bad = env.idp(3, "ReadBooking", confidence_level=7)
    assert (await env.send(bad)).error_code == "IDP_MALFORMED"  # type: ignore[union-attr]
    got = [(e.body["idp_id"], e.body["code"], e.body["session_state"]) for _s, e in await read_log(env.js, "IDP_RECEIVED")]
    assert got == [(ok["idp_id"], "IDP_DUPLICATE", None), (wrong_mandate["idp_id"], "IDP_MANDATE_MISMATCH", None)]
    # Still no IDP_SUBMITTED for any of them: nothing took a step.
    assert [e.body["idp_id"] for _s, e in await read_log(env.js, "IDP_SUBMITTED")] == [ok["idp_id"]]
