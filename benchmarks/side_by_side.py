"""Two gateways, or a gateway and its contract floor, driven at the same time: ``python -m benchmarks.side_by_side
TREE_A TREE_B`` / ``python -m benchmarks.side_by_side --floor TREE``.

What a change to the gateway's own code moved, on a shared host (issue 48, target 3). Gateways run one
after the other read their CPU per envelope under different loads of the host's other tenants, and a
change of a few per cent drowned in that (the seventh look, benchmarks/performance-changes.md). Here
each contender has an embedded server of its own, both are driven at once with the same closed
loop (the bench's driver, new 1 KB moments, 256 in flight, on the bench's event loop: uvloop where installed;
the twelfth and thirteenth looks' figures drove it on asyncio's), so whatever the host does it does to both;
each round swaps which server each contender runs on, and starts both processes afresh (the servers
keep what earlier rounds stored: the warm-up, ``--warm``, takes in the watches' replay of it). A round's
figure is B's CPU per envelope over A's (each process's CPU-time clock); the median of the rounds is
the answer, and two copies of one tree (an A/A run) show the spread that is noise. Each side's loop is
the bench's own: a gateway's slot is free once the envelope's outcome is out, the floor's once its
surface item is (``bench_gateway._systems``).

``--floor TREE``: A is the contract floor with the two watches every instance keeps (``benchmarks/relay.py``
``floor-watch``, from this checkout), B the gateway of TREE: target 3's ratio (``make bench``'s "gateway CPU
per envelope vs the contract floor with its two watches") judged side by side, as a report beside the
bench's, which runs the two one after the other.

A tree is a directory holding the project's sources (``git worktree add`` or ``git archive | tar -x``);
its gateway runs with this interpreter and that directory first on ``PYTHONPATH``.
Knobs: ``--n`` envelopes a round (8,000), ``--rounds`` (6), ``--warm`` envelopes before each (2,000).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client

from benchmarks import harness
from benchmarks import relay as relay_mod
from benchmarks.bench_gateway import _systems
from benchmarks.harness import (
    Driver,
    System,
    bench_server,
    cpu_s,
    progress,
    start_gateway,
    start_ready,
    stop,
    wait_gateway,
)
from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.streams import ensure_streams

FLOOR = "floor-watch"


@dataclass(frozen=True)
class Contender:
    """One side: a tree's gateway, or (``tree`` None) the contract floor with its two watches."""

    tree: Path | None

    @property
    def name(self) -> str:
        return str(self.tree) if self.tree is not None else f"contract floor + its 2 watches ({FLOOR})"

    def system(self) -> System:
        """The bench's own system for this side (``bench_gateway._systems``): the gateway's closed loop frees a
        slot on the envelope's outcome, the floor's on its surface item, as in ``make bench``."""
        gw, *_, floor_watch = _systems()
        return floor_watch if self.tree is None else gw

    async def start(self, nc: Client, url: str, data: Path) -> asyncio.subprocess.Process:
        if self.tree is None:
            data.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - process start-up, not a hot path
            return await start_ready(nc, f"bench.relay.ready.{FLOOR}", "benchmarks.relay", url, FLOOR,
                                     log_path=data / "relay.log")
        proc = await start_gateway(url, data, tree=self.tree)
        try:
            await wait_gateway(nc)
        except BaseException:  # not in the caller's hands yet: stopped here, or it outlives the run
            await stop(proc)
            raise
        return proc


async def measure(sides: tuple[Contender, Contender], n: int, rounds: int, warm: int) -> dict[Contender, list[float]]:
    """Each side's CPU per envelope (ms), one figure a round."""
    got: dict[Contender, list[float]] = {c: [] for c in sides}
    with tempfile.TemporaryDirectory(prefix="pgw-side-") as d:
        root = Path(d)
        async with bench_server(root / "n0", websocket_port=None) as s0, \
                bench_server(root / "n1", websocket_port=None) as s1:
            servers, ncs, drivers, systems = (s0, s1), [], [], []
            for s in servers:
                nc = await connect(s.client_url, name="side-by-side-driver")
                await ensure_streams(nc.jetstream(), Config().subjects)
                if any(c.tree is None for c in sides):
                    await relay_mod.ensure_relay_streams(nc)
                driver = Driver(nc)
                # Each server runs either side, a round each: both sides' systems are watched on both (two
                # gateways are one system there, watched once: only one runs on a server at a time).
                by_name: dict[str, System] = {}
                mine: dict[Contender, System] = {}
                for c in sides:
                    fresh = c.system()
                    mine[c] = by_name.setdefault(fresh.name, fresh)
                for system in by_name.values():
                    await driver.watch(system)
                ncs.append(nc)
                drivers.append(driver)
                systems.append(mine)
            try:
                for r in range(rounds):
                    order = sides if r % 2 == 0 else sides[::-1]
                    procs = []
                    try:
                        for i, c in enumerate(order):
                            procs.append(await c.start(ncs[i], servers[i].client_url, root / f"p{r}-{i}"))
                        if warm:
                            await asyncio.gather(*(drivers[i].throughput(systems[i][c], warm)
                                                   for i, c in enumerate(order)))
                        before = [cpu_s(p.pid) for p in procs]
                        await asyncio.gather(*(drivers[i].throughput(systems[i][c], n, label=f"round {r + 1}, {'AB'[sides.index(c)]}")
                                               for i, c in enumerate(order)))
                        after = [cpu_s(p.pid) for p in procs]
                    finally:
                        for p in procs:
                            await stop(p)
                    for i, c in enumerate(order):
                        got[c].append((after[i] - before[i]) * 1000 / n)
                    a, b = (got[c][-1] for c in sides)
                    progress(f"round {r + 1}/{rounds}: A {a:.4f} ms, B {b:.4f} ms an envelope, B/A {b / a:.3f}")
            finally:
                for nc in ncs:
                    await nc.close()
    return got


def report(sides: tuple[Contender, Contender], got: dict[Contender, list[float]]) -> str:
    """The table: each side's figures and mean, each round's B/A, and their median."""
    a, b = sides
    ratios = [y / x for x, y in zip(got[a], got[b], strict=True)]
    lines = [f"{label} {c.name:46} " + " ".join(f"{x:.4f}" for x in got[c]) + f"  mean {statistics.fmean(got[c]):.4f} ms"
             for label, c in (("A", a), ("B", b))]
    lines.append("B/A by round: " + " ".join(f"{x:.3f}" for x in ratios) + f"  median {statistics.median(ratios):.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.side_by_side", description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", type=Path, nargs="+", metavar="TREE",
                    help="TREE_A TREE_B: two trees' gateways; with --floor, one tree, against the contract floor")
    ap.add_argument("--floor", action="store_true",
                    help=f"A is the contract floor with its two watches ({FLOOR}), B the one TREE's gateway")
    ap.add_argument("--n", type=int, default=8000, help="envelopes a round (default 8000)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds, each swapping the servers (default 6)")
    ap.add_argument("--warm", type=int, default=2000, help="envelopes before each round's measure (default 2000)")
    args = ap.parse_args(argv)
    trees = [t.resolve() for t in args.trees]
    if len(trees) != (1 if args.floor else 2):
        ap.error("--floor takes one TREE" if args.floor else "two trees: TREE_A TREE_B (or --floor TREE)")
    if not args.floor and trees[0] == trees[1]:
        ap.error("the two trees are one directory: for an A/A run, copy it (git archive HEAD | tar -x -C COPY)")
    for t in trees:
        if not (t / "gateway" / "pipeline.py").is_file():
            ap.error(f"{t} holds no gateway sources (gateway/pipeline.py)")
    sides = (Contender(None), Contender(trees[0])) if args.floor else (Contender(trees[0]), Contender(trees[1]))
    print(report(sides, harness.run(measure(sides, args.n, args.rounds, args.warm))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
