"""OpenTelemetry trace export (pgwcore/tracing.py): one trace from the agent's traceparent through the
gateway, the signer and the registrar, exported over OTLP/HTTP by the real OpenTelemetry SDK.

No OTLP collector is installable from the registries this project reaches, so the receiving end
is a loopback HTTP endpoint that decodes each export with the official OTLP protobuf definitions
(``opentelemetry-proto``): what a collector would receive, byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pgwcore import tracing
from pgwcore.server import EmbeddedServer
from subjects.client import envelope
from tests.chaos.harness import ServiceProc, free_port, wait_services
from tests.polling import until
from tests.scittles_peer import Scittles

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def test_off_unless_the_standard_variables_ask() -> None:
    """No OTEL_* variable: off; an endpoint or OTEL_TRACES_EXPORTER=otlp: on; OTEL_SDK_DISABLED wins."""
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "otlp"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_SDK_DISABLED": "true"})
    assert not tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_TRACES_EXPORTER": "none"})
    with tracing.span("x", f"00-{TRACE}-{PARENT}-01") as s:
        assert s is None  # off: nothing is created


async def test_one_trace_through_gateway_signer_and_registrar(
    nats_server: EmbeddedServer, nc, tmp_path: Path, scittles: Scittles, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An envelope sent with a traceparent yields spans of the gateway, the signer and the registrar in its trace."""
    spans: list[dict] = []

    async def receive(request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest.FromString(await request.read())
        for rs in req.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({"service": service, "name": s.name, "trace": s.trace_id.hex(),
                                  "parent": s.parent_span_id.hex()})
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    cfg = tmp_path / "pgw.toml"
    cfg.write_text(f'[registrar]\nts_url = "{scittles.url}"\n')
    url = nats_server.client_url
    procs = [ServiceProc(role, url, tmp_path / role, cfg) for role in ("gateway", "signer", "registrar")]
    try:
        for p in procs:
            await p.start()
        for role in ("gateway", "signer", "registrar"):
            await wait_services(nc, f"pgw-{role}", 1, procs, timeout=60)
        body = envelope("vendor.pgw.binding_moment", {"principal": "alice", "binding_moment": {"synopsis": "x"}},
                        envelope_id="traced-1")  # malformed: refused, and a refusal is a verdict too
        await nc.jetstream().publish("pgw.agent.tracer.envelope", json.dumps(body).encode(),
                                     headers={"Nats-Msg-Id": "tracer:traced-1", "traceparent": f"00-{TRACE}-{PARENT}-01"})

        async def all_three() -> bool:
            names = {(s["service"], s["name"]) for s in spans if s["trace"] == TRACE}
            return {("pgw-gateway", "pgw.gateway.turn"), ("pgw-signer", "pgw.signer.capsule"),
                    ("pgw-registrar", "pgw.registrar.register")} <= names

        await until(all_three, timeout=90, interval=0.1,
                    what=lambda: f"spans of the trace: {spans}\n" + "\n".join(p.log_tail() for p in procs))
        ours = [s for s in spans if s["trace"] == TRACE]
        assert {s["parent"] for s in ours} == {PARENT}, ours  # each a child of the agent's span
    finally:
        for p in procs:
            await p.stop()
        await runner.cleanup()
