"""spec 002 stages in order, on a real nats-server: shape, kind, payload, schema
versions, migration defaults, universal kinds, contract gate, limits."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from gateway.stages import kind as kind_stage
from subjects.client import Surface
from subjects.wire import (
    ClarificationAnswers,
    ClarificationItem,
    ClarificationRequestPayload,
    ErrorEnvelopePayload,
    ResolutionOutcome,
    SchemaOutcome,
)
from tests.moments import good_moment
from tests.pipeline_helpers import Recorder, env, moment_env, running_gateway


@pytest.fixture
async def gw(nats_server, tmp_path):
    async with running_gateway(nats_server, str(tmp_path / "d")) as g:
        yield g


@pytest.fixture
async def rec(nc):
    async with Recorder(nc) as r:
        yield r


def clar(questions=None, **kw):
    payload = {"questions": questions or [{"id": "q1", "question": "Which account should the refund go to?"}]}
    return env("clarification.request", payload, **kw)


async def test_unknown_top_level_member_is_invalid_envelope_shape(gw, rec):
    """A top-level member outside spec 002's closed shape is refused as invalid_envelope_shape."""
    e = clar()
    e["extra"] = 1
    out = await rec.roundtrip("planner", e, official=False)  # an unknown top-level member
    assert (out.status, out.code) == ("invalid", "invalid_envelope_shape")


async def test_unknown_kind_is_refused(gw, rec):
    """A type the host does not advertise is refused with unknown_envelope_kind."""
    out = await rec.roundtrip("planner", env("vendor.other.thing", {}))
    assert (out.status, out.code) == ("invalid", "unknown_envelope_kind")


async def test_invalid_payload_has_actionable_details(gw, rec):
    """A clarification.request without questions is envelope_invalid with a detail naming the path."""
    out = await rec.roundtrip("planner", env("clarification.request", {"contextType": "x"}), official=False)
    assert out.code == "envelope_invalid"
    assert out.details and "questions" in out.details[0].message
    assert out.details[0].path.startswith("$.payload")


async def test_higher_schema_version_is_unknown_schema_version(gw, rec):
    """schemaVersion above the advertised one is refused with unknown_schema_version."""
    e = clar()
    e["schemaVersion"] = 2
    out = await rec.roundtrip("planner", e, )
    assert out.code == "unknown_schema_version"


async def test_lower_schema_version_warns_under_warn(gw, rec):
    """schemaVersion below the advertised one is accepted with an envelope_schema_version_drift warning."""
    e = env("schema.response", {"envelopeType": "error", "ack": True})
    e["schemaVersion"] = 0
    out = await rec.roundtrip("planner", e)
    assert out.status == "accepted"
    assert any(w.rule == "envelope_schema_version_drift" for w in out.warnings)


async def test_lower_schema_version_refused_under_strict(nats_server, tmp_path, rec):
    """Under envelopeStrictness strict, schema-version drift is a refusal."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"envelope_strictness": "strict"}):
        e = env("schema.response", {"envelopeType": "error", "ack": True})
        e["schemaVersion"] = 0
        out = await rec.roundtrip("planner", e)
        assert (out.status, out.code) == ("invalid", "envelope_schema_version_drift")
        e2 = env("schema.response", {"envelopeType": "error", "ack": True})
        e2["schemaVersion"] = 1
        assert (await rec.roundtrip("planner", e2)).status == "accepted"


async def test_migration_defaults_are_warnings(gw, rec):
    """Missing meta.source and missing correlationId are synthesized with warnings (spec 002 Migration)."""
    e = env("schema.response", {"envelopeType": "error", "ack": True})
    del e["meta"]["source"]
    del e["correlationId"]
    out = await rec.roundtrip("planner", e, official=False)  # migration: ids and meta.source absent
    assert out.status == "accepted"
    rules = {w.path for w in out.warnings if w.rule == "migration"}
    assert {"$.meta.source", "$.correlationId"} <= rules
    assert out.correlation_id and out.correlation_id.endswith(e["envelopeId"])


async def test_schema_request_answered_with_the_validating_types_schema(gw, rec):
    """schema.request gets a schema outcome holding the JSON Schema generated from the validating type."""
    e = env("schema.request", {"envelopeType": "clarification.request"})
    out = await rec.roundtrip("planner", e)
    assert isinstance(out, SchemaOutcome)
    assert out.schema == msgspec.json.schema(ClarificationRequestPayload)
    assert out.envelope_type == "clarification.request" and out.schema_version == 1


async def test_schema_request_for_unknown_kind_is_refused(nats_server, tmp_path, rec):
    """schema.request for a kind the host does not support is refused when configured so (issue 15 point 3)."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"schema_request_unknown_kind": "refuse"}):
        out = await rec.roundtrip("planner", env("schema.request", {"envelopeType": "vendor.nope.x"}))
        assert out.code == "unknown_envelope_kind"


async def test_error_envelope_is_a_successful_turn(gw, rec):
    """An error envelope is accepted (the agent's deliberate failure report), with no verdict."""
    out = await rec.roundtrip("planner", env("error", {"code": "tool_call_refused", "message": "The tool refused."}))
    assert out.status == "accepted" and out.recorded_event_ids
    assert not [v for v in rec.verdicts if v.envelope_id == out.envelope_id]
    assert msgspec.json.schema(ErrorEnvelopePayload)  # the published type exists


async def test_clarification_lifted_and_answers_come_back_as_resolution(nats_server, tmp_path, nc, rec):
    """clarification.request reaches the bound principal as a clarification item; the answers return as a resolution."""
    async with running_gateway(nats_server, str(tmp_path / "d"), agents={"planner": {"principals": ["alice"]}}):
        out = await rec.roundtrip("planner", clar())
        assert out.status == "accepted" and out.moment_id
        item = await rec.item(lambda i: isinstance(i, ClarificationItem))
        assert item.principal == "alice" and item.questions[0].id == "q1"
        reply = await Surface(nc, "alice").resolve(item.moment_id, ClarificationAnswers(answers={"q1": "The Visa card."}))
        assert reply.status == "accepted"
        res = await rec.until(lambda: next((o for o in rec.outcomes if isinstance(o, ResolutionOutcome)), None))
        assert res.resolution == ClarificationAnswers(answers={"q1": "The Visa card."})


@pytest.mark.parametrize("second", ["ok", "ok\u200b", "ok\u0007", "\u200b"])
async def test_questions_under_one_id_or_an_id_rewritten_are_refused(nats_server, tmp_path, nc, rec, second):
    """Answers come back keyed by the question's id: two questions under one id (``ok`` twice), or an id the
    redaction would rewrite into another (``ok`` + U+200B: her "NO" to the first question reached the agent as
    "yes" under its id; found by a docs-only attack), or one that is nothing to see, are refused with the path
    of the id, and nothing reaches her."""
    questions = [{"id": "ok", "question": "May I wire 99,999 EUR to a new payee?"},
                 {"id": second, "question": "May I pay 12 EUR to ACME?"}]
    async with running_gateway(nats_server, str(tmp_path / "d"), agents={"planner": {"principals": ["alice"]}}):
        out = await rec.roundtrip("planner", clar(questions))
        assert (out.status, out.code) == ("invalid", "envelope_invalid"), out
        assert [d.path for d in out.details] == ["$.payload.questions[1].id"], out.details
        assert "question id" in out.details[0].message or "share the id" in out.details[0].message, out.details
        fine = await rec.roundtrip("planner", clar([questions[0], {"id": "ok2", "question": "May I pay 12 EUR?"}]))
        assert fine.status == "accepted", fine
        await rec.item(lambda i: isinstance(i, ClarificationItem) and i.moment_id == fine.moment_id)
        items = [i for i in rec.items if isinstance(i, ClarificationItem)]
        assert [i.moment_id for i in items] == [fine.moment_id], items  # the refused one reached no surface


async def test_an_answer_that_shows_nothing_is_refused_and_a_real_one_then_accepted(nats_server, tmp_path, nc, rec):
    """Her free text, objection or clarification answer of white space or invisible characters only: a U+200B got
    engine_failure (the redaction emptied it), a space was recorded and signed as her answer (found by a docs-only
    attack). Each is refused ``invalid_resolution`` naming the field, the moment stays open, and her real answer
    is then accepted."""
    from subjects.wire import BindingMomentItem, DialogueVeto, FreeTextAnswer

    async with running_gateway(nats_server, str(tmp_path / "d"), agents={"planner": {"principals": ["alice"]}}):
        surface = Surface(nc, "alice")
        out = await rec.roundtrip("planner", moment_env("alice", good_moment()))
        assert out.status == "accepted", out
        await rec.item(lambda i: isinstance(i, BindingMomentItem) and i.moment_id == out.moment_id)
        for blank in (FreeTextAnswer(text="\u200b"), FreeTextAnswer(text=" \u00a0\u2800"), DialogueVeto(objection="\u200b")):
            reply = await surface.resolve(out.moment_id, blank)
            assert (reply.status, reply.code) == ("refused", "invalid_resolution"), (blank, reply)
            assert "shows nothing" in (reply.reason or ""), reply
        assert (await surface.resolve(out.moment_id, FreeTextAnswer(text="Only the summary."))).status == "accepted"
        ask = await rec.roundtrip("planner", clar())
        await rec.item(lambda i: isinstance(i, ClarificationItem) and i.moment_id == ask.moment_id)
        reply = await surface.resolve(ask.moment_id, ClarificationAnswers(answers={"q1": "\u200b "}))
        assert (reply.status, reply.code) == ("refused", "invalid_resolution") and "answers.q1" in reply.reason, reply
        assert (await surface.resolve(ask.moment_id, ClarificationAnswers(answers={"q1": "Visa."}))).status == "accepted"


async def test_clarification_principal_from_meta_pgw(gw, rec):
    """In open mode, a clarification may still name its principal in meta.pgw.principal (deprecated, not official)."""
    e = clar()
    e["meta"]["pgw"] = {"principal": "bob"}
    out = await rec.roundtrip("planner", e, official=False)
    assert out.status == "accepted"
    item = await rec.item(lambda i: isinstance(i, ClarificationItem))
    assert item.principal == "bob"


async def test_clarification_without_principal_is_refused(gw, rec):
    """A clarification with no principal and no single bound principal is refused."""
    out = await rec.roundtrip("planner", clar())
    assert out.code == "principal_required"


async def test_contract_fail_node(nats_server, tmp_path, rec):
    """An agent whose contract does not accept a kind gets envelope_contract_violation with refusedType and acceptedTypes; universals pass."""
    cfg = {"contracts": {"planner": {"accepts": ["vendor.pgw.authorization"]}}}
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline=cfg):
        out = await rec.roundtrip("planner", moment_env("alice", good_moment()))
        assert (out.status, out.code) == ("gated", "envelope_contract_violation")
        assert out.refused_type == "vendor.pgw.binding_moment"
        assert set(kind_stage.UNIVERSAL_KINDS) | {"vendor.pgw.authorization"} == set(out.accepted_types)
        v = await rec.verdict(lambda v: v.envelope_id == out.envelope_id)
        assert v.verdict_class == "denied"
        assert not rec.items
        ok = await rec.roundtrip("planner", env("error", {"code": "x", "message": "y"}))
        assert ok.status == "accepted"
        other = await rec.roundtrip("writer", moment_env("alice", good_moment()))
        assert other.status == "accepted"  # no contract for this agent


async def test_contract_discard_and_warn(nats_server, tmp_path, rec):
    """With discard-and-warn the envelope is discarded (never routed) and the next one in the turn proceeds."""
    cfg = {"contracts": {"planner": {"accepts": [], "refusal_mode": "discard-and-warn"}}}
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline=cfg):
        a = moment_env("alice", good_moment())
        b = env("error", {"code": "x", "message": "y"})
        await rec.send("planner", [a, b])
        oa = await rec.outcome(a["envelopeId"])
        ob = await rec.outcome(b["envelopeId"])
        assert oa.code == "envelope_contract_violation" and oa.details[0].rule == "discarded"
        assert oa.status == "gated" and any(w.rule == "discarded" for w in oa.warnings)
        assert ob.status == "accepted"
        assert not rec.items


async def test_envelopes_per_turn(nats_server, tmp_path, rec):
    """Envelopes past envelopesPerTurn in one turn are refused with cap.breached kind envelopes, each of them."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"envelopes_per_turn": 2}):
        turn = [env("error", {"code": "x", "message": str(i)}) for i in range(4)]
        await rec.send("planner", turn)
        outs = [await rec.outcome(e["envelopeId"]) for e in turn]
        assert [o.status for o in outs] == ["accepted", "accepted", "breached", "breached"]
        assert outs[3].code == "cap.breached" and outs[3].cap_kind == "envelopes"


async def test_schema_rounds(nats_server, tmp_path, rec):
    """Re-emissions of one correlationId after refusals past schemaRounds become cap.breached kind schema."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"schema_rounds": 2}):
        codes = []
        for _ in range(4):
            e = env("clarification.request", {"questions": []}, correlation_id="corr-1")
            codes.append((await rec.roundtrip("planner", e, official=False)).code)
        assert codes == ["envelope_invalid", "envelope_invalid", "cap.breached", "cap.breached"]
        fixed = clar(correlation_id="corr-1")
        out = await rec.roundtrip("planner", fixed, headers={"Pgw-Principal": "alice"})
        assert (out.code, out.cap_kind) == ("cap.breached", "schema")
        other = clar(correlation_id="corr-2")
        assert (await rec.roundtrip("planner", other, headers={"Pgw-Principal": "alice"})).status == "accepted"


async def test_schema_rounds_counted_after_the_dedup_claim(nats_server, tmp_path, rec):
    """A correlationId refused after its dedup claim still counts: past schemaRounds even a valid re-emission is cap.breached."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"schema_rounds": 1}):
        codes = []
        # An invalid principal handle is refused by the route stage, after the claim; the
        # last emission is valid up to the route (where it would be unknown_workflow).
        for principal in ("not a handle!", "not a handle!", "alice"):
            e = env("vendor.pgw.authorization", {"workflow_id": "w", "envelope": {}, "principal": principal},
                    correlation_id="corr-a")
            codes.append((await rec.roundtrip("planner", e)).code)
        assert codes == ["envelope_invalid", "cap.breached", "cap.breached"]
        fresh = env("vendor.pgw.authorization", {"workflow_id": "w", "envelope": {}, "principal": "alice"},
                    correlation_id="corr-b")
        assert (await rec.roundtrip("planner", fresh)).code == "unknown_workflow"


async def test_clarification_rounds(nats_server, tmp_path, rec):
    """clarification.request envelopes of one run's node past clarificationRounds are cap.breached kind clarification."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"clarification_rounds": 2}):
        statuses = []
        for turn in range(3):
            e = clar(node_id="node-a", correlation_id=f"run-1:node-a:{turn}:k")
            o = await rec.roundtrip("planner", e, headers={"Pgw-Principal": "alice"})
            statuses.append((o.status, o.cap_kind))
        assert statuses == [("accepted", None), ("accepted", None), ("breached", "clarification")]
        e = clar(node_id="node-b", correlation_id="run-1:node-b:3:k")
        assert (await rec.roundtrip("planner", e, headers={"Pgw-Principal": "alice"})).status == "accepted"


async def test_every_refusal_has_an_outcome_and_a_verdict(gw, rec):
    """Each refusal code above yields an outcome with the code and a verdict for the same envelope."""
    bad_shape = clar()
    bad_shape["nope"] = True
    high = clar()
    high["schemaVersion"] = 9
    cases = [
        bad_shape,
        env("vendor.x.y", {}),
        env("clarification.request", {}),
        high,
        clar(),  # principal_required
        moment_env("alice", good_moment(recommended_idx=7)),
    ]
    for e in cases:
        out = await rec.roundtrip("planner", e, official=False)  # refused on purpose, several not official
        assert out.status != "accepted" and out.code
        v = await rec.verdict(lambda v, eid=e["envelopeId"]: v.envelope_id == eid)
        assert v.decision == "reject" and v.reason.code == out.code


async def test_not_json_gets_a_refusal(gw, rec, nc):
    """A body that is not JSON is refused with invalid_envelope_shape and still gets a verdict."""
    await rec.send("planner", None, msg_id="planner:raw-1", raw=b"{not json")
    out = await rec.until(lambda: next((o for o in rec.outcomes if o.code == "invalid_envelope_shape"), None))
    assert out.status == "invalid"
    await rec.verdict(lambda v: v.reason is not None and v.reason.code == "invalid_envelope_shape")
    _ = json, asyncio


async def test_policy_and_limit_refusals_have_verdicts(nats_server, tmp_path, rec):
    """Contract, cap, correlation-conflict and binding refusals each yield an outcome with the code and a verdict."""
    cfg = {"contracts": {"planner": {"accepts": ["vendor.pgw.binding_moment"]}}, "envelopes_per_turn": 1}
    agents = {"planner": {"principals": ["alice"]}}
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline=cfg, agents=agents):
        turn = [env("error", {"code": "a", "message": "b"}, correlation_id="k1"), env("error", {"code": "a", "message": "b"})]
        await rec.send("planner", turn)
        await rec.outcome(turn[0]["envelopeId"])
        cases = [
            (turn[1], "cap.breached"),
            (env("vendor.pgw.authorization", {"workflow_id": "w", "envelope": {}}), "envelope_contract_violation"),
            (env("schema.response", {"envelopeType": "error", "ack": True}, correlation_id="k1"), "envelope_correlation_conflict"),
            (moment_env("bob", good_moment()), "principal_not_bound"),
        ]
        for e, code in cases:
            if e is not turn[1]:
                await rec.send("planner", e)
            out = await rec.outcome(e["envelopeId"])
            assert out.code == code
            v = await rec.verdict(lambda v, eid=e["envelopeId"]: v.envelope_id == eid)
            assert v.decision == "reject" and v.reason.code == code


async def test_schema_requests_bound_to_schema_rounds(nats_server, tmp_path, rec):
    """schema.request envelopes of one run's node past schemaRounds are cap.breached kind schema (spec 002 Universal kinds)."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"schema_rounds": 1}):
        first = await rec.roundtrip("planner", env("schema.request", {"envelopeType": "error"}, node_id="n1",
                                                   correlation_id="run-1:n1:0:k"))
        assert first.__struct_config__.tag == "schema"
        second = await rec.roundtrip("planner", env("schema.request", {"envelopeType": "error"}, node_id="n1",
                                                    correlation_id="run-1:n1:1:k"))
        assert (second.code, second.cap_kind) == ("cap.breached", "schema")


async def test_pending_moments_beyond_one_reply_are_listed_fairly_and_say_more(tmp_path):
    """One agent's many large moments made the principal's pending reply larger than the server's max_payload:
    she got no answer, and no surface could list any moment, another agent's included (found by a docs-only
    attack). Now the reply fits: each agent's oldest moments in turn, ``more`` set, and the rest follow as she
    answers."""
    import types

    from benchmarks.harness import moment_of_kb
    from consumers.slack.service import Lane
    from consumers.surfaces.feed import SurfaceFeed
    from pgwcore.connect import connect
    from pgwcore.server import EmbeddedServer
    from subjects.client import Agent
    from subjects.names import Subjects
    from subjects.wire import pending_reply_decoder

    async with EmbeddedServer(tmp_path / "nats-small", port=-1, websocket_port=None, max_payload=128 * 1024) as server:
        nc = await connect(server.client_url, name="test")
        try:
            async with running_gateway(server, str(tmp_path / "d"),
                                       agents={"flooder": {"principals": ["alice"]}, "helper": {"principals": ["alice"]}}):
                flooder, helper = Agent(nc, "flooder"), Agent(nc, "helper")
                try:
                    flooded = []
                    for i in range(12):  # about 17 KB each: 200 KB in all
                        eid = await flooder.send_moment("alice", moment_of_kb(16, i))
                        got = await flooder.outcome_for(eid, timeout=15)
                        assert got.status == "accepted"
                        flooded.append(got.moment_id)
                    eid = await helper.send_moment("alice", good_moment())
                    theirs = await helper.outcome_for(eid, timeout=15)
                    assert theirs.status == "accepted"
                finally:
                    await flooder.close()
                    await helper.close()
                got = await nc.request("pgw.principal.alice.pending", b"{}", timeout=15)
                assert len(got.data) <= 128 * 1024, len(got.data)
                reply = pending_reply_decoder.decode(got.data)
                assert reply.more and 1 < len(reply.items) < 13, (reply.more, len(reply.items))
                assert theirs.moment_id in [i.moment_id for i in reply.items]  # the other agent's is not kept out
                assert [i.created_at for i in reply.items] == sorted(i.created_at for i in reply.items)
                # Each reader of the list takes a part for a part (a review): a moment it leaves out is not gone.
                left_out = next(m for m in flooded if m not in {i.moment_id for i in reply.items})
                feed = SurfaceFeed(nc, "alice")
                await feed.pending()
                assert feed.partial
                feed._open[left_out] = msgspec.json.encode(reply.items[0])  # as if shown before a reconnect
                assert feed._gone_since([]) == []  # before: a withdrawn item made up for it
                lane = types.SimpleNamespace(nc=nc, subjects=Subjects("pgw"), principal="alice")
                assert await Lane.pending_ids(lane) is None  # before: Slack closed it for good
                assert (await Surface(nc, "alice").pending_reply()).more
        finally:
            await nc.close()
