"""Faults: nothing lost, nothing doubled (issue 8).

The kill -9 rounds run at the issue's size in CI: 5 rounds, each killing the
gateway while a load of 10,000 envelopes is in flight (about a minute). Scale
with ``PGW_CHAOS_KILL_ENVELOPES`` (per kill round), ``PGW_CHAOS_ROUNDS`` and
``PGW_CHAOS_ENVELOPES`` (the base load of the two-gateway and server-restart
tests, default 300), ``PGW_CHAOS_REPLAY_PAIRS`` (correlationIds of the replay
test, each sent twice, default 1,500), e.g. ``PGW_CHAOS_KILL_ENVELOPES=50000 PGW_CHAOS_ROUNDS=10 make chaos``.

Every test reads the history back from the streams and runs the checker
(``tests/chaos/checker.py``): each acknowledged envelope must be delivered
once (one outcome; for a binding moment one surface item and one verdict),
none lost, none duplicated, nothing unexpected.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams
from subjects.client import BINDING_MOMENT_KIND, envelope
from tests.chaos.checker import _json, check_streams, read_stream
from tests.chaos.harness import (
    Load,
    ServiceProc,
    chaos_config,
    env_int,
    free_port,
    wait_drained,
    wait_services,
)
from tests.moments import good_moment
from tests.polling import until

pytestmark = [pytest.mark.chaos]

ROUNDS = env_int("PGW_CHAOS_ROUNDS", 5)
PER_ROUND = env_int("PGW_CHAOS_ENVELOPES", 300)
KILL_PER_ROUND = env_int("PGW_CHAOS_KILL_ENVELOPES", 10_000)  # the issue: "during 10,000 in-flight envelopes"
SEED = env_int("PGW_CHAOS_SEED", int(time.time()))


async def _outcomes(js) -> int:
    return (await js.stream_info("PGW_OUTBOUND")).state.messages


async def _wait_progress(js, target: int, procs: list[ServiceProc], timeout: float = 60) -> None:
    """Wait until ``target`` outcomes exist (the gateway is mid-stream), polling the server."""
    async def reached() -> bool:
        return await _outcomes(js) >= target

    await until(reached, timeout=timeout, interval=0.02,
                what=lambda: f"progress to {target} outcomes: {[p.log_tail() for p in procs]}")


async def _explain(js, eids: list[str]) -> None:
    """Print every message about ``eids`` (for a failing run's diagnosis)."""
    from tests.chaos.checker import read_stream

    for stream in ("PGW_INBOUND", "PGW_OUTBOUND", "PGW_VERDICTS", "PGW_SURFACE"):
        for m in await read_stream(js, stream):
            if any(e.encode() in m.data for e in eids):
                print(stream, m.metadata.sequence.stream, dict(m.headers or {}), m.data[:400])


async def test_gateway_kill9_rounds(tmp_path: Path, nats_server: EmbeddedServer, nc) -> None:
    """kill -9 of the gateway while envelopes are in flight, in repeated rounds: every
    acknowledged envelope is delivered exactly once, no item, outcome or verdict is doubled."""
    rng = random.Random(SEED)
    js = nc.jetstream()
    gw = ServiceProc("gateway", nats_server.client_url, tmp_path / "gw", chaos_config(tmp_path / "c.toml"))
    load = Load(nc)
    in_flight_at_kill: list[int] = []
    try:
        for r in range(ROUNDS):
            await gw.start()
            await wait_services(nc, "pgw-gateway", 1, [gw])
            base = await _outcomes(js)
            sending = asyncio.create_task(load.send(KILL_PER_ROUND, f"r{r}"))
            await _wait_progress(js, base + rng.randint(KILL_PER_ROUND // 10, KILL_PER_ROUND // 2), [gw])
            info = await js.consumer_info("PGW_INBOUND", "pgw-gateway")
            in_flight_at_kill.append(info.num_ack_pending)  # delivered to the worker, not yet acked
            gw.kill9()
            await gw.wait_dead()
            await sending
        await gw.start()
        await wait_drained(js, timeout=120)
        report = await check_streams(js, load.acked, sent=load.sent, agents=[load.agent])
        if report.duplicated:
            await _explain(js, report.duplicated[:3])
    finally:
        await gw.stop()
    print(f"\n[chaos gateway kill -9] seed {SEED}, {ROUNDS} rounds x {KILL_PER_ROUND}: {report.summary()}; "
          f"turns in flight (delivered, unacked) at each kill: {in_flight_at_kill}")
    assert report.acked == ROUNDS * KILL_PER_ROUND
    assert all(n > 0 for n in in_flight_at_kill), "a kill hit an idle gateway"
    assert report.ok, report.summary()
    assert report.delivered_once == report.acked


async def test_two_gateways_share_the_work_and_decide_once(tmp_path: Path, nats_server: EmbeddedServer, nc) -> None:
    """Two gateway instances on one durable consumer, one killed -9 mid-stream and restarted:
    every acknowledged envelope is decided exactly once."""
    js = nc.jetstream()
    cfg = chaos_config(tmp_path / "c.toml")
    a = ServiceProc("gateway", nats_server.client_url, tmp_path / "a", cfg)
    b = ServiceProc("gateway", nats_server.client_url, tmp_path / "b", cfg)
    load = Load(nc, agent="pair")
    n = PER_ROUND * 2
    try:
        await a.start()
        await b.start()
        await wait_services(nc, "pgw-gateway", 2, [a, b])
        sending = asyncio.create_task(load.send(n, "p"))
        await _wait_progress(js, n // 4, [a, b])
        a.kill9()
        await a.wait_dead()
        await sending
        await a.start()
        await wait_drained(js, timeout=120)
        report = await check_streams(js, load.acked, sent=load.sent, agents=[load.agent])
    finally:
        await a.stop()
        await b.stop()
    print(f"\n[chaos two gateways] {report.summary()}")
    assert report.acked == n and report.ok, report.summary()


REPLAY_PAIRS = env_int("PGW_CHAOS_REPLAY_PAIRS", 1500)


def _pair_envelope(j: int, tag: str) -> tuple[dict, str]:
    """Envelopes 2i and 2i + 1: correlationId i and its re-emission (the same correlationId and type, a new
    envelopeId). For one i in five the first is malformed (refused: the re-emission is the agent's correction)."""
    i, again = divmod(j, 2)
    corr = f"corr-{i:06d}"
    bad = i % 5 == 4 and not again
    moment = {"synopsis": "x"} if bad else good_moment()
    env = envelope(BINDING_MOMENT_KIND, {"principal": "alice", "binding_moment": moment},
                   envelope_id=f"{corr}-{'b' if again else 'a'}", correlation_id=corr)
    return env, "refused" if bad else "moment"


async def test_gateway_kill9_amid_replays_decides_each_correlation_id_once(
        tmp_path: Path, nats_server: EmbeddedServer, nc) -> None:
    """Two gateways on one consumer, one killed -9 while envelopes and their re-emissions (the same
    correlationId and type, a new envelopeId) are in flight: every acknowledged envelope gets one outcome;
    each correlationId gets one moment, one surface item and one dispatch verdict, all its accepted outcomes
    name that moment, and all but one of them are flagged as replays (spec 002 "Replay determinism"); a
    refused first emission binds nothing, and its correction is processed, not replayed."""
    js = nc.jetstream()
    agent = "replays"
    cfg = chaos_config(tmp_path / "c.toml")
    a = ServiceProc("gateway", nats_server.client_url, tmp_path / "a", cfg)
    b = ServiceProc("gateway", nats_server.client_url, tmp_path / "b", cfg)
    load = Load(nc, agent=agent)
    try:
        await a.start()
        await b.start()
        await wait_services(nc, "pgw-gateway", 2, [a, b])
        base = await _outcomes(js)
        sending = asyncio.create_task(load.send(2 * REPLAY_PAIRS, "replay", make=_pair_envelope))
        await _wait_progress(js, base + REPLAY_PAIRS // 2, [a, b])
        in_flight = (await js.consumer_info("PGW_INBOUND", "pgw-gateway")).num_ack_pending
        a.kill9()
        await a.wait_dead()
        await sending
        await a.start()
        await wait_drained(js, timeout=120)
    finally:
        await a.stop()
        await b.stop()
    outcomes = [_json(m) for m in await read_stream(js, "PGW_OUTBOUND", f"pgw.agent.{agent}.outcome")]
    items = [i for i in (_json(m) for m in await read_stream(js, "PGW_SURFACE")) if i.get("agent") == agent]
    verdicts = [v for v in (_json(m) for m in await read_stream(js, "PGW_VERDICTS")) if v.get("agent") == agent]
    by_envelope = Counter(o.get("envelope_id") for o in outcomes)
    assert len(load.acked) == 2 * REPLAY_PAIRS
    assert in_flight > 0, "the kill hit idle gateways"
    assert {e: n for e, n in by_envelope.items() if n != 1} == {} and set(by_envelope) == set(load.acked)
    refused = {o["envelope_id"] for o in outcomes if o["status"] != "accepted"}
    assert refused == {f"corr-{i:06d}-a" for i in range(REPLAY_PAIRS) if i % 5 == 4}
    per_corr: dict[str, list[dict]] = {}
    for o in outcomes:
        if o["status"] == "accepted":
            per_corr.setdefault(o["correlation_id"], []).append(o)
    assert len(per_corr) == REPLAY_PAIRS
    moments = {c: {o["moment_id"] for o in os_} for c, os_ in per_corr.items()}
    assert {c: m for c, m in moments.items() if len(m) != 1} == {}
    assert {c: n for c, os_ in per_corr.items() if (n := sum(not o.get("replayed") for o in os_)) != 1} == {}
    item_count = Counter(i.get("moment_id") for i in items)
    dispatched = Counter(v.get("correlation_id") for v in verdicts if v.get("verdict_class") == "hitl_dispatched")
    assert {c: item_count[next(iter(m))] for c, m in moments.items() if item_count[next(iter(m))] != 1} == {}
    twice = {c: [v for v in verdicts if v.get("correlation_id") == c and v.get("verdict_class") == "hitl_dispatched"]
             for c in per_corr if dispatched[c] != 1}
    assert twice == {}, list(twice.items())[:1]
    print(f"\n[chaos replays] {REPLAY_PAIRS} correlationIds x 2 envelopes, one gateway of two killed -9: "
          f"{len(outcomes)} outcomes, {sum(bool(o.get('replayed')) for o in outcomes)} replayed, "
          f"{len(items)} surface items ({sum(1 for i in items if not i.get('moment_id'))} refusal notices), "
          f"{sum(dispatched.values())} dispatch verdicts; {in_flight} turns in flight at the kill")


async def test_nats_server_restart_under_load(tmp_path: Path) -> None:
    """kill -9 of the embedded nats-server (sync_interval: always) under load, then restart on
    the same store: no acknowledged envelope is lost, none doubled."""
    port = free_port()
    server = EmbeddedServer(tmp_path / "nats", port=port, monitor_port=-1, websocket_port=-1)
    await server.start()
    nc = await connect(server.client_url, name="chaos-load")
    js = nc.jetstream()
    await ensure_streams(js, Config().subjects)
    gw = ServiceProc("gateway", server.client_url, tmp_path / "gw", chaos_config(tmp_path / "c.toml"))
    load = Load(nc, agent="srv")
    n = PER_ROUND * 3
    try:
        await gw.start()
        await wait_services(nc, "pgw-gateway", 1, [gw])
        # Paced (open loop), so the server dies while agents are still publishing.
        sending = asyncio.create_task(load.send(n, "s", retry_for=60, rate=n / 3.0))
        await _wait_progress(js, n // 4, [gw])
        server.kill()  # SIGKILL: whatever the server acknowledged must already be on disk
        await server._proc.wait()
        server._proc = None
        server._release_lock()
        await server.start()
        await sending
        await wait_drained(js, timeout=120)
        report = await check_streams(js, load.acked, sent=load.sent, agents=[load.agent])
    finally:
        await gw.stop()
        await nc.close()
        await server.stop()
    print(f"\n[chaos nats-server kill -9] {report.summary()}; publish retries {load.failures}")
    assert report.acked == n, f"only {report.acked} of {n} acknowledged after retries"
    assert report.ok, report.summary()
