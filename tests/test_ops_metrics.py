"""Prometheus metrics (issue 8 "Ops"): the spec 000 rates, no principal ids as labels."""

from __future__ import annotations

import asyncio
import urllib.request

from pgwcore import metrics
from subjects.wire import BindingMoment, Hatches, MomentMeta, MomentOption, Question


def _value(name: str, **labels: str) -> float:
    v = metrics.REGISTRY.get_sample_value(name, labels)
    return v or 0.0


def _moment(*, free_text: bool = True, dialogue: bool = True, note: str | None = None) -> BindingMoment:
    return BindingMoment(
        synopsis="Deploy is blocked.",
        findings=["a"],
        recommendations=["b"],
        offer="c",
        question=Question(
            stem="Which?",
            options=[MomentOption("x", "rx"), MomentOption("y", "ry")],
            recommended_idx=0,
            hatches=Hatches(free_text=free_text, dialogue=dialogue),
        ),
        meta=MomentMeta(decision_class="deploy", calibration_note=note) if note else None,
    )


def test_hatch_suppression_and_calibration_note_are_counted_per_agent() -> None:
    """A moment with dialogue=false counts one suppression; a calibration_note counts one note."""
    before_s = _value("pgw_hatch_suppressions_total", agent="m-agent", hatch="dialogue")
    before_ft = _value("pgw_hatch_suppressions_total", agent="m-agent", hatch="free_text")
    before_n = _value("pgw_calibration_notes_total", agent="m-agent")
    before_m = _value("pgw_binding_moments_total", agent="m-agent")
    metrics.count_moment("m-agent", _moment(dialogue=False, note="70% sure"))
    metrics.count_moment("m-agent", _moment())
    assert _value("pgw_hatch_suppressions_total", agent="m-agent", hatch="dialogue") == before_s + 1
    assert _value("pgw_hatch_suppressions_total", agent="m-agent", hatch="free_text") == before_ft
    assert _value("pgw_calibration_notes_total", agent="m-agent") == before_n + 1
    assert _value("pgw_binding_moments_total", agent="m-agent") == before_m + 2


def test_dialogue_hatch_rate_has_numerator_and_denominator() -> None:
    """Only dialogue resolutions count in the dialogue-hatch counter; all count in resolutions."""
    labels = {"agent": "d-agent", "decision_class": "deploy"}
    b_d = _value("pgw_dialogue_hatch_total", **labels)
    b_r = _value("pgw_resolutions_total", **labels)
    metrics.count_resolution("d-agent", "deploy", "dialogue")
    metrics.count_resolution("d-agent", "deploy", "option")
    assert _value("pgw_dialogue_hatch_total", **labels) == b_d + 1
    assert _value("pgw_resolutions_total", **labels) == b_r + 2


def test_no_metric_has_a_principal_label() -> None:
    """No metric family declares a principal label (issue 8: no principal ids as labels)."""
    for family in metrics.REGISTRY.collect():
        for sample in family.samples:
            assert not any("principal" in k for k in sample.labels), family.name


def test_hostile_label_values_are_bounded() -> None:
    """A code that is not a short token is recorded as 'other', keeping the series set bounded."""
    metrics.count_envelope("invalid", "x" * 500)
    metrics.count_envelope("invalid", "bad code with spaces\n")
    assert _value("pgw_envelopes_total", outcome="invalid", code="other") >= 2
    assert metrics.safe_label("envelope_invalid") == "envelope_invalid"
    assert metrics.safe_label(None) == "none"


async def test_metrics_endpoint_serves_the_registry() -> None:
    """start_metrics_server serves the counters in the Prometheus text format over HTTP."""
    metrics.count_verdict("blocked")
    stop = metrics.start_metrics_server(0)
    try:
        url = f"http://127.0.0.1:{stop.port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    finally:
        stop()
    assert 'pgw_verdicts_total{verdict_class="blocked"}' in body


async def test_consumer_lag_gauge_reads_the_server(nc) -> None:
    """update_consumer_lag sets the gauge to the consumer's pending count on the real server."""
    js = nc.jetstream()
    for i in range(3):
        await js.publish("pgw.agent.lagger.envelope", b"{}", headers={"Nats-Msg-Id": f"l{i}"})
    await js.pull_subscribe("pgw.agent.lagger.envelope", durable="lag-test", stream="PGW_INBOUND")
    await metrics.update_consumer_lag(js, [("PGW_INBOUND", "lag-test"), ("PGW_INBOUND", "missing")])
    assert _value("pgw_consumer_lag", stream="PGW_INBOUND", consumer="lag-test") == 3
