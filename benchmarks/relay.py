"""The bare baseline relay, its own process: ``python -m benchmarks.relay URL [plain|group-commit]``.

The same durable pull consumer with explicit ack as the gateway's worker on a
stream like ``PGW_INBOUND``, the same pipelined fetch loop (four batches of 64
in flight), one JetStream publish of the body to ``bench.out.{principal}``
awaiting the PubAck (with ``Nats-Msg-Id``), then the ack. Same ack semantics,
no logic. ``group-commit``: its publishes go through the gateway's own
:class:`pgwcore.publish.GroupCommit`, so a ratio against it shows what the
gateway costs beyond the batching both then share.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

from pgwcore import loop as pgw_loop
from pgwcore.connect import connect
from pgwcore.publish import GroupCommit

PRINCIPAL = "alice"
CONN_NAME = "bench-relay-{variant}"
RELAYS = {  # variant: (input stream, input subjects, output stream, output prefix)
    "plain": ("BENCH_IN", "bench.agent.*.envelope", "BENCH_OUT", "bench.out"),
    "group-commit": ("BENCH_GC_IN", "bench.gcagent.*.envelope", "BENCH_GC_OUT", "bench.gcout"),
}


def durable(variant: str) -> str:
    return f"bench-relay-{variant}"


async def ensure_relay_streams(nc: Client) -> None:
    js = nc.jetstream()
    for variant, (sin, subj_in, sout, out) in RELAYS.items():
        for name, subj in ((sin, subj_in), (sout, f"{out}.*")):
            with contextlib.suppress(Exception):
                await js.add_stream(StreamConfig(name=name, subjects=[subj], storage=StorageType.FILE,
                                                 duplicate_window=3600.0,
                                                 allow_atomic=True if variant == "group-commit" else None))


async def relay_main(url: str, variant: str = "plain") -> None:
    """Pull, publish-with-PubAck, ack: the bare minimum with the gateway's ack semantics."""
    sin, subj_in, sout, out = RELAYS[variant]
    nc = await connect(url, name=CONN_NAME.format(variant=variant))
    js = nc.jetstream()
    await ensure_relay_streams(nc)
    psub = await js.pull_subscribe(
        subj_in, durable=durable(variant), stream=sin,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_ack_pending=64 * 16))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    gc = GroupCommit(js, sout) if variant == "group-commit" else None
    await nc.publish(f"bench.relay.ready.{variant}", b"")

    async def plain(subject: str, data: bytes, headers: dict[str, str]) -> object:
        return await js.publish(subject, data, headers=headers)

    async def one(m) -> None:
        seq = m.metadata.sequence.stream
        subject, headers = f"{out}.{PRINCIPAL}", {"Nats-Msg-Id": f"relay:{seq}"}
        if gc is None:
            await plain(subject, m.data, headers)
        else:
            await gc.write(subject, m.data, headers, lambda: plain(subject, m.data, headers), lambda seq: seq)
        await m.ack()

    # The same pipelined loop as the gateway's worker (gateway/pipeline.py):
    # up to four batches of 64 in flight, fetching again as soon as there is room.
    inflight: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        free = 256 - len(inflight)
        if free <= 0:
            await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            continue
        try:
            msgs = await psub.fetch(min(64, free), timeout=0.5)
        except Exception:  # noqa: BLE001 - timeouts between bursts
            continue
        for m in msgs:
            task = asyncio.create_task(one(m))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
    if inflight:
        await asyncio.gather(*inflight, return_exceptions=True)
    await nc.drain()


if __name__ == "__main__":
    pgw_loop.run(relay_main(sys.argv[1], *sys.argv[2:3]))
