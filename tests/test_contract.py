"""The bus contract: subject tokens, wire types, schemas, configuration errors, stream creation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js.api import StreamConfig

from pgwcore.config import load_config
from pgwcore.streams import StreamConflict, ensure_streams
from subjects.errors import ConfigError, SubjectError
from subjects.names import Subjects, principal_token
from subjects.schemas import all_types, json_schema
from subjects.wire import Verdict

S = Subjects()


def test_subject_builders_and_parser_round_trip():
    """Builders produce the DESIGN §2 subjects and parse() reads them back."""
    assert S.envelope("planner") == "pgw.agent.planner.envelope"
    assert S.surface("~alice") == "pgw.principal.alice.surface"
    assert S.verdict("hitl_dispatched") == "pgw.verdict.hitl_dispatched"
    p = S.parse("pgw.principal.alice.resolve")
    assert (p.role, p.token, p.channel) == ("principal", "alice", "resolve")
    assert S.parse("pgw.agent.a-1_b.outcome").token == "a-1_b"
    assert S.moment("planner") == "pgw.agent.planner.moment"
    assert S.parse("pgw.agent.planner.moment").channel == "moment"


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "*", ">", "ålice", "x" * 65, "~~alice", "a\x00"])
def test_bad_tokens_are_clear_errors(bad):
    """A bad principal token is a SubjectError naming the value, never mangled into a valid one."""
    with pytest.raises(SubjectError) as e:
        S.surface(bad)
    assert "principal token" in str(e.value)


@given(st.text(max_size=80))
def test_tokens_are_never_mangled(value):
    """Any string either maps to itself (minus one leading ~) or is refused."""
    try:
        tok = principal_token(value)
    except SubjectError:
        return
    assert tok == (value[1:] if value.startswith("~") else value)


@pytest.mark.parametrize("subject", ["pgw.agent.a.nope", "other.agent.a.envelope", "pgw.verdict.bogus", "pgw.agent.a*.envelope"])
def test_parse_refuses_foreign_subjects(subject):
    """Subjects outside the contract are refused by the parser."""
    with pytest.raises(SubjectError):
        S.parse(subject)


def test_parse_is_remembered_per_prefix_and_refusals_are_not():
    """A subject parsed twice gives the same frozen result; another prefix parses afresh; a refused subject
    is refused every time (the hot paths parse each agent's subject once, Subjects.parse)."""
    first = S.parse("pgw.agent.memo.envelope")
    assert S.parse("pgw.agent.memo.envelope") is first and Subjects().parse("pgw.agent.memo.envelope") is first
    assert first.token == "memo" and first.channel == "envelope"
    with pytest.raises(SubjectError):
        Subjects("acme").parse("pgw.agent.memo.envelope")  # not remembered across prefixes
    assert Subjects("acme").parse("acme.agent.memo.envelope") == first
    for _ in range(2):
        with pytest.raises(SubjectError):
            S.parse("pgw.agent.memo.nope")


def test_every_wire_type_has_a_json_schema():
    """`pgw schema` can print a schema for every registered wire type."""
    for name in all_types():
        schema = json_schema(name)
        assert "$defs" in schema or "type" in schema or "anyOf" in schema, name


def test_schema_command_prints_valid_json():
    """`pgw schema ResolveRequest` prints the JSON Schema, generated from the Struct."""
    out = subprocess.run([str(Path(sys.executable).parent / "pgw"), "schema", "ResolveRequest"], capture_output=True, text=True, check=True)
    schema = json.loads(out.stdout)
    assert "ResolveRequest" in json.dumps(schema)


def test_verdict_refuses_human_disposed_without_a_human():
    """human_disposed true with a non-human approver is unrepresentable (DESIGN §6)."""
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(
            {"verdict_id": "0" * 32, "verdict_class": "blocked", "decision": "reject", "approver": "policy",
             "human_disposed": True, "ts": "2026-01-01T00:00:00Z", "agent": "a", "action_type": "x", "action_id": "y"},
            Verdict,
        )


def test_bad_config_names_the_field(tmp_path):
    """A bad configuration fails with the field named; an unknown key is refused, not ignored."""
    f = tmp_path / "bad.toml"
    f.write_text("[limits]\nmax_depth = 'deep'\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert "limits.max_depth" in str(e.value)
    f.write_text("[limits]\nmax_dept = 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert "max_dept" in str(e.value)
    f.write_text("[agents.'bad agent']\nprincipals = []\n")
    with pytest.raises(ConfigError):
        load_config(f)


async def test_streams_are_idempotent_and_conflicts_reported(nc):
    """A second ensure changes nothing; a stream with other subjects is reported, not replaced."""
    js = nc.jetstream()
    assert set((await ensure_streams(js, S)).values()) == {"exists"}
    await js.delete_stream("PGW_CAPSULES")
    await js.add_stream(StreamConfig(name="PGW_CAPSULES", subjects=["pgw.capsule.registered", "elsewhere.>"]))
    with pytest.raises(StreamConflict) as e:
        await ensure_streams(js, S)
    assert "PGW_CAPSULES" in str(e.value) and "subjects" in e.value.differences
    info = await js.stream_info("PGW_CAPSULES")
    assert "elsewhere.>" in info.config.subjects  # untouched
