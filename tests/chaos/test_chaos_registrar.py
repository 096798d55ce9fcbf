"""kill -9 of the registrar during a burst of 1,000 registrations against the real scittles (issue 14).

The signer first turns 1,000 verdicts into 1,000 queued Signed Statements;
then ``pgw registrar`` (a child process) registers them with scittles and is
killed with SIGKILL at random points of the burst, three times, and restarted.
A kill between scittles' answer and the queue ack leaves a statement the TS
holds but the registrar never finished: on redelivery scittles answers ``400
Already Registered`` and the registrar must fetch the existing receipt.

Must hold: 0 lost (every queued capsule is on capsule.registered), 0
registered twice (once in scittles' log, once in PGW_CAPSULES), 0 in the
dead-letter stream, and every one anchored (receipt verified with the pinned
TS key).
"""

from __future__ import annotations

import random
import sqlite3
import time
import uuid
from pathlib import Path

import pytest

from consumers.signer import Signer
from consumers.ts_keys import read_pinned_ts_keys
from consumers.verifier import payload_of, verify_many
from pgwcore.config import Config
from pgwcore.publish import Publisher
from pgwcore.server import EmbeddedServer
from tests.chaos.harness import ServiceProc, env_int
from tests.polling import until
from tests.scittles_peer import Scittles
from tests.test_capsule_model import design_rows
from tests.test_capsule_signer import signer_keys, stream_items, wait_count

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

VERDICTS = env_int("PGW_CHAOS_REGISTRAR_VERDICTS", 1_000)
KILLS = env_int("PGW_CHAOS_REGISTRAR_KILLS", 3)
SEED = env_int("PGW_CHAOS_SEED", int(time.time()))


def _ts_entries(ts: Scittles) -> int:
    with sqlite3.connect(ts.data / "ts.db") as db:
        return db.execute("select count(*) from entries").fetchone()[0]


async def _count(js, stream: str) -> int:
    try:
        return (await js.stream_info(stream)).state.messages
    except Exception:  # noqa: BLE001 - not created yet
        return 0


async def test_registrar_kill9_during_burst_against_scittles(scittles: Scittles, tmp_path: Path,
                                                             nats_server: EmbeddedServer, nc, make_config) -> None:
    """Three kill -9s of `pgw registrar` while it registers 1,000 capsules with scittles: after restarts,
    every capsule is anchored exactly once, none lost, none dead-lettered, none twice in the TS log."""
    rng = random.Random(SEED)
    tag = uuid.uuid4().hex[:8]
    rows = [v for i in range(VERDICTS // 12 + 1) for v in design_rows(f"k{tag}{i}-")][:VERDICTS]
    config: Config = make_config()
    js = nc.jetstream()
    pub = Publisher(js, config.subjects)
    for v in rows:
        await pub.verdict(v)
    async with Signer(config, nc):
        await wait_count(js, "PGW_REGISTRATION", VERDICTS, timeout=120)
    queued = {payload_of(d)["capsule_id"] for _, d, _ in await stream_items(js, "PGW_REGISTRATION")}
    assert len(queued) == VERDICTS

    cfg = tmp_path / "registrar.toml"
    cfg.write_text(f'[registrar]\nts_url = "{scittles.url}"\nhttp_timeout_s = 1.0\npoll_timeout_s = 1.0\n'
                   "backoff_base_s = 0.1\nbackoff_max_s = 1.0\n")
    reg = ServiceProc("registrar", nats_server.client_url, tmp_path / "registrar", cfg)
    before = _ts_entries(scittles)
    already_before = scittles.log_tail(10**7).count("already_registered")
    try:
        await reg.start()
        marks = sorted(rng.sample(range(VERDICTS // 10, VERDICTS * 8 // 10), KILLS))
        for mark in marks:
            async def reached(mark: int = mark) -> bool:
                return _ts_entries(scittles) - before >= mark

            await until(reached, timeout=120, interval=0.01,
                        what=lambda mark=mark: f"TS log +{mark}: {reg.log_tail()}")
            reg.kill9()
            await reg.wait_dead()
            await reg.start()

        async def done() -> bool:
            return await _count(js, "PGW_CAPSULES") >= VERDICTS and await _count(js, "PGW_REGISTRATION") == 0

        await until(done, timeout=180, interval=0.2, what=lambda: f"all registered: {reg.log_tail()}")
    finally:
        # SIGTERM drains the registrar: it finishes what it holds, and each capsule it stores is an acked
        # publish, so once it has exited every capsule it will ever store (a duplicate too) is counted below.
        await reg.stop()

    items = await stream_items(js, "PGW_CAPSULES")
    registered = [payload_of(d)["capsule_id"] for _, d, _ in items]
    already = scittles.log_tail(10**7).count("already_registered") - already_before
    print(f"\n[chaos registrar kill -9 vs scittles] seed {SEED}, {VERDICTS} capsules, {KILLS} kills at TS log "
          f"+{marks}: registered {len(registered)}, distinct {len(set(registered))}, TS log +"
          f"{_ts_entries(scittles) - before}, TS 'already registered' answers {already}, "
          f"DLQ {await _count(js, 'PGW_REGISTRATION_DLQ')}")
    assert set(registered) == queued  # 0 lost
    assert len(registered) == VERDICTS  # 0 stored twice
    assert _ts_entries(scittles) - before == VERDICTS  # 0 registered twice in the TS's log
    assert await _count(js, "PGW_REGISTRATION_DLQ") == 0
    ts_keys = read_pinned_ts_keys(tmp_path / "registrar")
    results = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(config), ts_keys=ts_keys)
    assert all(r.ok and r.assurance["attestation_mode"] == "anchored" for r in results)
