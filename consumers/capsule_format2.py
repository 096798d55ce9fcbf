"""The format "2" profile (spec 004 as in ../shared/specs, draft -01): agent-action capsules and outcomes.

Agent actions are built by :mod:`consumers.capsule`, outcome statements
(§3.3) by :mod:`consumers.capsule_outcome`; this module routes between them
for the signer (see :mod:`consumers.profiles` for the hooks). Class 1
verification of format "2" is :mod:`consumers.verifier` itself, so
``verify_payload`` is None here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from consumers import capsule as capm
from consumers import capsule_map
from consumers import capsule_outcome as outm
from consumers.profiles import Profile
from subjects.wire import Verdict


def build(v: Verdict, **kw: Any) -> capm.Built | outm.OutcomeBuilt:
    if outm.is_outcome_verdict(v):
        return outm.build_outcome(v, **kw)
    return capsule_map.capsule_from_verdict_checked(v, **kw)


def link(built: Any, ledger: capm.Ledger, parent_capsule_id: str | None = None) -> tuple[Any, bytes]:
    if isinstance(built, outm.OutcomeBuilt):
        return outm.link_outcome(built, ledger, parent_capsule_id, embed_ledger=False)
    # The ledger linkage stays in PGW_SIGNER_LEDGER, outside the capsule (consumers.capsule.link_built).
    return capm.link_built(built, ledger, parent_capsule_id)


def claims(payload: Mapping[str, Any]) -> dict[Any, Any]:
    """§3.1 CWT claims (label 15); the capsule_* set is closed."""
    if outm.is_outcome(payload):
        return outm.claims(payload)
    return {
        1: payload["developer"],
        2: capm.subject_urn(payload["operator"], payload["action_id"]),
        "capsule_statement_type": "agent_action",
        "capsule_action_type": payload["action_type"],
        "capsule_decision_id": payload.get("decision_id") or payload["action_id"],
    }


def content_type(payload: Mapping[str, Any]) -> str:
    return capm.OUTCOME_MEDIA_TYPE if outm.is_outcome(payload) else capm.MEDIA_TYPE


PROFILE = Profile(
    format_version="2",
    label=f"format 2 ({capm.SPEC_VERSION})",
    build=build,
    link=link,
    claims=claims,
    content_type=content_type,
    verify_payload=None,
    outcomes=True,
)
