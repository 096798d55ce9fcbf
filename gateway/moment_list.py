"""The agent's list of its own moments (the list form of ``agent.{agent}.moment``, subjects/momentquery.py).

The moment records (KV ``PGW_MOMENTS``) are keyed by principal, so an agent's
moments are found through an index. The index costs no write of its own: every
desk write of a record carries the header ``Pgw-Moment-Agent``
(``{created ms};{agent}``, gateway.moment_record), every gateway instance
already follows the bucket headers-only (gateway.moments), and each builds the
index from what it follows (:class:`AgentIndex`), from the latest write of every
key at start and each write as it is stored. It is rebuilt the same after a
restart or a kill -9, on every instance, because it is a function of the
bucket's contents alone.

A list query first waits (3 s at most) until the instance has followed the bucket up to its
last sequence at the time of the query (``MomentDesk.caught_up``), so a moment
whose ``accepted`` outcome the agent has read is listed by any instance, as
when the index was a synced write made before the outcome. It then takes the
agent's keys, sorts them newest first by creation time, and reads the moment
records in that order until it has ``limit`` moments of the kind asked for. It
reads at most ``SCAN_LIMIT`` records, so a hostile agent cannot make one query
cost more than that; an open moment older than the agent's ``SCAN_LIMIT``
newest is not listed then (``more`` is set), though ``await_moment`` of its id
still finds it.

Data written before: the KV bucket ``PGW_AGENT_MOMENTS`` (one key per moment,
``{agent}.{created_ms}.{principal}.{moment_id}``) was the index the desk wrote,
a synced write per moment, until the index was derived. It is no longer
written, and still read: its keys are merged with the derived ones (one
``stream_info`` as before), so moments opened by the previous version (whose
records carry no ``Pgw-Moment-Agent``) are listed until they expire (30 days).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Protocol

from pgwcore.kvread import kv_keys
from subjects.momentquery import DEFAULT_LIST_LIMIT, ListWhich, MomentSummary
from subjects.util import to_rfc3339
from subjects.wire import BindingMomentItem, ClarificationItem

if TYPE_CHECKING:
    from gateway.moment_record import MomentRecord


class _Desk(Protocol):
    """What a list query needs of the moment desk (gateway.moments imports this module, not the reverse)."""

    js: Any

    agents: AgentIndex

    async def get(self, principal: str, moment_id: str) -> tuple[MomentRecord, int] | None: ...

    async def caught_up(self) -> bool: ...

INDEX_BUCKET = "PGW_AGENT_MOMENTS"  # the index as the previous version wrote it: read, no longer written
SCAN_LIMIT = 512  # moment records one list query reads at most
_BATCH = 32  # records read concurrently
SYNOPSIS_CHARS = 200
INDEX_TTL_S = 30 * 86400.0  # as long as the records (gateway.moments.MOMENT_TTL_S); the old keys' TTL


def index_key(rec: MomentRecord) -> str:
    """The moment's key in the old index bucket: agent, creation time (ms, fixed width), principal, moment id."""
    return f"{rec.agent}.{int(rec.created_at * 1000):015d}.{rec.principal}.{rec.moment_id}"


class AgentIndex:
    """Each agent's moments, derived from the desk's writes (the module docstring); in memory, bounded.

    Per (agent, principal) it keeps the newest ``SCAN_LIMIT`` moments (trimmed
    back to that when it holds twice as many), which is all a list query reads:
    the agent's ``SCAN_LIMIT`` newest are among the union of its principals'
    ``SCAN_LIMIT`` newest. A trimmed (agent, principal) answers ``more``, as
    the old index did for an agent with more than ``SCAN_LIMIT`` keys.
    """

    def __init__(self) -> None:
        self._moments: dict[str, dict[str, dict[str, int]]] = {}  # agent -> principal -> moment_id -> created ms
        self._trimmed: set[tuple[str, str]] = set()

    def add(self, agent: str, created_ms: int, principal: str, moment_id: str) -> None:
        mine = self._moments.setdefault(agent, {}).setdefault(principal, {})
        mine[moment_id] = created_ms
        if len(mine) > 2 * SCAN_LIMIT:
            keep = sorted(mine.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)[:SCAN_LIMIT]
            mine.clear()
            mine.update(keep)
            self._trimmed.add((agent, principal))

    def keys(self, agent: str, principal: str | None, now: float) -> tuple[list[tuple[str, str, str]], bool]:
        """(created ms fixed width, principal, moment_id) of ``agent``'s moments not past their TTL; and whether trimmed."""
        oldest = int((now - INDEX_TTL_S) * 1000)
        out: list[tuple[str, str, str]] = []
        trimmed = False
        for p, moments in self._moments.get(agent, {}).items():
            if principal is not None and p != principal:
                continue
            trimmed = trimmed or (agent, p) in self._trimmed
            out.extend((f"{ms:015d}", p, mid) for mid, ms in moments.items() if ms >= oldest)
        return out, trimmed


async def _legacy_keys(js: Any, agent: str, principal: str | None) -> list[tuple[str, str, str]]:
    """The agent's keys in the old index bucket (written by the previous version); none when it is absent."""
    keys = []
    for key in await kv_keys(js, INDEX_BUCKET, f"{agent}.*.*.*"):
        parts = key.split(".")
        if len(parts) == 4 and parts[0] == agent and (principal is None or parts[2] == principal):
            keys.append((parts[1], parts[2], parts[3]))
    return keys


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
    if not await desk.caught_up():
        raise TimeoutError("the moment desk has not followed PGW_MOMENTS up to now")
    derived, trimmed = desk.agents.keys(agent, principal, time.time())
    legacy = await _legacy_keys(desk.js, agent, principal)
    # (created_ms, principal, moment_id); a moment in both indexes is listed once.
    keys = sorted(set(derived) | set(legacy), reverse=True)  # fixed-width times: newest first
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
    return found, len(keys) > SCAN_LIMIT or trimmed


__all__ = ["INDEX_BUCKET", "SCAN_LIMIT", "AgentIndex", "index_key", "list_moments", "summary_of"]
