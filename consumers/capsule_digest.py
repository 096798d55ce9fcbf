"""JSON-DIGEST and the capsule's content address (spec 004 §2, §5.1), and the capsule error.

Split from ``consumers.capsule`` (issue 18): this is the hashing every capsule
reader and writer shares (the signer, the verifiers, the outcome statements),
apart from the model and its construction rules. ``consumers.capsule``
re-exports every name, so ``capm.json_digest`` and the like keep working.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

import rfc8785

from subjects import jcs
from subjects.errors import PgwError


class CapsuleError(PgwError, ValueError):
    """A capsule would violate a construction rule of spec 004; ``rule`` cites it."""

    def __init__(self, rule: str, why: str) -> None:
        self.rule = rule
        self.why = why
        super().__init__(f"capsule construction refused ({rule}): {why}")


# ---------------------------------------------------------------------------
# JSON-DIGEST (§2): HEX(SHA-256(JCS(normalize(v))))
# ---------------------------------------------------------------------------


def normalize(value: Any) -> Any:
    """Absent-field normalization (§2): drop null, [] and {} members, bottom-up.

    Members of objects are removed; array elements are kept in place (an
    array's positions carry meaning) but normalized themselves.
    """
    return jcs.walk(value, drop_absent=True)[0]


def canonical_bytes(value: Any) -> bytes:
    """RFC 8785 (JCS) serialization of ``normalize(value)`` (one walk, see :mod:`subjects.jcs`)."""
    return jcs.normalized_bytes(value)


def digest_of_walked(walked: Any, flags: int) -> str:
    try:
        return hashlib.sha256(jcs.encode(walked, flags)).hexdigest()
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as e:
        raise CapsuleError("§2 JSON-DIGEST", f"value has no JCS form: {e}") from e


def json_digest(value: Any) -> str:
    """JSON-DIGEST (§2). Raises CapsuleError if the value has no JCS form."""
    try:
        return jcs.json_digest(value)
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as e:
        raise CapsuleError("§2 JSON-DIGEST", f"value has no JCS form: {e}") from e


def find_floats(value: Any, path: str = "$") -> list[str]:
    """Paths of every floating-point number in ``value`` (§5.1, §6 check 1)."""
    if isinstance(value, float):
        return [path]
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in find_floats(v, f"{path}.{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in find_floats(v, f"{path}[{i}]")]
    return []


# §5.1: the members left out of the canonical form. A verifier knows the chain linkage only as
# the ``chain`` block, so everything else, this host's ``ledger`` block included, is hashed in.
IDENTITY_EXCLUDED = ("capsule_id", "chain")


def identity_form(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The canonical capsule form (§5.1): the envelope minus capsule_id and the ``chain`` block.

    The signer's hash-chain linkage (``ledger``) is inside the form: it links
    to a predecessor only (never to what later chains to it), so the id stays
    stable once the capsule is linked, and any verifier (the reference one
    included) recomputes the same id.
    """
    return {k: v for k, v in payload.items() if k not in IDENTITY_EXCLUDED}


def compute_capsule_id(payload: Mapping[str, Any]) -> str:
    return json_digest(identity_form(payload))


def ledger_entry_hash(position: int, capsule_id: str, chain: Mapping[str, Any] | None, prev_hash: str) -> str:
    """Hash of one link of the signer's hash chain over what it signed (§5.3 ``chained``).

    The link commits to the capsule's content address, its supersedes block
    (which capsule_id leaves out) and the previous link, so removing,
    reordering or altering a signed capsule breaks every later link.
    """
    if (not chain and type(position) is int and -_MAX_SAFE_INT <= position <= _MAX_SAFE_INT
            and _HEX.fullmatch(capsule_id) and _HEX.fullmatch(prev_hash)):
        # The JCS of the common link written out (the walk drops the empty chain; hex needs no
        # escaping): the same bytes json_digest hashes (tests/test_capsule_model.py), without the walk.
        return hashlib.sha256(
            f'{{"capsule_id":"{capsule_id}","position":{position},"prev_hash":"{prev_hash}"}}'.encode()
        ).hexdigest()
    return json_digest(
        {"position": position, "capsule_id": capsule_id, "chain": dict(chain or {}), "prev_hash": prev_hash}
    )


_HEX = re.compile(r"[0-9a-f]*")
_MAX_SAFE_INT = 2**53 - 1
