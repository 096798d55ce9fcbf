"""Messages handed over in nats-py's read loop, for subscriptions whose handling never waits.

nats-py delivers a subscription's messages through an ``asyncio.Queue`` and a
task per subscription (``Subscription._wait_for_msgs``), which awaits the
callback: per message a queue put and get, a wakeup of that task, and a
coroutine. Where the handling is only "find the waiter, resolve its future"
or "start a task" (the kernel's batched reads, ``kvread.BatchReader``, and
its transition requests, each handed to a task of its own), it is done here
as the message is parsed: :func:`deliver_inline` puts a plain function in
place of the queue. What is kept: the order of the messages, and the
subscription's life (unsubscribe, drain, reconnect; ``pending_msgs`` is 0).
What changes: a message can no longer pile up in the subscription (so no
slow-consumer error), and the function runs inside the read loop, so it must
not block or await. An error it raises is logged and the next message is
handled as usual (nats-py hands a callback's error to ``error_cb``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from nats.aio.msg import Msg

from pgwcore.logs import get_logger

log = get_logger("pgw.delivery")


class _Inline:
    """Stands in for a subscription's pending queue (the calls nats-py makes on it)."""

    def __init__(self, sub: Any, handle: Callable[[Msg], None]) -> None:
        self._sub = sub
        self._handle = handle

    def put_nowait(self, msg: Msg) -> None:
        self._sub._pending_size -= len(msg.data)  # added by _process_msg just before
        try:
            self._handle(msg)
        except Exception:
            log.exception("handling a message failed", subject=msg.subject)

    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def task_done(self) -> None:
        return None

    async def join(self) -> None:  # Subscription.drain waits for the queue: nothing is ever queued
        return None


def deliver_inline(sub: Any, handle: Callable[[Msg], None]) -> None:
    """From now on, each message of ``sub`` (a ``nats.aio.subscription.Subscription`` made with a
    callback) goes to ``handle(msg)`` as the read loop parses it, in order, instead of to the
    callback through the subscription's queue and task (the module's docstring)."""
    old, sub._pending_queue = sub._pending_queue, _Inline(sub, handle)
    task = sub._wait_for_msgs_task
    if task is not None:
        task.cancel()  # it waits on the old queue, which nothing is put on any more
    while not old.empty():  # anything read before the switch that the task has not taken: in order
        sub._pending_queue.put_nowait(old.get_nowait())


async def subscribe_inline(nc: Any, subject: str, handle: Callable[[Msg], None], *, queue: str = "") -> Any:
    """``nc.subscribe(subject, queue=queue)`` whose messages go to ``handle`` as the read loop parses
    them (:func:`deliver_inline`); what arrives before the switch reaches ``handle`` too."""

    async def cb(msg: Msg) -> None:  # the subscription's task, until deliver_inline ends it
        handle(msg)

    sub = await nc.subscribe(subject, queue=queue, cb=cb)
    deliver_inline(sub, handle)
    return sub


class ReplyInbox:
    """An inbox of one writer's own on the connection (``{inbox}.{token}``, made by ``nc.new_inbox()``,
    of the request inbox's form and permission), each reply handed to ``handle(token, msg)`` as the
    read loop parses it (:func:`deliver_inline`). Shared by the kernel's PubAck inbox
    (``pgwcore.atomic.AckInbox``) and its batched reads (``pgwcore.kvread.BatchReader``), which keep
    their own waiters by token."""

    def __init__(self, nc: Any, handle: Callable[[str, Msg], None]) -> None:
        self.nc = nc
        self._handle = handle
        self.prefix = ""  # "{inbox}." once started: a reply subject is prefix + token
        self.sub: Any = None

    @property
    def started(self) -> bool:
        return self.sub is not None

    async def start(self) -> None:
        self.prefix = self.nc.new_inbox() + "."
        cut, handle = len(self.prefix), self._handle
        self.sub = await subscribe_inline(self.nc, self.prefix + "*", lambda msg: handle(msg.subject[cut:], msg))

    async def close(self) -> None:
        sub, self.sub = self.sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # closing anyway
                await sub.unsubscribe()
