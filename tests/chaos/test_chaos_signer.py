"""Faults downstream of the gateway (issue 8): kill -9 of signers and the registrar in
repeated rounds, with two signer instances sharing the work. Every verdict becomes exactly
one capsule (signed once in the ledger, stored once), every capsule is registered once,
with the real scittles Transparency Service (tests/scittles_peer.py): once in its log too."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import time
from pathlib import Path

import pytest

from pgwcore.server import EmbeddedServer
from tests.chaos.checker import capsule_verdict_ids, check_streams
from tests.chaos.harness import (
    Load,
    ServiceProc,
    chaos_config,
    consumer_backlog,
    env_int,
    wait_drained,
    wait_services,
)
from tests.polling import until
from tests.scittles_peer import Scittles

pytestmark = [pytest.mark.chaos]

ROUNDS = env_int("PGW_CHAOS_ROUNDS", 5)
PER_ROUND = env_int("PGW_CHAOS_SIGNER_ENVELOPES", 1_000)  # 5,000 verdicts over the 5 rounds (about a minute)
SEED = env_int("PGW_CHAOS_SEED", int(time.time()))


async def _count(js, stream: str) -> int:
    try:
        return (await js.stream_info(stream)).state.messages
    except Exception:  # noqa: BLE001 - not created yet
        return 0


async def _wait_count(js, stream: str, target: int, procs: list[ServiceProc], timeout: float = 60) -> None:
    async def reached() -> bool:
        return await _count(js, stream) >= target

    await until(reached, timeout=timeout, interval=0.02,
                what=lambda: f"{stream} >= {target}: " + "\n".join(p.log_tail() for p in procs))


async def _wait_all_done(js, procs: list[ServiceProc], timeout: float = 180) -> None:
    """Gateway, signers and registrar have caught up: nothing pending anywhere."""
    await wait_drained(js, timeout=timeout)
    await wait_drained(js, "PGW_VERDICTS", "pgw-signer", timeout=timeout)
    async def queue_empty() -> bool:
        return not (await _count(js, "PGW_REGISTRATION") or await consumer_backlog(js, "PGW_REGISTRATION", "pgw-registrar"))

    await until(queue_empty, timeout=timeout, interval=0.2,
                what=lambda: "registration queue drained: " + "\n".join(p.log_tail() for p in procs))


def _ts_entries(ts: Scittles) -> int:
    with sqlite3.connect(ts.data / "ts.db") as db:
        return db.execute("select count(*) from entries").fetchone()[0]


async def test_signers_and_registrar_kill9_rounds(tmp_path: Path, nats_server: EmbeddedServer, nc,
                                                  scittles: Scittles) -> None:
    """Two signers and a registrar, one signer and the registrar killed -9 each round while
    verdicts and capsules are in flight: every verdict is capsuled exactly once, every
    capsule registered exactly once, no decision signed twice."""
    rng = random.Random(SEED)
    js = nc.jetstream()
    url = nats_server.client_url
    ts = scittles  # the real SCRAPI TS (one per session); its key from jwks_uri, pinned on first use
    ts_before = _ts_entries(ts)
    extra = (f'[signer]\nack_wait_s = 2.0\nbatch = 16\n\n[registrar]\nts_url = "{ts.url}"\n'
             'http_timeout_s = 2.0\npoll_timeout_s = 2.0\n')
    cfg = chaos_config(tmp_path / "c.toml", extra=extra)
    gw = ServiceProc("gateway", url, tmp_path / "gw", cfg)
    signers = [ServiceProc("signer", url, tmp_path / "signer", cfg) for _ in range(2)]  # one key, two workers
    reg = ServiceProc("registrar", url, tmp_path / "registrar", cfg)
    procs = [gw, *signers, reg]
    load = Load(nc, agent="sig")
    kills = 0
    try:
        await gw.start()
        for i, s in enumerate(signers):  # in turn: the first creates the key files, the second reads them
            await s.start()
            await wait_services(nc, "pgw-signer", i + 1, procs)
        await reg.start()
        await wait_services(nc, "pgw-gateway", 1, procs)
        await wait_services(nc, "pgw-registrar", 1, procs)
        for r in range(ROUNDS):
            base_ledger = await _count(js, "PGW_SIGNER_LEDGER")
            base_caps = await _count(js, "PGW_CAPSULES")
            sending = asyncio.create_task(load.send(PER_ROUND, f"s{r}", rate=PER_ROUND / 2.0))
            victim = signers[r % 2]
            await _wait_count(js, "PGW_SIGNER_LEDGER", base_ledger + rng.randint(5, PER_ROUND // 3), procs)
            victim.kill9()
            await _wait_count(js, "PGW_CAPSULES", base_caps + rng.randint(3, PER_ROUND // 4), procs)
            reg.kill9()
            kills += 2
            await victim.wait_dead()
            await reg.wait_dead()
            await victim.start()
            await reg.start()
            await sending
        await _wait_all_done(js, procs)
        caps, ledger = await capsule_verdict_ids(js)
        report = await check_streams(js, load.acked, sent=load.sent, agents=[load.agent], capsules=caps)
    finally:
        for p in procs:
            await p.stop()
    signed_twice = [v for v, n in ledger.items() if n > 1]
    ts_logged = _ts_entries(ts) - ts_before
    print(f"\n[chaos signers+registrar kill -9] seed {SEED}, {ROUNDS} rounds, {kills} kills: {report.summary()}; "
          f"ledger entries {sum(ledger.values())}, signed twice {len(signed_twice)}; TS log +{ts_logged}")
    assert report.acked == ROUNDS * PER_ROUND
    assert report.ok, report.summary()
    assert report.capsuled_once == report.verdicts
    assert not signed_twice
    assert ts_logged == report.verdicts  # each capsule in the TS's log once, kill -9s notwithstanding
