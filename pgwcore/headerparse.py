"""nats-py's parse of a received message's header block, at a fraction of its cost.

nats-py 2.16's ``Client._parse_header_lines`` checks every header name for
whitespace with a generator over its characters: about 9 us for the eight
headers of a headers-only delivery (the stream's own ``Nats-*`` headers and
the writer's), a sizeable share of what a watcher pays per message.
:func:`parse_header_lines` returns the same dict (``tests/test_headerparse.py``
holds it to nats-py's own, on any bytes): a name made only of ASCII letters,
digits and hyphens, which holds no whitespace and decodes as ASCII, skips
both checks; any other name takes nats-py's steps. :func:`install` sets it on
one connection (an instance attribute: nats-py calls it through ``self``).
"""

from __future__ import annotations

from nats.aio.client import Client

_CRLF = b"\r\n"


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """``Client._parse_header_lines(raw)``: ``Name: Value`` per line, same skips, same decoding."""
    out: dict[str, str] = {}
    for line in raw.split(_CRLF):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        if name.replace(b"-", b"").isalnum():  # ASCII letters, digits and hyphens only: nothing to strip or skip
            key = name.decode("ascii")
        else:
            try:
                key = name.strip().decode("ascii")
            except UnicodeDecodeError:
                continue
            if any(c.isspace() for c in key):
                continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out


def install(nc: Client) -> Client:
    """``nc`` parses the headers it receives with :func:`parse_header_lines`; returns ``nc``."""
    nc._parse_header_lines = parse_header_lines  # type: ignore[method-assign]
    return nc
