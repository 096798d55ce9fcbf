"""JetStream atomic batch publish (nats-server >= 2.12, ADR-50).

A batch is a run of messages to one stream that is stored whole or not at all,
answered by a single PubAck on the commit message. Under ``sync_interval:
always`` the server syncs the batch once at commit instead of once per
message, which is what makes it worth having: the signer stores a batch of
capsules (and their ledger links) for the price of one durable write.

Headers: ``Nats-Batch-Id`` (unique per batch), ``Nats-Batch-Sequence`` (1..n)
and ``Nats-Batch-Commit: 1`` on the last message. ``Nats-Msg-Id`` dedup still
applies, but a batch holding a duplicate id is refused as a whole
(:data:`ERR_BATCH_DUPLICATE_MSG_ID`); ``Nats-Expected-Last-Sequence`` on the
first message is checked against the stream as it was before the batch. The
stream must have ``allow_atomic`` set (:func:`enable_atomic`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import nats.errors
from nats.js.errors import APIError, NoStreamResponseError

from pgwcore.delivery import ReplyInbox
from pgwcore.logs import get_logger
from pgwcore.pubbatch import publish_many, publish_one, publish_soon

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.client import JetStreamContext

log = get_logger("pgw.atomic")

ERR_WRONG_LAST_SEQ = 10071  # JSStreamWrongLastSequenceErr
ERR_WRONG_LAST_MSG_ID = 10070  # JSStreamWrongLastMsgIDErr
ERR_ATOMIC_DISABLED = 10174  # the stream does not allow atomic publish
ERR_BATCH_DUPLICATE_MSG_ID = 10201  # a Nats-Msg-Id in the batch was already stored
MAX_BATCH = 1000  # the server's per-batch message limit (ADR-50)

BatchItem = tuple[str, bytes, Mapping[str, str]]  # subject, payload, headers


async def publish_atomic(nc: Client, items: Sequence[BatchItem], *, timeout: float = 5.0,
                         first_headers: Mapping[str, str] | None = None) -> Ack:
    """Publish ``items`` as one atomic batch; return the commit's PubAck.

    Raises ``APIError`` when the server refuses the batch (nothing of it is
    stored), ``NoStreamResponseError`` when no stream takes the subject, and
    nats' ``TimeoutError`` when the commit is not answered (then the batch may
    or may not be stored: callers treat it as a failure and rely on Msg-Id
    dedup when they retry).
    """
    if not items:
        raise ValueError("an atomic batch needs at least one message")
    if len(items) > MAX_BATCH:
        raise ValueError(f"an atomic batch holds at most {MAX_BATCH} messages, got {len(items)}")
    batch_id = secrets.token_hex(12)
    last = len(items) - 1
    run = []  # every message but the commit, handed to the connection at once (pgwcore.pubbatch)
    for i, (subject, payload, headers) in enumerate(items):
        hdr = dict(headers)
        if i == 0 and first_headers:
            hdr.update(first_headers)
        hdr["Nats-Batch-Id"] = batch_id
        hdr["Nats-Batch-Sequence"] = str(i + 1)
        if i < last:
            run.append((subject, payload, hdr))
            continue
        await publish_many(nc, run)
        hdr["Nats-Batch-Commit"] = "1"
        return await publish_acked(nc, subject, payload, hdr, timeout)
    raise AssertionError("unreachable: items is not empty")


class NotAnAckError(Exception):
    """A reply to a publish that names no stream and sequence: not the server's acknowledgement."""

    def __init__(self, data: bytes) -> None:
        super().__init__(f"the reply to a publish is no acknowledgement: {bytes(data[:120])!r}")


class Ack(msgspec.Struct):
    """A PubAck (or the API error instead): what the writers here need of it."""

    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    batch_size: int | None = msgspec.field(default=None, name="count")  # an atomic batch's commit (ADR-50)
    error: dict | None = None


_ack_dec = msgspec.json.Decoder(Ack)


def _answer(msg: Any, out: asyncio.Future[Ack]) -> None:
    """The reply to a publish -> the Ack, or the error js.publish would raise."""
    if msg.headers and msg.headers.get("Status") == "503":
        out.set_exception(NoStreamResponseError())
        return
    try:
        ack = _ack_dec.decode(msg.data)
        if ack.error is not None:
            APIError.from_error(ack.error)  # raises the matching subclass
        if not ack.stream or ack.seq <= 0:
            # Not the server's acknowledgement: a reply inbox is a subject others can publish on
            # (an answer aimed at it, docs/security.md "Replies"). The write is not taken as done.
            raise NotAnAckError(msg.data)
    except Exception as e:  # noqa: BLE001 - handed to the waiter
        out.set_exception(e)
        return
    out.set_result(ack)


class _AckWaiter:
    """One PubAck awaited through nats' request inbox: it stands in ``nc._resp_map`` where
    ``nc.request`` puts a future, and nats-py's inbox callback calls ``done()`` and
    ``set_result(msg)`` on it as on that future. The reply is decoded into the caller's
    future at once (no second future, no done-callbacks run by the loop); the timer, or
    the reply, takes it out of the map. A caller that stops waiting (its future cancelled)
    leaves it there until the timer."""

    __slots__ = ("out", "resp_map", "timer", "token")

    def __init__(self, out: asyncio.Future[Ack], resp_map: dict[str, Any], token: str) -> None:
        self.out = out
        self.resp_map = resp_map
        self.token = token
        self.timer: asyncio.TimerHandle | None = None

    def done(self) -> bool:
        return self.out.done()

    def set_result(self, msg: Any) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.resp_map.pop(self.token, None)
        if not self.out.done():
            _answer(msg, self.out)

    def expire(self) -> None:
        self.resp_map.pop(self.token, None)
        if not self.out.done():
            self.out.set_exception(nats.errors.TimeoutError())


_PUB_ACK_MEMBERS = frozenset({"stream", "seq", "duplicate", "domain", "batch", "count", "val", "error"})
_PUB_ACK_ERROR = frozenset({"code", "err_code", "description"})


def is_pub_ack(data: bytes) -> bool:
    """Whether a stored record is nats-server's acknowledgement of a JetStream publish (``{"stream", "seq"}``),
    or its answer to one it refused (``{"error": {"code", "err_code", "description"}, ...}``).

    A party's publish with a stream's or a bucket's subject as its reply subject makes the server store
    its acknowledgement there (docs/security.md "Replies"): no record any service wrote. Readers that walk
    a stream pass over it and say so. The refused form costs the party nothing stored (its publish was
    refused, e.g. a ``Nats-Expected-Last-Sequence`` it set to fail), and its description can echo text the
    stream chose (``wrong last msg ID: ...``: the last stored message's id, which may be long), so it is
    recognised at any length."""
    if not data.startswith(b"{") or (len(data) > 512 and not data.startswith(b'{"error":')):
        return False
    try:
        d = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return False
    if not isinstance(d, dict) or not set(d) <= _PUB_ACK_MEMBERS:
        return False
    err = d.get("error")
    if err is not None:
        return isinstance(err, dict) and set(err) <= _PUB_ACK_ERROR and type(err.get("code")) is int
    return isinstance(d.get("stream"), str) and type(d.get("seq")) is int


def is_server_answer(data: bytes) -> bool:
    """Whether a stored record is an answer nats-server sends to a reply subject: a publish's acknowledgement
    or refusal (:func:`is_pub_ack`), or a JetStream API answer (a JSON object whose ``type`` is ``io.nats.``...).

    Not an empty body, which the server also answers to some requests (an ``$JS.ACK`` sent with a reply
    subject): an agent's own empty publish is one too, and is answered (a refusal, docs/security.md)."""
    if is_pub_ack(data):
        return True
    if not data.startswith(b'{"type":"io.nats.'):
        return False
    try:
        d = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return False
    return isinstance(d, dict) and isinstance(d.get("type"), str) and d["type"].startswith("io.nats.")


def not_written_by_us(data: bytes | None) -> bool:
    """For a store whose writers never store an empty record (the signer's ledger, the capsule streams, the event
    log): whether a record there is an answer of the server's a party aimed at it. :func:`is_server_answer`, or an
    empty body: the server's status answers (a no-wait pull's ``404 No Messages``, an ``$JS.ACK``'s empty answer)
    are stored without their status line, as nothing (found by a docs-only attack: one such record in
    ``PGW_SIGNER_LEDGER`` stopped all signing, as the reader took the empty record for a link)."""
    return not data or is_server_answer(data)


def stored_by_reply(msg: Any) -> bool:
    """Whether an input message is an answer of the server's stored under a party's subject.

    An agent's publish with another agent's ``agent.{agent}.envelope`` (or ``.transition``) as its reply
    subject makes the server store its acknowledgement there, on that agent's subject: no message that
    agent sent. It has no header (every client's JetStream publish has a ``Nats-Msg-Id``, and the server
    adds none to an acknowledgement) and the acknowledgement's body; read as the agent's, it made a refusal,
    a signed verdict and capsule and an outcome that name an agent which sent nothing (found by an attack
    from the docs). So too any answer of the server's (:func:`is_server_answer`): a JetStream API request of
    the party's own (``$JS.API.CONSUMER.INFO`` of its consumer) with that subject as its reply stored the
    server's answer there (found by a review). A message an agent sent with such a body and no header is
    passed over too: it was no envelope or report, and is not answered."""
    return not msg.headers and is_server_answer(msg.data)


_tokens = itertools.count(1)


def reply_token() -> str:
    """A reply token for nats' request inbox (``nc._resp_map``), unique in this process.

    A counter in hex, shorter than the 22-character NUID tokens of ``nc.request``,
    so never equal to one; at a fraction of ``nc._nuid.next()``'s CPU.
    """
    return f"{next(_tokens):x}"


async def send_acked(nc: Client, subject: str, payload: bytes, headers: Mapping[str, str],
                     timeout: float) -> asyncio.Future[Ack]:
    """Publish to a stream now; the returned future resolves with its PubAck or fails as
    ``js.publish`` would (``APIError`` and its subclasses, ``NoStreamResponseError``,
    nats' ``TimeoutError`` after ``timeout``).

    ``js.publish`` at about two thirds of its CPU (the gateway issues six of these per
    binding moment): the reply comes through nats' own request inbox (``_resp_map``,
    as ``nc.request`` does, with an ``_AckWaiter`` in place of its future), the deadline
    is one timer instead of ``wait_for``, the PubAck is decoded by msgspec. Sending and awaiting are apart so that a writer can
    order its sends under a lock and wait outside it (the kernel's event log).
    """
    if not nc._resp_sub_prefix:
        await nc._init_request_sub()
    token = reply_token()  # unique per connection, like nc.request's
    loop = asyncio.get_running_loop()
    out: asyncio.Future[Ack] = loop.create_future()
    waiter = _AckWaiter(out, nc._resp_map, token)
    nc._resp_map[token] = waiter
    waiter.timer = loop.call_later(timeout, waiter.expire)
    try:
        # nc.publish's bytes and refusals at a fraction of its CPU (pgwcore.pubbatch)
        await publish_one(nc, subject, payload, headers, nc._resp_sub_prefix.decode() + token)
    except BaseException:
        waiter.timer.cancel()
        nc._resp_map.pop(token, None)
        raise
    return out


async def publish_acked(nc: Client, subject: str, payload: bytes, headers: Mapping[str, str],
                        timeout: float) -> Ack:
    """One JetStream publish awaiting its PubAck (``send_acked``, then the wait)."""
    return await (await send_acked(nc, subject, payload, headers, timeout))


class Deadlines:
    """The deadlines of many waiters on one loop timer, instead of a timer each (uvloop makes,
    starts and stops a libuv timer per ``call_later``; a writer's replies come long before).

    ``pending`` maps each waiter's token to it; a token no longer in it has been answered (or
    given up) and its deadline is forgotten. :meth:`add` notes a deadline ``timeout`` seconds
    from now; once it has passed with the token still pending, ``expire(token)`` is called,
    as a timer of its own would have been (the loop's clock; never before the deadline). The
    deadlines of one timeout come in order, so each timeout keeps a queue, whose answered
    front is dropped as new ones come: it holds about the waiters in flight."""

    def __init__(self, pending: Mapping[str, Any], expire: Callable[[str], None]) -> None:
        self._pending = pending
        self._expire = expire
        self._queues: dict[float, collections.deque[tuple[float, str]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def add(self, loop: asyncio.AbstractEventLoop, token: str, timeout: float) -> None:
        at = loop.time() + timeout
        q = self._queues.get(timeout)
        if q is None:
            q = self._queues[timeout] = collections.deque()
        pending = self._pending
        while q and q[0][1] not in pending:
            q.popleft()
        q.append((at, token))
        if self._timer is None or at < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(at, self._fire, loop)
            self._timer_at = at

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        pending = self._pending
        due: list[str] = []
        nxt: float | None = None
        for q in self._queues.values():
            while q:
                at, token = q[0]
                if token not in pending:
                    q.popleft()
                elif at <= now:
                    q.popleft()
                    due.append(token)
                else:
                    nxt = at if nxt is None or at < nxt else nxt
                    break
        if nxt is not None:
            self._timer = loop.call_at(nxt, self._fire, loop)
            self._timer_at = nxt
        for token in due:
            self._expire(token)


class AckInbox:
    """``send_acked`` with the PubAcks on an inbox of its own, each handed over in nats-py's read
    loop (``pgwcore.delivery``): the waiter's future is resolved as the reply is parsed, with no
    queue put and get and no wakeup of the request inbox's task per write. For one writer's hot
    path (the kernel's five durable writes per PERMIT); the connection's request inbox, which every
    other ``send_acked`` / ``nc.request`` of the process shares, is left as it is.

    The same answers, errors and deadlines as ``send_acked`` (``_answer``; nats' ``TimeoutError``
    after ``timeout``, the deadlines kept by one timer, :class:`Deadlines`); the reply subject is
    ``{inbox}.{token}``, an inbox of the same form as the request inbox's (``_INBOX.<nuid>``;
    :class:`pgwcore.delivery.ReplyInbox`, as ``kvread.BatchReader``'s). A caller that stops waiting (its
    future cancelled) leaves its waiter until the reply or the deadline. Before :meth:`start`
    and after :meth:`close`, :meth:`send` is ``send_acked`` itself.
    """

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self._replies = ReplyInbox(nc, self._on_reply)
        self._waiters: dict[str, asyncio.Future[Ack]] = {}
        self._deadlines = Deadlines(self._waiters, self._expire)

    async def start(self) -> None:
        await self._replies.start()

    async def close(self) -> None:
        """Unsubscribe; later sends go through ``send_acked``. A write still waiting meets its
        deadline (call it once nothing of this writer is in flight)."""
        await self._replies.close()

    def _on_reply(self, token: str, msg: Any) -> None:
        out = self._waiters.pop(token, None)
        if out is not None and not out.done():  # None: timed out meanwhile, or not ours; done: cancelled
            _answer(msg, out)

    def _expire(self, token: str) -> None:
        out = self._waiters.pop(token, None)
        if out is not None and not out.done():
            out.set_exception(nats.errors.TimeoutError())

    async def send(self, subject: str, payload: bytes, headers: Mapping[str, str],
                   timeout: float) -> asyncio.Future[Ack]:
        """``send_acked(nc, subject, payload, headers, timeout)``, the PubAck on this inbox."""
        if not self._replies.started:
            return await send_acked(self.nc, subject, payload, headers, timeout)
        token = reply_token()
        loop = asyncio.get_running_loop()
        out: asyncio.Future[Ack] = loop.create_future()
        self._waiters[token] = out
        self._deadlines.add(loop, token, timeout)
        try:
            # nc.publish's bytes and refusals, the write kicked by a loop callback (pgwcore.pubbatch)
            await publish_soon(self.nc, subject, payload, headers, self._replies.prefix + token)
        except BaseException:
            self._waiters.pop(token, None)  # its deadline is forgotten with it
            raise
        return out

    async def publish(self, subject: str, payload: bytes, headers: Mapping[str, str], timeout: float) -> Ack:
        """``publish_acked`` on this inbox: :meth:`send`, then the wait."""
        return await (await self.send(subject, payload, headers, timeout))


async def enable_atomic(js: JetStreamContext, stream: str) -> bool:
    """Make sure ``stream`` allows atomic batches; False if it can't.

    An existing stream made without the flag gets it as an additive update,
    nothing replaced. A server that refuses it keeps the stream as it is, and
    its writers go one message at a time.
    """
    try:
        info = await js.stream_info(stream)
        if info.config.allow_atomic:
            return True
        cfg = info.config
        cfg.allow_atomic = True
        info = await js.update_stream(cfg)
    except (nats.errors.Error, TimeoutError) as e:  # APIError and NotFoundError included
        log.warning("stream takes no atomic batches; writing one message at a time",
                    stream=stream, error=str(e))
        return False
    # A server older than 2.12 drops the unknown field instead of refusing it.
    if info.config.allow_atomic:
        log.info("atomic batches enabled on an existing stream", stream=stream)
    return bool(info.config.allow_atomic)
