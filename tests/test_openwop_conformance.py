"""The official conformance suite's envelope scenarios, pointed at the gateway through a small adapter.

The TypeScript suite (openwop/openwop ``conformance/src/scenarios/aiEnvelope.*``)
drives a host over HTTP: ``POST /v1/host/sample/envelope/accept`` with
``{envelope}`` answers ``{status, reason, details, envelopeId}``. This host has
no HTTP surface, so ``accept`` below is that seam over the bus: publish the
envelope as an agent would, wait for its outcome, and map it to the seam's
body (``reason`` carries the refusal code, as the suite's ``toContain`` checks
expect; on a replay ``envelopeId`` is the cached outcome's, ``replay_of``).
The scenarios' envelopes and expectations are copied case by case; cases that
plant state through seam options (``priorCorrelations``, ``hostSupportedEnvelopes``)
or read the run-event-log seam have no counterpart here and are not ported.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.pipeline_helpers import Recorder, running_gateway

BASE_META = {"source": "ai-generation", "ts": "2026-05-18T10:00:00Z"}


async def accept(rec: Recorder, envelope: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """The suite's ``accept(envelope)``: the outcome as the sample host's seam would answer it."""
    out = await rec.roundtrip("conformance", envelope, headers={"Pgw-Principal": "alice"}, **kw)
    reason = " ".join(x for x in (out.code, out.reason) if x) or None
    return {
        "status": out.status,
        "reason": reason,
        "details": [d.message for d in out.details],
        "envelopeId": out.replay_of or out.envelope_id,
    }


def clar(envelope_id: str, correlation_id: str, payload: Any = None) -> dict[str, Any]:
    return {
        "type": "clarification.request", "schemaVersion": 1, "envelopeId": envelope_id, "correlationId": correlation_id,
        "payload": payload if payload is not None else {"questions": [{"id": "q1", "question": "why?"}]}, "meta": BASE_META,
    }


UNIVERSAL_KINDS_CASES = [
    # aiEnvelope.universalKinds.test.ts, "behavioral accept via /v1/host/sample/envelope/accept"
    ("clarification.request valid", clar("env-uk-clar", "r:n:0:clar", {"questions": [{"id": "q1", "question": "Which provider?"}]}), "accepted"),
    ("schema.request", {"type": "schema.request", "schemaVersion": 1, "envelopeId": "env-uk-sr", "correlationId": "r:n:0:sr",
                        "payload": {"envelopeType": "vendor.acme.prd.create"}, "meta": BASE_META}, "accepted"),
    ("schema.response", {"type": "schema.response", "schemaVersion": 1, "envelopeId": "env-uk-sresp", "correlationId": "r:n:0:sresp",
                         "payload": {"envelopeType": "vendor.acme.prd.create", "ack": True}, "meta": BASE_META}, "accepted"),
    ("error envelope", {"type": "error", "schemaVersion": 1, "envelopeId": "env-uk-err", "correlationId": "r:n:0:err",
                        "payload": {"code": "validation_failed", "message": "I cannot produce JSON matching that schema"},
                        "meta": BASE_META}, "accepted"),
    ("clarification.request missing questions", clar("env-uk-bad", "r:n:0:bad", {"contextType": "form-field"}), "invalid"),
]


@pytest.mark.parametrize(("name", "envelope", "status"), UNIVERSAL_KINDS_CASES, ids=[c[0] for c in UNIVERSAL_KINDS_CASES])
async def test_universal_kinds_scenario(nats_server, tmp_path, nc, name, envelope, status):
    """aiEnvelope.universalKinds: each official case gets the status the suite expects (invalid ones carry details)."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        body = await accept(rec, envelope, official=status == "accepted")
        assert body["status"] == status, body
        if status == "invalid":
            assert body["details"]


async def test_correlation_replay_scenario(nats_server, tmp_path, nc):
    """aiEnvelope.correlationReplay: a re-emission gets the cached outcome (across a gateway restart, the first
    envelope's id surfacing); the same correlationId with another type is envelope_correlation_conflict."""
    async with running_gateway(nats_server, str(tmp_path / "a")), Recorder(nc) as rec:
        first = await accept(rec, clar("env-cr-replay-1", "r:n:0:replay1"))
        assert first["status"] == "accepted"
        second = await accept(rec, clar("env-cr-replay-1", "r:n:0:replay1"))
        assert (second["status"], second["envelopeId"]) == ("accepted", first["envelopeId"])
        conflict = await accept(rec, {"type": "error", "schemaVersion": 1, "envelopeId": "env-cr-conflict",
                                      "correlationId": "r:n:0:replay1", "payload": {"code": "x", "message": "y"},
                                      "meta": BASE_META})
        assert conflict["status"] == "invalid" and "envelope_correlation_conflict" in conflict["reason"]
        p1 = await accept(rec, clar("env-cr-persist-1", "r-cr-persist:n:0:persist1"))
        assert (p1["status"], p1["envelopeId"]) == ("accepted", "env-cr-persist-1")
    async with running_gateway(nats_server, str(tmp_path / "b")), Recorder(nc) as rec:  # a new process
        p2 = await accept(rec, clar("env-cr-persist-2", "r-cr-persist:n:0:persist1"))
        assert (p2["status"], p2["envelopeId"]) == ("accepted", "env-cr-persist-1")
