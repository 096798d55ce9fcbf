"""``pgw tail SUBJECT`` (issue 8 "Ops"): a pretty live view of any subject, redacted."""

from __future__ import annotations

import asyncio
import io
import json

from consumers.tail import REDACTED, string_redactor, tail


async def _run_tail(nc, subject: str, publish, **kw) -> str:
    out = io.StringIO()
    started = asyncio.Event()
    task = asyncio.create_task(tail(nc, subject, out=out, started=started, **kw))
    await asyncio.wait_for(started.wait(), 5)
    await publish()
    await asyncio.wait_for(task, 5)
    return out.getvalue()


async def test_secret_tokens_are_redacted_at_any_depth(nc) -> None:
    """A secret:-prefixed token nested deep in the body never reaches the ops terminal."""
    body = {"a": [{"b": {"c": "token is secret:hunter2 ok"}}], "secret:key": 1}

    async def pub() -> None:
        await nc.publish("ops.t1", json.dumps(body).encode(), headers={"traceparent": "00-ab-cd-01"})

    text = await _run_tail(nc, "ops.t1", pub, count=1)
    assert "hunter2" not in text and "secret:" not in text
    assert REDACTED in text
    assert "traceparent=00-ab-cd-01" in text and "ops.t1" in text


async def test_configured_secrets_are_redacted(nc) -> None:
    """A configured literal secret is replaced wherever it appears in a string."""

    async def pub() -> None:
        await nc.publish("ops.t2", json.dumps({"msg": "key=AKIAXYZ123 done"}).encode())

    text = await _run_tail(nc, "ops.t2", pub, count=1, redact=string_redactor(["AKIAXYZ123"]))
    assert "AKIAXYZ123" not in text and REDACTED in text


async def test_binary_bodies_are_summarised_not_shown(nc) -> None:
    """A binary (COSE) body is shown as its size and digest, never raw."""

    async def pub() -> None:
        await nc.publish("ops.t3", b"\xd2\x84\xff\xfe secret:abc")

    text = await _run_tail(nc, "ops.t3", pub, count=1, fmt="json")
    line = json.loads(text.strip())
    assert line["body"] is None and line["note"].startswith("binary, 15 bytes")


async def test_history_then_live_from_the_stream(nc) -> None:
    """--all shows what the stream already holds before live messages, in order."""
    js = nc.jetstream()
    for i in range(3):
        await js.publish("pgw.verdict.blocked", json.dumps({"n": i}).encode(), headers={"Nats-Msg-Id": f"v{i}"})

    async def pub() -> None:
        await js.publish("pgw.verdict.blocked", b'{"n": 3}', headers={"Nats-Msg-Id": "v3"})

    text = await _run_tail(nc, "pgw.verdict.*", pub, count=4, history="all", fmt="json")
    lines = [json.loads(x) for x in text.strip().splitlines()]
    assert [x["body"]["n"] for x in lines] == [0, 1, 2, 3]
    assert [x["seq"] for x in lines] == [1, 2, 3, 4]


async def test_last_n_from_the_stream(nc) -> None:
    """--last 2 starts with the last two stored messages of the subject."""
    js = nc.jetstream()
    for i in range(5):
        await js.publish("pgw.verdict.denied", json.dumps({"n": i}).encode(), headers={"Nats-Msg-Id": f"d{i}"})

    async def pub() -> None:
        pass

    text = await _run_tail(nc, "pgw.verdict.denied", pub, count=2, last=2, fmt="json")
    assert [json.loads(x)["body"]["n"] for x in text.strip().splitlines()] == [3, 4]


async def test_stop_event_ends_the_tail(nc) -> None:
    """Setting the stop event (Ctrl-C) ends the tail cleanly with the count shown."""
    stop = asyncio.Event()
    started = asyncio.Event()
    task = asyncio.create_task(tail(nc, "ops.none", out=io.StringIO(), stop=stop, started=started))
    await asyncio.wait_for(started.wait(), 5)
    stop.set()
    assert await asyncio.wait_for(task, 5) == 0
