"""Capsule profiles: which serialization suite the signer writes and the verifier reads.

Two profiles of the Agent Action Capsule exist in the wild:

- format ``"2"``: spec 004 as in ``../shared/specs`` (draft-mih-scitt-agent-action-capsule-01),
  verified by the reference ``agent-action-capsule`` 0.1.0; built by
  :mod:`consumers.capsule` (agent actions) and :mod:`consumers.capsule_outcome`
  (outcome statements, §3.3);
- format ``"4"``: the current drafts, verified by ``agent-action-capsule`` 0.3 and
  later; built and verified by the module named in :data:`MODULES`.

The signer signs through the profile that ``signer.capsule_format`` names
(:func:`profile`); a statement already recorded in the ledger is re-signed
through the profile its own payload names (:func:`profile_of`), so switching
the setting never changes a capsule that exists. The verifier dispatches each
statement on its own ``format_version`` (see :mod:`consumers.verifier`).

A profile module exposes ``PROFILE``, a :class:`Profile`. Its hooks:

``build(verdict, *, operator, salt, default_developer, authority, parent_capsule_id, chained, fallback_ts)``
    the capsule of one verdict, not yet linked into the signer's ledger, as a
    :class:`consumers.capsule.Built` (or anything with ``.capsule.capsule_id``,
    ``.capsule.chain``, ``.body`` and ``.flags`` that ``link`` accepts);
``link(built, ledger, parent_capsule_id)``
    ``(linked capsule, payload bytes to sign)``: the ledger linkage added, the
    capsule_id derived as the profile defines it;
``claims(payload)`` / ``content_type(payload)``
    the CWT claims (label 15) and the COSE content type of the statement;
``outcomes``
    whether ``build`` also takes the outcome verdicts of §3.3 (when False,
    the signer emits no outcome statements under this profile);
``sign(payload_json, payload, key)``
    optional: the statement bytes, where the profile's statement is not a
    COSE_Sign1 over the payload (format 4 signs a capsule-id registration
    statement that carries the capsule beside it);
``verify_payload(payload, *, msg, store, anchored, add)``
    the profile's Class 1 checks after the common COSE substrate checks;
    reports through ``add(check, code, message, severity="error", path=None)``
    and returns the rederived assurance dict (or None).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from subjects.errors import PgwError

FORMATS = ("2", "4")
DEFAULT_FORMAT = "4"  # pgwcore.config SignerConfig.capsule_format: the newest reference verifier's profile
# The module that defines each profile's PROFILE (imported on first use).
MODULES = {"2": "consumers.capsule_format2", "4": "consumers.capsule_format4"}


class ProfileError(PgwError):
    """A capsule format that this installation cannot build or verify."""

    def __init__(self, fmt: str, why: str) -> None:
        self.format = fmt
        self.why = why
        super().__init__(f"capsule format {fmt!r}: {why}")


@dataclass(frozen=True)
class Profile:
    format_version: str
    label: str  # what `pgw verify` prints, e.g. "format 2 (draft-mih-scitt-agent-action-capsule-01)"
    build: Callable[..., Any]
    link: Callable[..., tuple[Any, bytes]]
    claims: Callable[[Mapping[str, Any]], dict[Any, Any]]
    content_type: Callable[[Mapping[str, Any]], str]
    verify_payload: Callable[..., dict[str, str] | None] | None = None
    outcomes: bool = False  # build() takes outcome verdicts (consumers.capsule_outcome.companion)
    # sign(payload_json, payload, key) -> statement bytes, where the statement is not the default
    # COSE_Sign1 over the payload with claims(payload) and content_type(payload). ``payload`` is
    # the decoded payload_json, or None where the caller has only a body that may predate linking.
    sign: Callable[[bytes, Mapping[str, Any] | None, Any], bytes] | None = None


_loaded: dict[str, Profile] = {}


def profile(fmt: str) -> Profile:
    """The profile of capsule format ``fmt``; ProfileError if it is unknown or not installed."""
    got = _loaded.get(fmt)
    if got is not None:
        return got
    name = MODULES.get(fmt)
    if name is None:
        raise ProfileError(fmt, f"unknown; the formats are {', '.join(FORMATS)}")
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        raise ProfileError(fmt, f"its module {name} is not part of this installation") from None
    prof = getattr(mod, "PROFILE", None)
    if not isinstance(prof, Profile) or prof.format_version != fmt:
        raise ProfileError(fmt, f"{name} defines no PROFILE for format {fmt}")
    _loaded[fmt] = prof
    return prof


def profile_of(payload: Mapping[str, Any]) -> Profile:
    """The profile a stored payload was built with (its own ``format_version``)."""
    fmt = payload.get("format_version")
    if not isinstance(fmt, str):
        raise ProfileError(repr(fmt), "the payload names no format_version")
    return profile(fmt)
