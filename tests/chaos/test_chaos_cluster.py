"""Scale-out path (DESIGN §8, issue 8): three nats-server nodes on loopback, R3 streams,
one node killed -9 under load and brought back. Nothing acknowledged is lost, nothing
doubled, and the gateway keeps serving while the node is down."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams
from tests.chaos.checker import check_streams
from tests.chaos.harness import (
    Load,
    ServiceProc,
    chaos_config,
    env_int,
    free_port,
    unsettled,
    wait_drained,
    wait_services,
    wait_settled,
)
from tests.polling import until
from tests.ports import held_port

pytestmark = [pytest.mark.chaos]

PER_ROUND = env_int("PGW_CHAOS_ENVELOPES", 300)


def cluster_nodes(root: Path, n: int = 3) -> list[EmbeddedServer]:
    """``n`` EmbeddedServers with a full mesh of routes on loopback (fixed ports, so a node
    restarted on its store comes back at the same address)."""
    client = [free_port() for _ in range(n)]
    route = [free_port() for _ in range(n)]
    routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in route)
    nodes = []
    for i in range(n):
        conf = (f"server_name: pgw-n{i + 1}\n"
                f"cluster {{\n  name: pgw\n  listen: \"127.0.0.1:{route[i]}\"\n  routes: [{routes}]\n}}\n")
        nodes.append(EmbeddedServer(root / f"n{i + 1}", port=client[i], monitor_port=-1, websocket_port=None,
                                    extra_conf=conf, lock=False))
    return nodes


async def start_cluster(root: Path, n: int = 3, *, configure: Callable[[EmbeddedServer], None] | None = None,
                        attempts: int = 3) -> list[EmbeddedServer]:
    """``cluster_nodes``, each configured by ``configure``, started. ``free_port`` hands out a port it no
    longer holds, so another process (a parallel test worker) can bind it before its node does ("address
    already in use"): then every node stops and the cluster starts again on new ports, in a directory of its
    own, up to ``attempts`` times. Any other failure is raised at once."""
    for attempt in range(attempts):
        nodes = cluster_nodes(root if attempt == 0 else root / f"retry{attempt}", n)
        for node in nodes:
            if configure is not None:
                configure(node)
        starts = [asyncio.ensure_future(node.start(timeout=60)) for node in nodes]
        done, waiting = await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
        failed = [e for t in done if (e := t.exception()) is not None]
        if not failed:
            return nodes
        for t in waiting:  # the others would wait for routes to the node that failed
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for node in nodes:
            with contextlib.suppress(Exception):
                await node.stop()
        if attempt == attempts - 1 or not any("address already in use" in str(e) for e in failed):
            raise failed[0]
    raise AssertionError("unreachable")


async def test_a_cluster_port_taken_before_its_node_binds_it_gets_new_ports(tmp_path: Path, monkeypatch) -> None:
    """A route port that another process takes between free_port() and the node's start makes the
    cluster start again on new ports instead of failing the test."""
    import sys

    with held_port() as taken:
        ports = iter([taken])
        real = free_port
        monkeypatch.setattr(sys.modules[__name__], "free_port", lambda: next(ports, None) or real())
        nodes = await start_cluster(tmp_path)
        try:
            assert taken not in [n.port for n in nodes] and (tmp_path / "retry1").is_dir()
        finally:
            for node in nodes:
                await node.stop()


async def _restart(node: EmbeddedServer) -> None:
    node._proc = None
    await node.start(timeout=60)


async def test_r3_cluster_node_killed_under_load(tmp_path: Path) -> None:
    """A node of a three-node R3 cluster is killed -9 under load and restarted: the gateway keeps
    producing outcomes while it is down, and every acknowledged envelope is delivered once."""
    nodes = await start_cluster(tmp_path)
    url = ",".join(f"nats://127.0.0.1:{n.port}" for n in nodes)
    nc = await connect(url, name="chaos-load")
    js = nc.jetstream(timeout=5)
    gw = None
    try:
        await ensure_streams(js, Config().subjects, replicas=3)
        gw = ServiceProc("gateway", url, tmp_path / "gw", chaos_config(tmp_path / "c.toml"))
        await gw.start()
        await wait_services(nc, "pgw-gateway", 1, [gw], timeout=60)
        load = Load(nc, agent="cluster")
        n = PER_ROUND * 3
        sending = asyncio.create_task(load.send(n, "c", retry_for=90, rate=n / 6.0))
        await _wait_outcomes(js, n // 5)
        victim = random.choice(nodes)
        victim.kill()
        await victim._proc.wait()
        # What a test waits out after a restart is seen while the node is down: its replicas offline.
        server = f"pgw-{victim.data_dir.name}"  # its server_name

        async def its_replicas() -> list[str]:
            return [u for u in await unsettled(js) if f"replica {server} " in u]

        seen_down = await until(its_replicas, timeout=60, interval=0.25, what=f"{server}'s replicas seen down")
        down_at = await _outcomes(js)
        # Still serving with a node down: a further batch sent now is processed now.
        extra = n // 10
        await load.send(extra, "down", retry_for=60)
        await _wait_outcomes(js, down_at + extra, timeout=90)
        served_while_down = await _outcomes(js) - down_at
        await _restart(victim)
        await sending
        await wait_drained(js, timeout=120)
        await wait_settled(js)  # and settled again once it is back
        report = await check_streams(js, load.acked, sent=load.sent, agents=[load.agent])
        info = await js.stream_info("PGW_INBOUND")
        # What the streams hold, beside what the checker read back (a short read vs a lost write).
        held = {st: (await js.stream_info(st)).state.messages for st in ("PGW_OUTBOUND", "PGW_SURFACE", "PGW_VERDICTS")}
        replicas = [(p.name, p.current) for p in (info.cluster.replicas or [])]
    finally:
        if gw is not None:
            await gw.stop()
        await nc.close()
        for node in nodes:
            await node.stop()
    print(f"\n[chaos R3 cluster, killed {victim.data_dir.name}] {report.summary()}; outcomes while down "
          f"{served_while_down}; publish retries {load.failures}; replicas {replicas}; seen down: {seen_down[:3]}")
    assert report.acked == n + extra and report.ok, f"{report.summary()}; the streams hold {held}"
    assert served_while_down >= extra


async def _outcomes(js) -> int:
    async def info():  # None while a leader election is in progress
        with contextlib.suppress(Exception):
            return await js.stream_info("PGW_OUTBOUND")
        return None

    # Elections can take several request timeouts: bound it like the outcome wait itself.
    return (await until(info, timeout=60, interval=0.1, what="PGW_OUTBOUND answering")).state.messages


async def _wait_outcomes(js, target: int, timeout: float = 60) -> None:
    async def reached() -> bool:
        return await _outcomes(js) >= target

    await until(reached, timeout=timeout, what=f"{target} outcomes")
