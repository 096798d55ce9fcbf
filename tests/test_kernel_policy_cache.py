"""Cedar evaluation with the reduced context, parsed entities and reused decisions (spec 003 §5.4):
every decision equals Cedar's on the whole context, fail-closed rule included."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path
from typing import Any

import cedarpy
import msgspec
import pytest

from gateway.kernel.policy import PolicyEngine, context_paths, idp_context, project_context
from subjects.idp import decode_idp
from tests.kernel_support import EXAMPLE_POLICIES, idp, thin

SO = str(uuid.uuid4())

# Policies reading the context in every way the reduction must get right: nested
# attributes, `has` (extended and plain), decimals, a forbid that errors on an absent
# attribute, a record compared whole, entity attributes against the context.
POLICIES = """
permit(principal, action == Action::"CloseBooking", resource)
when { context.idp.confidence_level.greaterThanOrEqual(decimal("0.8")) };
permit(principal, action == Action::"ProcessPayment", resource)
when { context.idp.reasoning_basis.type == "INSTRUCTION" };
permit(principal, action == Action::"AdvanceMissionStage", resource)
when { context.idp.reasoning_basis.type == "MISSION_STAGE" && context.idp has mission_ref };
permit(principal, action == Action::"Mission", resource) when { context has idp.mission_ref };
permit(principal, action == Action::"Owner", resource) when { principal.principal == context.principal };
permit(principal, action == Action::"Mandate", resource) when { context.mandate == {"jti": "m1", "so_id": resource.so_id} };
permit(principal, action == Action::"Urgent", resource);
forbid(principal, action == Action::"Urgent", resource) unless { context.idp.hem_urgency == "NONE" };
"""
WHOLE = 'permit(principal, action == Action::"Any", resource) when { context == {} };'
ACTIONS = ["CloseBooking", "ProcessPayment", "AdvanceMissionStage", "Mission", "Owner", "Mandate", "Urgent", "Other"]


def _engine(tmp_path: Path, text: str) -> PolicyEngine:
    (tmp_path / "p.cedar").write_text(text, encoding="utf-8")
    return PolicyEngine(tmp_path)


def _contexts() -> list[dict[str, Any]]:
    out = []
    for conf, basis, mission, urgency in itertools.product(
        (0.79995, 0.8, 0.95), ("INSTRUCTION", "MISSION_STAGE"), (None, str(uuid.uuid4())), ("NONE", "RECOMMENDED")
    ):
        if basis == "MISSION_STAGE" and mission is None:
            continue  # not a valid IDP (spec 003 §4.3)
        rec = idp(so_id=SO, mandate_id="m1", step=1, action="CloseBooking", confidence_level=conf,
                  reasoning_basis={"type": basis, "description": "why"}, mission_ref=mission, hem_urgency=urgency)
        out.append({"idp": idp_context(decode_idp({k: v for k, v in rec.items() if v is not None})),
                    "principal": "alice", "mandate": {"jti": "m1", "so_id": SO}})
    # An IDP_THIN: the attributes the policies read are absent (fail closed).
    t = idp_context(decode_idp(thin(idp(so_id=SO, mandate_id="m1", step=1, action="CloseBooking"))))
    out.append({"idp": t, "principal": "bob", "mandate": {"jti": "m2", "so_id": SO}})
    return out


def _cedar_whole(engine: PolicyEngine, action: str, principal: str, ctx: dict[str, Any]) -> bool:
    """Cedar's own decision on the whole context, with the kernel's fail-closed rule."""
    res = {"type": "GovernedObject", "id": SO}
    r = cedarpy.is_authorized(
        {"principal": {"type": "Agent", "id": "a1"}, "action": {"type": "Action", "id": action},
         "resource": res, "context": ctx},
        engine.text, engine._entities("a1", principal, res, SO))
    return bool(r.allowed) and not r.diagnostics.errors


def test_reduced_context_decides_as_the_whole_context(tmp_path: Path) -> None:
    """For every action and context, the engine's decision (reduced context, cached) equals Cedar's on the whole context, twice."""
    engine = _engine(tmp_path, POLICIES)
    assert engine.context_paths is not None  # the reduction is in use for these policies
    seen = set()
    for ctx in _contexts():
        for principal in ("alice", "bob"):
            for _round in range(2):  # the second round is answered from the cache
                got = engine.evaluate_many(ACTIONS, agent="a1", principal=principal,
                                           resource={"type": "GovernedObject", "id": SO}, so_id=SO, context=ctx)
                want = [_cedar_whole(engine, a, principal, ctx) for a in ACTIONS]
                assert [d.allowed for d in got] == want, (ctx, principal)
                seen.update(zip(ACTIONS, want, strict=True))
    # Each policy was met both ways, so the comparison covered permits and denials.
    for a in ACTIONS[:-1]:
        assert (a, True) in seen and (a, False) in seen, a


def test_cache_key_holds_principal_agent_and_resource(tmp_path: Path) -> None:
    """A decision cached for one principal, agent or resource is not reused for another."""
    engine = _engine(tmp_path, 'permit(principal, action, resource) when { principal.principal == "alice" && resource.so_id == "x" };')
    kw: dict[str, Any] = {"agent": "a1", "resource": {"type": "GovernedObject", "id": SO}, "context": {}}
    assert engine.evaluate("A", principal="alice", so_id="x", **kw).allowed
    assert not engine.evaluate("A", principal="bob", so_id="x", **kw).allowed
    assert not engine.evaluate("A", principal="alice", so_id="y", **kw).allowed
    other = {"type": "GovernedObject", "id": str(uuid.uuid4())}
    assert engine.evaluate("A", agent="a2", principal="alice", resource=other, so_id="x", context={}).allowed


def test_whole_context_use_sends_the_whole_context(tmp_path: Path) -> None:
    """A policy using the context record itself gets all of it: no reduction."""
    engine = _engine(tmp_path, WHOLE)
    assert engine.context_paths is None
    ctx = {"idp": {"a": 1}}
    assert project_context(ctx, None) is ctx
    assert not engine.evaluate("Any", agent="a1", principal="p", resource={"type": "GovernedObject", "id": SO},
                               so_id=SO, context=ctx).allowed
    assert engine.evaluate("Any", agent="a1", principal="p", resource={"type": "GovernedObject", "id": SO},
                           so_id=SO, context={}).allowed


def test_example_policies_read_only_their_paths() -> None:
    """The shipped policies read three IDP attributes; the reduction keeps those and what `has` needs."""
    engine = PolicyEngine(EXAMPLE_POLICIES)
    assert set(engine.context_paths or ()) == {("idp", "confidence_level"), ("idp", "mission_ref"),
                                                ("idp", "reasoning_basis", "type")}
    ctx = {"idp": {"confidence_level": {"__extn": {"fn": "decimal", "arg": "0.9000"}}, "goal_id": "g",
                   "reasoning_basis": {"type": "RULE_BASED"}}, "agent": "a"}
    assert project_context(ctx, engine.context_paths) == {
        "idp": {"confidence_level": {"__extn": {"fn": "decimal", "arg": "0.9000"}}, "reasoning_basis": {"type": "RULE_BASED"}}}


@pytest.mark.parametrize(
    ("policy", "paths"),
    [
        ('permit(principal, action, resource) when { context.a.b == 1 && context has a };', (("a",), ("a", "b"))),
        ('permit(principal, action, resource) when { (if true then context else {}).a == 1 };', None),
        ('permit(principal, action, resource) when { [context.a].contains(1) };', (("a",),)),
        ('permit(principal, action, resource) when { context.a.b.lessThan(decimal("1.0")) };', (("a", "b"),)),
    ],
)
def test_context_paths_of_expressions(policy: str, paths: Any) -> None:
    """Attribute chains from `context` are paths; any other use of `context` means the whole context."""
    est = msgspec.json.decode(cedarpy.policies_to_json_str(policy))
    got = context_paths(est)
    assert (None if got is None else set(got)) == (None if paths is None else set(paths))


def test_projection_keeps_non_records_and_absence() -> None:
    """A path through a decimal or a string keeps that value whole; an absent path stays absent."""
    dec = {"__extn": {"fn": "decimal", "arg": "0.5000"}}
    ctx = {"a": {"d": dec, "s": "text"}, "b": 1}
    got = project_context(ctx, (("a", "d", "fn"), ("a", "s", "x"), ("c", "y"), ("a", "missing")))
    assert got == {"a": {"d": dec, "s": "text"}}
