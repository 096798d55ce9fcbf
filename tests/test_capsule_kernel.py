"""Capsules of kernel transitions tell what happened (issue 20: items 1, 4, 5).

A real gateway with the IDP kernel and the real signer against a real
nats-server: an agent's IDP is permitted, the agent reports a transition,
and the statements the signer makes of it are read back from
``PGW_REGISTRATION`` and checked by ``pgw verify`` and by the reference
verifier from PyPI.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import cbor2
import msgspec
import pytest

from consumers import capsule_kernel as kernel_facts
from consumers import capsule_v4
from consumers.capsule import (
    salted_digest,
)
from consumers.capsule_map import capsule_from_verdict
from consumers.signer import Signer, load_or_create_salt, salt_path
from consumers.verifier import payload_of, verify_many
from pgwcli.commands import capsules as cli
from subjects.idp import Permit
from tests import refverifier
from tests import test_kernel_hem as hem
from tests.kernel_support import read_log
from tests.polling import until
from tests.test_capsule_model import SALT, verdict
from tests.test_capsule_signer import signer_keys, stream_items
from tests.test_kernel_hem import Env

env = hem.env  # the fixture: a gateway with the IDP kernel, agent bot bound to principal alice


async def transition(env: Env, executed: str, effect: dict[str, Any] | None = None) -> tuple[str, Any]:
    """Permit one IDP (declared CloseBooking), report ``executed``; return its id and config."""
    rec = env.idp(1)
    assert isinstance(await env.send(rec), Permit)
    await env.report(rec["idp_id"], executed, effect)
    await env.watch.wait("verdict:executed", lambda v: v["idp_id"] == rec["idp_id"])
    return rec["idp_id"], env.gw.config


def with_format(config: Any, fmt: str) -> Any:
    return msgspec.structs.replace(config, signer=msgspec.structs.replace(config.signer, capsule_format=fmt))


async def statements_of(env: Env, idp_id: str, fmt: str = "2") -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """(the action's capsule, its outcome statement, every stored statement) once the signer made them.

    The signer writes format ``fmt`` ("2" unless a test says otherwise: the profile
    whose reference verifier, 0.1.0, these tests run).
    """
    config = with_format(env.gw.config, fmt)
    js = env.js

    def action_capsule(p: dict[str, Any]) -> bool:
        return p.get("action_id") == idp_id and "statement_type" not in p and p.get("action_type") != "fyi" \
            and p["disposition"].get("verdict_class", "executed") in ("executed", "errored")

    def outcome(p: dict[str, Any]) -> bool:  # a -01 outcome statement, or (format 4) an outcome capsule
        return p.get("action_id") == idp_id and (
            p.get("statement_type") == "outcome" or (p.get("chain") or {}).get("relation") == "confirms")

    async def both() -> list[Any] | None:
        items = await stream_items(js, "PGW_REGISTRATION")
        payloads = [payload_of(d) or {} for _, d, _ in items]
        return items if any(map(action_capsule, payloads)) and any(map(outcome, payloads)) else None

    async with Signer(config, env.nc):
        items = await until(both, timeout=20, what="the transition's capsule and outcome statement")
    payloads = [payload_of(d) or {} for _, d, _ in items]
    cap = next(filter(action_capsule, payloads))
    out = next(filter(outcome, payloads))
    return cap, out, items


async def test_commitment_gap_capsule_records_what_ran(env: Env) -> None:
    """An IDP_COMMITMENT_GAP capsule carries verdict_class and a salted reason_digest over the structured
    reason, binds the check's content by digest only (§8.1) and claims no approval of what ran."""
    idp_id, config = await transition(env, "CloseBooking ")
    cap, out, items = await statements_of(env, idp_id)
    salt = load_or_create_salt(salt_path(config))
    d = cap["disposition"]
    assert d["verdict_class"] == "executed"
    reason = {"code": "IDP_COMMITMENT_GAP", "match_result": "IDP_COMMITMENT_GAP", "match_rule": "string_exact",
              "declared_action": "CloseBooking", "executed_action": "CloseBooking "}
    assert d["reason_digest"] == salted_digest(salt, reason)
    assert d["decision"] == "needs_input" and d["approver"] == "policy" and d["human_disposed"] is False
    assert not {"action_kind", "declared_action", "match_result"} & set(cap["pgw"])
    check = next(c for c in cap["constraints"] if c["id"] == kernel_facts.COMMITMENT_CHECK_ID)
    assert check["result"] == "fail" and check["blocking"] is False and check["check_type"].startswith("io.pgw.")
    # §3.3: the kernel's independent check disputes the action, in a statement of its own
    assert out["outcome"]["kind"] == "dispute" and out["refers_to"] == cap["capsule_id"]
    assert out["outcome"]["reason_digest"] == d["reason_digest"]
    results = verify_many([(s, data) for s, data, _ in items], keys=signer_keys(config))
    assert all(r.ok for r in results), [(r.source, r.findings) for r in results if not r.ok]
    # capsules only: no outcome statements, no event-log checkpoint (it has no capsule_id)
    ref = refverifier.run([p for p in (payload_of(data) for _, data, _ in items)
                           if "statement_type" not in p and "capsule_id" in p])
    assert ref and all(r.ok and not r.errors for r in ref), [(r.capsule_id, r.errors) for r in ref]
    print("reference 0.1.0 (kernel run):", refverifier.summary(ref))  # counts for docs/capsules.md


async def test_confirmed_without_response_agrees_with_the_log(env: Env) -> None:
    """A transition reported `confirmed` with no response: STATE_TRANSITIONED and the capsule both record
    the dispatched status §5.2 allows, each with the reported status beside it, and every effect fact agrees."""
    effect = {"type": "booking.close", "status": "confirmed", "request": {"id": 7}, "external_ref": "bk-7"}
    idp_id, _config = await transition(env, "CloseBooking", effect)
    cap, _out, _items = await statements_of(env, idp_id)
    st = next(ev for _seq, ev in await read_log(env.js, "STATE_TRANSITIONED") if ev.body["idp_id"] == idp_id)
    logged = st.body["effect"]
    e = cap["effect"]
    assert e["status"] == "dispatched" and "response_digest" not in e  # §5.2: no confirmed without it
    assert cap["pgw"]["effect_status_reported"] == "confirmed"
    assert logged["status"] == e["status"] == "dispatched"  # the log says what the capsule says
    assert logged["status_reported"] == cap["pgw"]["effect_status_reported"] == "confirmed"
    assert (e["type"], e["request_digest"], e.get("external_ref")) == \
        (logged["type"], logged["request_digest"], logged["external_ref"])
    assert logged.get("response_digest") is None
    binding = next(c for c in cap["constraints"] if c["id"] == kernel_facts.BINDING_CHECK_ID)
    assert binding["result"] == "fail" and binding["blocking"] is False


@pytest.mark.parametrize("fmt", ["2"])
async def test_outcome_statement_for_a_verified_transition(env: Env, capsys: Any, fmt: str) -> None:
    """A matching transition yields an outcome statement (§3.3) under format "2": its own media
    type and statement type, the action's sub, and `pgw verify` verifies it and says what each statement is."""
    idp_id, config = await transition(env, "CloseBooking", {"type": "booking.close", "status": "confirmed",
                                                            "response": {"ok": True}})
    cap, out, items = await statements_of(env, idp_id, fmt)
    config = with_format(config, fmt)
    assert cap["format_version"] == fmt
    assert out["outcome"] == {"kind": "confirmation", "source": "io.pgw.kernel_commitment_check"}
    assert out["refers_to"] == cap["capsule_id"] and out["decision_id"] == cap["decision_id"]
    raw = next(data for _, data, _ in items if payload_of(data) == out)
    prot = cbor2.loads(cbor2.loads(raw).value[0])
    assert prot[3] == "application/agent-action-capsule-outcome+json"
    assert prot[15]["capsule_statement_type"] == "outcome"
    assert prot[15][2] == f"urn:agent-action-capsule:{cap['operator']}:{cap['action_id']}"
    capsys.readouterr()
    args = argparse.Namespace(paths=[], stream=["PGW_REGISTRATION"], key=[], ts_key=[], store=[], json=False)
    assert await cli.handle_verify(args, config) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("statement=outcome" in ln and ln.startswith("OK") for ln in lines), lines
    assert any(f"format={fmt}" in ln and "statement=outcome" not in ln for ln in lines), lines
    assert "ledger" not in out  # the hash chain stays store-level


async def test_format4_outcome_is_a_capsule(env: Env) -> None:
    """Under draft -05 {#outcomes} an outcome is a new capsule: format "4", chained `confirms` to the action's
    capsule, signed as a capsule-id statement like any capsule; no -01 outcome statement is emitted, and the
    newest reference verifier accepts both with no error or overclaim."""
    from tests.test_capsule_format4 import NEWEST

    idp_id, config = await transition(env, "CloseBooking", {"type": "booking.close", "status": "confirmed",
                                                            "response": {"ok": True}})
    cap, out, items = await statements_of(env, idp_id, "4")
    assert (out["format_version"], out["canonicalization_id"], out["action_type"]) == ("4", "jcs", "fyi")
    assert out["spec_version"] == capsule_v4.SPEC_VERSION and "statement_type" not in out
    assert out["chain"] == {"parent_capsule_id": cap["capsule_id"], "relation": "confirms"}
    assert out["assurance"]["ledger_mode"] == "chained" and out["decision_id"] == cap["decision_id"]
    assert [c["result"] for c in out["constraints"]] == ["pass"]
    raw = next(data for _, data, _ in items if payload_of(data) == out)
    prot = cbor2.loads(cbor2.loads(raw).value[0])
    assert prot[3] == capsule_v4.ID_MEDIA_TYPE and set(prot[15]) == {1, 2}
    assert not any((payload_of(d) or {}).get("format_version") == "2" for _, d, _ in items)
    results = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(config))
    assert all(r.ok for r in results), [(r.source, r.findings) for r in results if not r.ok]
    payloads = [payload_of(d) for _, d, _ in items]
    ref = refverifier.run(payloads, version=NEWEST)
    bad = [(r.capsule_id, f.code, f.severity) for r in ref for f in r.findings
           if f.severity == "error" or "overclaim" in f.code]
    assert all(r.ok for r in ref) and not bad, bad


def test_gap_mapping_is_shared_by_both_formats() -> None:
    """The commitment-gap mapping holds in format "4" as in format "2": same verdict class and reason digest,
    and neither carries the declared or the executed action or the match result in clear (§8.1)."""
    v = verdict("gap", "executed", decision="accept", idp_id="idp-9", action_id="idp-9", action_type="CloseBooking",
                details={"match_result": "IDP_COMMITMENT_GAP", "requested_action": "CloseBooking",
                         "executed_action": "DeleteBooking", "effect_attestation": "runtime_claimed"})
    v2 = capsule_from_verdict(v, operator="acme", salt=SALT, chained=False).to_dict()
    v4 = capsule_v4.from_verdict(v, operator="acme", salt=SALT).body
    for body in (v2, v4):
        d = body["disposition"]
        assert (d["verdict_class"], d["decision"], d["human_disposed"]) == ("executed", "needs_input", False)
        assert d["reason_digest"] == v2["disposition"]["reason_digest"]
        text = json.dumps(body)
        assert "DeleteBooking" not in text and "CloseBooking" not in text and "IDP_COMMITMENT_GAP" not in text


@pytest.mark.parametrize("fmt", ["2", "4"])
async def test_capsule_carries_no_check_content_and_no_secret(env: Env, fmt: str) -> None:
    """An executed action holding an IBAN and an effect reference holding a secret: token leave neither
    in any statement byte (spec 004 §8.1: the check's content by digest only; SR-1 over every verdict)."""
    iban, token = "DE89370400440532013000", "secret:hunter2-hunter2"
    idp_id, _config = await transition(env, f"CloseBooking to {iban}",
                                       {"type": "booking.close", "status": "dispatched", "external_ref": f"ref {token}"})
    cap, _out, items = await statements_of(env, idp_id, fmt)
    assert cap["effect"]["external_ref"] == "ref [REDACTED]"
    for _, data, _ in items:
        assert iban.encode() not in data and b"hunter2" not in data
    assert not {"action_kind", "declared_action", "match_result"} & set(cap["pgw"])
    assert [c["result"] for c in cap["constraints"] if c["id"] == kernel_facts.COMMITMENT_CHECK_ID] == ["fail"]
