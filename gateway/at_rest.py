"""A message of ``PGW_INBOUND`` that held a secret, once the gateway is done with it (spec 002 SR-1).

``PGW_INBOUND`` keeps what agents send for 7 days, readable by ops
credentials; a secret in it would stay readable at rest (docs/security.md
"Data at rest"). So once the gateway has recorded what a message caused, the
message is settled here, the same way whoever read it:

- a turn the pipeline answered (outcome, verdict and dedup record stored;
  gateway/pipeline.py);
- a turn given up after ``gateway.max_deliver`` deliveries, once its dead
  letter is recorded (gateway/deadletter.py, either way in);
- a transition report, once the kernel has recorded it (its events and
  verdict; gateway/kernel/transitions.py).

Settling: when the message holds no secret, it stays as sent. It holds one
when redaction changes its body as parsed, or its bytes hold one a parse does
not show (a JSON member given twice: the parser keeps the last, the bytes keep
both), or a header holds one (its name or value: ``Nats-Msg-Id``,
``Pgw-Principal``, any other). Then its redacted form is kept in the bucket ``PGW_INBOUND_REDACTED``
(key ``{agent}.{stream seq}``, the stream's 7 days), with the message's
``Nats-Msg-Id`` (redacted) in ``Pgw-Inbound-Msg-Id`` and its subject in
``Pgw-Inbound-Subject``: what ``pgw replay`` re-drives in its place
(consumers/replay.py). Then the message is deleted with erase
(``STREAM.MSG.DELETE`` without ``no_erase`` overwrites its bytes; a limit, a
purge or an ack would leave them in the block file). The copy is written
before the erase, so a crash in between leaves both, and the caller's next
delivery (or advisory) settles it again: both writes are idempotent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from nats.js.errors import APIError

from gateway.stages.redaction import body_plainly_clean, json_unescaped
from pgwcore.logs import get_logger
from pgwcore.streams import (
    DAY,
    INBOUND_MSG_ID_HEADER,
    INBOUND_REDACTED_BUCKET,
    INBOUND_SUBJECT_HEADER,
    ensure_kv,
)

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from gateway.stages.base import Turn

log = get_logger("pgw.at_rest")

INBOUND_STREAM = "PGW_INBOUND"
REDACTED_TTL_S = 7 * DAY  # PGW_INBOUND's own max_age: a copy lives no longer than the message would have


async def ensure_copies(js: JetStreamContext) -> None:
    """The bucket of redacted copies, made by whichever part of the gateway starts first."""
    await ensure_kv(js, INBOUND_REDACTED_BUCKET, ttl=REDACTED_TTL_S)


def redacted_turn(red: Any, body: bytes) -> bytes | None:
    """The message ``body`` with every secret redacted, or None when redaction changes nothing in it."""
    try:
        value = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return _redacted_text(red, body)
    try:
        graph = red.graph(value)
    except RecursionError:  # deeper than redaction walks (the shape stage refuses it): judged whole, as text
        return _redacted_text(red, body)
    return None if graph == value else msgspec.json.encode(graph)


def _redacted_text(red: Any, body: bytes) -> bytes | None:
    """A body no parser read (not JSON, or JSON deeper than they go), judged whole as text and as the JSON
    text it may be, its escapes read: the redacted text, or None when neither reading holds anything to
    redact. Where the escapes hide a secret ("\\u0073ecret:"), what is kept is the text with them read."""
    text = body.decode("utf-8", "replace")
    out = red.text(text)
    if out != text:
        return out.encode()
    read = json_unescaped(text)
    if read == text:
        return None
    out = red.text(read)
    return None if out == read else out.encode("utf-8", "replace")


def _headers_hold_secret(red: Any, headers: Any) -> bool:
    """Whether a message's headers hold a secret as they stand in its bytes: each name and value, each line
    as written (``secret:value`` where the name is ``secret``), and the lines the parse did not keep
    (``pgwcore.headerparse.Headers.dropped``)."""
    if red.holding(dict(headers)):
        return True
    # A line joins its name and value with ":". With no configured secret only a name ending in "secret"
    # (its capitals are the only ASCII folding to it, and names are ASCII) makes a token of the two.
    whole = [f"{k}:{v}" for k, v in headers.items() if red.has_secrets or k.lower().endswith("secret")]
    dropped = getattr(headers, "dropped", b"")
    if dropped:
        whole.append(dropped.decode("utf-8", "replace"))
    return bool(whole) and bool(red.holding(" ".join(whole)))


def _as_read(body: bytes) -> bytes:
    """``body`` as the gateway parsed it (a member given twice kept once, as msgspec keeps it), or as sent
    when it is not JSON."""
    try:
        return msgspec.json.encode(msgspec.json.decode(body))
    except (msgspec.DecodeError, RecursionError):
        return body


async def settle_raw(js: JetStreamContext, red: Any, turn: Turn) -> bool:
    """Keep the redacted form of ``turn`` and erase it as sent, if it held a secret (module docstring).

    True when the message was erased (or was gone already), False when it stays as sent.
    """
    # Most bodies are judged clean by one scan of their bytes (Redactor.bytes_plainly_clean); the
    # rest are parsed and walked, and their bytes read member by member.
    clean = body_plainly_clean(red, turn)  # judged once per turn: the redaction stage asked it first
    redacted = None if clean else redacted_turn(red, turn.body)
    if redacted is None:
        if (clean or not red.bytes_hold_secret(turn.body)) and not (
                turn.headers is not None and _headers_hold_secret(red, turn.headers)):
            return False
        # The body as the gateway read it (one value per member), or as sent when that held nothing.
        redacted = _as_read(turn.body)
    # The message's id and principal redacted like the body; traceparent and subject as sent.
    headers = {INBOUND_MSG_ID_HEADER: red.text(turn.msg_id or ""), "Pgw-Principal": red.text(turn.principal or ""),
               "traceparent": turn.traceparent or "", INBOUND_SUBJECT_HEADER: turn.subject}
    await js.publish(f"$KV.{INBOUND_REDACTED_BUCKET}.{turn.agent}.{turn.stream_seq}", redacted,
                     headers={k: v for k, v in headers.items() if v})
    try:
        # STREAM.MSG.DELETE without no_erase: the server overwrites the message's bytes.
        await js.delete_msg(INBOUND_STREAM, turn.stream_seq)
    except APIError as e:  # gone already: a redelivery of a message settled before
        log.debug("inbound message already erased", seq=turn.stream_seq, error=str(e))
    return True
