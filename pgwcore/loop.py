"""The event loop every pgw process runs on: uvloop where it is installed, asyncio's otherwise.

uvloop (libuv) does the socket and scheduling work of nats-py's many small
requests in C; the services spend a large share of their time there (see
benchmarks/performance-log.md). ``PGW_LOOP=asyncio`` forces the standard loop, e.g. to
compare the two or to rule uvloop out when chasing a bug.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_name() -> str:
    """``uvloop`` or ``asyncio``: what :func:`run` will use."""
    if os.environ.get("PGW_LOOP", "").strip().lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop :func:`loop_name` names, with :func:`quiet_teardown` as its handler."""
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.run(_quietly(main))
    return asyncio.run(_quietly(main))


async def _quietly(main: Coroutine[Any, Any, T]) -> T:
    asyncio.get_running_loop().set_exception_handler(quiet_teardown)
    return await main


# What a connection the server closed leaves behind: nats-py's transport futures fail with these when the
# server drops the socket (a refused login, a server that went away) and nobody is left to await them.
_TEARDOWN = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def quiet_teardown(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: a "never retrieved" connection reset is the client's own teardown after
    the command has said what happened (a refused login's one line, ``pgw streams`` with no credentials,
    found under load), not an error of its own; everything else goes to the default handler."""
    if isinstance(context.get("exception"), _TEARDOWN) and "never retrieved" in str(context.get("message", "")):
        return
    loop.default_exception_handler(context)


U = TypeVar("U")


def retrieve(task: asyncio.Future[Any]) -> None:
    """A done callback that marks a task's exception as retrieved (its caller failed with another)."""
    if not task.cancelled():
        task.exception()  # retrieved: the caller has already failed with the other one's error


async def together(first: Awaitable[T], second: Awaitable[U]) -> tuple[T, U]:
    """``asyncio.gather(first, second)`` with one task instead of two and no gathering future.

    ``second`` runs in the caller's own task, ``first`` beside it; both are in
    flight together (the hot path's pairs of durable writes, benchmarks/performance-log.md).
    An error of either is raised, once ``second`` is done (gather raises at
    once); if ``second`` fails, ``first`` keeps running to its end, as under
    gather. Cancelling the caller cancels both. (:func:`gather_inline` of the two.)
    """
    b, a = await gather_inline(second, first)
    return a, b


async def gather_inline(first: Awaitable[Any], *rest: Awaitable[Any], return_exceptions: bool = False) -> list[Any]:
    """``await asyncio.gather(first, *rest)`` with ``first`` run in the caller's own task.

    One task and the gathering future fewer than gather (the kernel's rounds of
    durable writes, benchmarks/performance-changes.md): ``rest`` are wrapped in tasks
    (a future is taken as it is), which start only once ``first`` suspends, so
    a write ``first`` sends before its first suspension leaves first, as under
    gather. The results come in the order given. Differences from gather:

    * an error is raised once every awaitable before it in the list is done
      (gather raises at once); the others keep running to their end, their
      errors retrieved, as under gather;
    * ``return_exceptions=True`` returns each ``Exception`` in its place, but a
      cancellation is always raised (the caller's task cannot tell its own from
      that of ``first``), and the awaitables still pending are then cancelled;
    * cancelling the caller cancels them all, as it does under gather.
    """
    others = [asyncio.ensure_future(a) for a in rest]
    out: list[Any] = []
    try:
        for aw in (first, *others):
            try:
                out.append(await aw)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not return_exceptions:
                    raise
                out.append(e)
    except asyncio.CancelledError:
        for t in others:
            t.cancel()  # a no-op on those already done
        raise
    except BaseException:
        for t in others:
            t.add_done_callback(retrieve)
        raise
    return out
