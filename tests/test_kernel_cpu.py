"""The kernel's per-request helpers made cheaper keep their exact results: timestamps, reply tokens, state keys."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from gateway.kernel import state
from pgwcore.atomic import reply_token
from subjects import util
from subjects.util import stable_id


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
