"""Format "4" capsules: the current Agent Action Capsule drafts (profile "4").

Implements draft-mih-scitt-agent-action-capsule-05 as stored in
action-state-group/agent-action-capsule at commit 16289abe29349da7356879a343197f54aacc23ed
(spec/draft-mih-scitt-agent-action-capsule-05.md), the draft the reference
verifier agent-action-capsule 0.12.0 checks (its ``versions.py`` accepts -04
and -05, format "4"). Section names below are that draft's anchors.

What changes from format "2" (spec 004, draft -01, :mod:`consumers.capsule`):

- identity ({#identity}, {#conventions}): ``format_version: "4"`` and
  ``canonicalization_id: "jcs"``; capsule_id is SHA-256 over *plain* JCS of the
  capsule with only ``capsule_id`` removed. No absent-field normalization, and
  ``chain`` is inside the preimage. (The reference also leaves out the
  local-only ``signature``/``key_id`` members of its ledger lines; a capsule
  built here never carries them.)
- signing ({#envelope}): the Producer Envelope is a tagged COSE_Sign1 whose
  attached payload is the raw 32-byte capsule_id (not the JSON), protected map
  exactly {1: -8, 3: "application/agent-action-capsule-id", 4: raw Ed25519
  public key}, unprotected map empty.
- registration ({#registration}): a bare Producer Envelope is not an RFC 9943
  Signed Statement. What goes to a Transparency Service is a separate
  registration statement: payload the same raw capsule_id, content type
  ``application/agent-action-capsule-id``, protected CWT claims ``iss``/``sub``.
- ledger_mode ({#assurance}): ``chained`` is derived *solely* from the
  capsule's own ``chain`` block, so a capsule claims ``chained`` only when it
  carries one (a supersedes link); otherwise ``standalone``. The signer's
  hash chain over everything it signs stays in its store-level ledger
  (``PGW_SIGNER_LEDGER``, :mod:`consumers.ledger_check` checks it), outside the
  capsule, so capsule_id stays a pure function of the verdict.
- constraint ``check_type`` values are namespaced ({#constraints},
  {#namespacing}; the shared verdict mapping already does so for format "2").

The draft mandates no container for a capsule with its envelopes
({#envelope}: "This document does not mandate a container representation").
On the bus a format "4" statement is the registration statement, carrying the
capsule JSON and the Producer Envelope in its *unprotected* header under the
text labels :data:`CAPSULE_LABEL` and :data:`ENVELOPE_LABEL`. Both are
self-authenticating against the signed payload (the capsule JSON by
recomputing its capsule_id, the envelope by its own signature over the same
capsule_id), so nothing in them needs the statement's protection, and the
registrar registers the statement unchanged.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import cbor2
import msgspec
import rfc8785
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from consumers import capsule as capm
from consumers import capsule_kernel as kernel_facts
from consumers import capsule_map
from consumers import capsule_outcome as outm
from consumers.cose import (
    ALG,
    CONTENT_TYPE,
    CWT_CLAIMS,
    EDDSA,
    KID_LABEL,
    decode_sign1,
    raw_public,
)
from subjects import jcs
from subjects.wire import Verdict

FORMAT = "4"
DRAFT = "draft-mih-scitt-agent-action-capsule-05"  # the text implemented (commit above)
# {#identity}: "The value defined by this profile version is draft-mih-scitt-agent-action-capsule-04"
# (the -05 text at that commit still defines -04 as the value a capsule carries).
SPEC_VERSION = "draft-mih-scitt-agent-action-capsule-04"
# -04 and -05 both define format 4 (the reference accepts both).
ACCEPTED_SPEC_VERSIONS = (SPEC_VERSION, DRAFT)
CANONICALIZATION_ID = "jcs"
ID_MEDIA_TYPE = "application/agent-action-capsule-id"  # {#envelope}, {#registration}
# Container labels (ours: the draft leaves the container open). Text labels are valid COSE labels (RFC 9052 §3).
CAPSULE_LABEL = "agent-action-capsule"
ENVELOPE_LABEL = "agent-action-capsule-envelope"
# Local-only members of a reference ledger line, never in a capsule_id preimage (reference canonical.py).
LOCAL_ONLY = ("signature", "key_id")
_NOT_PREIMAGE = ("capsule_id", "ledger", *LOCAL_ONLY)  # what seal() leaves out of a body before it derives the id
MAX_SAFE_INT = 2**53 - 1


class Built4(NamedTuple):
    """A format "4" capsule: its JSON body (capsule_id included), the id and the exact JSON bytes."""

    body: dict[str, Any]
    capsule_id: str
    payload: bytes
    relation: str = "supersedes"  # the chain relation a parent known only at linking gets

    @property
    def chain(self) -> dict[str, Any] | None:
        c = self.body.get("chain")
        return c if isinstance(c, dict) else None


def _unsafe(value: Any, path: str = "$") -> list[str]:
    """Paths of floats and of integers beyond +-(2^53-1) ({#conventions}: both are forbidden)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, float):
        return [path]
    if isinstance(value, int):
        return [path] if abs(value) > MAX_SAFE_INT else []
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in _unsafe(v, f"{path}.{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _unsafe(v, f"{path}[{i}]")]
    return []


def identity_preimage(capsule: Mapping[str, Any]) -> dict[str, Any]:
    """{#identity}: the capsule with only ``capsule_id`` (and the reference's local-only members) removed."""
    return {k: v for k, v in capsule.items() if k != "capsule_id" and k not in LOCAL_ONLY}


def compute_capsule_id(capsule: Mapping[str, Any]) -> str:
    """{#identity} format 4: HEX(SHA-256(plain JCS(preimage))); CapsuleError if it has no JCS form.

    The walk's flags say whether the preimage holds a float or an integer beyond +-(2^53-1) at all
    ({#conventions}); only then is it walked again for the paths to report."""
    pre = identity_preimage(capsule)
    walked, flags = jcs.walk(pre)  # plain JCS: walk without drop_absent
    _refuse_unsafe(pre, flags)
    return hashlib.sha256(_encode(walked, flags)).hexdigest()


def _refuse_unsafe(value: Mapping[str, Any], flags: int) -> None:
    """{#conventions}: CapsuleError naming every float and unsafe integer, where the walk's flags say there is one."""
    if flags:
        bad = _unsafe(value)
        if bad:
            raise capm.CapsuleError("{#conventions} floats/unsafe integers", f"not allowed at {', '.join(bad)}")


def _jcs(value: Any) -> bytes:
    return _encode(*jcs.walk(value))  # plain JCS: walk without drop_absent


def _encode(walked: Any, flags: int) -> bytes:
    try:
        return jcs.encode(walked, flags)
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as e:
        raise capm.CapsuleError("{#conventions} JCS", f"value has no JCS form: {e}") from e


def seal(body: Mapping[str, Any], walked_flags: int | None = None) -> Built4:
    """Fix the format-4 identity members and compute capsule_id over the result.

    The payload bytes are the walked preimage with ``capsule_id`` added: an
    ASCII key with a hex string value changes none of the walk's flags, so
    the preimage is walked once for both the id and the payload, or not at
    all when ``walked_flags`` says ``body`` is already a plain copy from
    :func:`subjects.jcs.walk` with those flags (the checked body of the shared
    mapping, whose absent members are already left out).
    """
    out = dict(body)  # a copy in C, then the few members that are not in the preimage left out
    for k in _NOT_PREIMAGE:
        out.pop(k, None)
    out["spec_version"] = SPEC_VERSION
    out["format_version"] = FORMAT
    out["canonicalization_id"] = CANONICALIZATION_ID
    if walked_flags is None:
        walked, flags = jcs.walk(out)  # plain JCS: walk without drop_absent
    else:  # ``out`` is itself a plain copy: no second one (the members added are strings)
        walked, flags = out, walked_flags
    _refuse_unsafe(out, flags)
    cid, payload = _identified(walked, flags)
    out["capsule_id"] = cid
    return Built4(out, cid, payload)


_ID_MARK = "0" * 64  # where the capsule_id goes, until it is known
_ID_MEMBER = b'"capsule_id":"' + _ID_MARK.encode() + b'"'


def _identified(walked: dict[str, Any], flags: int) -> tuple[str, bytes]:
    """(capsule_id, payload bytes) of a walked preimage, from one JCS encode.

    The preimage is encoded with a ``capsule_id`` member holding a mark of
    the id's length. JCS writes an object's members in key order with no
    whitespace, so the preimage's bytes are those bytes without that member
    (and one comma), and the payload's are the same bytes with the id written
    over the mark. Where the mark's member is found more than once (a nested
    ``capsule_id`` of 64 zeros), both are encoded as they are.
    """
    walked["capsule_id"] = _ID_MARK
    full = _encode(walked, flags)
    i = full.find(_ID_MEMBER)
    if i > 0 and full.find(_ID_MEMBER, i + 1) < 0:
        j = i + len(_ID_MEMBER)
        if full[j] == 0x2C:  # ","
            pre = full[:i] + full[j + 1:]
        elif full[i - 1] == 0x2C:
            pre = full[: i - 1] + full[j:]
        else:  # the only member
            pre = full[:i] + full[j:]
        cid = hashlib.sha256(pre).hexdigest()
        return cid, b"".join((full[: i + 14], cid.encode(), full[j - 1:]))
    del walked["capsule_id"]
    cid = hashlib.sha256(_encode(walked, flags)).hexdigest()
    walked["capsule_id"] = cid
    return cid, _encode(walked, flags)


def from_verdict(
    v: Verdict,
    *,
    operator: str,
    salt: str,
    default_developer: str = "principal-gateway",
    authority: str | None = None,
    parent_capsule_id: str | None = None,
    fallback_ts: str | Callable[[], str | None] | None = None,
) -> Built4:
    """The format "4" capsule of one verdict: the same mapping as format "2", then format 4's rules.

    The verdict -> capsule mapping (DESIGN §6) and every construction rule of
    :func:`consumers.capsule.build_capsule_checked` (disposition honesty,
    confirmed-effect binding, attestation matrix, orthogonality) are shared;
    what differs is applied to the checked body here. Deterministic in its
    inputs, so a redelivered verdict gives the same capsule_id.
    """
    built = capsule_map.capsule_from_verdict_checked(
        v, operator=operator, salt=salt, default_developer=default_developer, authority=authority,
        parent_capsule_id=parent_capsule_id, chained=False, fallback_ts=fallback_ts,
        identify=False,  # format 4 derives its own capsule_id ({#identity}, seal below); "" is left out there
    )
    body = dict(built.body)
    # {#assurance}: "chained is derived solely from ... the Capsule's own chain-linkage block".
    assurance = dict(body["assurance"])
    assurance["ledger_mode"] = "chained" if body.get("chain") else "standalone"
    body["assurance"] = assurance
    # {#constraints}, {#namespacing}: producer-local check_type values are namespaced; the shared
    # mapping already writes capm.CHECK_TYPE_GATEWAY_RULE ("io.pgw.gateway_rule").
    # built.body is the walked copy (its flags in built.flags); the members changed here are strings.
    return seal(body, built.flags)


def with_parent(built: Built4, parent_capsule_id: str | None) -> Built4:
    """Add a supersedes parent known only when the run is linked (a parent signed in the same batch).

    ``chain`` is inside the format-4 preimage ({#identity}), so the capsule is
    sealed again; ``ledger_mode`` becomes ``chained``, which the draft derives
    from the chain block alone ({#assurance}).
    """
    if parent_capsule_id is None:
        return built
    body = dict(built.body)
    body["chain"] = {"parent_capsule_id": parent_capsule_id, "relation": built.relation}
    body["assurance"] = {**body["assurance"], "ledger_mode": "chained"}
    return seal(body)._replace(relation=built.relation)


# {#outcomes}: "An asynchronously observed consequence, such as a reversal, dispute, correction, or
# confirmation, is recorded as a new Capsule with its own Capsule ID ... Correlation uses payload
# fields such as action_id, decision_id, external_ref, and chain". {#hitl}: "confirms: Non-terminal:
# this Capsule observes or records the outcome of the parent; the parent's open state remains."
OUTCOME_RELATION = "confirms"


def outcome_from_verdict(
    v: Verdict,
    *,
    operator: str,
    salt: str,
    default_developer: str = "principal-gateway",
    authority: str | None = None,
    parent_capsule_id: str | None = None,
    fallback_ts: str | Callable[[], str | None] | None = None,
) -> Built4:
    """The format "4" outcome of an outcome verdict (:func:`consumers.capsule_outcome.companion`): a capsule.

    Format 4 has no outcome statement type or media type (draft -05 {#outcomes}
    makes an outcome a new Capsule), so the kernel's commitment check of a
    transition is an ``fyi`` capsule of the same action, chained ``confirms``
    to the action's capsule, its check as a Constraint Record (evidence by
    salted digest, {#constraints}); a dispute carries the salted reason digest
    of the gap and the disposition ``needs_input`` the action's capsule has.
    """
    spec = v.details[outm._DETAIL]
    facts = kernel_facts.transition_facts(v)
    try:
        timestamp = capm.utc_z(v.ts)
    except (ValueError, TypeError):
        fallback = fallback_ts() if callable(fallback_ts) else fallback_ts
        if fallback is None:
            raise capm.CapsuleError("{#identity} timestamp", f"verdict ts {v.ts!r} is not RFC 3339") from None
        timestamp = capm.utc_z(fallback)
    action_id = v.action_id or f"verdict:{v.verdict_id}"
    gap = facts is not None and facts.gap
    disposition: dict[str, Any] = {"decision": "needs_input" if gap else "accept", "approver": "policy",
                                   "human_disposed": False}
    if authority:
        disposition["authority"] = authority
    if gap:
        disposition["reason_digest"] = capm.salted_digest(salt, kernel_facts.gap_reason(facts))  # type: ignore[arg-type]
    body: dict[str, Any] = {
        "action_id": action_id, "action_type": "fyi", "operator": operator,
        "developer": v.agent or default_developer, "timestamp": timestamp, "decision_id": action_id,
        "disposition": disposition,
        "assurance": {"attestation_mode": "self_attested", "effect_mode": "not_applicable",
                      "ledger_mode": "chained" if parent_capsule_id else "standalone"},
        "pgw": {"verdict_id": v.verdict_id, "of_verdict_id": v.supersedes, "outcome": spec["kind"],
                "source": spec["source"]},
    }
    for k, val in (("idp_id", v.idp_id), ("agent", v.agent)):
        if val:
            body["pgw"][k] = val
    if facts is not None:
        rec = capsule_map.transition_constraints(facts, salt, unbound_here=False)[0]
        body["constraints"] = [{k: val for k, val in msgspec.to_builtins(rec).items() if val is not None}]
    if parent_capsule_id:
        body["chain"] = {"parent_capsule_id": parent_capsule_id, "relation": OUTCOME_RELATION}
    return seal(body)._replace(relation=OUTCOME_RELATION)


# ---------------------------------------------------------------------------
# COSE: Producer Envelope ({#envelope}) and registration statement ({#registration})
# ---------------------------------------------------------------------------


def _bstr(b: bytes) -> bytes:
    """A CBOR byte string (major type 2), head in its shortest form (RFC 8949 §3, §4.2.1)."""
    n = len(b)
    if n < 24:
        head = bytes((0x40 | n,))
    elif n < 0x100:
        head = bytes((0x58, n))
    elif n < 0x10000:
        head = b"\x59" + n.to_bytes(2, "big")
    elif n < 0x100000000:
        head = b"\x5a" + n.to_bytes(4, "big")
    else:
        head = b"\x5b" + n.to_bytes(8, "big")
    return head + b


_SIG1_HEAD = b"\x84\x6aSignature1"  # array(4), tstr(10) "Signature1"


def _sig_structure(protected: bytes, payload: bytes) -> bytes:
    """:func:`consumers.cose.sig_structure` (RFC 9052 §4.4) for signing, written without cbor2's
    generic encoder: the same bytes (tests/test_capsule_v4_cbor.py), a few microseconds less per
    signature, and a format-4 capsule has two."""
    return b"".join((_SIG1_HEAD, _bstr(protected), b"\x40", _bstr(payload)))


@functools.lru_cache(maxsize=16)
def _envelope_protected(key: Ed25519PrivateKey) -> bytes:
    """The envelope's protected header: the same bytes for every capsule one key signs."""
    return cbor2.dumps({ALG: EDDSA, CONTENT_TYPE: ID_MEDIA_TYPE, KID_LABEL: raw_public(key.public_key())})


def producer_envelope(capsule_id: str, key: Ed25519PrivateKey) -> bytes:
    """{#envelope}: tagged COSE_Sign1, payload the raw 32-byte capsule_id, protected map exactly {1, 3, 4}."""
    payload = bytes.fromhex(capsule_id)
    if len(payload) != 32:
        raise capm.CapsuleError("{#envelope}", "capsule_id must be 64 hex characters")
    protected = _envelope_protected(key)
    signature = key.sign(_sig_structure(protected, payload))
    # RFC 8949 deterministic encoding, as cbor2.dumps writes it: tag 18, array(4), bstr, {}, bstr, bstr.
    return b"".join((b"\xd2\x84", _bstr(protected), b"\xa0", _bstr(payload), _bstr(signature)))


def claims_for(body: Mapping[str, Any]) -> dict[int, str]:
    """{#registration}: RFC 9943 requires protected CWT ``iss`` and ``sub``."""
    return {1: body["developer"], 2: capm.subject_urn(body["operator"], body["action_id"])}


def registration_statement(statement: bytes) -> bytes:
    """What goes to the Transparency Service for a bus statement: the registration statement alone.

    {#registration}: the registration makes the *Capsule ID* transparent (its
    payload is the raw capsule_id); {#privacy}: "anything admitted to a Capsule
    is admitted permanently" once anchored. So the capsule JSON and its Producer
    Envelope, which travel beside it on the bus (unprotected, outside the
    signature), are left out of what is registered, and the Transparency
    Service holds the identifier only. Any other statement is returned as is.
    Raises :class:`consumers.cose.CoseError` for bytes that are no COSE_Sign1.
    """
    msg = decode_sign1(statement)
    if msg.protected.get(CONTENT_TYPE) != ID_MEDIA_TYPE:
        return statement
    return msg.encode({k: v for k, v in msg.unprotected.items() if k not in (CAPSULE_LABEL, ENVELOPE_LABEL)})


def _tstr(s: str) -> bytes:
    """A CBOR text string (major type 3), head in its shortest form (RFC 8949 §3, §4.2.1)."""
    b = s.encode("utf-8")
    head = _bstr(b)  # the same head as a byte string, major type 2 -> 3
    return bytes((head[0] | 0x20,)) + head[1:]


@functools.lru_cache(maxsize=16)
def _registration_head(kid: str) -> bytes:
    """The registration statement's protected map up to its CWT claims: the same for every capsule of a kid."""
    # map(4) {1: -8, 4: kid, 3: ID_MEDIA_TYPE, 15: ...}, in this order, as cbor2.dumps writes the dict below.
    return b"".join((b"\xa4\x01\x27\x04", _bstr(kid.encode("ascii")), b"\x03", _tstr(ID_MEDIA_TYPE), b"\x0f"))


def _registration_protected(kid: str, claims: dict[int, Any]) -> bytes:
    """``cbor2.dumps({ALG: EDDSA, KID_LABEL: kid, CONTENT_TYPE: ID_MEDIA_TYPE, CWT_CLAIMS: claims})``,
    written without cbor2's generic encoder where the claims are the two strings of {#registration}
    (tests/test_capsule_v4_cbor.py holds it to cbor2)."""
    iss, sub = claims.get(1), claims.get(2)
    if len(claims) != 2 or type(iss) is not str or type(sub) is not str or next(iter(claims)) != 1:
        return cbor2.dumps({ALG: EDDSA, KID_LABEL: kid.encode("ascii"), CONTENT_TYPE: ID_MEDIA_TYPE,
                            CWT_CLAIMS: claims})
    return b"".join((_registration_head(kid), b"\xa2\x01", _tstr(iss), b"\x02", _tstr(sub)))


_CAPSULE_KEY = _tstr(CAPSULE_LABEL)
_ENVELOPE_KEY = _tstr(ENVELOPE_LABEL)


def statement(body: Mapping[str, Any], payload_json: bytes, key: Ed25519PrivateKey, kid: str) -> bytes:
    """The bus statement: the registration statement, with the capsule and its envelope as unprotected members."""
    cid = body["capsule_id"]
    raw_id = bytes.fromhex(cid)
    protected = _registration_protected(kid, claims_for(body))
    signature = key.sign(_sig_structure(protected, raw_id))
    envelope = producer_envelope(cid, key)
    # cbor2.dumps(CBORTag(COSE_SIGN1_TAG, [protected, {CAPSULE_LABEL: payload_json, ENVELOPE_LABEL:
    # envelope}, raw_id, signature])), written out: tag 18, array(4), bstr, map(2), bstr, bstr.
    return b"".join((b"\xd2\x84", _bstr(protected), b"\xa2", _CAPSULE_KEY, _bstr(bytes(payload_json)),
                     _ENVELOPE_KEY, _bstr(envelope), _bstr(raw_id), _bstr(signature)))
