"""The kernel's per-request helpers made cheaper keep their exact results: timestamps, reply tokens, state keys."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.kernel import state
from pgwcore.atomic import reply_token
from subjects import util
from subjects.util import stable_id
from tests.test_jcs import EXAMPLES, _outcome, scalars, text, values


@pytest.mark.parametrize("ns", [0, 1_764_270_000_123_456_789, 1_764_270_000_999_999_999, 1_764_270_001_000_000_000,
                                951_782_400_000_500_000])
def test_now_rfc3339_is_datetimes_isoformat(monkeypatch: pytest.MonkeyPatch, ns: int) -> None:
    """The per-second cached timestamp is the text datetime's isoformat gives at millisecond precision, with Z."""
    monkeypatch.setattr(util.time, "time_ns", lambda: ns)
    want = datetime.fromtimestamp(ns // 1000 / 1e6, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    assert util.now_rfc3339() == want
    monkeypatch.setattr(util.time, "time_ns", lambda: ns + 1_000_000_000)  # the next second is formatted anew
    assert util.now_rfc3339()[:19] != want[:19]


def test_reply_tokens_are_unique_and_never_a_nuid() -> None:
    """Reply tokens never repeat and are shorter than nats' 22-character NUID tokens of nc.request."""
    tokens = [reply_token() for _ in range(10_000)]
    assert len(set(tokens)) == len(tokens)
    assert all(len(t) < 22 for t in tokens)


def test_state_keys_are_the_hashed_ids() -> None:
    """Cached session and hold keys equal the stable ids they always were (the bucket's keys)."""
    for _ in range(2):
        assert state.session_key("a1", "s-1") == f"sess.{stable_id('session', 'a1', 's-1')}"
        assert state.hold_key("a1", "ABC-so") == f"hold.{stable_id('hold', 'a1', 'abc-so')}"


async def test_validation_reads_bring_the_hold_in_the_batched_request(nc: Any) -> None:
    """The hold of the governed object comes with the index, report key and session in one read, as ``hold`` gives it."""
    st = state.KernelState(nc.jetstream())
    await st.open()
    try:
        assert st._batch is not None  # the one-request path is the one under test
        so = str(uuid.uuid4())
        empty = await st.validation_reads("a1", so, str(uuid.uuid4()), "s-1")
        assert empty[3] == await st.hold("a1", so) and empty[3][1] == 0

        def terminate(h: state.HoldEntry) -> bool:
            h.terminated.append("m-1")
            return True

        await st.update_hold("a1", so.upper(), terminate)
        for session in ("s-1", None):  # with the session read and without it (a cached session)
            got = await st.validation_reads("a1", so, str(uuid.uuid4()), session)
            assert got[3] == await st.hold("a1", so)
            assert got[3][0].terminated == ["m-1"] and got[3][1] > 0
    finally:
        await st.close()


def test_the_event_logs_signer_makes_the_keys_own_signatures() -> None:
    """The log's libsodium signer gives byte for byte the signature of the kernel key (Ed25519 is deterministic)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gateway.kernel.eventlog import fast_signer
    from pgwcore.keys import SigningKey

    key = SigningKey(role="kernel", kid="k", private=Ed25519PrivateKey.generate())
    sign = fast_signer(key)
    assert sign is not key.sign  # libsodium is installed here: the fast path is the one tested
    for data in (b"", b"x", bytes(range(256)) * 8):
        sig = sign(data)
        assert sig == key.sign(data) and len(sig) == 64
        key.public.verify(sig, data)


@settings(max_examples=EXAMPLES, deadline=None)
@given(values)
def test_the_kernels_json_digest_is_the_spec_digest(value: object) -> None:
    """The kernel's JSON-DIGEST (one walk, msgspec where exact) gives the digest of subjects.idp.json_digest, or fails as it does."""
    from subjects.idp import json_digest
    from subjects.jcs import json_digest as fast

    assert _outcome(fast, value) == _outcome(json_digest, value)


def test_the_kernels_json_digest_drops_absent_members_as_the_spec_digest() -> None:
    """Null, [] and {} members are left out bottom-up and array positions kept, as spec 004's JSON-DIGEST does."""
    from subjects.idp import json_digest
    from subjects.jcs import json_digest as fast

    for v in ({"a": None, "b": {"c": []}, "d": [None, {}, {"e": None}], "f": 0.5, "g": "\u2028"},
              {"status": "ok", "result": {"written": 8, "name": "todo"}, "error": None}, [], {}, "x", 1e21):
        assert fast(v) == json_digest(v)


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(text, scalars, max_size=8))
def test_commitment_records_are_signed_as_the_kernel_key_signs_their_jcs(record: dict[str, Any]) -> None:
    """EventLog.sign_record gives b64url(key.sign(rfc8785.dumps(record))), the signature commitment records always carried."""
    import rfc8785
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from gateway.kernel.eventlog import EventLog, fast_signer
    from pgwcore.keys import SigningKey
    from subjects.idp import b64url

    key = SigningKey(role="kernel", kid="k", private=Ed25519PrivateKey.generate())
    log = EventLog.__new__(EventLog)  # the signer alone: no connection needed
    log._sign_bytes = fast_signer(key)
    assert _outcome(log.sign_record, record) == _outcome(lambda r: b64url(key.sign(rfc8785.dumps(r))), record)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.floats(min_value=0.0, max_value=1.0) | st.sampled_from([-0.0, 0.0, 0.79995, 0.8, 1e-05, 5e-324, 1.0]))
def test_remembered_cedar_decimals_are_the_computed_ones(x: float) -> None:
    """cedar_decimal gives, first call and remembered, the truncated four-place text of the float's shortest form."""
    from decimal import ROUND_FLOOR, Decimal

    from gateway.kernel.policy import cedar_decimal

    want = str(Decimal(repr(float(x))).quantize(Decimal("0.0001"), rounding=ROUND_FLOOR))
    assert cedar_decimal(x) == want and cedar_decimal(x) == want


def test_remembered_cedar_decimals_keep_negative_zero_apart() -> None:
    """-0.0 and 0.0 are equal floats but have their own Cedar text, whichever is asked first."""
    from gateway.kernel.policy import _decimal_of, cedar_decimal

    _decimal_of.cache_clear()
    assert (cedar_decimal(0.0), cedar_decimal(-0.0)) == ("0.0000", "-0.0000")
    _decimal_of.cache_clear()
    assert (cedar_decimal(-0.0), cedar_decimal(0.0)) == ("-0.0000", "0.0000")


@settings(max_examples=EXAMPLES, deadline=None)
@given(text, st.sampled_from([(), ("Smith",), ("smith", "Jones")]))
def test_remembered_pii_markers_are_the_markers(description: str, names: tuple[str, ...]) -> None:
    """The kernel's remembered PII check gives pii_markers' kinds in order, then those it finds only in the form a
    person reads (``seen_latin``), on the first call and the next."""
    from gateway.kernel.validation import _pii_kinds
    from gateway.security.seen import seen_latin
    from subjects.idp import pii_markers

    for s in (description, f"call Mr Smith at +1 555 123 4567 or {description}@example.com"):
        want = pii_markers(s, names)
        want += [k for k in pii_markers(seen_latin(s), names) if k not in want]
        assert list(_pii_kinds(s, names)) == want == list(_pii_kinds(s, names))
