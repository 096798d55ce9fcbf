"""Issue 15: envelopes that agree with the official OpenWOP schemas, and the gateway's answer to them.

Each envelope here is checked against the vendored official schemas
(tests/data/openwop) before it is sent; replay under a new envelopeId
(point 4) is in tests/test_pipeline_dedup.py.
"""

from __future__ import annotations

import copy

import msgspec
import pytest

from gateway.capabilities import capability_decoder
from subjects.wire import ClarificationItem
from tests.openwop_schemas import check_envelope, official_errors
from tests.pipeline_helpers import Recorder, env, running_gateway

CLARIFICATION = {"questions": [{"id": "q1", "question": "Which account should the refund go to?"}]}


@pytest.fixture
async def rec(nc):
    async with Recorder(nc) as r:
        yield r


def official(type_: str, payload: object) -> dict:
    e = env(type_, payload)
    check_envelope(e)
    return e


async def test_principal_from_the_header_for_an_official_clarification(nats_server, tmp_path, rec):
    """Open mode: an officially valid clarification.request names its principal in the Pgw-Principal header (point 1)."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        e = official("clarification.request", CLARIFICATION)
        out = await rec.roundtrip("planner", e, headers={"Pgw-Principal": "alice"})
        assert out.status == "accepted", out
        item = await rec.item(lambda i: isinstance(i, ClarificationItem) and i.envelope_id == e["envelopeId"])
        assert item.principal == "alice"
        assert not [w for w in out.warnings if w.rule == "deprecated"]


async def test_meta_pgw_principal_still_works_with_a_deprecation_warning(nats_server, tmp_path, rec):
    """The old meta.pgw.principal (not official: EnvelopeMeta is closed) is honoured, with a deprecation warning."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        e = env("clarification.request", CLARIFICATION)
        e["meta"]["pgw"] = {"principal": "bob"}
        assert official_errors(e), "meta.pgw must be refused by the official schema, or this test proves nothing"
        out = await rec.roundtrip("planner", e, official=False)
        assert out.status == "accepted"
        assert [w.path for w in out.warnings if w.rule == "deprecated"] == ["$.meta.pgw.principal"]
        item = await rec.item(lambda i: isinstance(i, ClarificationItem) and i.envelope_id == e["envelopeId"])
        assert item.principal == "bob"
        clash = env("clarification.request", CLARIFICATION)
        clash["meta"]["pgw"] = {"principal": "bob"}
        out = await rec.roundtrip("planner", clash, official=False, headers={"Pgw-Principal": "alice"})
        assert (out.status, out.code) == ("invalid", "envelope_invalid")


def without_source(e: dict) -> dict:
    e = copy.deepcopy(e)
    del e["meta"]["source"]
    assert official_errors(e), "the official schema requires meta.source"
    return e


@pytest.mark.parametrize(("strictness", "status"), [("warn", "accepted"), ("strict", "invalid")])
async def test_missing_meta_source_by_strictness(nats_server, tmp_path, rec, nc, strictness, status):
    """meta.source absent: the Migration default under warn, invalid_envelope_shape under strict; capabilities says which (point 2)."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"envelope_strictness": strictness}):
        out = await rec.roundtrip("planner", without_source(env("error", {"code": "x", "message": "y"})), official=False)
        assert out.status == status
        if strictness == "strict":
            assert out.code == "invalid_envelope_shape" and out.details[0].path == "$.meta.source"
        else:
            assert [w.path for w in out.warnings if w.rule == "migration"] == ["$.meta.source"]
        caps = capability_decoder.decode((await nc.request("pgw.capabilities", b"{}", timeout=10)).data)
        assert caps.pgw is not None
        assert caps.pgw.missing_meta_source == ("refused" if strictness == "strict" else "synthesized")
        assert caps.pgw.principal_header == "Pgw-Principal"


@pytest.mark.parametrize(("mode", "status", "code"), [(None, "accepted", None), ("refuse", "invalid", "unknown_envelope_kind")])
async def test_schema_request_for_an_unknown_vendor_kind(nats_server, tmp_path, rec, nc, mode, status, code):
    """schema.request for a kind this host does not support: accepted with the supported kinds by default
    (spec 002 leaves it open; the official scenario expects accepted), refused when configured (point 3)."""
    pipeline = {"schema_request_unknown_kind": mode} if mode else {}
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline=pipeline):
        e = official("schema.request", {"envelopeType": "vendor.acme.unknown.create"})
        out = await rec.roundtrip("planner", e)
        assert (out.status, out.code) == (status, code)
        assert any("supported kinds" in (d.message or "") for d in [*out.warnings, *out.details])
        caps = capability_decoder.decode((await nc.request("pgw.capabilities", b"{}", timeout=10)).data)
        assert caps.pgw.schema_request_unknown_kind == (mode or "accept")


def test_capabilities_document_round_trips() -> None:
    """The capability document's pgw notes are optional on decode (an older gateway's document still decodes)."""
    doc = {"supportedEnvelopes": [], "schemaVersions": {}, "limits": {"envelopesPerTurn": 1, "schemaRounds": 1,
           "clarificationRounds": 1}, "envelopeStrictness": "warn", "envelopeContracts": {"advertised": False}, "schemas": {}}
    assert capability_decoder.decode(msgspec.json.encode(doc)).pgw is None
