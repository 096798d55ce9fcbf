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


class Headers(dict[str, str]):
    """The parsed headers of a message whose header block held lines the parse does not keep (no name, a
    name that is not ASCII or holds white space, the first of two equal names): ``dropped`` is those lines
    as sent. They are in the message's bytes all the same, so what is judged of its bytes (a secret kept at
    rest, ``gateway/at_rest.py``) judges them too."""

    dropped: bytes = b""


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """``Client._parse_header_lines(raw)``: ``Name: Value`` per line, same skips, same decoding (a
    :class:`Headers` naming the lines it does not keep, where there are any)."""
    out: dict[str, str] = {}
    dropped: list[bytes] = []
    for line in raw.split(_CRLF):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            dropped.append(line)
            continue
        if name.replace(b"-", b"").isalnum():  # ASCII letters, digits and hyphens only: nothing to strip or skip
            key = name.decode("ascii")
        else:
            try:
                key = name.strip().decode("ascii")
            except UnicodeDecodeError:
                dropped.append(line)
                continue
            if any(c.isspace() for c in key):
                dropped.append(line)
                continue
        if key in out:  # the later line wins: the earlier one is in the bytes only
            dropped.append(f"{key}: {out[key]}".encode())
        out[key] = value.strip().decode("utf-8", "replace")
    if not dropped:
        return out
    headers = Headers(out)
    headers.dropped = b"\r\n".join(dropped)
    return headers


def install(nc: Client) -> Client:
    """``nc`` parses the headers it receives with :func:`parse_header_lines`; returns ``nc``."""
    nc._parse_header_lines = parse_header_lines  # type: ignore[method-assign]
    return nc
