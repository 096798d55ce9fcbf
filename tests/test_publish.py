"""Every verdict is counted once, by the publisher, whoever publishes it."""

from __future__ import annotations

from gateway import metrics
from gateway.publish import Publisher
from subjects.names import Subjects
from subjects.util import now_rfc3339, stable_id
from subjects.wire import Verdict


def count(verdict_class: str) -> float:
    return metrics.REGISTRY.get_sample_value("pgw_verdicts_total", {"verdict_class": verdict_class}) or 0.0


async def test_verdict_counted_once_even_when_republished(nc):
    """A verdict published twice (a redelivery) is stored and counted once."""
    pub = Publisher(nc.jetstream(), Subjects())
    v = Verdict(
        verdict_id=stable_id("count-test"), verdict_class="blocked", decision="reject", approver="policy",
        human_disposed=False, ts=now_rfc3339(), agent="a", action_type="pgw.envelope", action_id="x",
    )
    before = count("blocked")
    await pub.verdict(v)
    await pub.verdict(v)
    assert count("blocked") == before + 1
    info = await nc.jetstream().stream_info("PGW_VERDICTS")
    assert info.state.messages == 1
