"""Anchored heads of the event log: signed checkpoints kept outside ``PGW_EVENTLOG``.

The hash chain (spec 003 §8.2) shows that no event inside the log was
altered, but not that the log is whole: cutting off its last events, or
rolling it back and appending anew, leaves a chain that verifies. So the
kernel anchors the log's head outside it:

* every ``kernel.checkpoint_interval_s`` (if the head moved) and at drain,
  the kernel signs a ``Checkpoint`` (stream, sequence, digest of the event
  at that sequence, time, kid) with its event-log key;
* it is published on ``{prefix}.checkpoint.eventlog`` (stream
  ``PGW_CHECKPOINTS``, deny delete and purge), and written to
  ``{data_dir}/kernel/eventlog-anchor.json``: a second copy that does not
  live in the NATS store the log lives in;
* a checkpoint is only written if the log still extends the previous one
  (its event at the anchored sequence has the anchored digest): the kernel
  never re-anchors a truncated or forked log, it logs it as critical.

``check_anchor`` (``pgw log verify``) compares the log with the latest
anchor it can verify: a log that ends before the anchored sequence is
reported at the first missing sequence; one whose event at an anchored
sequence differs is reported at the first sequence after the last anchor it
still matches (the altered event lies between the two anchors).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import Counter

from gateway.kernel.eventlog import record_digest
from pgwcore.keys import SigningKey
from pgwcore.logs import get_logger
from pgwcore.metrics import REGISTRY
from subjects.checkpoint import CHECKPOINT_STREAM as STREAM
from subjects.checkpoint import Checkpoint, checkpoint_subject
from subjects.idp import b64url

log = get_logger("pgw.kernel.checkpoint")

ANCHOR_FILE = "kernel/eventlog-anchor.json"

ANCHOR_REFUSED = Counter(
    "pgw_eventlog_anchor_refused_total",
    "Checkpoints not written because the event log no longer extends the anchored head",
    registry=REGISTRY,
)


_decoder = msgspec.json.Decoder(Checkpoint)


def anchor_path(data_dir: Path) -> Path:
    return Path(data_dir) / ANCHOR_FILE


def read_anchor_file(data_dir: Path) -> Checkpoint | None:
    p = anchor_path(data_dir)
    try:
        return _decoder.decode(p.read_bytes())
    except FileNotFoundError:
        return None
    except (msgspec.DecodeError, msgspec.ValidationError, OSError) as e:
        log.warning("unreadable event-log anchor file", path=str(p), error=str(e))
        return None


async def latest_published(js: JetStreamContext, prefix: str) -> Checkpoint | None:
    try:
        raw = await js.get_last_msg(STREAM, checkpoint_subject(prefix))
    except NotFoundError:
        return None
    try:
        return _decoder.decode(raw.data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


async def all_published(js: JetStreamContext, prefix: str) -> list[Checkpoint]:
    """Every checkpoint in ``PGW_CHECKPOINTS``, oldest first (undecodable ones skipped)."""
    from gateway.kernel.eventlog import _iter_stored

    out = []
    with contextlib.suppress(NotFoundError):
        async for _seq, _subj, data in _iter_stored(js, STREAM, checkpoint_subject(prefix)):
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                out.append(_decoder.decode(data))
    return out


class Checkpointer:
    """Anchors the event log's head at a bounded interval and at drain (a kernel part)."""

    def __init__(self, eventlog: Any, key: SigningKey, prefix: str, data_dir: Path, interval_s: float) -> None:
        self.eventlog = eventlog
        self.js = eventlog.js
        self.key = key
        self.prefix = prefix
        self.data_dir = Path(data_dir)
        self.interval_s = interval_s
        self.last: Checkpoint | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop_loop = False
        self._lock = asyncio.Lock()
        self._file_warned = False

    async def start(self) -> None:
        try:
            pub = await latest_published(self.js, self.prefix)
        except Exception:
            # Anchoring is evidence, not a gate: the kernel still serves, and says so.
            log.exception("could not read the latest anchored head; anchoring from the data folder's copy")
            pub = None
        local = read_anchor_file(self.data_dir)
        cands = [c for c in (pub, local) if c is not None and c.stream == self.eventlog.stream]
        self.last = max(cands, key=lambda c: c.seq, default=None)
        try:
            broken = self.last is not None and await self._broken(self.last)
        except Exception:
            log.exception("could not compare the event log with its anchored head")
            broken = False
        if broken and self.last is not None:
            log.critical(
                "the event log does not extend its anchored head: truncated, rolled back or forked",
                anchored_seq=self.last.seq, alert_trigger="EVENTLOG_ANCHOR_MISMATCH",
            )
        if self.interval_s > 0:
            self._stop_loop = False
            self._task = asyncio.create_task(self._loop(), name="kernel-checkpoints")

    async def _loop(self) -> None:
        # Not `while True`: close() sets _stop_loop before it cancels, so a cancel swallowed by
        # Python 3.11's wait_for race (turned into TimeoutError, caught below) cannot keep it going.
        while not self._stop_loop:
            await asyncio.sleep(self.interval_s)
            try:
                await self.anchor()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("could not anchor the event log head")

    async def close(self) -> None:
        """Stop the timer and anchor the head a last time. Idempotent."""
        self._stop_loop = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        try:
            await self.anchor()
        except Exception:
            log.exception("could not anchor the event log head at shutdown")

    async def _broken(self, anchored: Checkpoint) -> bool:
        """True if the log no longer holds the anchored event at its sequence."""
        try:
            raw = await self.js.get_msg(self.eventlog.stream, anchored.seq)
        except NotFoundError:
            return True
        # The stored bytes' digest (eventlog.record_digest), so a foreign record at the
        # anchored sequence is compared, not a decoding error that stops anchoring for good.
        return record_digest(raw.data or b"") != anchored.digest

    async def anchor(self) -> Checkpoint | None:
        """Sign and publish the current head if it moved; None if nothing was written."""
        async with self._lock:
            seq, digest = await self.eventlog.head()
            if seq == 0 or (self.last is not None and self.last.seq == seq and self.last.digest == digest):
                return None
            if self.last is not None and (seq < self.last.seq or await self._broken(self.last)):
                ANCHOR_REFUSED.inc()
                log.critical(
                    "not anchoring: the event log does not extend its anchored head",
                    anchored_seq=self.last.seq, head_seq=seq, alert_trigger="EVENTLOG_ANCHOR_MISMATCH",
                )
                return None
            from subjects.util import now_rfc3339

            cp = Checkpoint(stream=self.eventlog.stream, seq=seq, digest=digest, ts=now_rfc3339(), kid=self.key.kid)
            cp.sig = b64url(self.key.sign(cp.signing_bytes()))
            data = msgspec.json.encode(cp)
            await self.js.publish(
                checkpoint_subject(self.prefix), data, stream=STREAM,
                headers={"Nats-Msg-Id": f"checkpoint-{self.eventlog.stream}-{seq}-{digest[:16]}"},
            )
            self.last = cp
            try:
                self._write_file(data)
            except OSError as e:
                if not self._file_warned:  # once: a read-only data folder stays read-only
                    log.warning("could not write the anchor file; anchoring in PGW_CHECKPOINTS only",
                                path=str(anchor_path(self.data_dir)), error=str(e))
                    self._file_warned = True
            log.debug("event log head anchored", seq=seq)
            return cp

    def _write_file(self, data: bytes) -> None:
        p = anchor_path(self.data_dir)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)


# ---------------------------------------------------------------------------
# Verification against the anchors (`pgw log verify`)
# ---------------------------------------------------------------------------


def _read_files(files: list[Path]) -> list[tuple[str, Checkpoint]]:
    out = []
    for f in files:
        try:
            out.append((str(f), _decoder.decode(Path(f).read_bytes())))
        except FileNotFoundError:
            continue
        except (msgspec.DecodeError, msgspec.ValidationError, OSError) as e:
            raise ValueError(f"anchor file {f} is unreadable: {e}") from None
    return out


async def check_anchor(
    js: JetStreamContext,
    keys: Mapping[str, Ed25519PublicKey],
    *,
    prefix: str,
    data_dir: Path | None,
    stream: str,
    anchor_files: list[Path] | None = None,
    anchored: list[tuple[str, Checkpoint, dict[str, Any]]] | None = None,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(anchor summary, first break or None) of ``stream`` against its latest verifiable anchor.

    ``anchored``: checkpoints held outside this host, already proved so by the
    caller, as (source, checkpoint, facts): the one the Transparency Service
    holds, with its receipt (``consumers.checkpoint_statement.latest_anchored``).
    Of two anchors of one sequence, such a one is used, and its facts reported.
    """
    published = [c for c in await all_published(js, prefix) if c.stream == stream]
    files = list(anchor_files or [])
    for f in files:
        if not Path(f).is_file():  # noqa: ASYNC240 - one stat of a local file the user named
            return None, {"seq": None, "event_type": None, "problem": f"anchor file {f} not found"}
    if data_dir is not None:
        files.append(anchor_path(data_dir))
    try:
        local = _read_files(files)
    except ValueError as e:
        return None, {"seq": None, "event_type": None, "problem": str(e)}
    outside = {id(c): facts for _src, c, facts in anchored or [] if c.stream == stream}
    cands: list[tuple[str, Checkpoint]] = [(STREAM, c) for c in published] + [(f, c) for f, c in local if c.stream == stream]
    cands += [(src, c) for src, c, _facts in anchored or [] if c.stream == stream]
    good: list[tuple[str, Checkpoint]] = []
    for src, c in cands:
        bad = c.verify(keys)
        if bad is None:
            good.append((src, c))
        elif src != STREAM:
            return None, {"seq": None, "event_type": None, "problem": f"anchor {src}: {bad}"}
    if not good:
        return None, None
    good.sort(key=lambda sc: (sc[1].seq, id(sc[1]) in outside))
    src, latest = good[-1]
    summary: dict[str, Any] = {"seq": latest.seq, "digest": latest.digest, "ts": latest.ts, "source": src,
                               "anchors": len(good), **outside.get(id(latest), {})}
    summary["sources"] = {s: max(c.seq for s2, c in good if s2 == s) for s, _c in good}  # newest seq per source
    info = await js.stream_info(stream)
    last = info.state.last_seq or 0
    first = info.state.first_seq or 0
    if last < latest.seq:
        return summary, {
            "seq": last + 1, "event_type": None,
            "problem": f"missing: the log ends at {last}, but its head was anchored at {latest.seq} ({latest.ts}); "
                       "the log was truncated or rolled back",
        }
    # An event's digest commits to the whole history before it, so if the log holds the
    # latest anchor it holds every earlier one: one read in the usual case. If not, the
    # anchors it still holds are a prefix of them; a binary search finds the last one.
    async def holds(c: Checkpoint) -> bool:
        if c.seq < first:
            return False
        try:
            raw = await js.get_msg(stream, c.seq)
        except Exception:  # noqa: BLE001 - an unreadable anchored event is not held
            return False
        return record_digest(raw.data or b"") == c.digest

    anchors = [c for _src, c in good]
    if await holds(latest):
        return summary, None
    lo, hi = 0, len(anchors) - 1  # anchors[hi] is not held; find the first one that is not
    while lo < hi:
        mid = (lo + hi) // 2
        if await holds(anchors[mid]):
            lo = mid + 1
        else:
            hi = mid
    matched = anchors[lo - 1].seq if lo > 0 else 0
    bad = anchors[lo]
    return summary, {
        "seq": matched + 1, "event_type": None,
        "problem": f"altered: the event at {bad.seq} differs from the one anchored at {bad.ts}; "
                   f"the log matches its anchors up to {matched} (rolled back or forked after it)",
    }
