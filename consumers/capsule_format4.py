"""The format "4" profile (the current drafts, draft-mih-scitt-agent-action-capsule-05) for the signer.

Built by :mod:`consumers.capsule_v4` and verified by :mod:`consumers.verify_v4`
(the verifier dispatches on the statement's content type, see
:mod:`consumers.verifier`); this module only plugs them into the signer's
profile hooks (:mod:`consumers.profiles`). The signer's hash chain stays in
its store-level ledger, outside the capsule ({#assurance}: ``ledger_mode`` is
derived from the chain block alone), so ``link`` ignores the ledger linkage
and only adds a supersedes parent known at linking.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import msgspec

from consumers import capsule as capm
from consumers import capsule_outcome as outm
from consumers import capsule_v4, verify_v4
from consumers.profiles import Profile
from subjects.wire import Verdict


def build(v: Verdict, **kw: Any) -> capsule_v4.Built4:
    if outm.is_outcome_verdict(v):
        # {#outcomes}: under -05 an outcome is a new Capsule; the -01 outcome statement type and
        # media type are not defined for format 4 ({#media-types} registers neither).
        return capsule_v4.outcome_from_verdict(v, **kw)
    return capsule_v4.from_verdict(v, **kw)


def link(built: capsule_v4.Built4 | outm.OutcomeBuilt, ledger: capm.Ledger,
         parent_capsule_id: str | None = None) -> tuple[Any, bytes]:
    # The hash chain is store-level only in format 4 (PGW_SIGNER_LEDGER), never in a statement.
    if isinstance(built, outm.OutcomeBuilt):
        return outm.link_outcome(built, ledger, parent_capsule_id, embed_ledger=False)
    b4 = capsule_v4.with_parent(built, parent_capsule_id)
    return b4, b4.payload


def sign(payload_json: bytes, payload: Mapping[str, Any] | None, key: Any) -> bytes:
    # The id is read from the bytes signed: a body built before linking may predate its chain
    # block, so ``payload`` is used only when it was decoded from ``payload_json`` (else None).
    body = payload if payload is not None else msgspec.json.decode(payload_json)
    return capsule_v4.statement(body, payload_json, key.private, key.kid)


def verify_payload(payload: dict[str, Any], *, msg: Any, store: Any, anchored: bool,
                   add: Callable[..., None]) -> dict[str, str] | None:
    """A format-4 capsule signed as a JSON payload (the format-2 shape): the envelope form is refused.

    Draft -05 {#envelope}: the statement's payload is the raw 32-byte capsule_id with content type
    application/agent-action-capsule-id. Class 1 still runs over the capsule, so the result says what
    else is wrong with it.
    """
    del msg
    add(0, "statement_payload_invalid",
        "a format \"4\" statement signs the raw 32-byte capsule_id with content type "
        f"{capsule_v4.ID_MEDIA_TYPE} (draft -05 {{#envelope}}), not the capsule JSON")
    res = SimpleNamespace(verdict_class=None, profile=capsule_v4.FORMAT, assurance=None, effect_grade=None)
    verify_v4.check_capsule(payload, SimpleNamespace(add=add), res, store=store, anchored=anchored)
    return res.assurance


PROFILE = Profile(
    format_version=capsule_v4.FORMAT,
    label=f"format 4 ({capsule_v4.DRAFT})",
    build=build,
    link=link,
    claims=capsule_v4.claims_for,
    content_type=lambda _payload: capsule_v4.ID_MEDIA_TYPE,
    # A statement over the raw capsule_id goes to consumers.verify_v4 on its content type; this
    # hook sees a COSE_Sign1 over a JSON payload naming format 4 (see verify_payload).
    verify_payload=verify_payload,
    outcomes=True,
    sign=sign,
)
