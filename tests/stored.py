"""Reading back what a stream stored, for assertions (direct gets by sequence, no consumer)."""

from __future__ import annotations

from typing import Any

import msgspec


async def stored_msgs(nc: Any, stream: str, subject: str | None = None) -> list[Any]:
    """Every message still stored in ``stream`` (optionally on one subject), oldest first.

    ``nc`` may be a connection or a JetStream context.
    """
    js = nc.jetstream() if hasattr(nc, "jetstream") else nc
    state = (await js.stream_info(stream)).state
    out = []
    for seq in range(state.first_seq or 1, (state.last_seq or 0) + 1):
        try:
            m = await js.get_msg(stream, seq)
        except Exception:  # noqa: BLE001 - deleted (work-queue or limits)
            continue
        if subject is None or m.subject == subject:
            out.append(m)
    return out


async def stored_json(nc: Any, stream: str, subject: str | None = None) -> list[Any]:
    """The stored bodies of ``stream`` decoded as JSON."""
    return [msgspec.json.decode(m.data) for m in await stored_msgs(nc, stream, subject)]
