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
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.errors import APIError

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
    token = nc._nuid.next().decode()
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
