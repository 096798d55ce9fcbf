"""Event-log checkpoints as SCITT Signed Statements (issue 20: the head anchored outside the log).

The kernel signs each anchored head of its event log as a ``Checkpoint``
(``gateway/kernel/checkpoint.py``, stream ``PGW_CHECKPOINTS``). The signer
wraps each one in a COSE_Sign1 of its own type and queues it on
``capsule.register``; the registrar registers it with the Transparency
Service like a capsule, so the head is also held by a log this host cannot
rewrite, with a receipt that says so.

The statement is not a capsule: spec 004 §3.1 closes the ``capsule_*``
claim set and reserves statement types other than ``agent_action`` and
``outcome`` (§11), so a checkpoint carries none of them. It is typed by its
content type, :data:`MEDIA_TYPE`, and its CWT claims are ``iss`` (the signer's
developer identity) and ``sub`` (``urn:pgw:eventlog:{operator}:{stream}``).
The payload is the RFC 8785 form of the kernel-signed checkpoint, so it
verifies with the kernel key whoever wrapped it; :func:`statement_id`
(SHA-256 of the payload, hex) is its ``Nats-Msg-Id`` and ``Pgw-Capsule-Id``:
a redelivered checkpoint becomes the same statement, byte for byte (Ed25519 is
deterministic), which the registration stream and the TS each hold once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from consumers.cose import Sign1, sign_statement
from subjects import jcs
from subjects.checkpoint import STATEMENT_TYPE, Checkpoint

MEDIA_TYPE = "application/vnd.pgw.eventlog-checkpoint+json"
_decoder = msgspec.json.Decoder(Checkpoint)


def payload(cp: Checkpoint) -> bytes:
    return jcs.dumps(msgspec.to_builtins(cp))


def statement_id(payload_bytes: bytes) -> str:
    return hashlib.sha256(payload_bytes).hexdigest()


def subject(operator: str, stream: str) -> str:
    return f"urn:pgw:eventlog:{operator}:{stream}"


def sign(cp: Checkpoint, key: Any, *, operator: str, developer: str) -> tuple[bytes, str]:
    """(COSE_Sign1 statement, statement id) of one kernel checkpoint, signed with the signer's ``key``."""
    body = payload(cp)
    claims = {1: developer, 2: subject(operator, cp.stream)}
    return sign_statement(body, key.private, key.kid, claims, MEDIA_TYPE), statement_id(body)


def is_checkpoint(msg: Sign1) -> bool:
    return msg.protected.get(3) == MEDIA_TYPE


def decode(msg: Sign1) -> Checkpoint:
    """The checkpoint a statement carries; msgspec errors if it is not one."""
    return _decoder.decode(msg.payload or b"")


def verify(msg: Sign1, kernel_keys: Mapping[str, Any] | None, add: Callable[..., None]) -> Checkpoint | None:
    """Checks of a checkpoint statement beyond its COSE signature, through ``add(check, code, message, ...)``.

    1 structural (the payload is a checkpoint, its claims name its stream);
    2 identity (the kernel's own signature over it, when kernel keys are given).
    """
    try:
        cp = decode(msg)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        add(1, "checkpoint_malformed", f"the payload is not an event-log checkpoint: {e}")
        return None
    if cp.type != STATEMENT_TYPE:
        add(1, "checkpoint_malformed", f"checkpoint type must be {STATEMENT_TYPE}")
    if payload(cp) != msg.payload:
        add(1, "checkpoint_not_canonical", "the payload is not the RFC 8785 form of the checkpoint")
    claims = msg.cwt_claims
    sub = claims.get(2)
    if not (isinstance(sub, str) and sub.startswith("urn:pgw:eventlog:") and sub.endswith(f":{cp.stream}")):
        add(1, "cwt_sub", f"sub must be urn:pgw:eventlog:OPERATOR:{cp.stream}")
    if not isinstance(claims.get(1), str):
        add(1, "cwt_iss", "iss is required")
    if kernel_keys:
        bad = cp.verify(kernel_keys)
        if bad is not None:
            add(2, "checkpoint_signature", bad)
    else:
        add(2, "checkpoint_not_checked", "no kernel key given: the kernel's signature was not checked", "info")
    return cp


# ---------------------------------------------------------------------------
# The latest checkpoint the Transparency Service holds (`pgw log verify`)
# ---------------------------------------------------------------------------

CAPSULES_STREAM = "PGW_CAPSULES"


def anchored_by(msg: Sign1, ts_keys: Mapping[str, Any]) -> dict[str, Any] | None:
    """The facts of the first receipt of ``msg`` that verifies with ``ts_keys``, else None."""
    from consumers.cose import CoseError
    from consumers.receipts import verify_receipt

    for r in msg.receipts():
        try:
            info = verify_receipt(r, msg.statement_bytes(), ts_keys)
        except CoseError:
            continue
        return {"statement_id": statement_id(msg.payload or b""),
                "receipt": {"kid": info.kid, "tree_size": info.tree_size, "leaf_index": info.leaf_index,
                            "leaf": info.leaf}}
    return None


def kept_statement(data: bytes, ts_keys: Mapping[str, Any]) -> tuple[Checkpoint, dict[str, Any]]:
    """A Transparent checkpoint statement kept elsewhere (``pgw log verify --anchor``); ValueError says why not."""
    from consumers.cose import CoseError, decode_sign1

    try:
        msg = decode_sign1(data)
    except CoseError as e:
        raise ValueError(f"not a checkpoint statement: {e.why}") from None
    if not is_checkpoint(msg):
        raise ValueError(f"not a checkpoint statement (content type {msg.protected.get(3)!r})")
    try:
        cp = decode(msg)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"the statement carries no checkpoint: {e}") from None
    facts = anchored_by(msg, ts_keys)
    if facts is None:
        raise ValueError("no receipt of the statement verifies with a trusted Transparency Service key")
    return cp, facts


async def latest_anchored(js: Any, stream: str, ts_keys: Mapping[str, Any]) -> tuple[Checkpoint, dict[str, Any]] | None:
    """The newest checkpoint of ``stream`` in ``PGW_CAPSULES`` whose TS receipt verifies, with the receipt's facts.

    Read from the stream's end backwards (a direct read per message, nothing
    consumed) until one is found: the registrar appends checkpoints as they
    come, so the newest is near the end. None when none verifies (or no TS
    key is known: an unverified receipt anchors nothing, spec 004 §3.2).
    """
    from nats.js.errors import NotFoundError

    from consumers.cose import CoseError, decode_sign1

    if not ts_keys:
        return None
    try:
        state = (await js.stream_info(CAPSULES_STREAM)).state
    except NotFoundError:
        return None
    for seq in range(state.last_seq or 0, (state.first_seq or 1) - 1, -1):
        try:
            raw = await js.get_msg(CAPSULES_STREAM, seq)
            msg = decode_sign1(raw.data or b"")
        except (NotFoundError, CoseError):
            continue
        if not is_checkpoint(msg):
            continue
        try:
            cp = decode(msg)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        facts = anchored_by(msg, ts_keys) if cp.stream == stream else None
        if facts is not None:
            return cp, {**facts, "capsules_seq": seq}
    return None
