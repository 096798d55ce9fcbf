"""Two kernel instances, each with several appends in flight at once, on one event log (spec 003 §8.2).

Found while issue 48's round measured the gate: ``EventLog.append`` pipelines (each append is chained
onto the one this process sent just before, at the sequence the server must give it, with
``Nats-Expected-Last-Sequence``). When another instance's append takes that sequence first, the earlier
append of this process is refused, but the one pipelined behind it expects exactly the sequence the
other instance's record now holds, so the server stores it, chained to a record that was never
stored: the chain breaks (``prev_digest`` does not match), and every later reader takes that record
as foreign. One instance (test_kernel_log.py's cases) or one append at a time per instance
(``test_two_writers_keep_one_chain``) never meets it. Not fixed in that round (the fix changes the
log's write protocol, e.g. ``Nats-Expected-Last-Msg-Id`` on an append chained to this process's own
unacknowledged one, and must be checked on a replicated stream): this test says so until it is.
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


# Not strict: the break needs the other instance's append to land between two of this one's, which a
# loaded host does not always schedule (it broke in 3 of 3 runs alone, not in one full-suite run).
@pytest.mark.xfail(strict=False, reason="pipelined appends of two instances can break the chain (module docstring)")
async def test_two_pipelining_writers_keep_one_chain(make_config: Any, tmp_path: Path, nc: Any,
                                                      nats_server: Any) -> None:
    """Two instances, each appending eight events at once, forty times: the chain verifies whole."""
    cfg = kernel_config(make_config, Issuer(tmp_path / "issuer"), policy_dir(tmp_path))
    key = load_or_create(cfg.data_path, "kernel")
    nc2 = await connect(nats_server.client_url)
    try:
        a, b = EventLog(nc, cfg.subjects, key), EventLog(nc2, cfg.subjects, key)

        async def burst(log: EventLog, name: str) -> None:
            for r in range(40):
                await asyncio.gather(*(log.append("CEDAR_PERMIT_RECORDED", {"writer": name, "r": r, "i": i},
                                                  msg_id=f"{name}-{r}-{i}") for i in range(8)))

        await asyncio.gather(burst(a, "a"), burst(b, "b"))
        keys = {k.kid: k.public for k in public_keys(cfg.data_path, "kernel")}
        res = await verify_stream(nc.jetstream(), cfg.subjects, keys)
    finally:
        await nc2.close()
    assert res.ok and res.checked == 640, res.first_break
