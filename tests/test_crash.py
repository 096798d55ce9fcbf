"""A gateway killed after publishing but before acking: the redelivery yields the same result, once."""

from __future__ import annotations

import asyncio
from collections import Counter

from gateway.app import Gateway
from pgwcore.connect import connect
from subjects.client import Agent
from tests.moments import GOOD_MOMENT
from tests.polling import until
from tests.stored import stored_json


async def test_killed_before_ack_gives_one_outcome_and_one_verdict(nats_server, make_config, nc, monkeypatch):
    """Killed after the surface publish but before the ack, a restarted gateway leaves exactly one item, outcome and verdict."""
    config = make_config(gateway={"ack_wait_s": 1.0})
    processed = asyncio.Event()
    first_nc = await connect(nats_server.client_url, name="doomed-gateway")
    doomed = Gateway(config, first_nc)
    real_process = doomed.worker.pipeline.process_turn

    async def process_then_die(turn):  # everything published, then the process "dies"
        await real_process(turn)
        processed.set()
        await asyncio.Event().wait()  # never returns, so never acks

    monkeypatch.setattr(doomed.worker.pipeline, "process_turn", process_then_die)
    await doomed.__aenter__()
    agent = Agent(nc, "crash-agent")
    eids = [await agent.send_moment("alice", GOOD_MOMENT) for _ in range(1)]
    await asyncio.wait_for(processed.wait(), 10)
    # kill: the connection goes away without draining or acking
    await first_nc.close()
    doomed.worker._task.cancel()
    await doomed.desk.close()

    second_nc = await connect(nats_server.client_url, name="second-gateway")
    survivor = Gateway(config, second_nc)
    deliveries: list[int] = []
    real_second = survivor.worker.pipeline.process_turn

    async def record(turn):
        deliveries.append(turn.num_delivered)
        return await real_second(turn)

    monkeypatch.setattr(survivor.worker.pipeline, "process_turn", record)
    acked = asyncio.Event()
    survivor.timing_hooks.append(lambda _stage, _dt: acked.set())  # called right after the ack
    async with survivor as gw:
        js = nc.jetstream()
        await asyncio.wait_for(acked.wait(), 30)  # the redelivered message, re-processed and acked

        async def ack_recorded() -> bool:  # the ack is asynchronous: the server records it a moment later
            return (await js.consumer_info("PGW_INBOUND", "pgw-gateway")).ack_floor.stream_seq >= 1

        await until(ack_recorded, timeout=10, what="the survivor's ack recorded by the server")
        await gw.drain()
    await second_nc.drain()

    js = nc.jetstream()
    outcomes = await stored_json(js, "PGW_OUTBOUND")
    items = await stored_json(js, "PGW_SURFACE")
    verdicts = await stored_json(js, "PGW_VERDICTS")
    assert Counter(o["envelope_id"] for o in outcomes) == Counter({eids[0]: 1})
    assert [i["item"] for i in items] == ["binding_moment"]
    assert [v["verdict_class"] for v in verdicts] == ["hitl_dispatched"]
    assert deliveries == [2]  # the survivor really re-processed the redelivered message
    await agent.close()
