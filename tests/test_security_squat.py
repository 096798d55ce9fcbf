"""No agent can make the server drop another agent's envelope, whatever client it uses (DESIGN §7, issue 19).

Everything here speaks raw nats-py with each party's own credentials against a
secured server running the generated authorization block: no
``subjects.client`` on the agents' side, so nothing client-side (like
``Agent.send``'s salted re-send) can be what saves the victim.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest

from gateway.security import Party, agent_durable
from pgwcore.identity import creds_connect_options
from subjects.wire import EnvelopeOutcome, outcome_decoder
from tests.gauntlet.bed import Bed, secured_bed
from tests.moments import GOOD_MOMENT
from tests.openwop_schemas import checked_envelope, checked_outcome
from tests.polling import consumer_drained, until

pytestmark = pytest.mark.security
TABLE = "envelope suppression (raw nats-py agents)"
WAIT = 15.0


def raw_envelope(principal: str, envelope_id: str) -> bytes:
    """A binding-moment envelope built by hand, as a client in another language would."""
    body = {
        "type": "vendor.pgw.binding_moment",
        "envelopeId": envelope_id,
        "correlationId": f"run-{envelope_id}",
        "payload": {"principal": principal, "binding_moment": GOOD_MOMENT},
        "meta": {"source": "ai-generation", "ts": "2026-01-01T00:00:00Z"},
    }
    return msgspec.json.encode(checked_envelope(body))


async def raw_agent(bed: Bed, name: str) -> nats.NATS:
    """A plain nats-py connection with the agent's nkey seed and inbox prefix (the file `pgw creds` wrote)."""
    opts = creds_connect_options(bed.auth.creds_for(Party("agent", name)))
    return await nats.connect(bed.server.client_url, allow_reconnect=False, max_reconnect_attempts=0,
                              name=f"raw-{name}", **opts)


async def outcomes_for(nc: nats.NATS, agent: str, envelope_id: str, *, want: int = 1) -> list[EnvelopeOutcome]:
    """Pull the agent's own durable (raw nats-py) until ``want`` outcomes for ``envelope_id`` came."""
    sub = await nc.jetstream().pull_subscribe_bind(agent_durable(agent), "PGW_OUTBOUND")
    got: list[EnvelopeOutcome] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    try:
        while len(got) < want and loop.time() < deadline:
            try:
                msgs = await sub.fetch(32, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            for m in msgs:
                await m.ack()
                o = outcome_decoder.decode(checked_outcome(m.data))
                if isinstance(o, EnvelopeOutcome) and o.envelope_id == envelope_id:
                    got.append(o)
    finally:
        await sub.unsubscribe()
    return got


async def victim_publishes(bed: Bed, a: nats.NATS, x: str, stolen: str) -> Any:
    """a publishes its envelope ``x`` under the squatted id; it is answered exactly once. The PubAck."""
    ack = await a.jetstream().publish(bed.config.subjects.envelope("a"), raw_envelope("p", x),
                                      headers={"Nats-Msg-Id": stolen})
    outs = await outcomes_for(a, "a", x)
    assert [o.status for o in outs] == ["accepted"], outs
    await settled(bed, "a", 1 if ack.duplicate else 2)  # the watch's copy, and a's original if stored
    assert await stored_outcomes(bed, "a", x) == 1
    return ack


async def settled(bed: Bed, agent: str, stored: int) -> None:
    """Wait until PGW_INBOUND holds ``stored`` envelopes on ``agent``'s subject (the watch's re-published copy
    included) and the gateway has acked every delivery: after that no further outcome can come."""
    js = bed.ncs["_watch"].jetstream()
    subject = bed.config.subjects.envelope(agent)

    async def done() -> bool:
        info = await js.stream_info("PGW_INBOUND", subjects_filter=subject)
        if (info.state.subjects or {}).get(subject, 0) < stored:
            return False
        return await consumer_drained(js, "PGW_INBOUND", "pgw-gateway")

    await until(done, timeout=WAIT, what=f"{stored} envelope(s) of {agent} stored and answered")


async def stored_outcomes(bed: Bed, agent: str, envelope_id: str) -> int:
    """How many outcomes for ``envelope_id`` PGW_OUTBOUND holds (read by the services' connection)."""
    js = bed.ncs["_watch"].jetstream()
    sub = await js.subscribe(bed.config.subjects.outcome(agent), ordered_consumer=True,
                             config=nats.js.api.ConsumerConfig(deliver_policy=nats.js.api.DeliverPolicy.ALL))
    n = 0
    try:
        while True:
            try:
                m = await sub.next_msg(timeout=0.5)
            except (nats.errors.TimeoutError, TimeoutError):
                return n
            o: Any = outcome_decoder.decode(m.data)
            n += getattr(o, "envelope_id", None) == envelope_id
    finally:
        await sub.unsubscribe()


@pytest.mark.parametrize("stolen_form", ["a:{x}", "{x}"], ids=["agent-prefixed id", "bare id"])
async def test_squatted_msg_id_does_not_drop_the_victims_envelope(tmp_path: Path, security_table, stolen_form: str) -> None:
    """Agent b publishes first under the id agent a is about to use; a's envelope still gets exactly one outcome."""
    async with secured_bed(tmp_path) as bed:
        a, b = await raw_agent(bed, "a"), await raw_agent(bed, "b")
        try:
            x = uuid.uuid4().hex
            stolen = stolen_form.format(x=x)
            await b.jetstream().publish(bed.config.subjects.envelope("b"), b'{"any": "body"}',
                                        headers={"Nats-Msg-Id": stolen})
            ack = await victim_publishes(bed, a, x, stolen)
        finally:
            await a.close()
            await b.close()
    security_table.record(TABLE, f"pre-use a's msg id ({stolen_form})", "agent:b", "agent:a",
                          "a gets its outcome, once", f"a accepted once (PubAck duplicate={ack.duplicate})", True)


async def test_own_retry_after_a_lost_puback_gets_one_outcome(tmp_path: Path, security_table) -> None:
    """An agent re-publishing its envelope (as after a lost PubAck), stored twice, gets exactly one outcome."""
    async with secured_bed(tmp_path) as bed:
        a = await raw_agent(bed, "a")
        try:
            x = uuid.uuid4().hex
            body = raw_envelope("p", x)
            first = await a.jetstream().publish(bed.config.subjects.envelope("a"), body, headers={"Nats-Msg-Id": f"a:{x}"})

            async def retry() -> Any:
                """The retry, once PGW_INBOUND's 100 ms duplicate window has forgotten the id (the server stores
                it again); until then the server drops it as a duplicate."""
                ack = await a.jetstream().publish(bed.config.subjects.envelope("a"), body,
                                                  headers={"Nats-Msg-Id": f"a:{x}"})
                return None if ack.duplicate else ack

            second = await until(retry, timeout=5, what="the retry stored past the duplicate window")
            assert second.seq != first.seq, "the retry must reach the gateway for this test"
            outs = await outcomes_for(a, "a", x)
            assert [o.status for o in outs] == ["accepted"]
            await settled(bed, "a", 2)  # the first publish and the retry
            assert await stored_outcomes(bed, "a", x) == 1
            dispatches = [v for v in bed.verdicts if v.verdict_class == "hitl_dispatched" and v.envelope_id == x]
            assert len({v.verdict_id for v in dispatches}) == 1
        finally:
            await a.close()
    security_table.record(TABLE, "own retry stored twice", "agent:a", "agent:a",
                          "one outcome, one dispatch", "one outcome, one dispatch", True)


async def test_squat_right_after_the_victim_leaves_one_outcome(tmp_path: Path, security_table) -> None:
    """b re-uses a's id just after a published: a's stored envelope and the watch's re-published copy are one
    envelope to the gateway, so a gets exactly one outcome and one dispatch."""
    async with secured_bed(tmp_path) as bed:
        a, b = await raw_agent(bed, "a"), await raw_agent(bed, "b")
        try:
            x = uuid.uuid4().hex
            await a.jetstream().publish(bed.config.subjects.envelope("a"), raw_envelope("p", x),
                                        headers={"Nats-Msg-Id": x})
            await b.jetstream().publish(bed.config.subjects.envelope("b"), b'{"any": "body"}', headers={"Nats-Msg-Id": x})
            outs = await outcomes_for(a, "a", x)
            assert [o.status for o in outs] == ["accepted"], outs
            await settled(bed, "a", 2)  # a's envelope and the watch's re-published copy
            assert await stored_outcomes(bed, "a", x) == 1
            assert bed.gw is not None
            assert len({v.verdict_id for v in bed.verdicts if v.verdict_class == "hitl_dispatched" and v.envelope_id == x}) == 1
        finally:
            await a.close()
            await b.close()
    security_table.record(TABLE, "re-use a's id right after a", "agent:b", "agent:a",
                          "a gets its outcome, once", "a accepted once, one dispatch", True)


async def test_the_watch_holds_bounded_bytes_and_still_rescues(tmp_path: Path, security_table, monkeypatch) -> None:
    """An agent sending large envelopes cannot make the watch hold them all (it held every body for two seconds,
    300 MB after 300 bodies of 1 MB, and let go only when the next message came). Past ``MAX_HELD_BYTES`` the
    oldest bodies are let go and their ids kept: b squats a's id, floods b's own subject past the budget, and a's
    envelope is still re-published and answered once. With no traffic the watch lets go of everything on time."""
    from gateway.security import squat

    budget = 64 * 1024
    monkeypatch.setattr(squat, "MAX_HELD_BYTES", budget, raising=False)  # a watch without it fails below
    async with secured_bed(tmp_path) as bed:
        assert bed.gw is not None
        watch = next(p for p in bed.gw.parts if type(p).__name__ == "SecurityPart").squat
        a, b = await raw_agent(bed, "a"), await raw_agent(bed, "b")
        try:
            x = uuid.uuid4().hex
            stolen = f"a:{x}"
            await b.jetstream().publish(bed.config.subjects.envelope("b"), b'{"any": "body"}',
                                        headers={"Nats-Msg-Id": stolen})
            big = b'{"pad": "' + b"z" * 20_000 + b'"}'
            for i in range(6):  # 120 KB: the budget's twice, held within HOLD_S
                await b.jetstream().publish(bed.config.subjects.envelope("b"), big,
                                            headers={"Nats-Msg-Id": f"b:flood-{x}-{i}"})
            async def flood_seen() -> bool:
                return f"b:flood-{x}-5" in watch._seen

            async def let_go() -> bool:
                return not watch._seen and watch.held_bytes == 0

            await until(flood_seen, timeout=WAIT, what="the watch saw the flood")
            held = [v for v in watch._seen.values() if v[2] is not None]
            assert sum(len(v[2]) for v in held) <= budget, "the watch holds more body bytes than its budget"
            assert watch._seen[stolen][2] is None, "b's first body should have been let go, its id kept"
            rescues = watch.rescues
            await victim_publishes(bed, a, x, stolen)
            assert watch.rescues == rescues + 1  # a's, not b's whose body was let go
            # No traffic now: the sweep lets go of every id and body past HOLD_S.
            await until(let_go, timeout=squat.HOLD_S * 4,
                        what="the watch let go of everything with no traffic")
        finally:
            await a.close()
            await b.close()
    security_table.record(TABLE, "flood past the watch's byte budget, then squat", "agent:b", "agent:a",
                          "a gets its outcome, once; bounded memory", "a accepted once; held <= budget", True)
