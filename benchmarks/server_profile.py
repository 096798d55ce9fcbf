"""nats-server's own CPU profile while the gateway runs at a steady rate (``python -m benchmarks.server_profile``).

Issue 18: at 500 envelopes/s under ``sync_interval: always`` the server is the
largest user of the CPU, so "where does the server's time go" has to be
answerable without Go's toolchain. The server is started with a ``prof_port``
(its ``/debug/pprof`` endpoints on loopback); while the driver offers
``--rate`` envelopes/s to the gateway for ``--seconds``, the server's CPU
profile of that window is fetched and decoded here (pprof's protobuf, read
with a few lines of wire-format parsing) into the functions with the most
samples of their own ("flat") and with them on the stack ("cum").

    .venv/bin/python -m benchmarks.server_profile --rate 500 --seconds 10 [--sync default] [--top 30]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import socket
import sys
import tempfile
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import bench_server, progress


@dataclass
class Profile:
    total_ns: int
    flat: Counter[str]  # function -> ns of samples in which it is the leaf
    cum: Counter[str]  # function -> ns of samples in which it is anywhere on the stack


def _varint(b: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = b[i]
        i += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return result, i


def _fields(b: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of one protobuf message."""
    i = 0
    while i < len(b):
        key, i = _varint(b, i)
        field, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, i = _varint(b, i)
        elif wire == 2:
            n, i = _varint(b, i)
            value, i = b[i:i + n], i + n
        elif wire == 1:
            value, i = b[i:i + 8], i + 8
        elif wire == 5:
            value, i = b[i:i + 4], i + 4
        else:
            raise ValueError(f"not a pprof profile: wire type {wire} at byte {i}")
        yield field, wire, value


def _ints(value: int | bytes) -> list[int]:
    """A repeated integer field, packed (bytes) or not (one int)."""
    if isinstance(value, int):
        return [value]
    out, i = [], 0
    while i < len(value):
        x, i = _varint(value, i)
        out.append(x)
    return out


def decode(data: bytes) -> Profile:
    """Decode a pprof CPU profile (gzipped ``perftools.profiles.Profile``): the sample value used is the
    last one (``cpu`` nanoseconds in a Go CPU profile)."""
    try:
        raw = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
        return _decode(raw)
    except (IndexError, KeyError, EOFError, OSError) as e:
        raise ValueError(f"not a pprof profile: {e}") from e


def _decode(raw: bytes) -> Profile:
    strings: list[str] = []
    samples: list[tuple[list[int], list[int]]] = []
    locations: dict[int, list[int]] = {}  # location id -> function ids, innermost first
    functions: dict[int, int] = {}  # function id -> name (string table index)
    for field, _, value in _fields(raw):
        if field == 6 and isinstance(value, bytes):  # string_table
            strings.append(value.decode("utf-8", "replace"))
        elif field == 2 and isinstance(value, bytes):  # sample: location_id (1), value (2)
            ids: list[int] = []
            vals: list[int] = []
            for f, _, v in _fields(value):
                (ids if f == 1 else vals if f == 2 else []).extend(_ints(v))
            samples.append((ids, vals))
        elif field == 4 and isinstance(value, bytes):  # location: id (1), line (4) -> function_id (1)
            lid, fids = 0, []
            for f, _, v in _fields(value):
                if f == 1 and isinstance(v, int):
                    lid = v
                elif f == 4 and isinstance(v, bytes):
                    fids += [x for f3, _, x in _fields(v) if f3 == 1 and isinstance(x, int)]
            locations[lid] = fids
        elif field == 5 and isinstance(value, bytes):  # function: id (1), name (2)
            fid = name = 0
            for f, _, v in _fields(value):
                if f == 1 and isinstance(v, int):
                    fid = v
                elif f == 2 and isinstance(v, int):
                    name = v
            functions[fid] = name
    flat: Counter[str] = Counter()
    cum: Counter[str] = Counter()
    total = 0
    for ids, vals in samples:
        if not vals:
            continue
        weight = vals[-1]
        total += weight
        names = [strings[functions[fid]] for lid in ids for fid in locations.get(lid, []) if fid in functions]
        if names:
            flat[names[0]] += weight
        for name in set(names):
            cum[name] += weight
    return Profile(total, flat, cum)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def fetch_profile(port: int, seconds: int) -> bytes:
    """The server's CPU profile over the next ``seconds`` (blocks that long, in a thread)."""
    url = f"http://127.0.0.1:{port}/debug/pprof/profile?seconds={seconds}"

    def get() -> bytes:
        with urllib.request.urlopen(url, timeout=seconds + 30) as r:  # loopback: our own server
            return r.read()

    return await asyncio.to_thread(get)


def report(p: Profile, top: int) -> str:
    lines = [f"nats-server CPU in the window: {p.total_ns / 1e9:.2f} s"]
    for title, counts in (("own (flat)", p.flat), ("on the stack (cum)", p.cum)):
        lines.append(f"--- {title}")
        lines += [f"{c * 100 / p.total_ns:5.1f} %  {name}" for name, c in counts.most_common(top)]
    return "\n".join(lines)


async def _main(rate: float, seconds: int, sync: str, top: int) -> str:
    from benchmarks.bench_gateway import Bench  # the gateway bench's set-up, reused as is

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pgw-srvprof-") as d:
        root = Path(d)
        async with bench_server(root / "nats", websocket_port=None,
                                sync_interval="always" if sync == "always" else None,
                                extra_conf=f'prof_port: {port}') as server:
            b = Bench(server, root, f"server profile ({sync})")
            try:
                await b.start(group_commit_relay=False)
                progress(f"profiling nats-server for {seconds} s while the gateway takes {rate:.0f} envelopes/s")
                prof = asyncio.create_task(fetch_profile(port, seconds))
                p50, p99, achieved = await b.drv.latency(b.gw, rate, seconds, label="gateway under profile")
                data = await prof
            finally:
                await b.close()
    head = f"gateway at {achieved:.0f}/s ({sync}): p50 {p50:.2f} ms, p99 {p99:.2f} ms publish -> surface"
    return head + "\n" + report(decode(data), top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.server_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=500.0, help="envelopes/s offered to the gateway (default 500)")
    ap.add_argument("--seconds", type=int, default=10, help="length of the window (default 10)")
    ap.add_argument("--sync", choices=["always", "default"], default="always",
                    help="sync_interval: always (the embedded default) or the server's own default")
    ap.add_argument("--top", type=int, default=30, help="functions listed per table (default 30)")
    args = ap.parse_args(argv)
    if args.seconds < 1 or args.rate <= 0:
        ap.error("--seconds must be >= 1 and --rate > 0")
    print(harness.run(_main(args.rate, args.seconds, args.sync, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
