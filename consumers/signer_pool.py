"""Signing on another core: worker processes that hold the signer's key (``signer.workers``).

Why: the default profile (format "4", draft-mih-scitt-agent-action-capsule-05)
signs every capsule twice, the Producer Envelope ({#envelope}) and the
registration statement, and `cryptography`'s Ed25519 holds the GIL while it
signs (about 42 us a signature), so threads cannot overlap it with the
signer's NATS work. A worker process on another core can: it signs one
fetched batch while the signer's event loop stores the previous batch, acks
its verdicts and builds the next.

What crosses the process boundary:

- once, when a worker starts: where the key file is and the key's kid. Each
  worker reads that very file itself (:func:`pgwcore.keys.load_kid`, by kid,
  so a rotation in between cannot swap the key) and the pool checks at start
  that a worker signs as the signer's kid; key material is never sent;
- per fetched batch, one round trip per worker: the payload bytes of the
  batch's ledger entries out, the statement bytes back, in order.

Order and content: a statement is a pure function of the payload bytes and
the key. Ed25519 (RFC 8032 §5.1.6) is deterministic and the COSE encode has
one form, so a worker's statement is byte for byte the one the signer makes
in process (``tests/test_signer_pool.py``). The chain (ledger position, prev
hash, §5.3 ``chained``) is still built in the event loop, in order, before
anything is signed; no worker sees or decides an order.

The hand-off: ``ProcessPoolExecutor`` passes a batch out and its statements
back through two helper threads of the signer's process (its queue feeder and
its manager), and each needs the GIL while the event loop holds it, building
the next batch. Under CPython's default switch interval (5 ms) a thread that
asks for the GIL waits up to that long per hop, so a batch signed in about
20 ms came back after 40 or more. While a pool runs, the process's switch
interval is at most ``SWITCH_INTERVAL_S`` (1 ms; restored when the pool is
closed): 5-10 % more capsules a second in alternated runs
(benchmarks/performance-changes.md, "The hand-off to the workers").

A worker that dies (killed, out of memory), or hangs (no answer for
``HUNG_AFTER_S``: it is killed), breaks the pool: the batch in
hand is signed in process instead (the same bytes), the error is logged and a
new pool is started for the next batch. A pool that cannot be restarted (its
workers cannot read the key any more), or one that broke ``MAX_RESTARTS``
times, is given up: the signer signs in process from then on, logged as an
error. Nothing is published before the ledger holds the entry, so a batch
whose signatures never came back is not lost: its verdicts are redelivered
and re-signed from the stored payloads.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Literal

from consumers.signer_ledger import sign_payload
from pgwcore.keys import SigningKey, load_kid
from pgwcore.logs import get_logger
from subjects.errors import PgwError

log = get_logger("pgw.signer")

MAX_RESTARTS = 5  # pool breaks after which the signer signs in process for the rest of its life
# A batch a worker has not answered in this long is taken as hung (stopped, deadlocked, swapping):
# its workers are killed and it is handled as a death. A batch (500 verdicts) signs in well under a second.
HUNG_AFTER_S = 30.0
# The longest the event loop holds the GIL while a hand-off thread waits for it (see the docstring).
SWITCH_INTERVAL_S = 0.001

# -- in the worker ---------------------------------------------------------------------------------

_KEY: SigningKey | None = None


def _init(data_dir: str, keys_dir: str | None, kid: str, signer_pid: int) -> None:
    global _KEY  # noqa: PLW0603 - the worker's one key, set once when it starts
    _KEY = load_kid(Path(data_dir), "signer", kid, keys_dir=Path(keys_dir) if keys_dir else None)
    threading.Thread(target=_exit_with, args=(signer_pid,), daemon=True, name="pgw-signer-watch").start()


def _exit_with(pid: int) -> None:
    """End this worker when the signer's process ends, however it ends (``kill -9`` included).

    A pool worker waits on its input pipe, whose write end it holds itself, so
    it would outlive a killed signer (and keep the fork server alive) for ever.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): look once a second
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(0)
            time.sleep(1.0)
    select.select([fd], [], [])  # readable once the process has ended
    os._exit(0)


def _kid() -> str:
    assert _KEY is not None
    return _KEY.kid


def _sign_chunk(payloads: list[bytes]) -> list[bytes]:
    assert _KEY is not None
    return [sign_payload(p, _KEY) for p in payloads]


# -- in the signer ---------------------------------------------------------------------------------


# The pools running in this process (a rotation starts the new one before the old one is closed)
# and the switch interval the first of them found.
_switch_users = 0
_switch_before: float | None = None


def _lower_switch_interval() -> None:
    global _switch_users, _switch_before  # noqa: PLW0603 - one interpreter-wide setting, counted
    if _switch_users == 0 and sys.getswitchinterval() > SWITCH_INTERVAL_S:
        _switch_before = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
    _switch_users += 1


def _restore_switch_interval() -> None:
    global _switch_users, _switch_before  # noqa: PLW0603
    _switch_users -= 1
    if _switch_users == 0 and _switch_before is not None:
        sys.setswitchinterval(_switch_before)
        _switch_before = None


class SigningPoolError(PgwError):
    """The signing workers could not start with the signer's key."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_workers(setting: int | Literal["auto"]) -> int:
    """``signer.workers`` as a number: "auto" is one worker on two cores or more, none on one."""
    if setting == "auto":
        return 1 if usable_cores() >= 2 else 0
    return setting


def _context() -> multiprocessing.context.BaseContext:
    # A fork of the signer would copy its event loop, its threads and its NATS connection's
    # sockets; a fork server that has imported only this module gives clean, cheap workers.
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return multiprocessing.get_context("spawn")


class SigningPool:
    """``workers`` processes that sign statements with the signer's key (see the module docstring)."""

    def __init__(self, key: SigningKey, data_dir: Path, keys_dir: Path | None, workers: int) -> None:
        if workers < 1:
            raise ValueError("a signing pool has at least one worker")
        self.key = key
        self.workers = workers
        self._initargs = (str(data_dir), str(keys_dir) if keys_dir else None, key.kid, os.getpid())
        self._pool: ProcessPoolExecutor | None = None
        self.restarts = 0  # pools broken and replaced (tests, logs)
        self.hung_after_s = HUNG_AFTER_S
        self.given_up = False
        self._holds_switch = False  # this pool counts among the users of the lowered switch interval

    @property
    def active(self) -> bool:
        return self._pool is not None

    def worker_pids(self) -> list[int]:
        """The pids of the running workers (operations and tests); [] once given up or closed."""
        pool = self._pool
        # ProcessPoolExecutor names its processes only in this attribute (Python 3.11-3.13).
        procs = getattr(pool, "_processes", None) or {}
        return sorted(procs)

    async def start(self) -> None:
        """Start the workers and check that one signs as the signer's kid; SigningPoolError if not."""
        self._pool = await self._new_pool()
        if not self._holds_switch:
            self._holds_switch = True
            _lower_switch_interval()

    async def _new_pool(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self.workers, mp_context=_context(), initializer=_init,
                                   initargs=self._initargs)
        loop = asyncio.get_running_loop()
        try:
            kids = await asyncio.gather(*(loop.run_in_executor(pool, _kid) for _ in range(self.workers)))
        except BaseException as e:
            pool.shutdown(wait=False, cancel_futures=True)
            if isinstance(e, Exception):
                raise SigningPoolError(f"the signing workers could not start with the key {self.key.kid}: "
                                       f"{e!r}") from e
            raise
        if any(k != self.key.kid for k in kids):  # cannot happen: load_kid checks it; be loud
            pool.shutdown(wait=False, cancel_futures=True)
            raise SigningPoolError(f"a signing worker holds the key {kids}, the signer {self.key.kid}")
        return pool

    async def sign(self, payloads: list[bytes]) -> list[bytes]:
        """The statements of ``payloads``, in order, signed in the workers (in process once given up)."""
        if not payloads:
            return []
        pool = self._pool
        if pool is None:
            return [sign_payload(p, self.key) for p in payloads]
        loop = asyncio.get_running_loop()
        size = -(-len(payloads) // self.workers)
        chunks = [payloads[i:i + size] for i in range(0, len(payloads), size)]
        try:
            parts = await asyncio.wait_for(
                asyncio.gather(*(loop.run_in_executor(pool, _sign_chunk, c) for c in chunks)), self.hung_after_s,
            )
        except (BrokenProcessPool, TimeoutError) as e:
            hung = isinstance(e, TimeoutError)
            if hung:  # a worker that neither answers nor dies would stall the signer for ever
                for proc in list((getattr(pool, "_processes", None) or {}).values()):
                    proc.kill()
            log.error("a signing worker " + ("hung" if hung else "died") +
                      "; its batch is signed in process and the pool restarted",
                      count=len(payloads), error=repr(e), restarts=self.restarts + 1)
            out = [sign_payload(p, self.key) for p in payloads]  # the same bytes: Ed25519 is deterministic
            await self._restart(pool)
            return out
        return [s for part in parts for s in part]

    async def _restart(self, broken: ProcessPoolExecutor) -> None:
        if self._pool is not broken:  # another batch's failure restarted it already
            return
        self._pool = None
        broken.shutdown(wait=False, cancel_futures=True)
        self.restarts += 1
        if self.restarts > MAX_RESTARTS:
            self.given_up = True
            self._release_switch()
            log.error("signing workers keep dying; the signer signs in process from now on",
                      restarts=self.restarts)
            return
        try:
            self._pool = await self._new_pool()
        except SigningPoolError as e:
            self.given_up = True
            self._release_switch()
            log.error("the signing pool could not be restarted; the signer signs in process from now on",
                      error=str(e))

    async def close(self, *, finish: bool = False) -> None:
        """Stop the workers (idempotent); ``finish``: once they have signed what they were given
        (a pool replaced by one holding a rotated key, consumers/signer.py), else at once."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await asyncio.to_thread(pool.shutdown, wait=True, cancel_futures=not finish)
        self._release_switch()

    def _release_switch(self) -> None:
        if self._holds_switch:
            self._holds_switch = False
            _restore_switch_interval()
