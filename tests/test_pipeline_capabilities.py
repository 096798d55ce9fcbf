"""Capability handshake (spec 002 "Capability handshake integration") and configured vendor kinds."""

from __future__ import annotations

import json

import msgspec
import pytest

from gateway.capabilities import capability_decoder
from gateway.stages.authorization import AuthorizationEnvelopePayload
from gateway.stages.kind import UNIVERSAL_KINDS
from subjects.errors import ConfigError
from subjects.wire import (
    BindingMomentPayload,
    ClarificationRequestPayload,
    ErrorEnvelopePayload,
    SchemaRequestPayload,
    SchemaResponsePayload,
)
from tests.pipeline_helpers import Recorder, env, running_gateway

TASKS_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["steps"],
    "properties": {
        "reasoning": {"type": ["string", "null"]},
        "steps": {"type": "array", "items": {"type": "object", "required": ["title"], "properties": {"title": {"type": "string"}}}},
    },
}


@pytest.fixture
def vendor_cfg(tmp_path):
    f = tmp_path / "tasks.schema.json"
    f.write_text(json.dumps(TASKS_SCHEMA))
    return {"vendor_kinds": {"vendor.acme.tasks.create": {"schema_file": str(f), "schema_version": 2}},
            "contracts": {"planner": {"accepts": ["vendor.acme.tasks.create"]}},
            "envelopes_per_turn": 8}


async def test_capability_document(nats_server, tmp_path, nc, vendor_cfg):
    """capabilities lists the four universals, versions, limits, strictness, contracts and each kind's schema from its validating type."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline=vendor_cfg):
        msg = await nc.request("pgw.capabilities", b"{}", timeout=5)
        doc = capability_decoder.decode(msg.data)
    wire = json.loads(msg.data)
    assert {"supportedEnvelopes", "schemaVersions", "limits", "envelopeStrictness", "envelopeContracts"} <= set(wire)
    assert set(wire["limits"]) == {"envelopesPerTurn", "schemaRounds", "clarificationRounds"}
    assert set(UNIVERSAL_KINDS) <= set(doc.supported_envelopes)
    assert {"vendor.pgw.binding_moment", "vendor.pgw.authorization", "vendor.acme.tasks.create"} <= set(doc.supported_envelopes)
    assert doc.schema_versions["vendor.acme.tasks.create"] == 2 and doc.schema_versions["clarification.request"] == 1
    assert (doc.limits.envelopes_per_turn, doc.limits.schema_rounds, doc.limits.clarification_rounds) == (8, 3, 3)
    assert doc.envelope_strictness == "warn" and doc.envelope_contracts.advertised is True
    for kind, typ in [("clarification.request", ClarificationRequestPayload), ("schema.request", SchemaRequestPayload),
                      ("schema.response", SchemaResponsePayload), ("error", ErrorEnvelopePayload),
                      ("vendor.pgw.binding_moment", BindingMomentPayload),
                      ("vendor.pgw.authorization", AuthorizationEnvelopePayload)]:
        assert doc.schemas[kind] == msgspec.json.schema(typ), kind
    assert doc.schemas["vendor.acme.tasks.create"] == TASKS_SCHEMA


async def test_vendor_kind_validated_by_its_schema(nats_server, tmp_path, nc, vendor_cfg):
    """A configured vendor kind is validated against its JSON Schema file, with details, and recorded when valid."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline=vendor_cfg), Recorder(nc) as rec:
        good = env("vendor.acme.tasks.create", {"steps": [{"title": "Draft"}]})
        good["schemaVersion"] = 2
        out = await rec.roundtrip("planner", good)
        assert out.status == "accepted" and out.recorded_event_ids and not out.warnings
        bad = env("vendor.acme.tasks.create", {"steps": [{}], "extra": 1})
        bad["schemaVersion"] = 2
        out = await rec.roundtrip("planner", bad)
        assert out.code == "envelope_invalid"
        paths = {d.path for d in out.details}
        assert "$.payload.steps[0]" in paths and "$.payload" in paths
        unknown = await rec.roundtrip("planner", env("vendor.acme.other", {}))
        assert unknown.code == "unknown_envelope_kind"


def test_vendor_kind_must_be_namespaced():
    """A configured kind outside vendor.<host>.* fails the configuration with the field named."""
    from pgwcore.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, pipeline={"vendor_kinds": {"prd.create": {"schema_file": "x.json"}}})
    assert "pipeline.vendor_kinds.prd.create" in str(e.value)


async def test_bad_vendor_schema_fails_at_start(nats_server, tmp_path, nc):
    """A vendor kind whose schema file is not a JSON Schema fails the pipeline set-up with the field named."""
    from gateway.app import Gateway
    from pgwcore.config import load_config

    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"type": 12}))
    config = load_config(None, nats_url=nats_server.client_url,
                         pipeline={"vendor_kinds": {"vendor.acme.x": {"schema_file": str(f)}}})
    with pytest.raises(ConfigError) as e:
        await Gateway(config, nc).stage_state.get()
    assert "vendor.acme.x" in e.value.field
