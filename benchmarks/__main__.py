"""``python -m benchmarks`` (``make bench``): run every ``benchmarks/bench_*.py`` and print one table.

Each module exposes ``run() -> list[dict]`` with rows ``{name, value, baseline,
ratio, unit}``; every baseline is measured in the same run, on the same
machine, so a ratio means something even on a busy laptop. A module that
fails prints an error row and the others still run.

The run ends with the target table (``benchmarks/targets.py``): one line per
speed target, the floor it is judged against with that floor's figure, the
figure measured, and whether it is met; a target whose rows are missing (its
module failed or was left out) says "not measured".

Options: ``--only NAME`` (module name part, repeatable), ``--json FILE``
(also write ``{"rows": [...], "targets": [...]}``), ``--soak`` (add the
10-minute soak of the gateway, ``PGW_SOAK_S=600``), ``--profile`` (profile the
gateway's hot path with pyinstrument, see docs/performance.md). Progress goes
to stderr while a module runs; the tables to stdout at the end.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import pkgutil
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path

import structlog

from benchmarks import targets
from pgwcore.loop import loop_name


def discover() -> list[str]:
    here = Path(__file__).resolve().parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return "" if v is None else str(v)


def table(rows: list[dict]) -> str:
    cols = ["name", "value", "baseline", "ratio", "unit"]
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths, strict=True)))
    out = [line, "  ".join("-" * w for w in widths)]
    for row in cells:
        out.append("  ".join(v.ljust(w) if i in (0, 4) else v.rjust(w)
                             for i, (v, w) in enumerate(zip(row, widths, strict=True))))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", default=[], help="run only modules whose name contains this")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    ap.add_argument("--profile", action="store_true", help="profile the gateway hot path (pyinstrument)")
    ap.add_argument("--soak", action="store_true", help="add the 10-minute soak (PGW_SOAK_S=600)")
    args = ap.parse_args(argv)
    if args.soak:
        os.environ.setdefault("PGW_SOAK_S", "600")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.profile:
        from benchmarks import profile_gateway

        return profile_gateway.main()
    rows: list[dict] = []
    failed = 0
    t_all = time.monotonic()
    for name in discover():
        if args.only and not any(o in name for o in args.only):
            continue
        # Start each module on a settled disk: the previous one's deleted stores and
        # dirty pages would otherwise be written back during this one's fsyncs.
        os.sync()
        time.sleep(2)
        t0 = time.monotonic()
        print(f"running {name} (event loop: {loop_name()}) ...", file=sys.stderr, flush=True)
        try:
            got = importlib.import_module(f"benchmarks.{name}").run()
            for r in got:
                r.setdefault("module", name)
            rows += got
        except Exception as e:  # noqa: BLE001 - one broken benchmark must not hide the others
            failed += 1
            traceback.print_exc()
            rows.append({"name": f"{name}: FAILED ({type(e).__name__}: {e})"[:120], "module": name})
        print(f"  {name} took {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    elapsed = time.monotonic() - t_all
    print(f"all modules took {elapsed:.0f} s", file=sys.stderr, flush=True)
    rows.append(wall_row(elapsed, args.only, failed, os.environ))
    judged = targets.judge(rows)
    print(table(rows))
    print()
    print(targets.table(judged))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "targets": judged}, indent=2))
    return 1 if failed else 0


def wall_row(seconds: float, only: list[str], failed: int, environ: Mapping[str, str]) -> dict:
    """The whole run's seconds, and whether it was a complete ``make bench``: every module, none
    failed, no knob changed (a ``PGW_BENCH_*`` or ``PGW_SOAK_S`` set makes it another run)."""
    knobs = sorted(k for k, v in environ.items() if k.startswith("PGW_BENCH_") or (k == "PGW_SOAK_S" and v != "0"))
    why = [f"--only {' '.join(only)}"] if only else []
    why += [f"{failed} module(s) failed"] if failed else []
    why += [f"knobs set: {', '.join(knobs)}"] if knobs else []
    return {"name": targets.WALL, "value": round(seconds, 1), "baseline": None, "ratio": None,
            "unit": "s (" + ("; ".join(why) if why else "complete run, default knobs") + ")",
            "complete": not why, "why": "; ".join(why), "module": "benchmarks"}


if __name__ == "__main__":
    sys.exit(main())
