"""Every verdict yields a capsule: a kernel PERMIT whose transition report never comes is closed by a timeout (issue 14)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from consumers.signer import Signer
from consumers.verifier import payload_of, verify_many
from gateway.kernel.overdue import BUCKET as OPEN_BUCKET
from gateway.kernel.service import KernelService
from pgwcore.kvread import kv_keys, live_keys
from subjects.idp import Permit
from subjects.util import stable_id
from tests.kernel_support import (
    Issuer,
    idp,
    kernel_config,
    policy_dir,
    read_log,
    read_verdicts,
    request,
    running_gateway,
    stored_verdicts,
)
from tests.test_capsule_signer import signer_keys, stream_items, wait_count
from tests.test_kernel_hem import Env, env

__all__ = ["env"]

AGENT = "bot"


async def test_a_permit_without_report_is_closed_by_a_timeout_capsule(make_config: Any, nc: Any, tmp_path: Path) -> None:
    """A PERMIT with no transition report within kernel.report_deadline_s is logged TRANSITION_REPORT_OVERDUE and
    yields a `timeout` verdict whose capsule verifies; a permit that was reported is not timed out."""
    issuer = Issuer(tmp_path / "issuer")
    cfg = kernel_config(make_config, issuer, policy_dir(tmp_path), report_deadline_s=0.4, checkpoint_interval_s=0)
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent=AGENT, so_id=so)
    js = nc.jetstream()
    silent = idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")
    reported = idp(so_id=so, mandate_id=jti, step=2, action="CloseBooking")
    async with running_gateway(cfg, nc) as gw, Signer(cfg, nc):
        kernel = next(p for p in gw.parts if isinstance(p, KernelService))
        assert isinstance(await request(nc, AGENT, {"mandate": token, "idp": silent}), Permit)
        assert isinstance(await request(nc, AGENT, {"mandate": token, "idp": reported}), Permit)
        assert await kernel.handle_transition(
            AGENT, b'{"idp_id": "%s", "executed_action": "CloseBooking", "effect": {"type": "booking.close", "status": "dispatched"}}'
            % reported["idp_id"].encode(), 1) == "verified"
        timeouts = await stored_verdicts(js, "timeout")
        await wait_count(js, "PGW_REGISTRATION", 2)  # the executed and the timeout capsules
        assert await kernel.overdue.sweep(now=1e12) == 0  # nothing else open: the reported one was closed
    assert [v.idp_id for v in timeouts] == [silent["idp_id"]]
    v = timeouts[0]
    assert v.decision == "accept" and v.reason is not None and v.reason.code == "TRANSITION_REPORT_MISSING"
    overdue = await read_log(js, "TRANSITION_REPORT_OVERDUE")
    assert [e.body["idp_id"] for _s, e in overdue] == [silent["idp_id"]]
    assert v.details["event_seq"] == overdue[0][0]
    items = await stream_items(js, "PGW_REGISTRATION")
    caps = {payload_of(d)["pgw"]["idp_id"]: payload_of(d) for _s, d, _h in items}
    cap = caps[silent["idp_id"]]
    # spec 004 §5.4.2: the permit went out, so whether the action ran is unknown: a timeout after dispatch
    assert cap["disposition"]["verdict_class"] == "timeout"
    assert cap["effect"] == {"type": "CloseBooking", "status": "dispatched", "effect_attestation": "runtime_claimed"}
    assert cap["assurance"]["effect_mode"] == "dispatched_unconfirmed"
    results = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(cfg))
    assert all(r.ok for r in results), [(r.source, r.findings) for r in results if not r.ok]


async def test_a_late_report_is_chained_to_its_timeout(make_config: Any, nc: Any, tmp_path: Path) -> None:
    """A transition report after the overdue timeout yields an executed capsule that supersedes the timeout's."""
    issuer = Issuer(tmp_path / "issuer")
    cfg = kernel_config(make_config, issuer, policy_dir(tmp_path), report_deadline_s=3600, checkpoint_interval_s=0)
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent=AGENT, so_id=so)
    js = nc.jetstream()
    late = idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")
    async with running_gateway(cfg, nc) as gw, Signer(cfg, nc):
        kernel = next(p for p in gw.parts if isinstance(p, KernelService))
        assert isinstance(await request(nc, AGENT, {"mandate": token, "idp": late}), Permit)
        assert await kernel.overdue.sweep(now=1e12) == 1
        await wait_count(js, "PGW_REGISTRATION", 1)
        assert await kernel.handle_transition(
            AGENT, b'{"idp_id": "%s", "executed_action": "CloseBooking", "effect": {"type": "booking.close", "status": "dispatched"}}'
            % late["idp_id"].encode(), 1) == "verified"
        await wait_count(js, "PGW_REGISTRATION", 3)  # timeout, executed, and the executed one's outcome
    [timeout] = await stored_verdicts(js, "timeout")
    [executed] = await stored_verdicts(js, "executed")
    assert executed.supersedes == timeout.verdict_id
    items = await stream_items(js, "PGW_REGISTRATION")
    caps = {payload_of(d)["pgw"]["verdict_id"]: payload_of(d) for _s, d, _h in items}
    assert caps[executed.verdict_id]["chain"] == {"parent_capsule_id": caps[timeout.verdict_id]["capsule_id"],
                                                  "relation": "supersedes"}
    results = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(cfg))
    assert all(r.ok for r in results), [(r.source, r.findings) for r in results if not r.ok]


async def test_a_hem_approval_without_report_is_closed_too(env: Env) -> None:
    """A hem_urgency REQUIRED IDP approved by its principal, then never reported, is closed by a timeout verdict
    naming the moment; the sweep before the deadline closes nothing."""
    from subjects.client import Surface
    from subjects.idp import HemPending
    from subjects.wire import OptionChoice
    from tests.test_kernel_hem import PRINCIPAL, _moment

    kernel = next(p for p in env.gw.parts if isinstance(p, KernelService))
    rec = env.idp(1, hem_urgency="REQUIRED")
    pending = await env.send(rec)
    assert isinstance(pending, HemPending)
    item = await _moment(Surface(env.nc, PRINCIPAL), rec["idp_id"])
    assert (await Surface(env.nc, PRINCIPAL).resolve(item.moment_id, OptionChoice(index=0))).status == "accepted"
    await env.watch.wait("HEM_RESOLVED", lambda ev: ev["body"]["idp_id"] == rec["idp_id"])

    async def opened() -> bool:
        return bool(await live_keys(env.js, kernel.overdue.kv, OPEN_BUCKET))

    from tests.polling import until

    await until(opened, timeout=10, what="the approved permit registered as open")
    assert await kernel.overdue.sweep() == 0  # not yet due
    [key] = await live_keys(env.js, kernel.overdue.kv, OPEN_BUCKET)
    assert await kernel.overdue.sweep(now=1e12) == 1
    assert await kv_keys(env.js, OPEN_BUCKET, key) == [key]  # closed: its delete marker
    assert await kernel.overdue.sweep(now=1e12) == 0  # ... which the next sweep removes for good
    assert await kv_keys(env.js, OPEN_BUCKET, key) == []
    [v] = await stored_verdicts(env.js, "timeout")
    assert v.idp_id == rec["idp_id"] and v.moment_id == pending.moment_id
    # the human's approval is the decision it closes; it supersedes the dispatch, the approval having no
    # closure of its own (spec 004 §5.4.2)
    assert (v.approver, v.human_disposed, v.supersedes) == ("human", True, stable_id("dispatch", pending.moment_id))
    assert await read_verdicts(env.js, "resolved") == []


async def test_a_logged_permit_is_registered_by_its_log_event_and_closed_once(make_config: Any, nc: Any, tmp_path: Path) -> None:
    """A Cedar PERMIT writes no PGW_KERNEL_OPEN key (its CEDAR_PERMIT_RECORDED registers it, issue 18); the sweep
    closes it from the log once, also when the log is read again from the start, and the rebuild knows it is closed."""

    from gateway.kernel.overdue import POSITION_KEY

    issuer = Issuer(tmp_path / "issuer")
    cfg = kernel_config(make_config, issuer, policy_dir(tmp_path), report_deadline_s=3600, checkpoint_interval_s=0)
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent=AGENT, so_id=so)
    js = nc.jetstream()
    silent = idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")
    async with running_gateway(cfg, nc) as gw:
        kernel = next(p for p in gw.parts if isinstance(p, KernelService))
        assert isinstance(await request(nc, AGENT, {"mandate": token, "idp": silent}), Permit)
        assert await live_keys(js, kernel.overdue.kv, OPEN_BUCKET) == []
        assert await kernel.overdue.sweep() == 0  # not due within the hour
        assert await kernel.overdue.sweep(now=1e12) == 1
        entry, _ = await kernel.state.idp(so, silent["idp_id"])  # type: ignore[misc]
        [(seq, _ev)] = await read_log(js, "TRANSITION_REPORT_OVERDUE")
        assert entry.overdue_seq == seq
        # Read from the start again (a position set back by another gateway, a lost bucket): closed once.
        await kernel.state.kv.put(POSITION_KEY, b"0")
        assert await kernel.overdue.sweep(now=1e12) == 0
        # The rebuild from the log records the same.
        entry.overdue_seq = None
        await kernel.state.put_idp(entry, (await kernel.state.idp(so, silent["idp_id"]))[1])  # type: ignore[index]
        await kernel.state.apply("TRANSITION_REPORT_OVERDUE", _ev.body, seq)
        again, _ = await kernel.state.idp(so, silent["idp_id"])  # type: ignore[misc]
        assert again.overdue_seq == seq
    assert len(await stored_verdicts(js, "timeout")) == 1
    assert len(await read_log(js, "TRANSITION_REPORT_OVERDUE")) == 1
