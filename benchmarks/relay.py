"""The bare baseline relay, its own process: ``python -m benchmarks.relay URL [plain|group-commit|floor|floor-min|floor-watch]``.

The same durable pull consumer with explicit ack as the gateway's worker on a
stream like ``PGW_INBOUND``, the same pipelined fetch loop (four batches of 64
in flight), one JetStream publish of the body to ``bench.out.{principal}``
awaiting the PubAck (with ``Nats-Msg-Id``), then the ack. Same ack semantics,
no logic. ``group-commit``: its publishes go through the gateway's own
:class:`pgwcore.publish.GroupCommit`, so a ratio against it shows what the
gateway costs beyond the batching both then share.

``floor``: the same loop doing only the durable writes the bus contract and
the delivery guarantees ask of the gateway for one binding moment, in the
gateway's order and through its own writers (``GroupCommit``, ``KvWriter``),
with no logic between them: the correlationId claim (KV create), the moment
record (KV create), then together the surface item and the ``hitl_dispatched``
verdict, then together the outcome and the claim's settle (KV
compare-and-set), then the ack (gateway/pipeline.py, gateway/moments.py
``dispatch``). The agent's index entry is no longer among them (issue 32,
decision 2): the gateway derives the index from the moment record's write
(its ``Pgw-Moment-Agent`` header, gateway/moment_list.py), so the floor stores
one record fewer per moment than before. What the gateway spends beyond this floor is
its own code; what the floor spends beyond the plain relay is what is stored
(benchmarks/performance-log.md, "Run 6: the contract floors").

``floor-min``: the least any gateway keeping DESIGN's streams could store for
one binding moment: one durable claim (the dedup that must hold across
restarts and instances, DESIGN §3.2 step 8), then together the surface item,
the verdict and the outcome (the contract's own streams, DESIGN §2), then the
ack. Not a design (no moment record for §4.2's answers, no settle to replay
from): a lower bound for what storing fewer records could reach.

``floor-watch``: the contract floor plus the two watches the contract asks of
every gateway instance, with no logic in them: a plain subscription to every
agent's envelope subject (``SquatWatch``, DESIGN §7: each instance sees every
envelope published, no queue group), keeping each ``Nats-Msg-Id`` for
``HOLD_S`` as the watch does in its common case; and the headers-only ordered
consumer over the moment bucket (the moment desk's watch, gateway/moments.py,
from which the agents' index is derived since issue 32, decision 2), keeping
each key's ``Pgw-Moment-Agent`` and the sequence followed. Reported beside
the contract floor (not a target's floor): what the gateway's received
messages cost before its own code runs.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import KeyWrongLastSequenceError

from gateway.security.squat import HOLD_S
from pgwcore import loop as pgw_loop
from pgwcore.atomic import publish_acked
from pgwcore.connect import connect
from pgwcore.loop import together
from pgwcore.publish import GroupCommit, KvWriter
from pgwcore.service import delivery
from pgwcore.streams import ensure_kv, ensure_stream

PRINCIPAL = "alice"
CONN_NAME = "bench-relay-{variant}"
RELAYS = {  # variant: (input stream, input subjects, output stream, output prefix)
    "plain": ("BENCH_IN", "bench.agent.*.envelope", "BENCH_OUT", "bench.out"),
    "group-commit": ("BENCH_GC_IN", "bench.gcagent.*.envelope", "BENCH_GC_OUT", "bench.gcout"),
    "floor": ("BENCH_FL_IN", "bench.flagent.*.envelope", "BENCH_FL_SURFACE", "bench.flsurface"),
    "floor-min": ("BENCH_FM_IN", "bench.fmagent.*.envelope", "BENCH_FM_SURFACE", "bench.fmsurface"),
    "floor-watch": ("BENCH_FW_IN", "bench.fwagent.*.envelope", "BENCH_FW_SURFACE", "bench.fwsurface"),
}
FLOOR_TAGS = {"floor": "FL", "floor-min": "FM", "floor-watch": "FW"}


def floor_streams(variant: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """The floor's verdict and outcome streams (name, subject prefix), beside its surface stream."""
    t = FLOOR_TAGS[variant]
    return (f"BENCH_{t}_VERDICTS", f"bench.{t.lower()}verdict"), (f"BENCH_{t}_OUTBOUND", f"bench.{t.lower()}outcome")


def floor_buckets(variant: str) -> tuple[str, ...]:
    """The floor's KV buckets: claims, and but for the minimal floor the moment records (no agent index: derived)."""
    t = FLOOR_TAGS[variant]
    return (f"BENCH_{t}_CLAIMS",) + ((f"BENCH_{t}_MOMENTS",) if variant != "floor-min" else ())


FLOOR_STREAMS = floor_streams("floor")
FLOOR_BUCKETS = floor_buckets("floor")
# Sizes of the records, matched to what the gateway stores for the bench's 1 KB moment (stream
# bytes per message of each of its streams against the floor's, 2026-11-26): the claim (a
# DedupRecord, about 200 bytes) and its settle (with the outcome, about 710), the verdict and the
# outcome; the moment record is the envelope plus MOMENT_EXTRA (its fields around the moment), at
# every size, and carries the gateway's two headers (AGENT_HEADERS).
CLAIM, SETTLE, VERDICT, OUTCOME = (b"c" * 200, b"s" * 710, b"v" * 425, b"o" * 466)
MOMENT_EXTRA = b" " * 267
AGENT_HEADERS = {"Pgw-Moment-State": "pending;;1", "Pgw-Moment-Agent": "1764100000123;agent"}


def durable(variant: str) -> str:
    return f"bench-relay-{variant}"


async def ensure_relay_streams(nc: Client) -> None:
    js = nc.jetstream()
    for variant, (sin, subj_in, sout, out) in RELAYS.items():
        extra = floor_streams(variant) if variant in FLOOR_TAGS else ()
        for name, subj in ((sin, subj_in), (sout, f"{out}.*"), *((n, f"{o}.*") for n, o in extra)):
            await ensure_stream(js, StreamConfig(name=name, subjects=[subj], storage=StorageType.FILE,
                                                 duplicate_window=3600.0, num_replicas=1,
                                                 allow_atomic=True if variant != "plain" and name != sin else None))
        for bucket in floor_buckets(variant) if variant in FLOOR_TAGS else ():
            await ensure_kv(js, bucket, replicas=1, atomic=True)


async def floor_writes(nc: Client, variant: str = "floor") -> Callable[[object], Awaitable[None]]:
    """The floor's writes for one input message ``m`` (module docstring), through the gateway's writers."""
    js = nc.jetstream()
    surface_subject = f"{RELAYS[variant][3]}.{PRINCIPAL}"
    surface = GroupCommit(js, RELAYS[variant][2])
    (vname, vpre), (oname, opre) = floor_streams(variant)
    verdicts, outcomes = GroupCommit(js, vname), GroupCommit(js, oname)
    writers = [KvWriter(js, await js.key_value(b), b) for b in floor_buckets(variant)]

    async def publish(gc: GroupCommit, subject: str, body: bytes, msg_id: str) -> None:
        headers = {"Nats-Msg-Id": msg_id}
        await gc.write(subject, body, headers, lambda: publish_acked(nc, subject, body, headers, js._timeout),
                       lambda seq: seq)

    async def run(m) -> None:
        seq = m.metadata.sequence.stream
        key = f"agent.{seq}"
        claims = writers[0]
        try:
            rev = await claims.create(key, CLAIM)
        except KeyWrongLastSequenceError:
            return  # a redelivery: the gateway would replay its stored outcome; the floor has none

        def surface_item() -> Awaitable[None]:
            return publish(surface, surface_subject, m.data, f"item:{seq}")

        def verdict() -> Awaitable[None]:
            return publish(verdicts, f"{vpre}.hitl_dispatched", VERDICT, f"dispatch:{seq}")

        def outcome() -> Awaitable[None]:
            return publish(outcomes, f"{opre}.agent", OUTCOME, f"outcome:{seq}")

        if variant == "floor-min":
            await together(surface_item(), together(verdict(), outcome()))
            return
        moments = writers[1]
        await moments.create(f"{PRINCIPAL}.{seq}", m.data + MOMENT_EXTRA, AGENT_HEADERS)
        await together(surface_item(), verdict())
        await together(outcome(), claims.update(key, SETTLE, rev))

    return run


async def contract_watches(nc: Client, variant: str) -> list[object]:
    """``floor-watch``'s two subscriptions (module docstring): what each received message must cost
    at least, the bookkeeping of the watches' common case and nothing else."""
    js = nc.jetstream()
    seen: OrderedDict[str, tuple[float, str, bytes, object]] = OrderedDict()
    index: dict[str, str] = {}
    followed = [0]

    async def envelope_published(msg: Msg) -> None:
        headers = msg.headers
        mid = headers.get("Nats-Msg-Id") if headers else None
        if not mid:
            return
        now = time.monotonic()
        while seen and now - next(iter(seen.values()))[0] > HOLD_S:
            seen.popitem(last=False)
        if mid not in seen:
            seen[mid] = (now, msg.subject, msg.data, headers)

    bucket = floor_buckets(variant)[1]
    prefix = f"$KV.{bucket}."

    async def moment_written(msg: Msg) -> None:
        headers = msg.headers or {}
        agent = headers.get("Pgw-Moment-Agent")
        if agent is not None:
            index[msg.subject[len(prefix):]] = agent
        followed[0] = max(followed[0], delivery(msg)[0])

    return [
        await nc.subscribe(RELAYS[variant][1], cb=envelope_published),
        await js.subscribe(f"{prefix}>", stream=f"KV_{bucket}", cb=moment_written, ordered_consumer=True,
                           deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, inactive_threshold=300.0,
                           headers_only=True),
    ]


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
    floor = await floor_writes(nc, variant) if variant in FLOOR_TAGS else None
    watches = await contract_watches(nc, variant) if variant == "floor-watch" else []
    await nc.publish(f"bench.relay.ready.{variant}", b"")

    async def plain(subject: str, data: bytes, headers: dict[str, str]) -> object:
        return await js.publish(subject, data, headers=headers)

    async def one(m) -> None:
        seq = m.metadata.sequence.stream
        subject, headers = f"{out}.{PRINCIPAL}", {"Nats-Msg-Id": f"relay:{seq}"}
        if floor is not None:
            try:
                await floor(m)
            except Exception as e:  # left unacked: redelivered after ack_wait, and said here
                print(f"floor: input {seq} failed: {e!r}", file=sys.stderr, flush=True)
                raise
        elif gc is None:
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
    for sub in watches:
        await sub.unsubscribe()  # type: ignore[attr-defined]
    # Every ack is sent; flush them and close. (nats-py's drain() does not finish
    # with a pull subscription open: it waited its 30 s timeout at every stop,
    # past the harness's 15 s, and the relay was killed.)
    await nc.flush()
    await nc.close()


if __name__ == "__main__":
    pgw_loop.run(relay_main(sys.argv[1], *sys.argv[2:3]))
