"""A KV read at a fraction of nats-py's client CPU (issue 18, the IDP kernel's hot path).

``kv.get`` in nats-py builds the request with ``json.dumps``, awaits it through
``wait_for``, parses the answer with ``json.loads`` into ``RawStreamMsg`` and
its headers with a MIME parser. ``get_last`` sends the same request
(``$JS.API.STREAM.MSG.GET.KV_{bucket}``, ``last_by_subj``), so the server does
the same work and answers from the stream leader, as ``kv.get`` does on a
stream without direct gets, but takes the reply through nats' request inbox
with one timer (as ``pgwcore.atomic.send_acked`` does) and decodes it with
msgspec. Same answers: the value and revision of the key's last entry, or
None when the key has none or its last entry is a delete or purge marker
(``KV-Operation``), which ``kv.get`` reports as ``KeyNotFoundError``.

Also the listings of a bucket's keys (:func:`kv_keys`, :func:`listing`,
:func:`live_keys`), which never end at nats-py's "initial values done" marker,
and the removal of a finished key's delete marker (:func:`purge_markers`).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, NamedTuple

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.errors import APIError

from pgwcore.atomic import Deadlines, reply_token
from pgwcore.delivery import ReplyInbox
from pgwcore.logs import get_logger
from pgwcore.msgget import last_seq_under
from pgwcore.pubbatch import publish_soon

log = get_logger("pgw.kvread")

ERR_NO_MESSAGE = 10037  # JSNoMessageFoundErr


class _StoredMsg(msgspec.Struct):
    seq: int
    data: str = ""
    hdrs: str | None = None


class _GetReply(msgspec.Struct):
    message: _StoredMsg | None = None
    error: dict[str, Any] | None = None


_reply_dec = msgspec.json.Decoder(_GetReply)
_enc = msgspec.json.Encoder()


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(nats.errors.TimeoutError())


def _deleted(hdrs: str) -> bool:
    raw = base64.b64decode(hdrs)
    # NATS/1.0 header block: a delete or purge marker carries ``KV-Operation``.
    return b"KV-Operation:" in raw and (b"KV-Operation: DEL" in raw or b"KV-Operation: PURGE" in raw
                                        or b"KV-Operation:DEL" in raw or b"KV-Operation:PURGE" in raw)


async def get_last(nc: Client, api_prefix: str, bucket: str, key: str, timeout: float) -> tuple[bytes, int] | None:
    """(value, revision) of ``key`` in KV ``bucket``; None if it has no value."""
    if not nc._resp_sub_prefix:
        await nc._init_request_sub()
    token = reply_token()
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    nc._resp_map[token] = fut
    timer = loop.call_later(timeout, _expire, fut)
    try:
        await nc.publish(
            f"{api_prefix}.STREAM.MSG.GET.KV_{bucket}",
            _enc.encode({"last_by_subj": f"$KV.{bucket}.{key}"}),
            reply=nc._resp_sub_prefix.decode() + token,
        )
        msg = await fut
    finally:
        timer.cancel()
        nc._resp_map.pop(token, None)
    reply = _reply_dec.decode(msg.data)
    if reply.error is not None:
        if reply.error.get("err_code") == ERR_NO_MESSAGE or reply.error.get("code") == 404:
            return None
        APIError.from_error(reply.error)  # raises the matching subclass
    m = reply.message
    if m is None:
        return None
    if m.hdrs and _deleted(m.hdrs):
        return None
    value = base64.b64decode(m.data) if m.data else b""
    if not value:
        return None
    return value, m.seq


async def kv_last_seq(js: Any, bucket: str) -> int:
    """The stream sequence of bucket ``bucket``'s last entry, 0 when it holds none: its last message under the
    bucket's own subjects, not the stream's last message (one stored outside them: pgwcore.msgget.outside)."""
    return await last_seq_under(js, f"KV_{bucket}", f"$KV.{bucket}.>")


async def kv_keys(js: Any, bucket: str, pattern: str = ">") -> list[str]:
    """The keys of bucket ``bucket`` matching ``pattern`` that have an entry (a delete marker counts: the
    caller's read finds it gone), from the server's per-subject index of the bucket's stream; none when
    the bucket is absent.

    Not a KV watcher (nats-py's ``watch``/``keys``): it can signal "initial values done" before a value
    already delivered reaches the client, so a listing read that way misses a key now and then under load.
    """
    from nats.js.errors import NotFoundError

    pre = f"$KV.{bucket}."
    try:
        info = await js.stream_info(f"KV_{bucket}", subjects_filter=pre + pattern)
    except NotFoundError:
        return []
    return [subject[len(pre):] for subject in info.state.subjects or {}]


class Marker(NamedTuple):
    """A key whose last entry is a delete or purge marker: the marker's stream sequence and when it was stored."""

    key: str
    seq: int
    at: float  # seconds since the epoch


async def listing(js: Any, kv: Any, bucket: str, pattern: str = ">", timeout: float = 10.0) -> tuple[list[str], list[Marker]]:
    """The keys of ``kv`` (bucket ``bucket``) matching ``pattern`` whose last entry is a value, in stream
    order, and the markers of those whose last entry is a delete or purge marker.

    A KV watcher's last entries, each with the count still to come (``delta``): the listing ends at
    the entry with none to come, never at nats-py's "initial values done" marker (see :func:`kv_keys`),
    and a bucket with no key at all is told by the server before any watch (its message count for the
    whole bucket, which the sweeps list every few seconds; its subject index for a pattern).
    """
    if pattern == ">":  # the whole bucket: its last entry says it, without listing every subject
        # Not the stream's message count: a message the server delivered to a party's reply subject in the
        # bucket is stored under another subject (pgwcore.msgget.outside), so a bucket with no key held one
        # message, and the watch that no entry comes to waited out its timeout at every sweep (a review).
        if not await kv_last_seq(js, bucket):
            return [], []
    elif not await kv_keys(js, bucket, pattern):
        return [], []
    watcher = await kv.watch(pattern, meta_only=True)
    live: dict[str, None] = {}
    markers: dict[str, Marker] = {}
    try:
        while True:
            entry = await watcher.updates(timeout)
            if entry is None:  # nats-py's marker: not trusted
                continue
            if entry.operation in ("DEL", "PURGE"):
                live.pop(entry.key, None)
                at = entry.created.timestamp() if entry.created is not None else 0.0
                markers[entry.key] = Marker(entry.key, entry.revision, at)
            else:
                markers.pop(entry.key, None)
                live[entry.key] = None
            if entry.delta == 0:
                return list(live), list(markers.values())
    finally:
        await watcher.stop()


async def live_keys(js: Any, kv: Any, bucket: str, pattern: str = ">", timeout: float = 10.0) -> list[str]:
    """The keys of ``kv`` matching ``pattern`` whose last entry is a value (:func:`listing`)."""
    return (await listing(js, kv, bucket, pattern, timeout))[0]


# A finished key's marker is kept this long: an operation on the key that read it before it was finished
# (another gateway's sweep) has long ended by then. Each marker is read by the sweeps of those seconds only.
MARKER_KEEP_S = 10.0
PURGE_MOST = 5000  # markers removed per call at the most: a backlog (a bucket of an older version) drains over sweeps
PURGE_AT_ONCE = 64  # purge requests in flight together


async def purge_markers(js: Any, bucket: str, markers: list[Marker], *, older_than: float,
                        most: int = PURGE_MOST) -> int:
    """Remove from bucket ``bucket``'s stream, for good, those of ``markers`` stored before ``older_than``
    (oldest first, ``most`` of them); how many were removed.

    A purge of the key's subject up to and including the marker's sequence: a value written to the
    key after the listing (a higher sequence) stays. A bucket that nobody watches for deletes (the
    kernel's open dispatches and permits, read by their sweeps only) needs no marker once its key is
    finished, and each one left would be read again by every sweep, for ever: one per gated call
    (20,000 of them made each listing take about 450 ms of CPU, against 1.3 ms once removed).
    """
    old = sorted((m for m in markers if m.at < older_than), key=lambda m: m.seq)[:most]
    stream = f"KV_{bucket}"
    for i in range(0, len(old), PURGE_AT_ONCE):
        await asyncio.gather(*(js.purge_stream(stream, seq=m.seq + 1, subject=f"$KV.{bucket}.{m.key}")
                               for m in old[i:i + PURGE_AT_ONCE]))
    return len(old)


async def sweep_markers(js: Any, bucket: str, markers: list[Marker], now: float) -> None:
    """:func:`purge_markers` of the markers older than :data:`MARKER_KEEP_S`, as a sweep calls it: a failure
    is logged and the markers are tried again at the next sweep."""
    try:
        await purge_markers(js, bucket, markers, older_than=now - MARKER_KEEP_S)
    except Exception as e:  # noqa: BLE001 - tried again at the next sweep
        log.warning("removing finished keys' delete markers failed", bucket=bucket, error=repr(e))


async def enable_direct(js: Any, bucket: str) -> bool:
    """Make sure ``KV_{bucket}`` answers direct gets (``allow_direct``, an additive update); False if
    not, and False for a replicated bucket, whose followers may answer a direct get (see ``BatchReader``)."""
    try:
        info = await js.stream_info(f"KV_{bucket}")
        if (info.config.num_replicas or 1) > 1:
            return False
        if info.config.allow_direct:
            return True
        cfg = info.config
        cfg.allow_direct = True
        info = await js.update_stream(cfg)
    except (nats.errors.Error, TimeoutError):
        return False
    return bool(info.config.allow_direct)


class _Batch:
    __slots__ = ("found", "fut")

    def __init__(self, fut: asyncio.Future[dict[str, tuple[bytes, int] | None]]) -> None:
        self.found: dict[str, tuple[bytes, int] | None] = {}
        self.fut = fut


class BatchReader:
    """Several keys of one KV bucket in one request: a batched direct get
    (``multi_last``, nats-server 2.11+), one message out instead of one per key.

    The server answers with the last entry of each key that has one, in one
    consistent view of the stream (``Nats-UpTo-Sequence``), then an end-of-batch
    status (204; 404 when no key has an entry). The same answers as ``get_last``
    per key: a delete or purge marker, an empty value or no entry is None.

    Direct gets may be answered by any replica that is not catching up, and a
    partitioned follower can be far behind, so ``enable_direct`` turns them on
    only for a bucket with one replica, where the one server answers (the
    embedded default); a replicated bucket keeps leader reads (``get_last``).
    """

    def __init__(self, nc: Client, api_prefix: str, bucket: str, timeout: float) -> None:
        self.nc = nc
        self.subject = f"{api_prefix}.DIRECT.GET.KV_{bucket}"
        self.pre = f"$KV.{bucket}."
        self.timeout = timeout
        self._replies = ReplyInbox(nc, self._on_reply)  # each reply handled as it is read
        self._pending: dict[str, _Batch] = {}
        self._deadlines = Deadlines(self._pending, self._expire)

    def _expire(self, token: str) -> None:
        b = self._pending.get(token)
        if b is not None:
            _expire(b.fut)

    async def start(self) -> None:
        await self._replies.start()

    async def close(self) -> None:
        await self._replies.close()

    def _on_reply(self, token: str, msg: Any) -> None:
        b = self._pending.get(token)
        if b is None or b.fut.done():
            return
        h = msg.headers or {}
        status = h.get("Status")
        if status is not None:
            if status in ("204", "404"):
                b.fut.set_result(b.found)
            else:
                b.fut.set_exception(APIError(code=int(status) if status.isdigit() else None,
                                             description=str(h.get("Description", ""))))
            return
        subject = h.get("Nats-Subject", "")
        op = h.get("KV-Operation")
        value = msg.data
        b.found[subject[len(self.pre):]] = None if op in ("DEL", "PURGE") or not value else (value, int(h["Nats-Sequence"]))

    async def get_many(self, keys: list[str]) -> list[tuple[bytes, int] | None]:
        """(value, revision) or None for each key, in order."""
        token = reply_token()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, tuple[bytes, int] | None]] = loop.create_future()
        self._pending[token] = _Batch(fut)
        # The deadline on the future (no wait_for's extra future and callbacks), kept with the others
        # by one loop timer (pgwcore.atomic.Deadlines).
        self._deadlines.add(loop, token, self.timeout)
        try:
            # nc.publish's bytes and refusals, the write kicked by a loop callback (pgwcore.pubbatch)
            await publish_soon(
                self.nc, self.subject, _enc.encode({"multi_last": [self.pre + k for k in keys], "batch": len(keys)}),
                None, self._replies.prefix + token,
            )
            found = await fut
        finally:
            del self._pending[token]  # its deadline is forgotten with it
        return [found.get(k) for k in keys]
