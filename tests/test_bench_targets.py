"""The target table ``python -m benchmarks`` ends with (benchmarks/targets.py), from synthetic rows.

No server, no timing: rows named as the bench modules print them (built with
``benchmarks.harness.row``, as they are), judged met, not met, and missing.
A target whose rows are missing must say "not measured", never "yes".
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import targets as T  # noqa: N812 - short: the tests read T.NOT_MEASURED often
from benchmarks.__main__ import main, wall_row
from benchmarks.harness import row

D = "default sync interval: "


def _p99(tag: str, who: str, values: list[float], seconds: float = 10, saturated: bool = False) -> list[dict]:
    n = len(values)
    sat = " (saturated)" if saturated else ""
    return [row(f"{tag}{who}: p99 publish->surface @ 500/s, {seconds:g} s window, run {i + 1}/{n}{sat}", v, 4.0,
                "ms", digits=2) for i, v in enumerate(values)]


def run13() -> list[dict]:
    """Run 13's figures (docs/performance.md), as the modules print them."""
    return [
        row("gateway: envelopes/s until acked (closed loop, 256 in flight)", 1149, 1867, "env/s", digits=1),
        row("contract floor (the gateway's writes, no logic): envelopes/s until acked", 1400, 1867, "env/s", digits=1),
        row("gateway CPU per envelope vs the contract floor", 0.630, 0.304, "ms CPU"),
        row("gateway, server's default sync interval: envelopes/s until acked", 1536, 8282, "env/s", digits=1),
        row(f"{D}contract floor (the gateway's writes, no logic): envelopes/s until acked", 2800, 8282, "env/s",
            digits=1),
        row(f"{D}gateway CPU per envelope vs the contract floor", 0.560, 0.320, "ms CPU"),
        row("messages sent to the server per envelope (writes, acks, fetches)", 8.03, 2.02, "msgs", digits=2),
        row("contract floor: messages sent / received per envelope", 8.02, 2.02, "msgs", digits=2),
        *_p99("", "gateway", [128.3, 138.7, 86.0, 93.6, 119.2]),
        *_p99("", "contract floor", [38.4]),
        *_p99(D, "gateway", [18.2, 16.0, 9.6, 12.2, 10.3]),
        *_p99(D, "contract floor", [7.3]),
        row(T.IDP_KERNEL, 0.0, 3000.0, "req/s", digits=0),
        row(T.IDP_FLOOR, 250.0, 3000.0, "req/s", digits=0),
        row("idp kernel: CPU per request @ 250/s (vs bare responder)", 1.67, 0.05, "ms CPU"),
        row("idp contract floor: CPU per request @ 250/s (vs bare responder)", 0.40, 0.05, "ms CPU"),
        row(T.SIGNER_VS_RAW4, 5336, 9529, "capsules/s", digits=1),
        row("gateway: 2 instances vs 1, CPU per envelope (all instances), 16 KB", 1.301, 1.0, "ms CPU"),
        row("contract floor: 2 instances vs 1, CPU per envelope (all instances), 16 KB", 1.122, 1.0, "ms CPU"),
        row(T.AGENTS, 1084, 1000, "env/s", digits=1),
        row("gateway CPU per envelope vs the contract floor, 16 KB moments", 0.85, 0.40, "ms CPU"),
        row("gateway CPU per envelope vs the contract floor, 120 KB moments", 2.33, 1.0, "ms CPU"),
    ]


def all_met() -> list[dict]:
    """Figures on the right side of every threshold, the gate's rows and a complete run included."""
    return [
        row("gateway: envelopes/s until acked (closed loop, 256 in flight)", 1000, 1867, "env/s", digits=1),
        row("contract floor (the gateway's writes, no logic): envelopes/s until acked", 1400, 1867, "env/s", digits=1),
        row("gateway CPU per envelope vs the contract floor", 0.42, 0.304, "ms CPU"),
        row("gateway, server's default sync interval: envelopes/s until acked", 2000, 8282, "env/s", digits=1),
        row(f"{D}contract floor (the gateway's writes, no logic): envelopes/s until acked", 2800, 8282, "env/s",
            digits=1),
        row(f"{D}gateway CPU per envelope vs the contract floor", 0.44, 0.320, "ms CPU"),
        row(T.GW_CPU_VS_WATCH_FLOOR, 0.42, 0.35, "ms CPU"),
        row(D + T.GW_CPU_VS_WATCH_FLOOR, 0.44, 0.37, "ms CPU"),
        row("messages sent to the server per envelope (writes, acks, fetches)", 6.03, 2.02, "msgs", digits=2),
        *_p99("", "gateway", [50.0, 60.0, 70.0, 75.0, 76.0]),
        *_p99("", "contract floor", [38.4]),
        *_p99(D, "gateway", [18.2, 16.0, 9.6, 12.2, 20.0]),
        row("idp: ceiling / contract floor", 250.0, 250.0, "req/s", digits=0),
        row("idp kernel: CPU per request @ 500/s (vs bare responder)", 0.95, 0.05, "ms CPU"),
        row(T.IDP_KERNEL_CPU_FIXED.format(rate=500), 0.95, 0.70, "ms CPU"),
        row("signer: end to end / raw format-4 loop", 7000, 9529, "capsules/s", digits=1),
        *(row(f"gate: added latency p50 at 100/s ({s})", 3.0, None, "ms") for s in ("always", "default sync")),
        *(row(f"gate: added latency p99 at 100/s ({s})", 12.0, None, "ms") for s in ("always", "default sync")),
        *(row(f"gate: ceiling p99<=20ms ({s})", 750.0, None, "req/s") for s in ("always", "default sync")),
        *(row(f"gate: ceiling p99<=20ms vs the gate floor's ({s})", 500.0, 500.0, "calls/s", digits=0)
          for s in ("always", "default sync")),
        *(row(f"gate: ceiling p99<=20ms vs the declaration's ({s})", 500.0, 500.0, "calls/s", digits=0)
          for s in ("always", "default sync")),
        *(row(f"gate: added p99 at 100/s vs the declaration's own p99 ({s})", 5.0, 4.0, "ms", digits=2)
          for s in ("always", "default sync")),
        *(row(f"gate: messages per gated call vs the gate floor's ({s})", 15.1, 15.0, "msgs", digits=2)
          for s in ("always", "default sync")),
        *(row(f"gate: one agent, steps/s of one session in sequence ({s})", 200.0, 210.0, "steps/s", digits=1)
          for s in ("always", "default sync")),
        *(row(f"gate: gateway CPU per gated call vs the gate floor's at 100/s ({s})", 1.5, 0.9, "ms CPU")
          for s in ("always", "default sync")),
        row(T.GW_STEADY.format(rate=T.STEADY_RATE), 0.5, 0.3, "ms CPU"),
        row(T.IDP_STEADY.format(rate=T.IDP_STEADY_RATE), 1.5, 1.0, "ms CPU"),
        row(T.AGENTS, 900, 1000, "env/s", digits=1),
        wall_row(250.0, [], 0, {}),
    ]


def met(rows: list[dict]) -> dict[str, str]:
    return {j["target"]: j["met"] for j in T.judge(rows)}


def by_source(rows: list[dict], needle: str) -> list[dict]:
    return [j for j in T.judge(rows) if needle in j["target"]]


def test_run_13_judges_as_the_issue_reads_it() -> None:
    """Run 13's figures: the gateway's CPU (2.07x, 1.75x) and the signer (0.56) miss, the default-interval
    p99 is met in 5 of 5, the IDP kernel's ceiling (none against the floor's 250/s) misses; messages and
    instances are reported; the gate's rows are absent, so not measured."""
    judged = {j["target"]: j for j in T.judge(run13())}
    m = {k: j["met"] for k, j in judged.items()}
    # Judged against the floor with its two watches since issue 48: run 13 printed no such row.
    assert m["gateway CPU <= 1.5x contract floor + its 2 watches (always)"] == T.NOT_MEASURED
    assert m["gateway CPU / contract floor (report; always)"] == "report"
    assert judged["gateway CPU / contract floor (report; always)"]["figure"].startswith("2.07x")
    assert m["gateway CPU / contract floor (report; default sync)"] == "report"
    assert judged["gateway CPU / contract floor (report; default sync)"]["figure"].startswith("1.75x")
    assert m["gateway env/s until acked >= 0.67x contract floor (always)"] == "yes"  # 1149 / 1400 = 0.82
    assert m["gateway env/s until acked >= 0.67x contract floor (default sync)"] == "no"  # 1536 / 2800 = 0.55
    assert m["gateway messages sent per envelope (report; before 8.03)"] == "report"
    assert m["p99 @ 500/s <= 20 ms in 5 of 5 windows of 10 s (default sync)"] == "yes"
    p99 = judged["p99 @ 500/s <= 2x contract floor's p99 (always)"]
    assert p99["met"] == "no" and p99["figure"].startswith("3.61x") and "38.4 ms" in p99["floor"]
    assert m["IDP ceiling (p99 <= 10 ms) >= 0.9x IDP contract floor"] == "no"
    assert m["IDP kernel: gateway CPU per request <= 1.0 ms"] == "no"
    signer = judged["signer end to end >= 0.7x raw format-4 loop"]
    assert signer["met"] == "no" and signer["figure"].startswith("0.56x") and "9,529" in signer["floor"]
    inst = judged["2 gateway instances / 1, CPU per envelope (report)"]
    assert inst["met"] == "report" and inst["figure"].startswith("1.30") and "1.12" in inst["floor"]
    assert m["1,000 new agents >= 0.8x one agent (env/s)"] == "yes"
    assert m["16, 120 KB moments: gateway / floor CPU (report)"] == "report"
    for j in by_source(run13(), "gate:"):
        assert j["met"] == T.NOT_MEASURED, j
    assert m["soak: gateway RSS growth (report; --soak)"] == T.NOT_MEASURED
    assert m["make bench < 5 min (complete run, default knobs)"] == T.NOT_MEASURED


def test_figures_within_every_threshold_are_met() -> None:
    """With every figure on the right side (the gate's rows and the other engineers' ratio rows present),
    every thresholded target says yes; report-only ones say report; only the soak is not measured."""
    m = met(all_met())
    reported = {"2 gateway instances / 1, CPU per envelope (report)", "16, 120 KB moments: gateway / floor CPU (report)",
                "gateway CPU / contract floor (report; always)",
                "gateway CPU / contract floor (report; default sync)",
                *(t.name for t in T.TARGETS if t.name.startswith("gate:") and "(report;" in t.name),
                "IDP kernel: gateway CPU per request at 500/s, p99 aside (report)",
                "gate: highest rate with p99 <= 20 ms (always)", "gate: highest rate with p99 <= 20 ms (default sync)"}
    unmeasured = {"soak: gateway RSS growth (report; --soak)", "2 gateway instances / 1, CPU per envelope (report)",
                  "16, 120 KB moments: gateway / floor CPU (report)"}
    for target, verdict in m.items():
        if target in unmeasured:
            assert verdict == T.NOT_MEASURED, target
        elif target in reported:
            assert verdict == "report", target
        else:
            assert verdict == "yes", (target, verdict)


def test_a_missing_row_never_leaves_a_target_met() -> None:
    """Removing any one row turns a target that needs it into "not measured" and changes no other
    verdict; a failed module (only its FAILED row left) leaves every target it feeds not measured."""
    full = all_met()
    before = met(full)
    for i, gone in enumerate(full):
        after = met(full[:i] + full[i + 1:])
        changed = {t for t in before if after[t] != before[t]}
        assert changed, f"no target reads {gone['name']!r}"
        for t in changed:
            assert after[t] == T.NOT_MEASURED, (gone["name"], t, after[t])
    failed = [r for r in full if not r["name"].startswith(("idp", "signer"))]
    failed += [{"name": "bench_idp: FAILED (RuntimeError: boom)", "module": "bench_idp"}]
    m = met(failed)
    assert m["IDP ceiling (p99 <= 10 ms) >= 0.9x IDP contract floor"] == T.NOT_MEASURED
    assert m["IDP kernel: gateway CPU per request <= 1.0 ms"] == T.NOT_MEASURED
    assert m["IDP kernel: gateway CPU per request at 500/s, p99 aside (report)"] == T.NOT_MEASURED
    assert m["signer end to end >= 0.7x raw format-4 loop"] == T.NOT_MEASURED
    assert m["gateway CPU <= 1.5x contract floor + its 2 watches (always)"] == "yes"


def test_the_p99_target_needs_five_windows_of_ten_seconds() -> None:
    """One 3 s window under 20 ms is not measured (too short to judge), one over 20 ms already misses,
    a "(saturated)" window is read, and four windows of 10 s are not enough."""
    target = "p99 @ 500/s <= 20 ms in 5 of 5 windows of 10 s (default sync)"
    assert met(_p99(D, "gateway", [5.0], seconds=3))[target] == T.NOT_MEASURED
    assert met(_p99(D, "gateway", [25.0], seconds=3))[target] == "no"
    assert met(_p99(D, "gateway", [5.0] * 4 + [21.0], saturated=True))[target] == "no"
    assert met(_p99(D, "gateway", [5.0] * 4))[target] == T.NOT_MEASURED
    assert met(_p99(D, "gateway", [5.0] * 5, saturated=True))[target] == "yes"
    # The `always` windows are not the default interval's, nor the other way round.
    assert met(_p99("", "gateway", [5.0] * 5))[target] == T.NOT_MEASURED
    assert met(_p99(D, "gateway", [5.0] * 5) + _p99(D, "contract floor", [1.0]))[
        "p99 @ 500/s <= 2x contract floor's p99 (always)"] == T.NOT_MEASURED


def test_the_named_ratio_rows_win_over_the_fallback() -> None:
    """`idp: ceiling / contract floor` and `signer: end to end / raw format-4 loop`, when printed, decide
    the target even where the older rows say otherwise; a row holding the ratio alone is read too."""
    older = run13()  # kernel 0 vs floor 250; signer 0.56
    m = met([*older, row(T.IDP_RATIO, 500, 500, "req/s"), row(T.SIGNER_RATIO, 7100, 10000, "capsules/s")])
    assert m["IDP ceiling (p99 <= 10 ms) >= 0.9x IDP contract floor"] == "yes"
    assert m["signer end to end >= 0.7x raw format-4 loop"] == "yes"
    alone = [{"name": T.IDP_RATIO, "value": 0.85, "baseline": None, "ratio": None, "unit": "ratio"},
             {"name": T.SIGNER_RATIO, "value": None, "baseline": None, "ratio": 0.72, "unit": "ratio"}]
    m = met(older + alone)
    assert m["IDP ceiling (p99 <= 10 ms) >= 0.9x IDP contract floor"] == "no"
    assert m["signer end to end >= 0.7x raw format-4 loop"] == "yes"


def test_an_idp_floor_below_the_ladder() -> None:
    """Both ceilings 0 (neither passed the ladder's first step) is not measured; a kernel above a floor
    at 0 meets the target; a kernel at the floor's 0.8 misses it."""
    target = "IDP ceiling (p99 <= 10 ms) >= 0.9x IDP contract floor"

    def rows(kernel: float, floor: float) -> list[dict]:
        return [row(T.IDP_KERNEL, kernel, 3000.0, "req/s"), row(T.IDP_FLOOR, floor, 3000.0, "req/s")]

    assert met(rows(0, 0))[target] == T.NOT_MEASURED
    assert met(rows(250, 0))[target] == "yes"
    assert met(rows(400, 500))[target] == "no"
    assert met(rows(450, 500))[target] == "yes"


def test_the_kernel_cpu_at_a_fixed_rate_is_reported_beside_its_floor_never_judged() -> None:
    """The kernel's CPU at 500/s (both it and its floor kept up, p99 aside) is a report with the floor's figure
    at the same rate, whatever its value; the row the bench prints is the one judged."""
    from benchmarks.bench_idp import FIXED_RATE, FIXED_RATE_ROW

    assert FIXED_RATE_ROW.format(rate=FIXED_RATE) == T.IDP_KERNEL_CPU_FIXED.format(rate=500)
    target = "IDP kernel: gateway CPU per request at 500/s, p99 aside (report)"
    for kernel in (0.9, 1.4):
        (j,) = [j for j in T.judge([row(T.IDP_KERNEL_CPU_FIXED.format(rate=500), kernel, 0.7, "ms CPU")])
                if j["target"] == target]
        assert j["met"] == "report"
        assert j["figure"] == f"{kernel:.3f} ms ({kernel / 0.7:.2f}x its floor)", j
        assert j["floor"] == "IDP contract floor 0.700 ms at 500/s", j
    assert met([row("idp kernel: CPU per request @ 500/s (vs bare responder)", 0.9, 0.05, "ms CPU")])[target] \
        == T.NOT_MEASURED


async def test_the_ladder_keeps_the_cost_of_every_rate_it_kept_up_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench_idp._ladder``: the ceiling is the last step that passed p99; the cost at each rate is kept
    whenever the offered rate was achieved with no failure (p99 aside), the passing try's when there is
    one, else the last try's; a rate it fell behind on has none."""
    from collections.abc import Iterator
    from contextlib import contextmanager
    from types import SimpleNamespace

    from benchmarks import bench_idp

    # Per rate, per try: (p99 in s, share of the offered rate achieved, failures).
    plan = {250: [(0.002, 1.0, 0)], 500: [(0.030, 1.0, 0), (0.012, 1.0, 0)], 750: [(0.001, 0.5, 0), (0.001, 1.0, 3)]}
    tries: dict[int, int] = {}
    cpu = iter(range(1, 100))  # each try's service CPU (s): distinct, so the kept try can be told

    async def drive(_send: object, n: int, rate: float) -> tuple[list[float], float, int]:
        i = tries[int(rate)] = tries.get(int(rate), -1) + 1
        p99, share, fail = plan[int(rate)][i]
        return [p99] * n, n / (rate * share), fail

    @contextmanager
    def meter() -> Iterator[SimpleNamespace]:  # a stand-in for harness.Meter: the ladder reads .cpu, .msgs
        m = SimpleNamespace(cpu={}, msgs={"service": (7 * 10, 0)})
        yield m
        m.cpu = {"service": float(next(cpu))}

    monkeypatch.setattr(bench_idp, "_drive", drive)
    monkeypatch.setattr(bench_idp, "RATES", [250, 500, 750, 1000])
    ceiling, _rows, at_ceiling, kept = await bench_idp._ladder("kernel", None, meter, seconds=0.04)
    assert ceiling == 250  # 500/s kept up but missed p99 twice: the ladder stops there
    assert at_ceiling["rate"] == 250 and at_ceiling["service"] == 1000 / 10
    assert sorted(kept) == [250, 500]  # never reached 750
    assert kept[500]["service"] == 3 * 1000 / 20  # the second (last) try's
    monkeypatch.setattr(bench_idp, "RATES", [750])
    tries.clear()
    _c, _r, _a, kept = await bench_idp._ladder("kernel", None, meter, seconds=0.04)
    assert kept == {}  # behind the rate, then failures: no cost at 750/s


def test_the_gate_rows_are_judged_against_their_limits() -> None:
    """The gate's p50 over 5 ms and p99 over 15 ms miss; its ceiling is reported with its figure."""
    rows = [row("gate: added latency p50 at 100/s (always)", 5.5, None, "ms"),
            row("gate: added latency p99 at 100/s (always)", 14.9, None, "ms"),
            row("gate: ceiling p99<=20ms (always)", 750.0, None, "req/s")]
    j = {x["target"]: x for x in T.judge(rows)}
    assert j["gate: added p50 @ 100/s <= 5 ms (always)"]["met"] == "no"
    assert j["gate: added p99 @ 100/s <= 15 ms (always)"]["met"] == "yes"
    assert j["gate: highest rate with p99 <= 20 ms (always)"]["met"] == "report"
    assert j["gate: highest rate with p99 <= 20 ms (always)"]["figure"] == "750 /s"
    assert j["gate: added p50 @ 100/s <= 5 ms (default sync)"]["met"] == T.NOT_MEASURED


def test_the_gate_is_judged_against_its_floor_and_reported_against_the_declaration() -> None:
    """issue 48: the gate's ceiling >= 0.9x the gate floor's (a floor below the ladder is met by any ceiling
    above it), added p99 <= 2x the declaration's own; the declaration ratio and the messages are reports."""
    def judged(rows: list[dict]) -> dict[str, dict]:
        return {j["target"]: j for j in T.judge(rows)}

    ceiling = "gate: ceiling (p99 <= 20 ms) >= 0.9x the gate floor's (always)"
    floor_row = "gate: ceiling p99<=20ms vs the gate floor's (always)"
    assert judged([row(floor_row, 300.0, 400.0, "calls/s")])[ceiling]["met"] == "no"  # 0.75x
    assert judged([row(floor_row, 400.0, 400.0, "calls/s")])[ceiling]["met"] == "yes"
    assert judged([row(floor_row, 50.0, 0.0, "calls/s")])[ceiling]["met"] == "yes"
    assert judged([row(floor_row, 0.0, 0.0, "calls/s")])[ceiling]["met"] == T.NOT_MEASURED
    assert judged([])[ceiling]["met"] == T.NOT_MEASURED
    added = "gate: added p99 @ 100/s <= 2x the declaration's own p99 (default sync)"
    added_row = "gate: added p99 at 100/s vs the declaration's own p99 (default sync)"
    assert judged([row(added_row, 9.0, 4.0, "ms")])[added]["met"] == "no"
    assert judged([row(added_row, 7.9, 4.0, "ms")])[added]["met"] == "yes"
    msgs = judged([row("gate: messages per gated call vs the gate floor's (always)", 15.1, 15.0, "msgs")])[
        "gate: messages sent per gated call (report; always)"]
    assert msgs["met"] == "report" and msgs["figure"] == "15.10" and "16.1" in msgs["floor"] and "15.00" in msgs["floor"]
    decl = judged([row("gate: ceiling p99<=20ms vs the declaration's (always)", 300.0, 500.0, "calls/s")])[
        "gate: ceiling / the IDP kernel's (report; always)"]
    assert decl["met"] == "report" and decl["figure"].startswith("0.60x") and "same ladder" in decl["floor"]
    kern = judged([row("gate: ceiling p99<=20ms (default sync)", 400.0, None, "calls/s"),
                   row(T.IDP_KERNEL, 500.0, 3000.0, "req/s")])["gate: ceiling / the IDP kernel's (report; default sync)"]
    assert kern["met"] == "report" and kern["figure"].startswith("0.80x") and "bench_idp" in kern["floor"]


def test_cpu_at_a_steady_rate_is_judged_against_the_floor_at_that_rate() -> None:
    """issue 48, target 4: the gateway at a steady 150/s and the kernel at 50/s, each <= 2x its floor at that rate."""
    gw = f"gateway CPU at a steady {T.STEADY_RATE}/s <= 2x contract floor at that rate (always)"
    idp = f"IDP kernel CPU at a steady {T.IDP_STEADY_RATE}/s <= 2x IDP contract floor at that rate"
    assert met([row(T.GW_STEADY.format(rate=T.STEADY_RATE), 0.9, 0.4, "ms CPU")])[gw] == "no"
    assert met([row(T.GW_STEADY.format(rate=T.STEADY_RATE), 0.7, 0.4, "ms CPU")])[gw] == "yes"
    assert met([row(T.IDP_STEADY.format(rate=T.IDP_STEADY_RATE), 1.9, 1.0, "ms CPU")])[idp] == "yes"
    assert met([])[idp] == T.NOT_MEASURED


def test_instance_rounds_are_averaged() -> None:
    """With several instance rounds the mean rows are read; with per-round rows alone, their mean."""
    target = "2 gateway instances / 1, CPU per envelope (report)"
    rounds = [row(f"{who}: 2 instances vs 1, CPU per envelope (all instances), 16 KB, round {i}/2", v, 1.0, "ms")
              for who, vals in (("gateway", (1.2, 1.4)), ("contract floor", (1.1, 1.3))) for i, v in zip((1, 2), vals, strict=True)]
    j = {x["target"]: x for x in T.judge(rounds)}[target]
    assert j["figure"].startswith("1.30") and "1.20" in j["floor"] and j["met"] == "report"
    means = [{"name": f"{who}: 2 instances vs 1, CPU ratio over 2 rounds (mean; min-max)", "value": v,
              "baseline": None, "ratio": v, "unit": "two/one"} for who, v in (("gateway", 1.25), ("contract floor", 1.05))]
    j = {x["target"]: x for x in T.judge(rounds + means)}[target]
    assert j["figure"].startswith("1.25") and "1.05" in j["floor"]


def test_the_wall_time_is_judged_only_for_a_complete_run() -> None:
    """`make bench` under five minutes is judged for a complete run with default knobs only."""
    target = "make bench < 5 min (complete run, default knobs)"
    assert met([wall_row(250, [], 0, {"PGW_SOAK_S": "0", "HOME": "/root"})])[target] == "yes"
    assert met([wall_row(320, [], 0, {})])[target] == "no"
    assert met([wall_row(100, ["gateway"], 0, {})])[target] == T.NOT_MEASURED
    assert met([wall_row(100, [], 1, {})])[target] == T.NOT_MEASURED
    short = wall_row(100, [], 0, {"PGW_BENCH_N": "500"})
    assert not short["complete"] and "PGW_BENCH_N" in short["unit"]
    assert met([short])[target] == T.NOT_MEASURED


def test_a_broken_judge_is_not_measured() -> None:
    """A judge that raises shows its error as "not measured"; the other targets still print."""
    def boom(_rows: T.Rows) -> T.Judged:
        raise KeyError("value")

    targets = [T.Target("broken", "test", boom), *T.TARGETS[:1]]
    judged = T.judge(run13(), targets)
    assert judged[0]["met"] == T.NOT_MEASURED and "KeyError" in judged[0]["figure"]
    assert judged[1]["met"] == T.NOT_MEASURED  # run 13 printed no floor-with-watches row; the judge ran


def test_python_m_benchmarks_ends_with_the_target_table_and_writes_it_to_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m benchmarks --only NAME --json FILE` with no module matching: stdout ends with the target
    table (every target not measured) and the JSON holds the rows and the same targets."""
    out = tmp_path / "bench.json"
    assert main(["--only", "no-such-module", "--json", str(out)]) == 0
    printed = capsys.readouterr().out.rstrip().splitlines()
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["rows"]] == [T.WALL]
    assert len(data["targets"]) == len(T.TARGETS)
    assert all(j["met"] == T.NOT_MEASURED for j in data["targets"])
    tail = printed[-len(T.TARGETS):]
    assert printed[-len(T.TARGETS) - 2].split() == ["target", "floor", "(same", "run)", "figure", "met"]
    for line, j in zip(tail, data["targets"], strict=True):
        assert line.startswith(j["target"]) and line.endswith(T.NOT_MEASURED)


def _anchor(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_performance_page_links_only_to_sections_that_exist() -> None:
    """The performance pages' links into each other (and docs/gate.md's into them) name headings that exist;
    the run log and the changes page live beside the benchmarks, the reference page in docs/."""
    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "performance.md").read_text()
    assert re.search(r"\]\(\.\./benchmarks/performance-log\.md#", page), "performance.md links to no section of the run log"
    pages = [root / "docs" / "performance.md", root / "benchmarks" / "performance-changes.md",
             root / "benchmarks" / "performance-log.md", root / "docs" / "gate.md"]
    for path in pages:
        links = re.findall(r"\]\(((?:[./a-z]*/)?(?:performance-log|performance-changes|performance)\.md)?#([^)]+)\)",
                           path.read_text())
        for target, anchor in links:
            text = ((path.parent / target) if target else path).read_text()
            anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
            assert anchor in anchors, (path.name, target, anchor)


def test_the_performance_page_stays_a_five_minute_read() -> None:
    """Issue 32: docs/performance.md is what a newcomer reads in five minutes (what is compared with what, the
    table of record, how to reproduce); runs, analyses and knobs go to the run log and the changes page. Its
    target table is scanned, not read, so the limit is set for it: 2,000 words in all."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "performance.md").read_text()
    words = len(page.split())
    assert words <= 2000, f"docs/performance.md has {words} words; move runs and analyses to benchmarks/performance-log.md"
    headings = re.findall(r"^## (.+)$", page, re.M)
    assert headings[:3] == ["What is compared with what", "The targets", "Reproduce"], headings


def test_a_ratio_that_rounds_to_its_limit_shows_the_third_decimal() -> None:
    """Where two decimals would print the limit itself the figure has three (0.667x: no, 0.671x: yes, against
    0.67x; 1.499x against 1.5x); elsewhere two (run 19 printed "0.67x ... no")."""
    judge = T.rates_at_least("ours", "floor", 0.67, "env/s", "contract floor")

    def rows(v: float, f: float) -> T.Rows:
        return T.Rows([row("ours", v, 1.0, "env/s"), row("floor", f, 1.0, "env/s")])

    miss, hit, far = judge(rows(2255, 3380)), judge(rows(2268, 3380)), judge(rows(2400, 3380))
    assert miss.figure.startswith("0.667x") and miss.met == "no"
    assert hit.figure.startswith("0.671x") and hit.met == "yes"
    assert far.figure.startswith("0.71x") and far.met == "yes"
    assert T._x(1.499, 1.5) == "1.499x" and T._x(1.5, 1.5) == "1.50x" and T._x(2.25, 1.5) == "2.25x"


def test_the_gateway_cpu_is_judged_against_the_floor_with_its_watches_and_the_bare_floor_reported() -> None:
    """issue 48 (the decision issue 32 asked for): the gateway's CPU against the contract floor with the two
    required watches is judged (<= 1.5x) on each sync setting, against the bare floor reported; without its
    row a target is not measured."""
    rows = [row(T.GW_CPU_VS_WATCH_FLOOR, 0.495, 0.330, "ms CPU"),
            row(D + T.GW_CPU_VS_WATCH_FLOOR, 0.520, 0.300, "ms CPU"),
            row(T.GW_CPU_VS_FLOOR, 0.495, 0.250, "ms CPU")]
    judged = {j["target"]: j for j in T.judge(rows)}
    always = judged["gateway CPU <= 1.5x contract floor + its 2 watches (always)"]
    assert always["met"] == "yes" and always["figure"] == "1.50x (0.495 ms)" and "0.330 ms" in always["floor"]
    default = judged["gateway CPU <= 1.5x contract floor + its 2 watches (default sync)"]
    assert default["met"] == "no" and default["figure"] == "1.73x (0.520 ms)"
    bare = judged["gateway CPU / contract floor (report; always)"]
    assert bare["met"] == "report" and bare["figure"] == "1.98x (0.495 ms)"
    assert judged["gateway CPU / contract floor (report; default sync)"]["met"] == T.NOT_MEASURED
    alone = {j["target"]: j["met"] for j in T.judge(rows[:1])}
    assert alone["gateway CPU <= 1.5x contract floor + its 2 watches (default sync)"] == T.NOT_MEASURED
