"""Profile the gateway's hot path under load (``python -m benchmarks --profile``).

Runs ``pgw gateway`` under pyinstrument (``PGW_PROFILER=cprofile``: cProfile,
exact call counts) against an embedded server, drives
``PGW_PROFILE_N`` binding moments through it (closed loop), stops it with
SIGTERM (pyinstrument writes a pstats file on exit) and prints the top
functions by own time and the project's functions by cumulative time.
"""

from __future__ import annotations

import asyncio
import os
import pstats
import signal
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import PRINCIPAL, Driver, System, bench_server, until_signal, wait_gateway
from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.server import bound_to_parent
from pgwcore.streams import ensure_streams


async def _profile(n: int, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="pgw-prof-") as d:
        root = Path(d)
        async with bench_server(root / "nats", websocket_port=None) as server:
            nc = await connect(server.client_url, name="profile-driver")
            await ensure_streams(nc.jetstream(), Config().subjects)
            gw = System("gateway", "pgw.agent", f"pgw.principal.{PRINCIPAL}.surface", "PGW_INBOUND", "pgw-gateway")

            async def cb(msg) -> None:
                gw.on_receive(msg.data)

            await nc.subscribe(gw.receive_subject, cb=cb)
            log = open(root / "gw.log", "wb")  # noqa: SIM115, ASYNC230
            profiler = (["-m", "cProfile", "-o", str(out)] if os.environ.get("PGW_PROFILER") == "cprofile"
                        else ["-m", "pyinstrument", "-r", "pstats", "-o", str(out)])
            proc = await asyncio.create_subprocess_exec(
                *bound_to_parent([sys.executable, *profiler, "-m", "pgwcli", "--server", server.client_url,
                                  "--data-dir", str(root / "gw"), "--log-level", "WARNING", "--log-format", "json",
                                  "gateway"]),
                stdout=log, stderr=log, start_new_session=True)
            log.close()
            try:
                await wait_gateway(nc)
                rate = await Driver(nc).throughput(gw, n, kb=int(os.environ.get("PGW_PROFILE_KB", "1")))
                print(f"profiled run: {n} envelopes at {rate:.0f}/s", file=sys.stderr)
                proc.send_signal(signal.SIGTERM)  # pyinstrument writes the profile on exit
                await asyncio.wait_for(proc.wait(), 60)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                await nc.close()


def main() -> int:
    out = Path(os.environ.get("PGW_PROFILE_OUT", "gateway-profile.pstats"))
    asyncio.run(until_signal(_profile(int(os.environ.get("PGW_PROFILE_N", "3000")), out)))
    stats = pstats.Stats(str(out))
    print(f"== top 25 by own time (profile: {out}) ==")
    stats.sort_stats("tottime").print_stats(25)
    print("== the project's own functions by cumulative time ==")
    stats.sort_stats("cumulative").print_stats(r"(gateway|subjects|consumers)/", 40)
    return 0
