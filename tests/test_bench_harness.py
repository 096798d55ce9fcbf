"""Smoke test of the benchmark harness at tiny sizes (issue 18): what it reports is what happened.

No timing is asserted. What is: a throughput run ends only when the
consumer has acked every input; the message meter sees the relay's publish
and ack per envelope and the gateway's six writes and ack; the contract floor stores each of
the records it stands for; the sized moments
pass the gateway's grammar at 1, 16 and 120 KB (else the bench would measure
refusals); envelopes from new agents add no consumer to PGW_OUTBOUND; and the
latency windows report percentiles and the CPU the machine and each process
used meanwhile; and nats-server's own CPU profile decodes. The CPU meter
reads another process's CPU as that process reads its own, finer than the
10 ms ticks of ``/proc/<pid>/stat``, exited threads included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import nats.errors
import pytest
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError

from benchmarks.bench_gateway import Bench, _instances, _latency_rows
from benchmarks.harness import System, connz, cpu_s, moment_of_kb, started_at
from benchmarks.server_profile import decode, fetch_profile, free_port, report
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer, bound_to_parent
from tests.procs import NO_PDEATHSIG, PDEATHSIG

# A child that burns CPU in a thread that then exits, then in its main thread up to an odd
# amount (not a whole tick), prints its own CPU time and waits for its stdin to close.
_BURNER = """
import sys, threading, time
t = threading.Thread(target=lambda: sum(range(3_000_000)))
t.start(); t.join()
while time.process_time() < 0.2037:
    pass
print(time.process_time_ns(), flush=True)
sys.stdin.read()
"""


def test_the_cpu_meter_reads_another_process_to_below_a_tick() -> None:
    child = subprocess.Popen([sys.executable, "-c", _BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        own = int(child.stdout.readline()) / 1e9
        seen = cpu_s(child.pid)
        # The child's own clock, read just before it blocked, and ours, read after: the same
        # CPU time (its exited thread included) within the little it spent printing and blocking.
        assert own <= seen < own + 0.005, (own, seen)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    assert cpu_s(child.pid) == 0.0  # reaped: nothing to read


def test_moments_have_the_sizes_asked_for() -> None:
    for kb in (16, 120):
        for case in (None, 1, 99_999, 1_234_567):
            size = len(json.dumps(moment_of_kb(kb, case)))
            assert kb * 1024 * 0.9 <= size <= kb * 1024 * 1.1, (kb, case, size)


def _texts(moment: dict) -> list[str]:
    """Every text slot of a bench moment, in order."""
    q = moment["question"]
    return [moment["synopsis"], *moment["findings"], *moment["recommendations"], moment["offer"], q["stem"],
            *(o["label"] for o in q["options"]), *(o["reasoning"] for o in q["options"])]


async def test_each_envelope_the_driver_sends_carries_its_own_texts(nats_server: EmbeddedServer) -> None:
    """The driver's moments differ in every text slot from one envelope to the next (a text sent again finds
    the gateway's per-text caches full, so the bench would not count what folding a new moment costs), and
    each still passes the grammar, the lints and SR-1's pre-check, at every size (else it would time refusals)."""
    import msgspec

    from benchmarks.harness import Driver
    from gateway.stages import lints, shape
    from gateway.stages.moment_grammar import check_binding_moment
    from gateway.stages.redaction import Redactor
    from pgwcore.config import Config
    from subjects.wire import AIEnvelope, BindingMomentPayload

    nc = await connect(nats_server.client_url, name="driver-bodies")
    try:
        drv = Driver(nc)
        limits, red = Config().limits, Redactor()
        for kb in (1, 16, 120):
            seen: set[str] = set()
            for _ in range(3):
                eid, body = drv.body(kb)
                (raw,) = shape.decode_body(body, limits)
                assert raw["envelopeId"] == eid
                moment = raw["payload"]["binding_moment"]
                texts = _texts(moment)
                assert not seen & set(texts), (kb, seen & set(texts))  # no text of an earlier envelope again
                seen |= set(texts)
                assert check_binding_moment(moment) == []
                assert lints.check(msgspec.convert(raw["payload"], BindingMomentPayload).binding_moment) == []
                assert red.plainly_clean(msgspec.convert(raw, AIEnvelope))
    finally:
        await nc.close()



async def floor_keys(js: Any) -> set[str]:
    """The IDP floor bucket's keys from the server's per-subject index (nats-py's ``kv.keys()`` watcher can say
    "no keys" under load before it hands over what it holds; gateway/moments.py reads its keys the same way)."""
    from benchmarks.bench_idp import FLOOR_BUCKET

    pre = f"$KV.{FLOOR_BUCKET}."
    index = await js.stream_info(f"KV_{FLOOR_BUCKET}", subjects_filter=f"{pre}>")
    return {s[len(pre):] for s in (index.state.subjects or {})}

async def test_the_harness_counts_until_acked_and_meters_messages(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    b = Bench(nats_server, tmp_path, "smoke", floor_min=True)
    try:
        await b.start(group_commit_relay=False)
        relay = await b.run(b.relay, 30)
        info = await b.drv.js.consumer_info(b.relay.stream, b.relay.durable)
        stream = await b.drv.js.stream_info(b.relay.stream)
        assert info.ack_floor.stream_seq == stream.state.last_seq and info.num_ack_pending == 0
        assert relay["sent"] >= 2.0 and relay["received"] >= 2.0  # a publish and an ack; a delivery and a PubAck
        assert relay["rate"] > 0

        # The contract floor does the writes it is named for, per input: the claim and its
        # settle, the moment record, the surface item, the verdict, the outcome; no agent index
        # entry any more (derived from the moment record's write, issue 32).
        js = b.drv.js

        async def stores(system: System, per_input: dict[str, int], n: int = 30) -> dict:
            """Run ``n`` inputs through ``system``; each stream named grew by its count per input."""
            before = {name: (await js.stream_info(name)).state.last_seq for name in per_input}
            got = await b.run(system, n)
            for name, k in per_input.items():
                assert (await js.stream_info(name)).state.last_seq - before[name] == n * k, name
            return got

        floor = await stores(b.floor, {"KV_BENCH_FL_CLAIMS": 2, "KV_BENCH_FL_MOMENTS": 1, "BENCH_FL_SURFACE": 1,
                                       "BENCH_FL_VERDICTS": 1, "BENCH_FL_OUTBOUND": 1})
        assert floor["sent"] >= 7.0  # six writes and an ack
        with pytest.raises(NotFoundError):  # the index bucket is gone from the floor
            await js.stream_info("KV_BENCH_FL_INDEX")
        info = await js.consumer_info(b.floor.stream, b.floor.durable)
        assert info.num_ack_pending == 0 and info.num_pending == 0
        # The minimal floor: a claim and the contract's three streams, nothing else.
        fmin = await stores(b.floor_min, {"KV_BENCH_FM_CLAIMS": 1, "BENCH_FM_SURFACE": 1, "BENCH_FM_VERDICTS": 1,
                                          "BENCH_FM_OUTBOUND": 1})
        assert fmin["sent"] >= 5.0  # four writes and an ack
        # The floor with the two watches: the floor's writes, a plain subscription to every agent's
        # envelope subject, and a consumer that followed every moment write.
        fwatch = await stores(b.floor_watch, {"KV_BENCH_FW_CLAIMS": 2, "KV_BENCH_FW_MOMENTS": 1, "BENCH_FW_SURFACE": 1,
                                              "BENCH_FW_VERDICTS": 1, "BENCH_FW_OUTBOUND": 1})
        assert fwatch["sent"] >= 7.0
        moments = await js.stream_info("KV_BENCH_FW_MOMENTS")
        (watch,) = await js.consumers_info("KV_BENCH_FW_MOMENTS")
        assert watch.config.headers_only and watch.delivered.stream_seq == moments.state.last_seq
        (conn,) = [c for c in await asyncio.to_thread(connz, nats_server.monitor_url, subs=True)
                   if c.get("name") == "bench-relay-floor-watch"]
        assert "bench.fwagent.*.envelope" in conn["subscriptions_list"]

        consumers_before = (await b.drv.js.stream_info("PGW_OUTBOUND")).state.consumer_count
        for kb in (1, 16, 120):  # System.check raises on any refused envelope
            gw = await b.run(b.gw, 10, kb=kb, agents=5)
            assert gw["sent"] >= 7.0  # claim, moment, surface item, verdict, outcome, settle, ack
        info = await b.drv.js.consumer_info(b.gw.stream, b.gw.durable)
        assert info.num_ack_pending == 0 and info.num_pending == 0
        # First contact creates no consumer per agent (15 new agents above).
        assert (await b.drv.js.stream_info("PGW_OUTBOUND")).state.consumer_count == consumers_before

        # The latency windows and what the machine did meanwhile (a 0.1 s window: 50 envelopes).
        rows = {r["name"]: r for r in await _latency_rows(b, "t: ", 1, 0.1)}

        def named(prefix: str) -> dict:  # a slow machine's window is marked " (saturated)" at the end
            (found,) = [r for name, r in rows.items() if name.startswith(prefix)]
            return found

        p99 = named("t: gateway: p99 publish->surface @ 500/s, 0.1 s window, run 1/1")
        p50 = named("t: gateway: p50 publish->surface @ 500/s, run 1/1")
        assert 0 < p50["value"] <= p99["value"] and 0 < p50["baseline"] <= p99["baseline"]
        floor_p99 = named("t: contract floor: p99 publish->surface @ 500/s, 0.1 s window, run 1/1")
        floor_p50 = named("t: contract floor: p50 publish->surface @ 500/s, run 1/1")
        assert 0 < floor_p50["value"] <= floor_p99["value"] and floor_p99["baseline"] == p99["baseline"]
        busy = rows["t: machine CPU busy during the latency windows (all processes)"]
        # The machine's share comes from /proc/stat's 10 ms ticks: over a 0.1 s window of light work every tick
        # may land on an idle moment (a fresh clone's run read 0 for the relay's window), so 0 is a reading.
        # The processes' own CPU, below, comes from their CPU-time clocks and must show the work.
        assert 0 <= busy["value"] <= 100 and 0 <= busy["baseline"] <= 100
        # Each process's share is its own CPU over the window: the gateway and the relay did work.
        assert rows["t: service process CPU during the latency windows"]["value"] > 0
        assert rows["t: service process CPU during the latency windows"]["baseline"] > 0
        assert rows["t: nats-server CPU during the latency windows"]["value"] > 0
    finally:
        await b.close()


async def test_instance_rounds_alternate_one_and_two_of_each(nats_server: EmbeddedServer, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """PGW_BENCH_INSTANCE_ROUNDS=2: a second gateway and a second floor start, are measured, stop,
    and start again; each round has its rows, and the mean rows summarise them."""
    monkeypatch.setenv("PGW_BENCH_INSTANCE_ROUNDS", "2")
    b = Bench(nats_server, tmp_path, "rounds")
    try:
        await b.start(group_commit_relay=False)
        rows = {r["name"]: r for r in await _instances(b, tmp_path, 200)}  # enough CPU ticks to read
        for r in (1, 2):
            for name in (f"gateway: 2 instances vs 1, CPU per envelope (all instances), 16 KB, round {r}/2",
                         f"contract floor: 2 instances vs 1, CPU per envelope (all instances), 16 KB, round {r}/2"):
                assert rows[name]["value"] > 0 and rows[name]["baseline"] > 0, name
        for what in ("gateway", "contract floor"):
            mean = rows[f"{what}: 2 instances vs 1, CPU ratio over 2 rounds (mean; min-max)"]
            per_round = [rows[n]["ratio"] for n in rows if n.startswith(f"{what}: 2 instances vs 1, CPU per")]
            assert min(per_round) - 0.01 <= mean["value"] <= max(per_round) + 0.01
        # The first round's second instances were stopped; the last round's run until close.
        assert len(b.gw.procs) == 2 and len(b.floor.procs) == 2
        assert all(p.returncode is None for p in b.gw.procs + b.floor.procs)
    finally:
        await b.close()


async def test_server_profile_decodes_a_real_nats_server_cpu_profile(tmp_path: Path) -> None:
    """benchmarks.server_profile reads nats-server's own pprof output (no Go toolchain here)."""
    port = free_port()
    async with EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=None, websocket_port=None,
                              extra_conf=f"prof_port: {port}") as server:
        nc = await connect(server.client_url, name="profile-load")
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="PROFT", subjects=["proft.>"]))
        prof = asyncio.create_task(fetch_profile(port, 1))
        loop = asyncio.get_running_loop()
        end = loop.time() + 1.5
        while loop.time() < end and not prof.done():  # keep the server busy (fsync'd writes) during the window
            await asyncio.gather(*(js.publish(f"proft.{i}", b"x" * 512) for i in range(50)))
        profile = decode(await prof)
        await nc.close()
    assert profile.total_ns > 0
    assert any("nats-server" in name for name in profile.cum), profile.cum.most_common(5)
    assert sum(profile.flat.values()) <= profile.total_ns
    assert all(profile.flat[name] <= profile.cum[name] for name in profile.flat)
    assert max(profile.cum.values()) <= profile.total_ns
    assert "nats-server CPU in the window" in report(profile, 5)
    with pytest.raises(ValueError, match="not a pprof profile"):
        decode(b"\x1f\x8bnot gzip at all")


async def test_the_idp_contract_floor_stores_what_a_permit_stores(nats_server: EmbeddedServer, tmp_path: Path) -> None:
    """benchmarks.bench_idp's floor responder writes, per request, the session, the report key, the
    index entry and two log events before it answers, and refuses to take one idp_id twice; the
    log-index floor writes the session, IDP_SUBMITTED and CEDAR_PERMIT_RECORDED; the minimal floor
    the session and IDP_SUBMITTED only."""
    from benchmarks.bench_idp import FLOOR_LOG
    from benchmarks.harness import start_ready, stop

    nc = await connect(nats_server.client_url, name="floor-test")
    js = nc.jetstream()
    proc = await start_ready(nc, "bench.idpfloor.ready", "benchmarks.bench_idp", "floor", nats_server.client_url,
                             log_path=tmp_path / "floor.log")
    proc_min = proc_log = None
    try:
        proc_min = await start_ready(nc, "bench.idpfloormin.ready", "benchmarks.bench_idp", "floor-min",
                                     nats_server.client_url, log_path=tmp_path / "floor-min.log")
        proc_log = await start_ready(nc, "bench.idpfloorlog.ready", "benchmarks.bench_idp", "floor-log",
                                     nats_server.client_url, log_path=tmp_path / "floor-log.log")

        def request(idp_id: str, session: str) -> bytes:
            return json.dumps({"idp": {"idp_id": idp_id, "session_id": session}}).encode()

        for i in range(5):
            msg = await nc.request("bench.idpfloor", request(f"i{i}", f"s{i}"), timeout=10)
            assert msg.data == b'{"result":"PERMIT"}'
        keys = await floor_keys(js)
        for i in range(5):
            assert {f"sess.s{i}", f"tr.i{i}", f"idp.i{i}"} <= keys
        log = await js.stream_info(FLOOR_LOG, subjects_filter="bench.idpf.log.*")
        assert log.state.subjects == {"bench.idpf.log.IDP_SUBMITTED": 5, "bench.idpf.log.CEDAR_PERMIT_RECORDED": 5}
        # A create of a key that exists is refused, as the kernel's is: no answer for a reused idp_id.
        with pytest.raises(nats.errors.TimeoutError):  # the responder's writes fail; it does not answer
            await nc.request("bench.idpfloor", request("i0", "s-new"), timeout=2)

        async def one_request(subject: str, idp_id: str, session: str) -> tuple[set[str], dict[str, int]]:
            """One PERMIT from ``subject``'s floor: the keys it added, and the log's counts after it."""
            keys_before = await floor_keys(js)
            msg = await nc.request(subject, request(idp_id, session), timeout=10)
            assert msg.data == b'{"result":"PERMIT"}'
            log = await js.stream_info(FLOOR_LOG, subjects_filter="bench.idpf.log.*")
            return await floor_keys(js) - keys_before, log.state.subjects

        # The minimal floor stores the session and IDP_SUBMITTED only.
        assert await one_request("bench.idpfloormin", "m0", "sm0") == (
            {"sess.sm0"}, {"bench.idpf.log.IDP_SUBMITTED": 6, "bench.idpf.log.CEDAR_PERMIT_RECORDED": 5})
        # The log-index floor: the session and both log events, no index entry or report key.
        assert await one_request("bench.idpfloorlog", "l0", "sl0") == (
            {"sess.sl0"}, {"bench.idpf.log.IDP_SUBMITTED": 7, "bench.idpf.log.CEDAR_PERMIT_RECORDED": 6})
    finally:
        await stop(proc)
        await stop(proc_min)
        await stop(proc_log)
        await nc.close()


async def test_the_idp_contract_floor_serves_requests_side_by_side(nats_server: EmbeddedServer,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """As the kernel does (a task per request): a request whose read is held does not hold the next one.
    Until 2026-11-28 the floor served one request at a time, so its ceiling was a serial server's."""
    from benchmarks import bench_idp
    from pgwcore import kvread

    held, release = asyncio.Event(), asyncio.Event()

    class HeldFirst(kvread.BatchReader):
        async def get_many(self, keys: list[str]) -> list:  # type: ignore[override]
            if not held.is_set():
                held.set()
                await release.wait()
            return await super().get_many(keys)

    monkeypatch.setattr(kvread, "BatchReader", HeldFirst)
    nc = await connect(nats_server.client_url, name="floor-side-by-side")
    ready = await nc.subscribe("bench.idpfloor.ready", max_msgs=1)
    stop = asyncio.Event()
    floor = asyncio.create_task(bench_idp._floor_main(nats_server.client_url, stop=stop))
    try:
        await ready.next_msg(timeout=30)

        def request(i: int) -> bytes:
            return json.dumps({"idp": {"idp_id": f"side{i}", "session_id": f"side-s{i}"}}).encode()

        first = asyncio.create_task(nc.request("bench.idpfloor", request(1), timeout=30))
        await asyncio.wait_for(held.wait(), 10)
        second = await nc.request("bench.idpfloor", request(2), timeout=10)  # a serial floor: times out
        assert second.data == b'{"result":"PERMIT"}'
        assert not first.done()
        release.set()
        assert (await first).data == b'{"result":"PERMIT"}'
    finally:
        release.set()
        stop.set()  # the floor finishes what it serves, closes its inboxes and drains its connection
        await asyncio.wait_for(floor, 30)
        await nc.close()


def test_idp_floor_shapes_parse_and_refuse_what_they_do_not_know() -> None:
    """The floors' notation: rounds, batched reads, writes together, group commit; a bad shape is refused
    with what is known."""
    from benchmarks.bench_idp import FLOORS, parse_shape

    assert parse_shape(FLOORS["floor"]) == (
        [("read", ["idp", "tr", "sess"]), ("write", ["sess", "submitted", "tr"]), ("write", ["idp", "permit"])], False)
    assert parse_shape("sess+submitted / open @gc") == ([("write", ["sess", "submitted"]), ("write", ["open"])], True)
    for bad, why in (("sess+bogus", "log events"), ("read:permit / sess", "keys"), ("sess / ", "expected"),
                     ("sess @fast", "only @gc")):
        with pytest.raises(ValueError, match=why):
            parse_shape(bad)


async def test_an_idp_floor_shape_through_group_commit_stores_its_writes(nats_server: EmbeddedServer,
                                                                        tmp_path: Path) -> None:
    """``python -m benchmarks.bench_idp shape URL NAME SHAPE`` (what ``shapes`` starts): each round's
    records, here through the gateway's group commit, before the answer."""
    from benchmarks.bench_idp import FLOOR_BUCKET, FLOOR_LOG
    from benchmarks.harness import start_ready, stop

    nc = await connect(nats_server.client_url, name="shape-test")
    js = nc.jetstream()
    proc = await start_ready(nc, "bench.idpfloor.t1.ready", "benchmarks.bench_idp", "shape", nats_server.client_url,
                             "t1", "read:sess / sess+submitted / open+permit @gc", log_path=tmp_path / "shape.log")
    try:
        for i in range(3):
            msg = await nc.request("bench.idpfloor.t1", json.dumps({"idp": {"idp_id": f"g{i}",
                                                                              "session_id": f"gs{i}"}}).encode(),
                                   timeout=10)
            assert msg.data == b'{"result":"PERMIT"}'
        assert await floor_keys(js) == {f"{k}{i}" for i in range(3) for k in ("sess.gs", "open.g")}
        log = await js.stream_info(FLOOR_LOG, subjects_filter="bench.idpf.log.*")
        assert log.state.subjects == {"bench.idpf.log.IDP_SUBMITTED": 3, "bench.idpf.log.CEDAR_PERMIT_RECORDED": 3}
        assert (await js.stream_info(f"KV_{FLOOR_BUCKET}")).config.allow_atomic
    finally:
        await stop(proc)
        await nc.close()


def test_size_breakdown_times_each_step_on_a_valid_moment() -> None:
    """benchmarks.size_breakdown calls the pipeline's own functions; the moment it times passes them
    (else it would time refusals), and each step costs something."""
    import msgspec

    from benchmarks.harness import PRINCIPAL, envelope, moment_of_kb
    from benchmarks.size_breakdown import steps
    from gateway.stages import lints, shape
    from gateway.stages.moment_grammar import check_and_fold, check_binding_moment
    from pgwcore.config import Config
    from subjects.client import BINDING_MOMENT_KIND
    from subjects.wire import BindingMomentPayload

    got = steps(16)
    assert got["bytes"] > 15 * 1024
    assert all(v > 0 for v in got.values()), got
    body = json.dumps(envelope(BINDING_MOMENT_KIND, {"principal": PRINCIPAL, "binding_moment": moment_of_kb(16)})).encode()
    (raw,) = shape.decode_body(body, Config().limits)
    assert check_binding_moment(raw["payload"]["binding_moment"]) == []
    assert lints.check(msgspec.convert(raw["payload"], BindingMomentPayload).binding_moment) == []
    # The bench's moments take the grammar's one pass, as a principal's plain moment does (check_and_fold).
    for kb in (1, 16, 120):
        assert check_and_fold(moment_of_kb(kb, 7)) == ([], ANY), kb
        assert check_and_fold(moment_of_kb(kb, 7))[1] is not None


async def test_side_by_side_drives_two_trees_at_once_and_swaps_their_servers(tmp_path: Path) -> None:
    """benchmarks.side_by_side: each round starts both trees' gateways, one per server, drives both, and swaps the
    servers next round; every envelope is acked (Driver.throughput), each figure is a CPU time, the report has the
    median of the rounds' ratios; a directory without the gateway's sources is refused before anything starts."""
    from benchmarks.harness import REPO
    from benchmarks.side_by_side import Contender, main, measure, report

    copy = tmp_path / "copy"  # a second tree: the project's packages copied (an A/A run)
    for d in ("gateway", "pgwcore", "pgwcli", "subjects", "consumers", "integrations"):
        if (Path(REPO) / d).is_dir():
            shutil.copytree(Path(REPO) / d, copy / d, ignore=shutil.ignore_patterns("__pycache__", "node_modules"))
    sides = (Contender(Path(REPO)), Contender(copy))
    got = await measure(sides, n=120, rounds=2, warm=0)
    assert all(len(got[c]) == 2 and all(x > 0 for x in got[c]) for c in sides), got
    assert "median" in report(sides, got)
    for args in ([str(REPO), str(tmp_path / "empty")], [str(REPO), str(REPO)],  # no sources; the same tree twice
                 [str(REPO)], ["--floor", str(REPO), str(copy)]):  # one tree, or two with --floor
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2


async def test_side_by_side_drives_a_gateway_beside_its_contract_floor() -> None:
    """``--floor``: side A is the contract floor with its two watches (the relay's floor-watch), B the tree's
    gateway, on swapped servers each round; each side's inputs all acked, each figure a CPU time."""
    from benchmarks.harness import REPO
    from benchmarks.side_by_side import Contender, measure, report

    sides = (Contender(None), Contender(Path(REPO)))
    assert sides[0].system().name == "floor-watch" and sides[1].system().name == "gateway"
    got = await measure(sides, n=120, rounds=2, warm=0)
    assert all(len(got[c]) == 2 and all(x > 0 for x in got[c]) for c in sides), got
    assert "contract floor + its 2 watches" in report(sides, got)


@pytest.mark.parametrize(("gated", "floor", "failed", "expected"), [
    (400, 500, 500, 450),   # one ladder step short: tried at the threshold itself
    (300, 400, 400, 360),
    (500, 750, 750, 675),
    (0, 100, 100, 90),      # failed at the operating point, the floor did not
    (400, 750, 500, None),  # failed at 500, below the threshold 675: the ladder answered
    (400, 500, 450, None),  # failed at the threshold already
    (500, 500, 750, None),  # at the floor's ceiling
    (750, 500, None, None),
    (200, 0, 100, None),    # the floor passed no step
    (0, 0, 100, None),
])
def test_the_gate_is_tried_at_the_target_threshold_only_when_the_ladder_stepped_over_it(
        gated: int, floor: int, failed: int | None, expected: int | None) -> None:
    """Issue 48, target 1 (gate ceiling >= 0.9x the gate floor's): on a ladder of 200, 300, 400, 500, 750/s the
    threshold (450 for a floor of 500) is no step of it, so a gate one step below read 0.80x without being asked
    for 450. threshold_step names the one extra rate the bench tries, and only when no failed step answers it."""
    from benchmarks import bench_gate

    assert bench_gate.threshold_step(gated, floor, failed) == expected


def test_bench_gate_reports_its_rows_beside_the_direct_call_and_the_gate_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks.bench_gate at a tiny window on one sync setting: every gated call was confirmed (else it raises),
    and it reports the added latency, the ceilings (against the gate floor and the declaration), one agent's steps
    and the per-call costs under the row names the target table reads, each with its baseline."""
    from benchmarks import bench_gate

    monkeypatch.setattr(bench_gate, "WINDOW_S", 0.3)
    monkeypatch.setattr(bench_gate, "RATES", [])
    monkeypatch.setattr(bench_gate, "DOWN", [])
    monkeypatch.setattr(bench_gate, "SYNCS", ["default"])
    monkeypatch.setattr(bench_gate, "WARM", 3)
    monkeypatch.setattr(bench_gate, "SPLIT_S", 0.2)
    monkeypatch.setattr(bench_gate, "SEQ_N", 5)
    rows = {r["name"]: r for r in bench_gate.run()}
    assert list(rows) == [
        "gate: added latency p50 at 100/s (default sync)",
        "gate: added latency p99 at 100/s (default sync)",
        "gate: the declaration alone (agent.{agent}.idp PERMIT), p50 at 100/s (default sync)",
        "gate: added p99 at 100/s vs the declaration's own p99 (default sync)",
        "gate: ceiling p99<=20ms (default sync)",
        "gate: ceiling p99<=20ms vs the gate floor's (default sync)",
        "gate: one agent, steps/s of one session in sequence (default sync)",
        "gate: gateway CPU per gated call at 100/s (default sync)",
        "gate: gateway CPU per gated call vs the gate floor's at 100/s (default sync)",
        "gate: executor CPU per call at 100/s, gated vs direct (default sync)",
        "gate: nats-server CPU per call at 100/s, gated vs direct (default sync)",
        "gate: messages the gateway sent per gated call (default sync)",
        "gate: messages per gated call vs the gate floor's (default sync)",
    ]
    assert all(r["baseline"] is not None for name, r in rows.items() if name != "gate: ceiling p99<=20ms (default sync)"), rows
    assert rows["gate: added latency p50 at 100/s (default sync)"]["baseline"] > 0  # the direct call's own p50
    assert rows["gate: ceiling p99<=20ms (default sync)"]["value"] in (0, 90, 100)  # 90: the threshold step
    # The gated call sends the kernel's writes and the executor request; the direct one only the executor's.
    assert rows["gate: messages the gateway sent per gated call (default sync)"]["value"] > \
        rows["gate: messages the gateway sent per gated call (default sync)"]["baseline"]
    # The gate floor sends one message per record of its shape, the batched read, the executor call and the answer.
    floor_msgs = rows["gate: messages per gated call vs the gate floor's (default sync)"]["baseline"]
    shape = bench_gate.parse_gate_shape(bench_gate.GATE_SHAPES["floor"])
    assert abs(floor_msgs - sum(1 if kind != "write" else len(items) for kind, items in shape)) < 0.2, floor_msgs


def test_the_gate_floor_shapes_parse() -> None:
    """The gate floor's notation: rounds of writes, one batched read, exactly one reply; a bad shape is refused."""
    from benchmarks.bench_gate import GATE_SHAPES, parse_gate_shape

    floor = parse_gate_shape(GATE_SHAPES["floor"])
    assert floor[0] == ("read", ["idp", "tr", "sess"]) and ("reply", []) in floor
    assert ("write", ["st", "verified"]) in floor and floor[-1] == ("write", ["del"])
    parse_gate_shape(GATE_SHAPES["before"])
    for bad in ("sess+submitted", "read:idp / reply / reply", "sess+bogus / reply", "read:gate / reply"):
        with pytest.raises(ValueError):
            parse_gate_shape(bad)


async def test_an_instance_count_is_of_answers_never_of_the_no_responders_status(nats_server: EmbeddedServer) -> None:
    """The bench's wait_gateway and the suite's wait_services count instances answering ``$SRV.PING``
    (``pgwcore.micro.count_instances``). With none
    registered, the server answers the ping itself, with its "no responders" status: counted as an instance,
    wait_gateway returned at once for a gateway that never started (its driver then waited 900 s on envelopes
    nobody read), and wait_services went on before a service had registered."""
    from benchmarks.harness import wait_gateway
    from pgwcore.micro import MicroRegistration, count_instances

    nc = await connect(nats_server.client_url, name="instance-count")
    try:
        assert await count_instances(nc, "pgw-gateway", timeout=0.5) == 0
        with pytest.raises(TimeoutError, match="did not start"):
            await wait_gateway(nc, timeout=1)
        reg = await MicroRegistration(nc, "gateway").start()
        try:
            await wait_gateway(nc, timeout=10)
            assert await count_instances(nc, "pgw-gateway", enough=1) == 1
            with pytest.raises(TimeoutError):
                await wait_gateway(nc, timeout=1, count=2)  # one instance and no status make no second
        finally:
            await reg.drain()
    finally:
        await nc.close()


async def test_side_by_side_stops_a_gateway_that_never_registers(nats_server: EmbeddedServer, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway started for a round that is not found serving (wait_gateway fails) is stopped before the error
    goes on: it is in no round's hands yet, and in a session of its own it would outlive the run."""
    import benchmarks.side_by_side as sbs
    from benchmarks.harness import REPO

    started: list[asyncio.subprocess.Process] = []
    real_start = sbs.start_gateway

    async def recording_start(*args: Any, **kw: Any) -> asyncio.subprocess.Process:
        started.append(await real_start(*args, **kw))
        return started[-1]

    async def never_found(nc: Any, timeout: float = 30, count: int = 1) -> None:
        raise TimeoutError(f"{count} gateway instance(s) did not start")

    monkeypatch.setattr(sbs, "start_gateway", recording_start)
    monkeypatch.setattr(sbs, "wait_gateway", never_found)
    nc = await connect(nats_server.client_url, name="side-by-side-start")
    try:
        with pytest.raises(TimeoutError, match="did not start"):
            await sbs.Contender(Path(REPO)).start(nc, nats_server.client_url, tmp_path / "gw")
    finally:
        await nc.close()
    assert len(started) == 1 and started[0].returncode is not None


_Started = dict[int, tuple[int | None, str]]  # a run's children by pid: (start time, command line)


@contextlib.asynccontextmanager
async def _side_by_side_mid_round(tmp_path: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, _Started]]:
    """A real ``side_by_side --floor`` run (on the bench's loop, ``harness.run``), yielded once its measured round
    has begun: its two nats-servers, the gateway and the relay run. Yielded with the processes it started, by pid:
    (start time, command line). On the way out the run, and every one of them still running, is killed, whatever
    the test found (before the round too: what the run had started by then)."""
    from benchmarks.harness import REPO, children

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "benchmarks.side_by_side", "--floor", REPO, "--rounds", "1", "--n", "50000",
        "--warm", "0", cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.stderr is not None
    started: _Started = {}

    def snapshot() -> None:
        started.update({pid: (started_at(pid), _cmdline(pid)) for pid in children(proc.pid)})

    async def until_round() -> None:
        assert proc.stderr is not None
        seen: list[bytes] = []
        async for line in proc.stderr:
            seen.append(line)
            if b"round 1, " in line:  # the measured round's first progress: both driven
                return
        raise AssertionError("no round: " + b"".join(seen[-20:]).decode(errors="replace"))

    try:
        await asyncio.wait_for(until_round(), 180)
        snapshot()
        commands = [c for _, c in started.values()]
        assert sum("nats-server" in c for c in commands) == 2, commands
        assert any("pgwcli" in c and " gateway" in c for c in commands), commands
        assert any("benchmarks.relay" in c for c in commands), commands
        yield proc, started
    finally:
        if proc.returncode is None:
            snapshot()
            proc.kill()
            await proc.wait()
        for pid in _running(started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # each leads a session (and group) of its own


def test_a_bound_command_whose_program_is_missing_fails_as_starting_it_would() -> None:
    """``bound_to_parent`` raises FileNotFoundError for a program that is not there, as ``exec`` would: not a
    ``setpriv`` that starts and fails in the child, where a gateway that never came left its run waiting 30 s
    for it and said only "did not start"."""
    with pytest.raises(FileNotFoundError):
        bound_to_parent([str(Path(sys.executable).parent / "no-such-program")])
    cmd = [sys.executable, "-c", "pass"]
    bound = bound_to_parent(cmd)
    assert bound[-3:] == cmd and (bound == cmd or bound[1:5] == ["--pdeathsig", "TERM", "--", sys.executable])


def _running(started: _Started) -> dict[int, str]:
    """Those of ``started`` still running: the same pid with the same start time (not a reused pid)."""
    return {pid: c for pid, (t, c) in started.items() if t is not None and started_at(pid) == t}


@pytest.mark.slow
async def test_a_run_stopped_by_sigterm_stops_the_servers_and_gateways_it_started(tmp_path: Path) -> None:
    """``timeout`` or a closed terminal (SIGTERM, SIGHUP) stops a benchmark run the way Ctrl-C does
    (``harness.until_signal``): its servers and gateways run in sessions of their own, and a run killed mid-round
    left them running beside the next run's measure. A real ``side_by_side --floor`` is signalled mid-round: it
    exits with 143, every process it started is gone as it exits, and its temporary directory too (what only its
    own cleanup does)."""
    async with _side_by_side_mid_round(tmp_path) as (proc, started):
        assert proc.stderr is not None
        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(proc.stderr.read(), 120)
        assert await proc.wait() == 143, rest.decode(errors="replace")[-3000:]
        left = _running(started)
    assert not left, f"left running after the run ended: {left}"
    assert list(tmp_path.glob("pgw-side-*")) == []  # noqa: ASYNC240 - after the run, not a hot path
    assert b"never retrieved" not in rest, rest.decode(errors="replace")[-3000:]
    assert b"SIGTERM: stopping the servers and processes this run started" in rest


@pytest.mark.slow
@pytest.mark.skipif(not PDEATHSIG, reason=NO_PDEATHSIG)
async def test_a_run_killed_by_sigkill_leaves_no_server_or_gateway_running(tmp_path: Path) -> None:
    """A SIGKILL (``timeout -k``, the kernel's out-of-memory killer) runs no cleanup of the run's own, so its
    servers, gateways and relays, each in a session of its own, used to run on beside the next run's measure.
    Each is started bound to the run (``pgwcore.server.bound_to_parent``: the kernel sends it SIGTERM when the
    run is gone). A real ``side_by_side --floor`` is killed mid-round: every process it started stops."""
    from tests.polling import until

    async with _side_by_side_mid_round(tmp_path) as (proc, started):
        proc.kill()
        assert await proc.wait() == -signal.SIGKILL

        async def all_gone() -> bool:
            return not _running(started)

        # A gateway whose server stopped with it waits out one request's timeout to anchor its log (5 s).
        await until(all_gone, timeout=60,
                    what=lambda: f"the run's children stopped; still running: {_running(started)}")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# A run that starts a child in a session of its own and never stops it (only until_signal's sweep can),
# and one in the run's own session (not the sweep's: multiprocessing's helpers are such children). "nohup":
# SIGHUP ignored first, as nohup does; "stubborn": the first child ignores SIGTERM, so the sweep's grace
# (argv[2] seconds) runs out and SIGKILL ends it.
_ABANDONING_RUN = """
import asyncio, signal, subprocess, sys
if sys.argv[1] == "nohup":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
from benchmarks.harness import until_signal
from pgwcore import loop as pgw_loop

SLEEP = "import time; time.sleep(600)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(600)"

async def main() -> None:
    p = await asyncio.create_subprocess_exec(sys.executable, "-c", STUBBORN if sys.argv[1] == "stubborn" else SLEEP,
                                             start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    if sys.argv[1] == "stubborn":
        await p.stdout.readline()  # it ignores SIGTERM from here on
    q = subprocess.Popen([sys.executable, "-c", SLEEP], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("children", p.pid, q.pid, flush=True)
    await asyncio.Event().wait()

pgw_loop.run(until_signal(main(), grace=float(sys.argv[2])))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "nohup", "stubborn"])
async def test_a_signalled_run_stops_the_children_its_own_cleanup_did_not(tmp_path: Path, mode: str) -> None:
    """``until_signal``: after the run's task is cancelled, every child still running that leads a session of its
    own (what the harness starts) has its group sent SIGTERM, and SIGKILL after the grace (``stubborn``); a child
    in the run's own session is left to its owner. The run exits with 128 + the signal. A second signal during
    the cleanup is only noted (``timeout`` signals twice). A signal ignored when the run started stays ignored
    (``nohup``): a SIGHUP then neither stops the run nor is said."""
    from benchmarks.harness import REPO

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _ABANDONING_RUN, mode, "10" if mode == "stubborn" else "30", cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    ours = other = None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line.startswith(b"children "), line + await proc.stderr.read()
        ours, other = (int(x) for x in line.split()[1:])
        born, other_born = started_at(ours), started_at(other)
        assert born is not None and other_born is not None
        if mode == "nohup":
            proc.send_signal(signal.SIGHUP)  # ignored: the run goes on until the SIGTERM
        proc.send_signal(signal.SIGTERM)
        if mode == "stubborn":  # the sweep waits out its grace on the child: a second signal meanwhile
            said = await asyncio.wait_for(proc.stderr.readline(), 60)
            assert b"SIGTERM: stopping" in said, said
            proc.send_signal(signal.SIGTERM)
        err = await asyncio.wait_for(proc.stderr.read(), 60)
        assert await proc.wait() == 143, err.decode(errors="replace")
        assert started_at(ours) != born, f"the child {ours} was left running"
        assert started_at(other) == other_born, "a child in the run's own session was stopped by the sweep"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for pid in (ours, other):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert (b"SIGTERM: already stopping" in err) == (mode == "stubborn"), err.decode(errors="replace")
    assert b"SIGHUP" not in err, err.decode(errors="replace")
