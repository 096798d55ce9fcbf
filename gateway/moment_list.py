"""The agent's list of its own moments (the list form of ``agent.{agent}.moment``, subjects/momentquery.py).

The moment records (KV ``PGW_MOMENTS``) are keyed by principal, so an agent's
moments are found through an index: the KV bucket ``PGW_AGENT_MOMENTS``, one
key per moment, ``{agent}.{created_ms}.{principal}.{moment_id}``, written by
the desk when it opens the moment (idempotent: a redelivered envelope finds
the record and so the same key) and kept as long as the records (30 days).

A list query takes the agent's keys from the server's per-subject index of
the bucket's stream (no value is read), sorts them newest first by the time
in the key, and reads the moment records in that order until it has
``limit`` moments of the kind asked for. It reads at most ``SCAN_LIMIT``
records, so a hostile agent cannot make one query cost more than that; an
open moment older than the agent's ``SCAN_LIMIT`` newest is not listed then
(``more`` is set), though ``await_moment`` of its id still finds it.
Moments opened before this index existed are not listed either.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from subjects.momentquery import DEFAULT_LIST_LIMIT, ListWhich, MomentSummary
from subjects.util import to_rfc3339
from subjects.wire import BindingMomentItem, ClarificationItem

if TYPE_CHECKING:
    from gateway.moment_record import MomentRecord


class _Desk(Protocol):
    """What a list query needs of the moment desk (gateway.moments imports this module, not the reverse)."""

    js: Any

    async def get(self, principal: str, moment_id: str) -> tuple[MomentRecord, int] | None: ...

INDEX_BUCKET = "PGW_AGENT_MOMENTS"
_PRE = f"$KV.{INDEX_BUCKET}."
SCAN_LIMIT = 512  # moment records one list query reads at most
_BATCH = 32  # records read concurrently
SYNOPSIS_CHARS = 200


def index_key(rec: MomentRecord) -> str:
    """The moment's key in the agent's index: agent, creation time (ms, fixed width), principal, moment id."""
    return f"{rec.agent}.{int(rec.created_at * 1000):015d}.{rec.principal}.{rec.moment_id}"


def summary_of(rec: MomentRecord) -> MomentSummary:
    item = rec.item
    if isinstance(item, BindingMomentItem):
        kind = "hem" if rec.hem else "binding_moment"
        synopsis: str | None = item.binding_moment.synopsis
    else:
        kind = "clarification"
        synopsis = item.questions[0].question if isinstance(item, ClarificationItem) and item.questions else None
    return MomentSummary(
        moment_id=rec.moment_id,
        principal=rec.principal,
        kind=kind,  # type: ignore[arg-type]
        status=rec.status,
        created_at=to_rfc3339(rec.created_at),
        correlation_id=rec.correlation_id,
        synopsis=synopsis[:SYNOPSIS_CHARS] if synopsis else None,
        expires_at=to_rfc3339(rec.expires_at) if rec.expires_at else None,
        closed_at=to_rfc3339(rec.resolved_at) if rec.status != "pending" and rec.resolved_at else None,
    )


def _wanted(rec: MomentRecord, which: ListWhich) -> bool:
    if which == "open":
        return rec.status == "pending"
    if which == "closed":
        return rec.status != "pending"
    return True


async def list_moments(
    desk: _Desk, agent: str, which: ListWhich, *, limit: int | None = None, principal: str | None = None
) -> tuple[list[MomentSummary], bool]:
    """``agent``'s moments of kind ``which``, newest first, at most ``limit``; and whether there are more."""
    limit = limit or DEFAULT_LIST_LIMIT
    info = await desk.js.stream_info(f"KV_{INDEX_BUCKET}", subjects_filter=f"{_PRE}{agent}.*.*.*")
    keys: list[tuple[str, str, str]] = []  # (created_ms, principal, moment_id)
    for subject in info.state.subjects or {}:
        parts = subject[len(_PRE):].split(".")
        if len(parts) == 4 and parts[0] == agent and (principal is None or parts[2] == principal):
            keys.append((parts[1], parts[2], parts[3]))
    keys.sort(reverse=True)  # fixed-width times: newest first
    found: list[MomentSummary] = []
    scanned = keys[:SCAN_LIMIT]
    for start in range(0, len(scanned), _BATCH):
        batch = scanned[start:start + _BATCH]
        records = await asyncio.gather(*(desk.get(p, mid) for _, p, mid in batch))
        for got in records:
            if got is None:
                continue  # expired from the desk, or not written yet
            rec = got[0]
            if rec.agent == agent and _wanted(rec, which):
                found.append(summary_of(rec))
        if len(found) > limit:
            return found[:limit], True
    return found, len(keys) > SCAN_LIMIT


__all__ = ["INDEX_BUCKET", "SCAN_LIMIT", "index_key", "list_moments", "summary_of"]
