"""spec 002 read line by line: rounds per exchange, ids holding secrets, one outcome per envelope,
nodeId on what an envelope causes, a replay's trust tag, the official schemas' strictness."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from subjects.wire import BindingMomentItem, ClarificationItem, SchemaOutcome
from tests.moments import good_moment
from tests.pipeline_helpers import Recorder, env, moment_env, running_gateway

ALICE = {"Pgw-Principal": "alice"}


@pytest.fixture
async def rec(nc):
    async with Recorder(nc) as r:
        yield r


def clar(**kw):
    return env("clarification.request", {"questions": [{"id": "q1", "question": "Which account?"}]}, **kw)


# -- rounds belong to one exchange (spec 002 "Capability handshake integration") ---------------


async def test_a_new_run_of_a_node_gets_no_new_clarification_rounds(nats_server, tmp_path, rec):
    """clarificationRounds is a hard cap per node (spec 002): past it in run-1 of node-a, the first clarification of
    run-2 on node-a to the same principal is cap.breached too; the same node asking another principal is not."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"clarification_rounds": 2}):
        got = []
        for turn in range(3):
            o = await rec.roundtrip("planner", clar(correlation_id=f"run-1:node-a:{turn}:k", node_id="node-a"), headers=ALICE)
            got.append((o.status, o.cap_kind))
        assert got == [("accepted", None), ("accepted", None), ("breached", "clarification")]
        fresh = await rec.roundtrip("planner", clar(correlation_id="run-2:node-a:0:k", node_id="node-a"), headers=ALICE)
        assert (fresh.status, fresh.cap_kind) == ("breached", "clarification")
        bob = await rec.roundtrip("planner", clar(correlation_id="run-2:node-a:1:k", node_id="node-a"),
                                  headers={"Pgw-Principal": "bob"})
        assert bob.status == "accepted"


async def test_no_choice_of_run_id_or_node_id_escapes_the_clarification_cap(nats_server, tmp_path, rec, monkeypatch):
    """With clarificationRounds 3, five clarifications to alice with no nodeId and a fresh correlationId each, or
    with one nodeId and a new runId each, get three accepted and two cap.breached; a new nodeId each runs out at
    four nodes' worth; the allowance comes back once the window has passed."""
    from gateway.stages import limits

    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"clarification_rounds": 3}):
        async def five(kw_of) -> list[str]:
            return [(await rec.roundtrip("planner", clar(**kw_of(i)), headers=ALICE)).status for i in range(5)]

        capped = ["accepted"] * 3 + ["breached"] * 2
        assert await five(lambda i: {}) == capped
        assert await five(lambda i: {"correlation_id": f"run-{i}:node-a:0:k", "node_id": "node-a"}) == capped
        spread = [(await rec.roundtrip("planner", clar(correlation_id=f"r:n{i}:0:k", node_id=f"n{i}"),
                                       headers=ALICE)).status for i in range(8)]
        assert spread == ["accepted"] * 6 + ["breached"] * 2  # 3 + 3 + 6 = 12 = 4 x clarificationRounds
        later = time.time() + getattr(limits, "CLARIFICATION_WINDOW_S", 3600.0) + 1
        monkeypatch.setattr(limits, "_clock", lambda: later, raising=False)
        assert (await rec.roundtrip("planner", clar(), headers=ALICE)).status == "accepted"


async def test_writing_the_principal_as_a_handle_gives_no_second_allowance(nats_server, tmp_path, rec):
    """``~alice`` and ``alice`` are one principal (spec 000 §3): the clarification cap counted them apart, so an
    agent had each cap twice by writing the handle both ways (found by an attack from the docs). One count now,
    per node and over all nodes."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"clarification_rounds": 2}):
        got = [(await rec.roundtrip("planner", clar(), headers={"Pgw-Principal": who})).status
               for who in ("alice", "~alice", "~alice", "alice")]
        assert got == ["accepted", "accepted", "breached", "breached"], got
        node = [(await rec.roundtrip("planner", clar(correlation_id=f"r:nx:{i}:k", node_id="nx"),
                                     headers={"Pgw-Principal": who})).status
                for i, who in enumerate(("~bob", "bob", "~bob"))]
        assert node == ["accepted", "accepted", "breached"], node


async def test_a_refused_clarification_uses_no_round(nats_server, tmp_path, rec):
    """A clarification refused after the limits stage (no principal named) does not use up the allowance."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"clarification_rounds": 1}):
        refused = await rec.roundtrip("planner", clar(correlation_id="run-1:n:0:k"))
        assert refused.code == "principal_required"
        ok = await rec.roundtrip("planner", clar(correlation_id="run-1:n:1:k"), headers=ALICE)
        assert ok.status == "accepted"
        over = await rec.roundtrip("planner", clar(correlation_id="run-1:n:2:k"), headers=ALICE)
        assert (over.status, over.cap_kind) == ("breached", "clarification")


async def test_schema_request_rounds_restart_with_a_new_run(nats_server, tmp_path, rec):
    """schema.request rounds are counted per run's node too: past schemaRounds in run-1, a new run starts at zero."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"schema_rounds": 1}):
        def ask(cid):
            return env("schema.request", {"envelopeType": "error"}, correlation_id=cid)

        assert isinstance(await rec.roundtrip("planner", ask("run-1:n:0:k")), SchemaOutcome)
        second = await rec.roundtrip("planner", ask("run-1:n:1:k"))
        assert (second.code, second.cap_kind) == ("cap.breached", "schema")
        assert isinstance(await rec.roundtrip("planner", ask("run-2:n:0:k")), SchemaOutcome)


# -- ids holding a secret (spec 002 "Redaction", "Replay determinism") ------------------------


async def test_correlation_ids_differing_inside_a_secret_are_not_one_key(nats_server, tmp_path, rec):
    """Two correlationIds that differ only inside a secret: token are not answered as one: neither gets the
    other's cached outcome; each is refused with identifier_redacted, with the digest of the id it sent."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        a = env("error", {"code": "x", "message": "y"}, correlation_id="run:secret:AAAA1111")
        b = env("error", {"code": "x", "message": "y"}, correlation_id="run:secret:BBBB2222")
        oa = await rec.roundtrip("planner", a)
        ob = await rec.roundtrip("planner", b)
        for o in (oa, ob):
            assert (o.status, o.code, o.replayed) == ("invalid", "identifier_redacted", False)
        for o, cid in ((oa, b"run:secret:AAAA1111"), (ob, b"run:secret:BBBB2222")):
            assert [d.path for d in o.details] == ["$.correlationId"]
            assert hashlib.sha256(cid).hexdigest() in o.details[0].message
            assert "AAAA1111" not in str(o) and "BBBB2222" not in str(o)


async def test_a_synthesized_correlation_id_holding_a_secret_token_is_refused(nats_server, tmp_path, rec):
    """A correlationId the gateway synthesizes (spec 002 Migration 3: agent, nodeId and envelopeId joined by
    ":") can hold a token none of its parts holds: nodeId "nodesecret" makes "planner:nodesecret:<id>". The
    body's bytes hold no token, yet the envelope is judged as synthesized, and refused as one that sent it."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        e = env("error", {"code": "x", "message": "y"}, envelope_id="e-77")
        e.pop("correlationId", None)
        e["nodeId"] = "nodesecret"
        o = await rec.roundtrip("planner", e, official=False)  # Migration 3: no correlationId, on purpose
        assert (o.status, o.code) == ("invalid", "identifier_redacted")
        assert [d.path for d in o.details] == ["$.correlationId"]
        assert b"secret:e-77" not in b"".join(rec.raw)


async def test_an_envelope_id_holding_a_secret_is_refused_not_rewritten(nats_server, tmp_path, rec):
    """An envelopeId holding a secret is refused with its own code (never routed, no surface item), and the
    outcome names the sha256 of the id as sent so the agent can match it."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        eid = "e-secret:tok-777"
        await rec.send("planner", moment_env("alice", good_moment(), envelope_id=eid))
        o = await rec.until(lambda: next((o for o in rec.outcomes if getattr(o, "code", None)), None))
        assert o.code == "identifier_redacted" and "tok-777" not in (o.envelope_id or "")
        assert any(hashlib.sha256(eid.encode()).hexdigest() in d.message for d in o.details)
        assert not [i for i in rec.items if isinstance(i, BindingMomentItem)]


# -- every envelope, one outcome (spec 002 "Wire serialization") ------------------------------


async def test_every_envelope_past_the_turn_limit_gets_its_outcome(nats_server, tmp_path, rec):
    """In a turn of 6 with envelopesPerTurn 2, envelopes 3-6 each get exactly one cap.breached outcome."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"envelopes_per_turn": 2}):
        turn = [env("error", {"code": "x", "message": str(i)}) for i in range(6)]
        await rec.send("planner", turn)
        outs = [await rec.outcome(e["envelopeId"]) for e in turn]
        assert [o.status for o in outs] == ["accepted"] * 2 + ["breached"] * 4
        assert all(o.cap_kind == "envelopes" for o in outs[2:])
        await rec.verdict(lambda v: v.envelope_id == turn[5]["envelopeId"])
        ids = [o.envelope_id for o in rec.outcomes]
        assert all(ids.count(e["envelopeId"]) == 1 for e in turn)


async def test_a_turn_over_max_turn_envelopes_is_refused_whole(nats_server, tmp_path, rec):
    """A turn longer than limits.max_turn_envelopes is refused with one invalid_envelope_shape outcome."""
    async with running_gateway(nats_server, str(tmp_path / "d"), limits={"max_turn_envelopes": 4}):
        turn = [env("error", {"code": "x", "message": str(i)}) for i in range(5)]
        await rec.send("planner", turn)
        o = await rec.until(lambda: next(iter(rec.outcomes), None))
        assert (o.code, o.envelope_id) == ("invalid_envelope_shape", None)
        assert "limit is 4" in o.reason


# -- nodeId on everything an envelope causes (spec 002 "Run event log integration") ----------


async def test_node_id_is_carried_by_outcome_item_and_verdicts(nats_server, tmp_path, rec, nc):
    """A clarification's nodeId is on its outcome, its surface item, its dispatch verdict, and on a refusal's
    outcome and verdict."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        o = await rec.roundtrip("planner", clar(node_id="node-7"), headers=ALICE)
        assert (o.status, o.node_id) == ("accepted", "node-7")
        item = await rec.item(lambda i: isinstance(i, ClarificationItem))
        assert item.node_id == "node-7"
        v = await rec.verdict(lambda v: v.verdict_class == "hitl_dispatched")
        assert v.node_id == "node-7"
        bad = await rec.roundtrip("planner", env("vendor.nope.x", {}, node_id="node-8"))
        assert (bad.code, bad.node_id) == ("unknown_envelope_kind", "node-8")
        rv = await rec.verdict(lambda v: v.envelope_id == bad.envelope_id)
        assert rv.node_id == "node-8"
        raw = next(r for r in rec.raw if b'"node-7"' in r)
        assert json.loads(raw)["node_id"] == "node-7"


# -- a replay answers with the re-emission's trust tag (spec 002 "Trust boundary") ------------


async def test_a_replay_resent_as_untrusted_is_answered_untrusted(nats_server, tmp_path, rec):
    """An envelope re-sent under its correlationId as contentTrust untrusted gets the cached outcome marked untrusted."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        first = await rec.roundtrip("planner", moment_env("alice", good_moment(), correlation_id="c-trust"))
        assert first.status == "accepted" and not first.untrusted
        again = moment_env("alice", good_moment(), correlation_id="c-trust", content_trust="untrusted")
        replay = await rec.roundtrip("planner", again)
        assert replay.replayed and replay.untrusted


# -- as strict as the official schemas (tests/data/openwop) ------------------------------------


@pytest.mark.parametrize("ts", ["yesterday", "2026-13-01T00:00:00Z", "2026-01-01 00:00:00", "2026-01-01T25:00:00Z"])
async def test_meta_ts_must_be_an_rfc3339_date_time(nats_server, tmp_path, rec, ts):
    """meta.ts that is not an RFC 3339 date-time (the official schema's format) is invalid_envelope_shape."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        e = env("error", {"code": "x", "message": "y"})
        e["meta"]["ts"] = ts
        o = await rec.roundtrip("planner", e, official=False)
        assert o.code == "invalid_envelope_shape"
        good = env("error", {"code": "x", "message": "y"})
        good["meta"]["ts"] = "2026-06-30T23:59:60.5+02:00"
        assert (await rec.roundtrip("planner", good)).status == "accepted"


@pytest.mark.parametrize("type_, payload", [
    ("error", {"code": "x", "message": ""}),
    ("error", {"code": "x", "message": "y", "extra": 1}),
    ("schema.request", {"envelopeType": "error", "colour": "red"}),
    ("schema.request", {"envelopeType": "error", "reason": "r" * 1025}),
    ("schema.response", {"envelopeType": "error", "ack": True, "reasoning": "no reasoning here"}),
    ("clarification.request", {"questions": [{"id": "q", "question": "Which?", "hint": "x"}]}),
    ("clarification.request", {"questions": [{"id": "q", "question": "Which?"}], "priority": 1}),
])
async def test_payloads_the_official_schemas_refuse_are_envelope_invalid(nats_server, tmp_path, rec, type_, payload):
    """A universal-kind payload the official schema refuses (empty message, unknown member, over-long reason)
    is envelope_invalid rather than accepted with the member silently dropped."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        o = await rec.roundtrip("planner", env(type_, payload), official=False, headers=ALICE)
        assert (o.status, o.code) == ("invalid", "envelope_invalid")


async def test_clarification_question_context_is_kept(nats_server, tmp_path, rec):
    """The official clarification question's open context bag is accepted and reaches the principal."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        q = {"id": "q", "question": "Which?", "context": {"field": "account"}}
        o = await rec.roundtrip("planner", env("clarification.request", {"questions": [q]}), headers=ALICE)
        assert o.status == "accepted"
        item = await rec.item(lambda i: isinstance(i, ClarificationItem))
        assert item.questions[0].context == {"field": "account"}


async def test_vendor_kind_reads_null_and_absent_alike(nats_server, tmp_path, rec):
    """For a configured vendor kind, a member set to null and an absent member are the same (spec 002
    "Reasoning field"): optional reasoning may be null, and strict-mode required-nullable reasoning may be absent."""
    schema = {
        "type": "object", "additionalProperties": False, "required": ["title", "note"],
        "properties": {"title": {"type": "string"}, "reasoning": {"type": "string"},
                       "note": {"type": ["string", "null"]}},
    }
    path = tmp_path / "task.schema.json"
    path.write_text(json.dumps(schema))
    kinds = {"vendor.acme.task": {"schema_file": str(path)}}
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"vendor_kinds": kinds}):
        for payload in ({"title": "t", "reasoning": None, "note": None}, {"title": "t"}, {"title": "t", "note": "n"}):
            o = await rec.roundtrip("planner", env("vendor.acme.task", payload))
            assert o.status == "accepted", (payload, o.details)
        missing = await rec.roundtrip("planner", env("vendor.acme.task", {"title": None}))
        assert missing.code == "envelope_invalid"


# -- a refused first use binds no type (spec 002 "Validation outcomes"; docs/conformance.md) ---


async def test_a_refused_correlation_id_may_be_reused_with_another_type(nats_server, tmp_path, rec):
    """A correlationId whose first use was refused (here: a kind the host does not support) may be used again
    with another type: no envelope_correlation_conflict; once accepted, the type is bound."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        first = await rec.roundtrip("planner", env("vendor.nope.x", {}, correlation_id="c-fix"))
        assert first.code == "unknown_envelope_kind"
        fixed = await rec.roundtrip("planner", env("error", {"code": "x", "message": "y"}, correlation_id="c-fix"))
        assert fixed.status == "accepted"
        other = await rec.roundtrip("planner", env("schema.response", {"envelopeType": "error", "ack": True},
                                                   correlation_id="c-fix"))
        assert other.code == "envelope_correlation_conflict"


# -- rows of docs/conformance.md that had no test of their own ----------------------------------


def test_stages_run_in_the_spec_order():
    """The pipeline's stages are shape, kind, payload, contract, limits, redaction, trust, dedup, in that order
    (spec 002 "Production flow": the ordering is normative); routing follows them."""
    from gateway.pipeline import STAGES

    assert [s.__module__.rsplit(".", 1)[-1] for s in STAGES] == [
        "shape", "kind", "payload", "contract", "limits", "redaction", "trust", "dedup"]


async def test_a_turn_is_processed_in_array_order(nats_server, tmp_path, rec):
    """Two envelopes of one turn sharing a correlationId: the first in the array is accepted and the second,
    of another type, is the correlation conflict, whichever type comes first (spec 002 "Wire serialization")."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        for n, order in enumerate((("error", "schema.response"), ("schema.response", "error"))):
            payloads = {"error": {"code": "x", "message": "y"}, "schema.response": {"envelopeType": "error", "ack": True}}
            turn = [env(t, payloads[t], correlation_id=f"c-order-{n}") for t in order]
            await rec.send("planner", turn)
            first, second = [await rec.outcome(e["envelopeId"]) for e in turn]
            assert (first.status, first.type) == ("accepted", order[0])
            assert second.code == "envelope_correlation_conflict"


@pytest.mark.parametrize("type_, payload", [
    ("clarification.request", {"questions": [{"id": "q", "question": "Which?"}]}),
    ("schema.request", {"envelopeType": "error"}),
    ("error", {"code": "x", "message": "y"}),
])
async def test_universal_payloads_take_an_optional_reasoning(nats_server, tmp_path, rec, type_, payload):
    """The universal kinds whose official schema has reasoning accept it, as a string or null, and accept its absence
    (spec 002 "Reasoning field")."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        for reasoning in ("Because the ledger has two accounts.", None, "absent"):
            p = dict(payload) if reasoning == "absent" else {**payload, "reasoning": reasoning}
            o = await rec.roundtrip("planner", env(type_, p), headers=ALICE, official=reasoning is not None)
            assert o.__struct_config__.tag == "schema" or o.status == "accepted", (reasoning, o)


def test_no_published_schema_uses_one_of():
    """No payload schema this host publishes expresses variants with oneOf (spec 002 "Variant payload
    discrimination"): the tagged unions come out of msgspec as anyOf with a single-field discriminator."""
    from gateway.stages.kind import BUILTIN_KINDS
    from subjects.schemas import all_types, json_schema

    docs = [k.schema() for k in BUILTIN_KINDS.values()] + [json_schema(t) for t in all_types()]
    assert "oneOf" not in json.dumps(docs)


@pytest.mark.parametrize("hider", ["\b", "\f", "\x7f"])
async def test_a_secret_token_split_by_a_control_character_is_redacted(nats_server, tmp_path, rec, hider):
    """With no configured secrets, a secret: token split by a backspace, form feed or DEL (which the reader never
    sees) is still redacted on its way to the principal: the fast "nothing to redact" check takes the walk for them."""
    async with running_gateway(nats_server, str(tmp_path / "d")):
        q = {"id": "q", "question": f"Use sec{hider}ret:tok-99-ALPHA for the refund?"}
        o = await rec.roundtrip("planner", env("clarification.request", {"questions": [q]}), headers=ALICE)
        assert o.status == "accepted"
        item = await rec.item(lambda i: isinstance(i, ClarificationItem))
        assert "tok-99-ALPHA" not in item.questions[0].question and "[REDACTED]" in item.questions[0].question
