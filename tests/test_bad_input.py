"""Hostile bodies never crash or stall the worker; the agent gets invalid_envelope_shape and a verdict is recorded."""

from __future__ import annotations

import pytest

from gateway.stages.base import Refuse
from gateway.stages.shape import decode_body
from pgwcore.config import LimitsConfig
from subjects.client import Agent, envelope
from tests.moments import GOOD_MOMENT
from tests.stored import stored_json

LIMITS = LimitsConfig()

BAD_BODIES = {
    "not_json": b"this is not json",
    "not_utf8": b'{"type": "\xff\xfe"}',
    "too_large": b'{"a": "' + b"x" * (LIMITS.max_body_bytes + 10) + b'"}',
    "too_deep": b"[" * 5000 + b"]" * 5000,
    "duplicate_keys": b'{"type": "a", "type": "b", "payload": {}, "meta": {"ts": "x"}, "envelopeId": "dup-1"}',
    "nan": b'{"type": "a", "payload": NaN, "envelopeId": "nan-1"}',
    "infinity": b'{"type": "a", "payload": -Infinity}',
    "huge_int": b'{"type": "a", "payload": ' + b"9" * 5000 + b"}",
    "trailing_comma": b'{"type": "a",}',
    "lone_surrogate": b'{"type": "\\ud800"}',
    "scalar": b"42",
    "empty_turn": b"[]",
}


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_decoder_refuses_with_shape_code(name):
    """Each hostile body is refused by the shape stage with invalid_envelope_shape (or decodes to a non-envelope)."""
    body = BAD_BODIES[name]
    try:
        values = decode_body(body, LIMITS)
    except Refuse as r:
        assert r.code == "invalid_envelope_shape"
        return
    # Decodable JSON that is not an envelope is refused later by the per-envelope shape check.
    assert name in ("lone_surrogate", "scalar"), values


async def test_bad_bodies_get_outcomes_and_verdicts_and_the_stream_keeps_flowing(gateway, nc):
    """Every bad body yields an invalid_envelope_shape outcome and a blocked verdict; a good envelope after them still goes through."""
    agent = Agent(nc, "fuzzer")
    js = nc.jetstream()
    subject = gateway.subjects.envelope("fuzzer")
    for i, body in enumerate(BAD_BODIES.values()):
        await js.publish(subject, body, headers={"Nats-Msg-Id": f"fuzzer:bad-{i}"})
    good = envelope("vendor.pgw.binding_moment", {"principal": "alice", "binding_moment": GOOD_MOMENT})
    await agent.send(good)
    out = await agent.outcome_for(good["envelopeId"], timeout=15)
    assert out.status == "accepted"
    bad: list[object] = []
    while len(bad) < len(BAD_BODIES):
        o = await anext(agent.outcomes())
        bad.append(o)
    assert {o.code for o in bad} == {"invalid_envelope_shape"}
    # Where the id could be read it is echoed back (duplicate keys, NaN).
    assert {"dup-1", "nan-1"} <= {o.envelope_id for o in bad}
    verdicts = await stored_json(js, "PGW_VERDICTS")
    blocked = [v for v in verdicts if v["verdict_class"] == "blocked"]
    assert len(blocked) == len(BAD_BODIES)
    assert all(v["reason"]["code"] == "invalid_envelope_shape" for v in blocked)
    await agent.close()
