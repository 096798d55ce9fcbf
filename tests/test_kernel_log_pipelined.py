"""Two kernel instances, each with several appends in flight at once, on one event log (spec 003 §8.2).

Found while issue 48's round measured the gate: ``EventLog.append`` pipelines (each append is chained
onto the one this process sent just before, at the sequence the server must give it, with
``Nats-Expected-Last-Sequence``). When another instance's append takes that sequence first, the earlier
append of this process is refused, but the one pipelined behind it expects exactly the sequence the
other instance's record now holds, so the server stores it, chained to a record that was never
stored: the chain breaks (``prev_digest`` does not match), and every later reader takes that record
as foreign. One instance (test_kernel_log.py's cases) or one append at a time per instance
(``test_two_writers_keep_one_chain``) never meets it. Fixed: an append chained onto this process's own
append also carries ``Nats-Expected-Last-Msg-Id`` = that append's id, so it is refused with it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gateway.kernel.eventlog import EventLog, verify_stream
from pgwcore.connect import connect
from pgwcore.keys import load_or_create, public_keys
from tests.kernel_support import Issuer, kernel_config, policy_dir


@pytest.mark.parametrize("chained", [False, True], ids=["append", "append_chained"])
async def test_two_pipelining_writers_keep_one_chain(make_config: Any, tmp_path: Path, nc: Any,
                                                      nats_server: Any, chained: bool) -> None:
    """Two instances, each appending eight events at once, twenty times (with ``chained``, half of them as
    the gate's pairs, ``append_chained``): the chain verifies whole and holds every event once."""
    cfg = kernel_config(make_config, Issuer(tmp_path / "issuer"), policy_dir(tmp_path))
    key = load_or_create(cfg.data_path, "kernel")
    nc2 = await connect(nats_server.client_url)
    try:
        a, b = EventLog(nc, cfg.subjects, key), EventLog(nc2, cfg.subjects, key)

        async def one(log: EventLog, name: str, r: int, i: int) -> None:
            body = {"writer": name, "r": r, "i": i}
            if chained and i % 2:
                await log.append_chained("CEDAR_PERMIT_RECORDED", body,
                                         lambda seq, _ev: ("CEDAR_PERMIT_RECORDED", {**body, "after": seq},
                                                           f"{name}-{r}-{i}-then"),
                                         msg_id=f"{name}-{r}-{i}")
            else:
                await log.append("CEDAR_PERMIT_RECORDED", body, msg_id=f"{name}-{r}-{i}")

        async def burst(log: EventLog, name: str) -> None:
            for r in range(20):
                await asyncio.gather(*(one(log, name, r, i) for i in range(8)))

        await asyncio.gather(burst(a, "a"), burst(b, "b"))
        keys = {k.kid: k.public for k in public_keys(cfg.data_path, "kernel")}
        res = await verify_stream(nc.jetstream(), cfg.subjects, keys)
    finally:
        await nc2.close()
    assert res.ok and res.checked == (480 if chained else 320), res.first_break
