"""The worker reads a turn's stream sequence and delivery count as nats' metadata does."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg

from pgwcore.service import delivery

REPLIES = [
    "$JS.ACK.PGW_INBOUND.pgw-gateway.1.12345.67.1763780000000000000.17",  # the usual (v1) form
    "$JS.ACK.PGW_INBOUND.pgw-gateway.3.9.9.1763780000000000000.0",
    "$JS.ACK.hub.ACCHASH.PGW_INBOUND.pgw-gateway.2.555.44.1763780000000000000.1.r4nd",  # v2, with a domain
    "$JS.ACK._.ACCHASH.PGW_INBOUND.pgw-gateway.5.8.7.1763780000000000000.0.r4nd",
]


@pytest.mark.parametrize("reply", REPLIES)
def test_delivery_matches_nats_metadata(reply: str) -> None:
    msg = Msg(None, subject="pgw.agent.a.envelope", reply=reply, data=b"")
    meta = Msg(None, subject="pgw.agent.a.envelope", reply=reply, data=b"").metadata
    assert delivery(msg) == (meta.sequence.stream, meta.num_delivered)
