"""The kernel's per-request helpers made cheaper keep their exact results: timestamps, reply tokens, state keys."""

from __future__ import annotations

from datetime import UTC, datetime

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
