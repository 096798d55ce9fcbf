"""The event-log checkpoint on the bus: a signed anchor of the kernel's log head (spec 003 §8.2).

The kernel signs and publishes it (``gateway/kernel/checkpoint.py``, stream
``PGW_CHECKPOINTS``); the signer wraps it as a statement for the
transparency service and ``pgw verify`` checks it (``consumers/``). It is a
wire type like the others here, so the consumers read it from the contract
rather than from the gateway that produces it.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

from subjects import jcs

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

CHECKPOINT_STREAM = "PGW_CHECKPOINTS"
STATEMENT_TYPE = "pgw.eventlog.checkpoint/1"


class Checkpoint(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One anchored head: the event at ``seq`` of ``stream`` has digest ``digest``."""

    type: str = STATEMENT_TYPE
    stream: str
    seq: int
    digest: str
    ts: str
    kid: str
    sig: str = ""

    def signing_bytes(self) -> bytes:
        d = msgspec.to_builtins(self)
        del d["sig"]
        return jcs.dumps(d)

    def verify(self, keys: Mapping[str, Ed25519PublicKey]) -> str | None:
        """None if signed by one of ``keys``, else what is wrong."""
        key = keys.get(self.kid)
        if key is None:
            return f"checkpoint signed with unknown kid {self.kid!r}"
        from cryptography.exceptions import InvalidSignature  # the bus contract needs it only here

        try:
            key.verify(base64.urlsafe_b64decode(self.sig + "=" * (-len(self.sig) % 4)), self.signing_bytes())
        except (InvalidSignature, ValueError):
            return "checkpoint signature does not verify"
        return None


def checkpoint_subject(prefix: str) -> str:
    return f"{prefix}.checkpoint.eventlog"
