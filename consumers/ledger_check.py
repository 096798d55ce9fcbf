"""The signer's store-level hash chain (``PGW_SIGNER_LEDGER``), checked on its own.

A format "4" capsule carries no ledger linkage (draft -05 {#assurance} derives
``chained`` from the ``chain`` block alone, and the capsule_id covers every
member), so what detects a removed, reordered or altered capsule is the
signer's ledger: position *n* commits to the capsule_id signed at *n*, its
supersedes block and the hash of link *n-1*
(:func:`consumers.capsule.ledger_entry_hash`), and stores the exact payload
signed. :func:`check_ledger` walks the links in stream order and
:func:`missing_from` names ledger capsules a set of statements lacks.
Format "2" entries are checked the same way (their payload's id by the
format-2 rule). Never raises.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import msgspec

from consumers import capsule as capm
from consumers import capsule_v4 as v4
from pgwcore.atomic import not_written_by_us


class LedgerIssue(msgspec.Struct, omit_defaults=True):
    position: int
    code: str
    message: str


class LedgerReport(msgspec.Struct, omit_defaults=True):
    ok: bool
    links: int
    issues: list[LedgerIssue] = msgspec.field(default_factory=list)
    capsule_ids: list[str] = msgspec.field(default_factory=list)  # in ledger order
    positions: list[int] = msgspec.field(default_factory=list)  # each capsule's position, as capsule_ids
    # Positions of the server's answers a party aimed at the ledger's subjects (docs/security.md "Replies";
    # pgwcore.atomic.not_written_by_us: acknowledgements, refusals, JetStream API answers, an empty status
    # answer): no link, and the links around one still chain onto each other, so it hides nothing; listed,
    # not an issue. Any other record that is no link is one.
    foreign: list[int] = msgspec.field(default_factory=list)


def _payload_id(payload: dict[str, Any]) -> str:
    if payload.get("format_version") == v4.FORMAT:
        return v4.compute_capsule_id(payload)
    return capm.compute_capsule_id(payload)


def check_ledger(raw_entries: Iterable[bytes]) -> LedgerReport:
    """Walk the ledger's messages in stream order: positions 1..n, each link hashed onto the one before."""
    issues: list[LedgerIssue] = []
    ids: list[str] = []
    positions: list[int] = []
    prev = capm.GENESIS_HASH
    n = 0
    foreign: list[int] = []
    for n, raw in enumerate(raw_entries, start=1):
        if not_written_by_us(raw):
            foreign.append(n)  # the next link must still chain onto the last one before it
            continue
        try:
            e = msgspec.json.decode(raw)
            payload = json.loads(e["payload"])
            chain = payload.get("chain") if isinstance(payload.get("chain"), dict) else None
            if e["position"] != n:
                issues.append(LedgerIssue(n, "ledger_position_gap", f"link {n} says position {e['position']}"))
            if e["prev_hash"] != prev:
                issues.append(LedgerIssue(n, "ledger_link_broken", "prev_hash is not the hash of the link before"))
            if capm.ledger_entry_hash(e["position"], e["capsule_id"], chain, e["prev_hash"]) != e["hash"]:
                issues.append(LedgerIssue(n, "ledger_hash_mismatch", "the link's hash does not recompute"))
            if _payload_id(payload) != e["capsule_id"] or payload.get("capsule_id") != e["capsule_id"]:
                issues.append(LedgerIssue(n, "ledger_payload_mismatch", "the stored payload is not the capsule listed"))
            ids.append(e["capsule_id"])
            positions.append(n)
            prev = e["hash"]
        except Exception as exc:  # noqa: BLE001 - a verifier reports, never throws
            issues.append(LedgerIssue(n, "ledger_entry_malformed", f"{type(exc).__name__}: {exc}"))
    return LedgerReport(ok=not issues, links=n - len(foreign), issues=issues, capsule_ids=ids, positions=positions,
                        foreign=foreign)


def missing_from(report: LedgerReport, present: Iterable[str]) -> list[str]:
    """Capsule ids the ledger lists that the given set of statements lacks (a removed capsule)."""
    have = set(present)
    return [c for c in report.capsule_ids if c not in have]
