"""DESIGN §7 bindings against a real server enforcing per-party credentials.

* ``Nats-Msg-Id`` is bound to the authenticated sender: agent B cannot
  suppress agent A's envelope by pre-using A's id.
* A resolution is bound to its moment, its principal and its expiry: a
  replayed, foreign or late answer is refused, also after a gateway restart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.security import msgid
from subjects.client import envelope
from subjects.wire import MomentExpired, OptionChoice
from tests.gauntlet.bed import Bed, flushed, secured_bed
from tests.moments import GOOD_MOMENT

pytestmark = pytest.mark.security
TABLE = "bindings (msg id, resolutions)"
WAIT = 15.0


def moment_env(principal: str, envelope_id: str, **payload: object) -> dict[str, object]:
    return envelope(
        "vendor.pgw.binding_moment", {"principal": principal, "binding_moment": GOOD_MOMENT, **payload},
        envelope_id=envelope_id,
    )


async def dispatch(bed: Bed, agent: str, principal: str, eid: str, **payload: object) -> str:
    await bed.agents[agent].send(moment_env(principal, eid, **payload))
    out = await bed.agents[agent].outcome_for(eid, timeout=WAIT)
    assert out.status == "accepted" and out.moment_id, out
    return out.moment_id


@pytest.mark.parametrize(
    ("agent", "mid", "eid", "first", "ok"),
    [
        ("a", "a:e1", "e1", True, True),
        ("a", "a:e1:5f2c", "e1", True, True),  # the client's salted re-send
        ("a", "a:e1:replay:7", "e1", True, True),  # pgw replay --fresh-msg-id
        ("a", None, "e1", True, True),
        ("a", "b:e1", "e1", True, False),  # claims agent b
        ("a", "a:e2", "e1", True, False),  # not the turn's first envelope id
        ("a", "a:e1x", "e1", True, False),
        ("a", "b:e1", "e9", False, False),  # a later envelope of a foreign-id turn
        ("a", "replay:PGW_INBOUND:4", "e1", True, True),
    ],
)
def test_msg_id_rule(agent: str, mid: str | None, eid: str, first: bool, ok: bool) -> None:
    """A Nats-Msg-Id is valid only if it names the subject's agent and, for a turn's first envelope, its envelopeId."""
    assert (msgid.check(agent, mid, eid, first=first) is None) is ok


async def test_agent_b_cannot_suppress_agent_a(tmp_path: Path, security_table) -> None:
    """B pre-using 'a:{id}' is refused and recorded against B, and A's envelope with that id is still processed."""
    async with secured_bed(tmp_path) as bed:
        js_b = bed.ncs["agent:b"].jetstream()
        stolen = "suppress-me-1"
        # B publishes a valid envelope on its own subject under A's would-be id.
        ack = await js_b.publish(bed.config.subjects.envelope("b"), _encode(moment_env("q", stolen)),
                                 headers={"Nats-Msg-Id": f"a:{stolen}"})
        assert not ack.duplicate
        out_b = await bed.agents["b"].outcome_for(stolen, timeout=WAIT)
        assert out_b.status == "invalid" and out_b.code == "invalid_msg_id", out_b
        v = await bed.verdict(lambda v: v.agent == "b" and v.reason is not None and v.reason.code == "invalid_msg_id")
        assert v.verdict_class == "blocked"

        # A publishes its real envelope under that id with a plain JetStream publish (no client-side
        # re-send): whether or not the stream dropped it as a duplicate, A gets its outcome
        # (the gateway's own exactly-once and security/squat.py; tests/test_security_squat.py).
        js_a = bed.ncs["agent:a"].jetstream()
        await js_a.publish(bed.config.subjects.envelope("a"), _encode(moment_env("p", stolen)),
                           headers={"Nats-Msg-Id": f"a:{stolen}"})
        out_a = await bed.agents["a"].outcome_for(stolen, timeout=WAIT)
        assert out_a.status == "accepted" and out_a.moment_id, out_a
        items = await bed.surfaces["p"].pending()
        assert any(getattr(i, "moment_id", None) == out_a.moment_id for i in items)
    security_table.record(TABLE, "pre-use another agent's Nats-Msg-Id", "agent:b", "agent:a",
                          "B refused + verdict; A delivered", "B invalid_msg_id + blocked verdict; A accepted", True)


async def test_resolutions_are_bound_to_moment_principal_and_expiry(tmp_path: Path, security_table) -> None:
    """A replayed, foreign or late resolution is refused; the first valid answer wins, also after a gateway restart."""
    async with secured_bed(tmp_path) as bed:
        p, q = bed.surfaces["p"], bed.surfaces["q"]
        mid = await dispatch(bed, "a", "p", "bind-1")

        foreign = await q.resolve(mid, OptionChoice(index=0))  # q answers p's moment on q's own subject
        assert (foreign.status, foreign.code) == ("refused", "unknown_moment"), foreign
        security_table.record(TABLE, "answer another principal's moment", "principal:q", "principal:p",
                              "refused", f"{foreign.status} {foreign.code}", True)

        first = await p.resolve(mid, OptionChoice(index=1))
        assert first.status == "accepted", first
        replay = await p.resolve(mid, OptionChoice(index=1))
        other = await p.resolve(mid, OptionChoice(index=0))
        assert (replay.status, replay.code) == ("refused", "already_resolved"), replay
        assert (other.status, other.code) == ("refused", "already_resolved"), other
        security_table.record(TABLE, "replay / second answer", "principal:p", "principal:p",
                              "refused (first wins)", f"{replay.code}, {other.code}", True)

        await bed.stop_gateway()
        await bed.start_gateway()
        after = await p.resolve(mid, OptionChoice(index=0))
        assert (after.status, after.code) == ("refused", "already_resolved"), after
        security_table.record(TABLE, "replay after gateway restart", "principal:p", "principal:p",
                              "refused", f"{after.status} {after.code}", True)

        # Late: a moment that expires; wait for the expiry outcome, then answer.
        late_mid = await dispatch(bed, "a", "p", "bind-late", expires_in_s=1)
        expired = await _next_outcome(bed, "a", lambda o: isinstance(o, MomentExpired) and o.moment_id == late_mid)
        assert expired.principal == "p"
        late = await p.resolve(late_mid, OptionChoice(index=0))
        assert (late.status, late.code) == ("refused", "expired"), late
        security_table.record(TABLE, "answer after expiry", "principal:p", "principal:p",
                              "refused", f"{late.status} {late.code}", True)

        # Only one resolution outcome reached the agent for the first moment.
        v = await bed.verdict(lambda v: v.verdict_class == "resolved" and v.moment_id == mid)
        assert v.option_index == 1
        ids = {x.verdict_id for x in bed.verdicts if x.verdict_class == "resolved" and x.moment_id == mid}
        assert ids == {v.verdict_id}, "exactly one resolution decision (a repeat publish is deduplicated by id)"


async def test_principal_cannot_resolve_on_another_principals_subject(tmp_path: Path, security_table) -> None:
    """q's credentials cannot even send a request on p's resolve subject: the server refuses it, no reply comes."""
    async with secured_bed(tmp_path) as bed:
        mid = await dispatch(bed, "a", "p", "bind-2")
        q_nc = bed.ncs["principal:q"]
        body = b'{"moment_id": "' + mid.encode() + b'", "resolution": {"kind": "option", "index": 0}}'
        await q_nc.publish(bed.config.subjects.resolve("p"), body, reply=q_nc.new_inbox())
        await flushed(q_nc)  # the server's -ERR precedes its PONG
        assert any("permissions violation" in e.lower() and "principal.p.resolve" in e for e in bed.errors)
        still = await bed.surfaces["p"].pending()
        assert any(getattr(i, "moment_id", None) == mid for i in still), "p's moment must still be pending"
    security_table.record(TABLE, "publish on another principal's resolve", "principal:q", "principal:p",
                          "refused by server", "permissions violation; moment still pending", True)


def _encode(value: object) -> bytes:
    import msgspec

    return msgspec.json.encode(value)


async def _next_outcome(bed: Bed, agent: str, pred):
    async def first():
        async for o in bed.agents[agent].outcomes():
            if pred(o):
                return o
        raise AssertionError("unreachable")

    return await asyncio.wait_for(first(), WAIT)

