"""Signing on other cores (``signer.workers``, consumers/signer_pool.py): the same bytes, and a worker's death."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from consumers import capsule as capm
from consumers import profiles
from consumers.ledger_check import check_ledger
from consumers.signer import LEDGER_STREAM, Signer, _Head, _Job, sign_payload
from consumers.signer_ledger import _entry_decoder
from consumers.signer_pool import SWITCH_INTERVAL_S, SigningPool, SigningPoolError, resolve_workers
from consumers.verifier import payload_of, verify_many
from pgwcore.keys import SigningKey, load_or_create
from pgwcore.publish import Publisher
from subjects.errors import ConfigError
from tests.polling import until
from tests.stored import stored_msgs
from tests.test_capsule_model import design_rows, verdict
from tests.test_capsule_signer import signer_keys, stream_items

SALT = "11" * 32
REPO = Path(__file__).resolve().parent.parent
# A process that starts a one-worker pool, prints the worker's pid and waits to be killed.
HOLDER = """
import asyncio, sys
from pathlib import Path
from consumers.signer_pool import SigningPool
from pgwcore.keys import load_or_create

async def main():
    pool = SigningPool(load_or_create(Path(sys.argv[1]), "signer"), Path(sys.argv[1]), None, workers=1)
    await pool.start()
    print(pool.worker_pids()[0], flush=True)
    await asyncio.Event().wait()

if __name__ == "__main__":
    asyncio.run(main())
"""


def _payloads(fmt: str, bodies: list[Any] | None = None) -> list[bytes]:
    """Linked ledger payloads of DESIGN §6's rows in format ``fmt``, as the signer would sign them;
    ``bodies`` gets the built bodies the signer hands its in-process signing beside them."""
    prof = profiles.profile(fmt)
    head = _Head(0, capm.GENESIS_HASH, None)
    out = []
    for v in design_rows(f"pool{fmt}"):
        job = _Job(None, v, built=prof.build(v, operator="op", salt=SALT, default_developer="pgw", authority=None,
                                             parent_capsule_id=None, fallback_ts=None))
        job.profile = prof
        entry, head = Signer._link(head, job, {})
        out.append(entry.payload.encode())
        if bodies is not None:
            bodies.append(job.built.body)
    return out


async def test_pool_statements_are_byte_identical_to_in_process(tmp_path: Path) -> None:
    """Two workers sign both formats' statements byte for byte as the signer's own process does, in order."""
    key = load_or_create(tmp_path, "signer")
    bodies: list[Any] = []
    payloads = _payloads("4", bodies) + _payloads("2", bodies)
    pool = SigningPool(key, tmp_path, None, workers=2)
    await pool.start()
    try:
        assert len(pool.worker_pids()) >= 1 and os.getpid() not in pool.worker_pids()
        # the signer's own in-process path (signer.workers = 0) signs each payload beside its built body
        in_process = [sign_payload(p, key, b) for p, b in zip(payloads, bodies, strict=True)]
        assert await pool.sign(payloads) == in_process
        assert await pool.sign([]) == []
    finally:
        await pool.close()
    assert pool.worker_pids() == []


async def test_the_switch_interval_is_lowered_while_a_pool_runs_and_restored_after(tmp_path: Path) -> None:
    """The hand-off threads get the GIL within 1 ms while a pool runs; a key rotation's overlap (the new
    pool started before the old one is closed) keeps it so; the interval found is back once both close."""
    key = load_or_create(tmp_path, "signer")
    before = sys.getswitchinterval()
    assert before > SWITCH_INTERVAL_S  # CPython's default, 5 ms
    old, new = SigningPool(key, tmp_path, None, workers=1), SigningPool(key, tmp_path, None, workers=1)
    try:
        await old.start()
        assert sys.getswitchinterval() == SWITCH_INTERVAL_S
        await new.start()
        await old.close(finish=True)
        await old.close()  # idempotent: not counted twice
        assert sys.getswitchinterval() == SWITCH_INTERVAL_S
    finally:
        await old.close()
        await new.close()
    assert sys.getswitchinterval() == before


async def test_a_killed_worker_is_replaced_and_its_batch_signed_the_same(tmp_path: Path) -> None:
    """A worker killed before its batch: the batch is signed in process (same bytes), a new worker takes over."""
    key = load_or_create(tmp_path, "signer")
    payloads = _payloads("4")
    pool = SigningPool(key, tmp_path, None, workers=1)
    await pool.start()
    try:
        before = pool.worker_pids()
        os.kill(before[0], signal.SIGKILL)
        assert await pool.sign(payloads) == [sign_payload(p, key) for p in payloads]
        assert pool.restarts == 1 and pool.active and not pool.given_up
        after = pool.worker_pids()
        assert after and set(after).isdisjoint(before)
        assert await pool.sign(payloads[:3]) == [sign_payload(p, key) for p in payloads[:3]]
    finally:
        await pool.close()


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "gone"


async def test_a_hung_worker_is_killed_and_its_batch_signed_the_same(tmp_path: Path) -> None:
    """A worker that stops answering (SIGSTOP) is killed after hung_after_s; its batch is signed in process."""
    key = load_or_create(tmp_path, "signer")
    payloads = _payloads("4")
    pool = SigningPool(key, tmp_path, None, workers=1)
    pool.hung_after_s = 1.0
    await pool.start()
    try:
        before = pool.worker_pids()
        os.kill(before[0], signal.SIGSTOP)
        assert await asyncio.wait_for(pool.sign(payloads), 20) == [sign_payload(p, key) for p in payloads]
        assert pool.restarts == 1 and pool.active and not pool.given_up
        assert set(pool.worker_pids()).isdisjoint(before)
        # The stopped worker was killed, not left behind (gone, or a zombie until its parent reaps it).
        async def ended() -> bool:
            return _proc_state(before[0]) in ("gone", "Z", "X")

        await until(ended, timeout=10, what="the stopped worker killed")
    finally:
        await pool.close()


async def test_a_worker_killed_while_its_batch_is_queued_or_signing_loses_nothing(tmp_path: Path) -> None:
    """A worker killed after its batch was handed over: the batch comes back signed in process, byte for byte."""
    key = load_or_create(tmp_path, "signer")
    payloads = _payloads("4") * 40  # a few hundred statements: the worker is busy when it dies
    pool = SigningPool(key, tmp_path, None, workers=1)
    await pool.start()
    try:
        worker = pool.worker_pids()[0]
        task = asyncio.create_task(pool.sign(payloads))
        async def handed_over() -> bool:  # the batch is with the worker (the executor's own queue)
            return bool(getattr(pool._pool, "_pending_work_items", None))

        await until(handed_over, timeout=10, interval=0.001, what="the batch handed to the worker")
        os.kill(worker, signal.SIGKILL)
        assert await task == [sign_payload(p, key) for p in payloads]
        assert pool.restarts == 1 and pool.active and worker not in pool.worker_pids()
    finally:
        await pool.close()


async def test_a_pool_that_cannot_read_the_key_fails_at_start(tmp_path: Path) -> None:
    """Workers that cannot load the signer's key file (by its kid) stop the start with the kid named."""
    key = load_or_create(tmp_path, "signer")
    other = SigningKey("signer", "0000000000000000", key.private)  # a kid with no key file
    pool = SigningPool(other, tmp_path, None, workers=1)
    with pytest.raises(SigningPoolError, match="0000000000000000"):
        await pool.start()
    assert not pool.active


def test_workers_setting_is_validated_and_auto_follows_the_cores(make_config: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """signer.workers takes 0-32 or "auto" (one worker on two cores, none on one); anything else names the field."""
    for bad in (-1, 33, "two"):
        with pytest.raises(ConfigError, match=r"signer\.workers"):
            make_config(signer={"workers": bad})
    assert make_config().signer.workers == "auto"
    assert make_config(signer={"workers": 0}).signer.workers == 0
    monkeypatch.setattr("consumers.signer_pool.usable_cores", lambda: 1)
    assert resolve_workers("auto") == 0
    monkeypatch.setattr("consumers.signer_pool.usable_cores", lambda: 2)
    assert resolve_workers("auto") == 1 and resolve_workers(3) == 3


async def test_signer_with_a_worker_killed_mid_run_loses_and_doubles_nothing(nc: Any, make_config: Any) -> None:
    """A signer whose signing worker is killed between batches: one capsule per verdict, each the in-process bytes."""
    config = make_config(signer={"workers": 1, "batch": 8})
    js = nc.jetstream()
    pub = Publisher(js, config.subjects)
    first = [verdict(f"wk{i}", "blocked" if i % 2 else "denied") for i in range(20)]
    second = [verdict(f"wl{i}", "blocked" if i % 2 else "denied") for i in range(20)]
    async with Signer(config, nc) as signer:
        assert signer.pool is not None
        for v in first:
            await pub.verdict(v)
        await signer.wait_signed(len(first), timeout=60)
        os.kill(signer.pool.worker_pids()[0], signal.SIGKILL)
        for v in second:
            await pub.verdict(v)
        await signer.wait_signed(len(first) + len(second), timeout=60)
        assert signer.pool.restarts == 1 and signer.pool.active
        key = signer.key
    assert signer.pool is None  # the workers stopped with the signer
    items = await stream_items(js, "PGW_REGISTRATION")
    per_verdict = Counter(payload_of(d)["pgw"]["verdict_id"] for _, d, _ in items)
    assert per_verdict == {v.verdict_id: 1 for v in first + second}
    entries = [_entry_decoder.decode(m.data) for m in await stored_msgs(js, LEDGER_STREAM)]
    assert check_ledger([m.data for m in await stored_msgs(js, LEDGER_STREAM)]).ok and len(entries) == 40
    assert key is not None
    by_cid = {e.capsule_id: sign_payload(e.payload.encode(), key) for e in entries}
    assert all(by_cid[h["Pgw-Capsule-Id"]] == d for _, d, h in items)
    results = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(config))
    assert all(r.ok for r in results), [(r.source, r.findings) for r in results if not r.ok]


def test_workers_end_when_the_signer_is_killed(tmp_path: Path) -> None:
    """kill -9 of the signer's process ends its signing worker too (no orphan holding the key)."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None
        worker = int(proc.stdout.readline())
        ended = os.pidfd_open(worker)  # readable once the worker has ended
    finally:
        proc.kill()
        proc.wait(10)
    try:
        readable, _, _ = select.select([ended], [], [], 20)
    finally:
        os.close(ended)
    assert readable, f"signing worker {worker} still running 20 s after its signer was killed"
