"""The cheaper parse of received header blocks (pgwcore.headerparse) gives nats-py's own dicts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from pgwcore.connect import connect
from pgwcore.headerparse import parse_header_lines
from pgwcore.server import EmbeddedServer

NAMES = st.sampled_from(["Nats-Msg-Id", "Pgw-Moment-State", "traceparent", "X", "a-b-", "-", "", " Key", "Key ",
                         "Ke y", "K\x1ce", "Kéy", "K\x85", "Ke\ty", "key\x0b", "9", "Nats_Stream", "K:ey"])
VALUES = st.sampled_from(["", " v ", "v", "pending 1.5 0", "é", "a: b", "\t x\x0b", "\xff"])
RAW_LINE = st.binary(max_size=24)


def _line(name: str, value: str) -> bytes:
    return name.encode("utf-8") + b":" + value.encode("utf-8")


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.tuples(NAMES, VALUES).map(lambda nv: _line(*nv)) | RAW_LINE
                | st.text(max_size=12).map(lambda t: t.encode("utf-8", "surrogatepass")), max_size=8),
       st.sampled_from([b"\r\n", b"\r\n\r\n", b""]))
def test_header_lines_parse_as_nats_py_parses_them(lines: list[bytes], end: bytes) -> None:
    """Any header block, malformed names and values included, gives the dict nats-py's parser gives."""
    raw = b"\r\n".join(lines) + end
    assert parse_header_lines(raw) == Client._parse_header_lines(raw)


def test_skipped_names_stay_skipped() -> None:
    """A name with inner whitespace or non-ASCII bytes is dropped; outer blanks are trimmed, as nats-py does."""
    raw = b"Ke y: 1\r\nK\xc3\xa9y: 2\r\n Pad : 3\r\nNats-Msg-Id: m:1 \r\nno colon\r\n\r\n"
    assert parse_header_lines(raw) == {"Pad": "3", "Nats-Msg-Id": "m:1"} == Client._parse_header_lines(raw)


async def test_a_connection_receives_headers_through_the_cheaper_parse(nats_server: EmbeddedServer) -> None:
    """A pgw connection uses the cheaper parse and delivers a message's headers as published."""
    nc = await connect(nats_server.client_url, name="pgw-test-headers")
    try:
        assert nc._parse_header_lines is parse_header_lines
        sub = await nc.subscribe("test.headerparse")
        await nc.publish("test.headerparse", b"x", headers={"Nats-Msg-Id": "a-1", "Pgw-Principal": "alice"})
        msg = await sub.next_msg(timeout=5)
        assert msg.headers == {"Nats-Msg-Id": "a-1", "Pgw-Principal": "alice"}
    finally:
        await nc.close()
