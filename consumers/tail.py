"""``pgw tail SUBJECT``: a pretty, redacted live view of any subject (issue 8 "Ops").

Live messages come from a plain core-NATS subscription (ops are read-only on
the bus). With ``--all``/``--since``/``--last`` the view starts with history
from the JetStream stream that holds the subject, read by message get in
stream order (consumers/history.py): no consumer is created, nothing is
acknowledged, no state changes, so the ops credentials need no consumer verb
(issue 19). The live subscription then only wakes the reader, which reads on
from the stream, so every message shows its sequence and none is shown twice.

Every string in a JSON body is redacted before it is shown (DESIGN §3.2 step 6,
SR-1: "redacted text appears nowhere downstream", and an ops terminal is
downstream). The project's SR-1 redactor (``gateway.stages.redaction``) is used
when present; otherwise ``secret:``-prefixed tokens and the configured secrets
are replaced here (the SR-1 stage is used when it is importable). Bodies that are not JSON (COSE capsules) are shown as a
size and a digest, never raw.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import importlib
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from consumers.history import StoredMsg, read_stored
from subjects.errors import PgwError

REDACTED = "[REDACTED]"
_SECRET_TOKEN = re.compile(r"secret:[^\s\"',;]*")
_HEADERS_SHOWN = ("traceparent", "Nats-Msg-Id", "Pgw-Replay-Of")


class TailError(PgwError):
    """What to tail cannot be tailed: the subject is not one, or no stream holds its history."""


def check_subject(subject: str) -> str:
    """A subscribable NATS subject: dot-separated non-empty tokens without white space, ``*`` a
    whole token, ``>`` only as the whole last one."""
    tokens = subject.split(".")
    bad = (not subject or any(c.isspace() for c in subject) or any(not tok for tok in tokens)
           or any(("*" in tok and tok != "*") or (">" in tok and tok != ">") for tok in tokens)
           or ">" in tokens[:-1])
    if bad:
        raise TailError(f"{subject!r} is not a NATS subject (tokens separated by dots, no spaces; "
                        "* for one token, > for the rest), e.g. 'pgw.verdict.>'")
    return subject


def _fallback_redactor(secrets: Iterable[str]) -> Callable[[str], str]:
    literal = sorted({s for s in secrets if s}, key=len, reverse=True)

    def redact(text: str) -> str:
        for s in literal:
            text = text.replace(s, REDACTED)
        return _SECRET_TOKEN.sub(REDACTED, text)

    return redact


def string_redactor(secrets: Iterable[str] = (), *, secrets_config: Any = None) -> Callable[[str], str]:
    """The redaction applied to every string shown: the SR-1 ``Redactor`` when available.

    ``secrets_config`` is the configuration's ``pipeline.secrets`` section
    (literal values, env var names, files), so ``pgw tail`` scrubs exactly
    what the gateway scrubs; ``secrets`` adds literal values.
    """
    secrets = list(secrets)
    fallback = _fallback_redactor(secrets)
    try:
        mod = importlib.import_module("gateway.stages.redaction")
        redactor_cls = mod.Redactor
    except (ImportError, AttributeError):
        return fallback
    r = redactor_cls.from_config(secrets_config) if secrets_config is not None else redactor_cls(secrets)
    if secrets and secrets_config is not None:
        extra = redactor_cls(secrets)
        return lambda text: fallback(extra.text(r.text(text)))
    # Belt and braces: the local rule after SR-1's, in case of a narrower configuration.
    return lambda text: fallback(r.text(text))


def redact_value(value: Any, redact: Callable[[str], str], *, _depth: int = 0) -> Any:
    """Walk any JSON value (keys too) and redact every string, at any depth."""
    if _depth > 200:
        return REDACTED  # deeper than anything legitimate: show nothing rather than recurse
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list):
        return [redact_value(v, redact, _depth=_depth + 1) for v in value]
    if isinstance(value, dict):
        return {redact(str(k)): redact_value(v, redact, _depth=_depth + 1) for k, v in value.items()}
    return value


@dataclass
class TailLine:
    """One message as shown: where it came from and its redacted body."""

    subject: str
    received: str
    headers: dict[str, str]
    body: Any
    seq: int | None = None
    note: str | None = None


def render_message(msg: Msg | StoredMsg, redact: Callable[[str], str]) -> TailLine:
    """Decode and redact one message for display; never raises."""
    headers = {k: redact(v) for k, v in (msg.headers or {}).items() if k in _HEADERS_SHOWN}
    seq = msg.seq if isinstance(msg, StoredMsg) else None
    data = msg.data or b""
    body: Any
    note = None
    try:
        body = redact_value(msgspec.json.decode(data), redact)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        try:
            text = data.decode("utf-8")
            body = redact(text)
            note = "not JSON"
        except UnicodeDecodeError:
            body = None
            note = f"binary, {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}"
    # A stored message is stamped with the time its stream stored it (history read later must not
    # look recent); a live one with the time it arrived.
    when = msg.time if isinstance(msg, StoredMsg) and msg.time is not None else datetime.now(UTC)
    return TailLine(
        subject=msg.subject,
        received=when.astimezone().isoformat(timespec="milliseconds"),
        headers=headers,
        body=body,
        seq=seq,
        note=note,
    )


def format_line(line: TailLine, *, fmt: str = "pretty") -> str:
    if fmt == "json":
        return msgspec.json.encode(
            {"subject": line.subject, "received": line.received, "seq": line.seq,
             "headers": line.headers, "body": line.body, "note": line.note}
        ).decode()
    head = f"[{line.received}] {line.subject}"
    if line.seq is not None:
        head += f" #{line.seq}"
    for k, v in line.headers.items():
        head += f" {k}={v}"
    if line.note:
        head += f" ({line.note})"
    if line.body is None:
        return head
    if isinstance(line.body, str):
        return f"{head}\n  {line.body}"
    pretty = msgspec.json.format(msgspec.json.encode(line.body), indent=2).decode()
    return head + "\n" + "\n".join("  " + ln for ln in pretty.splitlines())


async def tail(
    nc: Client,
    subject: str,
    *,
    out: TextIO = sys.stdout,
    redact: Callable[[str], str] | None = None,
    history: str | None = None,
    since: datetime | None = None,
    last: int | None = None,
    count: int | None = None,
    fmt: str = "pretty",
    stop: asyncio.Event | None = None,
    started: asyncio.Event | None = None,
) -> int:
    """Print messages on ``subject`` until ``stop`` is set or ``count`` were shown; return the count.

    ``history``: None (live only), ``"all"`` (the stream from its start),
    ``since`` (from a time) or ``last`` (the last N messages of the stream
    matching the subject) before going live.
    """
    check_subject(subject)
    redact = redact or string_redactor()
    stop = stop or asyncio.Event()
    shown = 0
    queue: asyncio.Queue[Msg | StoredMsg] = asyncio.Queue(maxsize=10_000)

    async def on_msg(msg: Msg) -> None:
        await queue.put(msg)

    follower: asyncio.Task[None] | None = None
    if history or since or last:
        stream = await _stream_of(nc, subject)
        poke = asyncio.Event()

        async def wake(_msg: Msg) -> None:
            poke.set()

        # Live messages only wake the reader: what is shown comes from the stream,
        # in stream order with its sequence, and nothing is shown twice.
        sub = await nc.subscribe(subject, cb=wake)
        await nc.flush()
        cursor = await _queue_history(nc, stream, subject, queue, since=since, last=last)

        async def follow() -> None:
            nonlocal cursor
            while True:
                await poke.wait()
                poke.clear()
                async for m in read_stored(nc, stream, subject, from_seq=cursor, to_seq=_NO_END):
                    await queue.put(m)
                    cursor = m.seq + 1

        follower = asyncio.create_task(follow())
        poke.set()  # anything stored between the history read and now
    else:
        sub = await nc.subscribe(subject, cb=on_msg)
        await nc.flush()
    if started is not None:
        started.set()
    stopper = asyncio.ensure_future(stop.wait())
    try:
        while count is None or shown < count:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                break
            print(format_line(render_message(getter.result(), redact), fmt=fmt), file=out, flush=True)
            shown += 1
    finally:
        stopper.cancel()
        if follower is not None:
            follower.cancel()
        await sub.unsubscribe()
    return shown


_NO_END = 2**63 - 1


async def _stream_of(nc: Client, subject: str) -> str:
    """The one stream that stores ``subject``'s history. A subject several streams store (``pgw.>``)
    has no one history in stream order: it is refused with their names, since following one of them
    would show nothing of the others and wait on it for ever."""
    js = nc.jetstream()
    # The request nats-py's find_stream_name_by_subject makes, which keeps only the first name.
    resp = await js._api_request(f"{js._prefix}.STREAM.NAMES", msgspec.json.encode({"subject": subject}),
                                 timeout=js._timeout)
    names = sorted(resp.get("streams") or [])
    if not names:
        raise TailError(f"no stream stores {subject!r}, so it has no history (`pgw streams` lists each "
                        "stream's subjects); without --all, --since or --last it is watched live")
    if len(names) > 1:
        raise TailError(f"{subject!r} is stored by {len(names)} streams ({', '.join(names)}): its history is read "
                        "from one stream; name a subject of one (`pgw streams` lists them, e.g. 'pgw.verdict.>'), "
                        "or watch it live without --all, --since or --last")
    return names[0]


async def _queue_history(
    nc: Client, stream: str, subject: str, queue: asyncio.Queue[Msg | StoredMsg], *,
    since: datetime | None, last: int | None,
) -> int:
    """Queue the stream's history for ``subject``; return the sequence to follow from."""
    to_seq = (await nc.jetstream().stream_info(stream)).state.last_seq
    kept: collections.deque[StoredMsg] = collections.deque(maxlen=last or None)
    since = since.astimezone() if since is not None else None  # a naive time is local time
    async for m in read_stored(nc, stream, subject, to_seq=to_seq):
        if since is not None and m.time is not None and m.time < since:
            continue
        kept.append(m)
    for m in kept:
        await queue.put(m)
    return to_seq + 1
