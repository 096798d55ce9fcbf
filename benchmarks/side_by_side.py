"""Two trees' gateways driven at the same time: ``python -m benchmarks.side_by_side TREE_A TREE_B``.

What a change to the gateway's own code moved, on a shared host (issue 48, target 3). Gateways run one
after the other read their CPU per envelope under different loads of the host's other tenants, and a
change of a few per cent drowned in that (the seventh look, benchmarks/performance-changes.md). Here
each tree's gateway has an embedded server of its own, both are driven at once with the same closed
loop (the bench's driver, new 1 KB moments, 256 in flight), so whatever the host does it does to both;
each round swaps which server each tree runs on, and starts both afresh. A round's figure is tree B's
CPU per envelope over tree A's (each process's CPU-time clock); the median of the rounds is the answer,
and two copies of one tree (an A/A run) show the spread that is noise.

A tree is a directory holding the project's sources (``git worktree add`` or ``git archive | tar -x``);
its gateway runs with this interpreter and that directory first on ``PYTHONPATH``.
Knobs: ``--n`` envelopes a round (8,000), ``--rounds`` (6), ``--warm`` envelopes before each (2,000).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness import (
    PRINCIPAL,
    Driver,
    System,
    cpu_s,
    progress,
    start_gateway,
    stop,
    wait_gateway,
)
from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams


async def measure(trees: tuple[Path, Path], n: int, rounds: int, warm: int) -> dict[Path, list[float]]:
    """Each tree's gateway CPU per envelope (ms), one figure a round."""
    got: dict[Path, list[float]] = {t: [] for t in trees}
    with tempfile.TemporaryDirectory(prefix="pgw-side-") as d:
        root = Path(d)
        async with EmbeddedServer(root / "n0", port=-1, monitor_port=-1, websocket_port=None) as s0, \
                EmbeddedServer(root / "n1", port=-1, monitor_port=-1, websocket_port=None) as s1:
            servers, ncs, drivers, systems = (s0, s1), [], [], []
            for s in servers:
                nc = await connect(s.client_url, name="side-by-side-driver")
                await ensure_streams(nc.jetstream(), Config().subjects)
                system = System("gateway", "pgw.agent", f"pgw.principal.{PRINCIPAL}.surface", "PGW_INBOUND", "pgw-gateway")
                driver = Driver(nc)
                await driver.watch(system)
                ncs.append(nc)
                drivers.append(driver)
                systems.append(system)
            try:
                for r in range(rounds):
                    order = trees if r % 2 == 0 else trees[::-1]
                    procs = []
                    try:
                        for i, tree in enumerate(order):
                            procs.append(await start_gateway(servers[i].client_url, root / f"gw{r}-{i}", tree=tree))
                            await wait_gateway(ncs[i])
                        if warm:
                            await asyncio.gather(*(drivers[i].throughput(systems[i], warm) for i in range(2)))
                        before = [cpu_s(p.pid) for p in procs]
                        await asyncio.gather(*(drivers[i].throughput(systems[i], n, label=f"round {r + 1}, {order[i].name}")
                                               for i in range(2)))
                        after = [cpu_s(p.pid) for p in procs]
                    finally:
                        for p in procs:
                            await stop(p)
                    for i, tree in enumerate(order):
                        got[tree].append((after[i] - before[i]) * 1000 / n)
                    a, b = (got[t][-1] for t in trees)
                    progress(f"round {r + 1}/{rounds}: A {a:.4f} ms, B {b:.4f} ms an envelope, B/A {b / a:.3f}")
            finally:
                for nc in ncs:
                    await nc.close()
    return got


def report(trees: tuple[Path, Path], got: dict[Path, list[float]]) -> str:
    """The table: each tree's figures and mean, each round's B/A, and their median."""
    a, b = trees
    ratios = [y / x for x, y in zip(got[a], got[b], strict=True)]
    lines = [f"{label} {t!s:40} " + " ".join(f"{x:.4f}" for x in got[t]) + f"  mean {statistics.fmean(got[t]):.4f} ms"
             for label, t in (("A", a), ("B", b))]
    lines.append("B/A by round: " + " ".join(f"{x:.3f}" for x in ratios) + f"  median {statistics.median(ratios):.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.side_by_side", description=__doc__.split("\n\n")[0])
    ap.add_argument("tree_a", type=Path)
    ap.add_argument("tree_b", type=Path)
    ap.add_argument("--n", type=int, default=8000, help="envelopes a round (default 8000)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds, each swapping the servers (default 6)")
    ap.add_argument("--warm", type=int, default=2000, help="envelopes before each round's measure (default 2000)")
    args = ap.parse_args(argv)
    trees = (args.tree_a.resolve(), args.tree_b.resolve())
    if trees[0] == trees[1]:
        ap.error("the two trees are one directory: for an A/A run, copy it (git archive HEAD | tar -x -C COPY)")
    for t in trees:
        if not (t / "gateway" / "pipeline.py").is_file():
            ap.error(f"{t} holds no gateway sources (gateway/pipeline.py)")
    print(report(trees, asyncio.run(measure(trees, args.n, args.rounds, args.warm))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
