"""The format "4" profile (draft-mih-scitt-agent-action-capsule-05) behind :mod:`consumers.profiles`.

Capsules are built by :mod:`consumers.capsule_v4` and verified by
:mod:`consumers.verify_v4`. A format-4 statement is not the format-2 shape
(COSE_Sign1 over the capsule JSON) but a registration statement over the raw
capsule_id ({#envelope}, {#registration}), so the signer signs it through
:func:`consumers.capsule_v4.statement` and links it outside the capsule (see
:mod:`consumers.signer`), and :mod:`consumers.verifier` sends it to
:func:`consumers.verify_v4.verify_v4` on its content type. The hooks here
serve the profile registry; ``verify_payload`` covers the one case that still
reaches it: a COSE_Sign1 whose payload is a format-4 capsule JSON, which the
draft does not define (its payload must be the raw 32-byte capsule_id).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

from consumers import capsule_v4 as v4
from consumers import verify_v4
from consumers.profiles import Profile
from subjects.wire import Verdict


def build(v: Verdict, *, chained: bool = True, **kw: Any) -> v4.Built4:
    """The format-4 capsule; ``chained`` is the format-2 ledger flag (the ledger is outside the capsule here)."""
    return v4.from_verdict(v, **kw)


def link(built: v4.Built4, ledger: Any, parent_capsule_id: str | None = None) -> tuple[Any, bytes]:
    """(linked, payload): the ledger stays outside a format-4 capsule, so only a late parent changes it."""
    linked = v4.with_parent(built, parent_capsule_id)
    return SimpleNamespace(capsule_id=linked.capsule_id, chain=linked.chain), linked.payload


def content_type(payload: Mapping[str, Any]) -> str:
    return v4.ID_MEDIA_TYPE


def verify_payload(payload: dict[str, Any], *, msg: Any, store: Any, anchored: bool,
                   add: Callable[..., None]) -> dict[str, str] | None:
    """A format-4 capsule signed as a JSON payload: Class 1 runs, and the envelope form is refused."""
    add(0, "statement_payload_invalid",
        "a format \"4\" statement signs the raw 32-byte capsule_id with content type "
        f"{v4.ID_MEDIA_TYPE} (draft -05 {{#envelope}}), not the capsule JSON")
    res = SimpleNamespace(verdict_class=None, profile=v4.FORMAT, assurance=None, effect_grade=None)
    verify_v4.check_capsule(payload, SimpleNamespace(add=add), res, store=store, anchored=anchored)
    return res.assurance


PROFILE = Profile(
    format_version=v4.FORMAT,
    label=f"format 4 ({v4.SPEC_VERSION})",
    build=build,
    link=link,
    claims=v4.claims_for,
    content_type=content_type,
    verify_payload=verify_payload,
    outcomes=False,
)
