"""Spec 003 governance holes: §8.7 agent-reported executed actions and the gate, audit_accessible on every IDP
event (§4.2, §9), confidence never rounded up into a policy (§5.4), names as PII (§9), the verification record
in the gap escalation (§5.5.2(b)), the INSTRUCTION source (§4.3), deny codes (§6.2, §11), mandate before index."""

from __future__ import annotations

import base64
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import rfc8785
from cryptography.exceptions import InvalidSignature

from gateway.kernel.hem import hem_moment
from gateway.kernel.service import KernelService
from pgwcore.keys import public_keys
from subjects.idp import DenyCode, EnrichedDeny, Permit, Reject, RejectCode, decode_idp
from subjects.kernelops import AuditRequest, audit_reply_decoder
from tests.kernel_support import (
    REPO,
    Issuer,
    idp,
    kernel_config,
    policy_dir,
    read_log,
    request,
    running_gateway,
    stored_verdicts,
    thin,
)

AGENT = "bot"
SECRET = "Quietly move the reserve to the side account"


class Env:
    def __init__(self, nc: Any, issuer: Issuer, gw: Any, cfg: Any, **mandate: Any) -> None:
        self.nc, self.issuer, self.gw, self.cfg = nc, issuer, gw, cfg
        self.js = nc.jetstream()
        self.so = str(uuid.uuid4())
        self.token, self.jti = issuer.mandate(agent=AGENT, so_id=self.so, **mandate)
        self.kernel = next(p for p in gw.parts if isinstance(p, KernelService))

    def idp(self, step: int, action: str = "CloseBooking", **over: Any) -> dict[str, Any]:
        return idp(so_id=self.so, mandate_id=self.jti, step=step, action=action, **over)

    async def send(self, rec: dict[str, Any], *, mandate: str | None = None) -> Any:
        return await request(self.nc, AGENT, {"mandate": mandate or self.token, "idp": rec})

    async def report(self, idp_id: str, executed: str, seq: int) -> str:
        data = msgspec.json.encode({"idp_id": idp_id, "executed_action": executed,
                                    "effect": {"type": "booking.close", "status": "dispatched"}})
        return await self.kernel.handle_transition(AGENT, data, seq)


@pytest.fixture
def kernel_env(make_config: Any, nc: Any, tmp_path: Path, request: Any):
    """A gateway with the kernel and the example policies; kernel options (and ``policy``, ``mandate``) via a marker."""
    marker = request.node.get_closest_marker("kernel")
    options = dict(marker.kwargs) if marker else {}
    text = options.pop("policy", None)
    mandate = options.pop("mandate", {})

    async def _make() -> AsyncIterator[Env]:
        issuer = Issuer(tmp_path / "issuer")
        cfg = kernel_config(make_config, issuer, policy_dir(tmp_path, text), checkpoint_interval_s=0, **options)
        async with running_gateway(cfg, nc) as gw:
            yield Env(nc, issuer, gw, cfg, **mandate)

    return _make


@pytest.fixture
async def env(kernel_env: Any) -> AsyncIterator[Env]:
    async for e in kernel_env():
        yield e


def _verify_record(record: dict[str, Any], keys: dict[str, Any]) -> None:
    """spec 003 §5.5.1: Ed25519 over the JCS of every field but kernel_signature; raises if it does not verify."""
    sig = record["kernel_signature"]
    unsigned = {k: v for k, v in record.items() if k != "kernel_signature"}
    keys[record["kid"]].verify(base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4)), rfc8785.dumps(unsigned))


# -- §8.7: the executed action is the agent's report ------------------------------


async def test_every_record_says_the_executed_action_is_agent_reported(env: Env) -> None:
    """STATE_TRANSITIONED, the signed verification record, its IDP_COMMITMENT_VERIFIED / _GAP event and the verdict all
    say executed_action_source agent_reported (spec 003 §8.7); the record's kernel signature verifies, and fails once
    the source is altered."""
    ok, off = env.idp(1), env.idp(2)
    for rec in (ok, off):
        assert isinstance(await env.send(rec), Permit)
    assert await env.report(ok["idp_id"], "CloseBooking", 901) == "verified"
    assert await env.report(off["idp_id"], "ReadBooking", 902) == "gap"
    keys = {k.kid: k.public for k in public_keys(env.cfg.data_path, "kernel")}
    [(_, st1), (_, st2)] = await read_log(env.js, "STATE_TRANSITIONED")
    assert st1.body["executed_action_source"] == st2.body["executed_action_source"] == "agent_reported"
    for etype in ("IDP_COMMITMENT_VERIFIED", "IDP_COMMITMENT_GAP"):
        [(_, ev)] = await read_log(env.js, etype)
        assert ev.body["executed_action_source"] == "agent_reported"
        record = ev.body["record"]
        assert record["executed_action_source"] == "agent_reported"
        _verify_record(record, keys)
        with pytest.raises(InvalidSignature):
            _verify_record({**record, "executed_action_source": "kernel_gate"}, keys)
    [v] = await stored_verdicts(env.js, "executed", lambda v: v.idp_id == ok["idp_id"])
    assert v.details["executed_action_source"] == "agent_reported"


@pytest.mark.kernel(gated_actions=["ProcessPayment"])
async def test_a_gated_action_is_denied_and_a_report_of_it_refused_as_a_finding(env: Env) -> None:
    """With ProcessPayment in kernel.gated_actions and no gate: a request for it is DENY GATE_REQUIRED (even where Cedar
    permits and even with hem_urgency REQUIRED), it is never offered as available, and an agent's report claiming it was
    executed is refused with code GATE_REQUIRED and logged as a CRITICAL finding, with no STATE_TRANSITIONED (§8.7)."""
    instr = {"type": "INSTRUCTION", "description": f"The principal asked for it under mandate {env.jti}"}
    r = await env.send(env.idp(1, "ProcessPayment", reasoning_basis=instr))
    assert isinstance(r, EnrichedDeny) and r.deny_code == "GATE_REQUIRED" and r.hem_available is False, r
    assert "ProcessPayment" not in r.available_actions and "CloseBooking" in r.available_actions
    r2 = await env.send(env.idp(2, "ProcessPayment", reasoning_basis=instr, hem_urgency="REQUIRED"))
    assert isinstance(r2, EnrichedDeny) and r2.deny_code == "GATE_REQUIRED"
    assert await read_log(env.js, "HEM_ESCALATED") == []
    denied = await env.send(env.idp(3, confidence_level=0.1))  # a POLICY_DENY: the gated action is not offered either
    assert isinstance(denied, EnrichedDeny) and denied.deny_code == "POLICY_DENY"
    assert "ProcessPayment" not in denied.available_actions
    rec = env.idp(4)
    assert isinstance(await env.send(rec), Permit)
    assert (await env.report(rec["idp_id"], "ProcessPayment", 903)).startswith("refused:")
    [(_, refused)] = await read_log(env.js, "TRANSITION_REFUSED")
    assert refused.body["code"] == "GATE_REQUIRED" and refused.body["executed_action_source"] == "agent_reported"
    assert refused.body["alert"]["severity"] == "CRITICAL" and refused.body["alert"]["alert_trigger"] == "GATE_REQUIRED"
    assert await read_log(env.js, "STATE_TRANSITIONED") == []
    [v] = await stored_verdicts(env.js, "denied", lambda v: v.idp_id == rec["idp_id"])
    assert v.reason.code == "GATE_REQUIRED"


@pytest.mark.kernel(policy=(
    'permit(principal, action == Action::"CloseBooking", resource)\n'
    '  when { !context.execution.gated && context.execution.executed_action_source == "agent_reported" };\n'
    'permit(principal, action == Action::"ProcessPayment", resource);\n'
    'forbid(principal, action == Action::"ProcessPayment", resource) unless { context.execution.gated };\n'
))
async def test_a_policy_reads_whether_the_action_will_transit_a_gate(env: Env) -> None:
    """Cedar's context.execution says the executed action will be agent-reported and not gated, so a policy can require
    the gate for an action (ProcessPayment denied) and still permit the rest (spec 003 §8.7)."""
    assert isinstance(await env.send(env.idp(1)), Permit)
    r = await env.send(env.idp(2, "ProcessPayment"))
    assert isinstance(r, EnrichedDeny) and r.deny_code == "POLICY_DENY"


# -- §4.2, §9: audit_accessible on every event of an IDP ----------------------------


@pytest.mark.kernel(mandate={"mission_ref": "6f1c2a4e-2b7d-4c1e-9f3a-1d2e3f4a5b6c"})
async def test_a_restricted_idp_denied_for_its_mission_ref_stays_restricted(env: Env) -> None:
    """An audit_accessible: false IDP whose only event is IDP_MISSION_REF_MISMATCH_REJECTED (spec 003 §5.2(g)) is withheld
    from the Session Audit Record (listed under restrictions) and refused by the IDP query (§4.2, §9)."""
    hidden = env.idp(1, mission_ref=str(uuid.uuid4()), audit_accessible=False,
                     declared_goal={"goal_id": str(uuid.uuid4()), "description": SECRET})
    r = await env.send(hidden)
    assert isinstance(r, EnrichedDeny) and r.deny_code == "IDP_MISSION_REF_MISMATCH"
    [(_, ev)] = await read_log(env.js, "IDP_MISSION_REF_MISMATCH_REJECTED")
    assert ev.body["audit_accessible"] is False

    async def ask(req: AuditRequest) -> Any:
        return audit_reply_decoder.decode((await env.nc.request("pgw.kernel.audit.carol", msgspec.json.encode(req), timeout=10)).data)

    session = await ask(AuditRequest(kind="session", id="s-1", agent=AGENT))
    one = await ask(AuditRequest(kind="idp", id=hidden["idp_id"]))
    assert session.ok and session.record is not None
    assert SECRET not in msgspec.json.encode(session).decode()
    [restriction] = session.record["restrictions"]
    assert restriction["idp_id"] == hidden["idp_id"] and "idp" in restriction["withheld"]
    assert not one.ok and one.refusal.code == "AUDIT_RESTRICTED" and SECRET not in msgspec.json.encode(one).decode()


# -- §5.4: confidence_level is never rounded up into a threshold ------------------


def test_cedar_decimal_truncates_toward_zero() -> None:
    """Cedar's four fractional digits are cut, never rounded up: 0.79995 is 0.7999, 0.8 stays 0.8000 (spec 003 §5.4)."""
    from gateway.kernel.policy import cedar_decimal

    assert cedar_decimal(0.79995) == "0.7999"
    assert cedar_decimal(0.99999) == "0.9999"
    assert cedar_decimal(0.8) == "0.8000" and cedar_decimal(1.0) == "1.0000" and cedar_decimal(0.0) == "0.0000"
    assert cedar_decimal(0.1 + 0.7) == "0.7999"  # the value sent is 0.7999999999999999


async def test_confidence_just_below_the_threshold_is_denied(env: Env) -> None:
    """With the example policy (CloseBooking needs confidence >= 0.8): 0.79995 and 0.79999999 are denied, 0.8 and
    0.80001 permitted (spec 003 §5.4)."""
    results = {c: await env.send(env.idp(i, confidence_level=c)) for i, c in enumerate((0.79995, 0.79999999, 0.8, 0.80001), 1)}
    assert isinstance(results[0.79995], EnrichedDeny) and results[0.79995].deny_code == "POLICY_DENY"
    assert isinstance(results[0.79999999], EnrichedDeny)
    assert isinstance(results[0.8], Permit) and isinstance(results[0.80001], Permit)


# -- §9: names are personal data; the default keeps flagged PII out of the log ------------


async def test_flagged_pii_is_refused_and_never_logged_by_default(env: Env) -> None:
    """With the default configuration, a titled name ("Mr Smith") or an e-mail address in a description is IDP_MALFORMED
    (rule pii) and no log event holds the text (spec 003 §9)."""
    for i, text in enumerate(["Tell Mr Smith the booking closed", "Mail bob@example.com"], 1):
        r = await env.send(env.idp(i, declared_goal={"goal_id": str(uuid.uuid4()), "description": text}))
        assert isinstance(r, Reject) and r.error_code == "IDP_MALFORMED" and r.details[0].rule == "pii", r
    logged = msgspec.json.encode([e.body for _s, e in await read_log(env.js)]).decode()
    assert "Smith" not in logged and "bob@" not in logged
    assert isinstance(await env.send(env.idp(3)), Permit)  # "Close the guest's booking after checkout": no name


@pytest.mark.kernel(pii_names=["Jane Doe"])
async def test_configured_names_are_personal_data(env: Env) -> None:
    """A kernel.pii_names entry is flagged in any case and spacing as a whole word, and only as one (spec 003 §9)."""
    r = await env.send(env.idp(1, declared_goal={"goal_id": str(uuid.uuid4()), "description": "Confirm with jane  DOE first"}))
    assert isinstance(r, Reject) and r.details[0].rule == "pii" and r.details[0].message.startswith("name"), r
    ok = env.idp(1, declared_goal={"goal_id": str(uuid.uuid4()), "description": "Confirm with Janedoe Travel first"})
    assert isinstance(await env.send(ok), Permit)


@pytest.mark.kernel(pii_names=["Jane Doe", "Ivan Doe"])
async def test_disguised_personal_data_is_refused_and_never_logged(env: Env) -> None:
    """The rule judges what a person reads: a name, a titled name, an e-mail address or a phone number written in
    full-width or mathematical letters, with a Cyrillic look-alike, a zero-width space inside, an accent, or a
    full-width or small at sign is IDP_MALFORMED (rule pii), and no log event holds it. Before, each was permitted
    and kept in the event log, which denies delete and purge (found by an attack from the docs)."""
    disguised = ["Refund \u0406van Doe", "Refund \uff2a\uff41\uff4e\uff45 \uff24\uff4f\uff45", "Refund \U0001d409\U0001d41a\U0001d427\U0001d41e Doe",
                 "Refund J\u0430ne Doe", "Refund Ja\u200bne Doe", "Refund Jan\u00e9 Doe", "Ask \uff2d\uff52 Smith",
                 "Ask M\u200br Smith", "Mail jroe\uff20example.com", "Mail jroe\ufe6bexample.com",
                 "Mail jroe@\u200bexample.com", "Mail jr\u043e\u0435@\u0435x\u0430mple.com",
                 "Call +1 4\u200b15 5\u200b55 01\u200b99"]
    for i, text in enumerate(disguised, 1):
        r = await env.send(env.idp(i, declared_goal={"goal_id": str(uuid.uuid4()), "description": text}))
        assert isinstance(r, Reject) and r.error_code == "IDP_MALFORMED" and r.details[0].rule == "pii", (text, r)
    logged = msgspec.json.encode([e.body for _s, e in await read_log(env.js)]).decode("utf-8")
    assert not [t for t in disguised if t.split(" ", 1)[1] in logged]
    assert isinstance(await env.send(env.idp(len(disguised) + 1)), Permit)  # a description with none


# -- §5.5.2(b): the gap escalation carries the verification record -----------------


def test_the_gap_moment_carries_the_verification_record() -> None:
    """The HEM moment for an IDP_COMMITMENT_GAP says in words what was declared and what ran, surfaces match_result,
    and carries every field of the verification record (spec 003 §5.5.2(b)), labelled for auditors."""
    rec = decode_idp(idp(so_id=str(uuid.uuid4()), mandate_id="j-1", step=1, action="CloseBooking"))
    record = {"idp_id": rec.idp_id, "state_transition_id": "st-41", "state_transition_seq": 41,
              "verified_at": "2026-11-27T18:00:00Z", "match_result": "IDP_COMMITMENT_GAP", "requested_action": "CloseBooking",
              "executed_action": "RefundBooking", "executed_action_source": "agent_reported", "kid": "k-1",
              "kernel_signature": "c2lnbmF0dXJl"}
    bm = hem_moment(agent=AGENT, idp=rec, trigger="IDP_COMMITMENT_GAP", verification=record)
    text = "\n".join(bm.findings)
    assert "match_result IDP_COMMITMENT_GAP" in text
    assert bm.findings[0].startswith("Why you are asked: agent bot said it would do CloseBooking but did RefundBooking")
    for k, v in record.items():
        assert k in text and str(v) in text, k


# -- §4.3: INSTRUCTION names its source as a word, not as a substring ------------------


async def test_a_one_character_session_id_is_not_named_by_any_word(kernel_env: Any) -> None:
    """With session_id "s", "The principal asked for it" does not name the source (it merely contains an s): IDP_MALFORMED;
    "instruction from session s." does (spec 003 §4.3)."""
    async for env in kernel_env():
        bad = env.idp(1, "ProcessPayment", session="s",
                      reasoning_basis={"type": "INSTRUCTION", "description": "The principal asked for it"})
        r = await env.send(bad)
        assert isinstance(r, Reject) and r.error_code == "IDP_MALFORMED" and r.details[0].rule == "instruction_source"
        ok = env.idp(1, "ProcessPayment", session="s",
                     reasoning_basis={"type": "INSTRUCTION", "description": "Paying on the instruction from session s."})
        assert isinstance(await env.send(ok), Permit)


# -- mandate before the index --------------------------------------------------------------


async def test_without_a_valid_mandate_an_agent_cannot_learn_that_an_idp_id_exists(env: Env, tmp_path: Path) -> None:
    """A request with a mandate from an untrusted issuer is MANDATE_INVALID whether or not its idp_id is committed, so the
    index answers nobody without a valid mandate (IDP_DUPLICATE only after the mandate verifies)."""
    rec = env.idp(1)
    assert isinstance(await env.send(rec), Permit)
    rogue_token, rogue_jti = Issuer(tmp_path / "rogue").mandate(agent=AGENT, so_id=env.so)
    known = await env.send({**rec, "mandate_id": rogue_jti, "step_sequence": 2}, mandate=rogue_token)
    fresh = await env.send({**env.idp(2), "mandate_id": rogue_jti}, mandate=rogue_token)
    assert isinstance(known, Reject) and isinstance(fresh, Reject)
    assert known.error_code == fresh.error_code == "MANDATE_INVALID"
    again = await env.send({**rec, "step_sequence": 2})
    assert isinstance(again, Reject) and again.error_code == "IDP_DUPLICATE"


# -- §4.4 RECOMMENDED, §7 thin-profile commitment checks ---------------------------------------


@pytest.mark.kernel(policy='permit(principal, action, resource) when { context.idp.hem_urgency == "RECOMMENDED" };\n')
async def test_recommended_is_recorded_and_given_to_policy_without_hem(env: Env) -> None:
    """hem_urgency RECOMMENDED is recorded in IDP_SUBMITTED and is what Cedar sees; it does not start HEM (spec 003 §4.4)."""
    assert isinstance(await env.send(env.idp(1, hem_urgency="RECOMMENDED")), Permit)
    assert isinstance(await env.send(env.idp(2, hem_urgency="NONE")), EnrichedDeny)
    [(_, first), _second] = await read_log(env.js, "IDP_SUBMITTED")
    assert first.body["idp"]["hem_urgency"] == "RECOMMENDED" and first.body["idp_recorded"]["hem_urgency"] == "RECOMMENDED"
    assert await read_log(env.js, "HEM_ESCALATED") == []


async def test_thin_profile_idps_are_commitment_checked(env: Env) -> None:
    """An IDP_THIN's requested_action is the basis of the commitment check (spec 003 §7): a matching report is
    IDP_COMMITMENT_VERIFIED, a different one IDP_COMMITMENT_GAP and HEM."""
    same, other = thin(env.idp(1, "ReadBooking")), thin(env.idp(2, "ReadBooking"))
    for rec in (same, other):
        assert isinstance(await env.send(rec), Permit)
    assert await env.report(same["idp_id"], "ReadBooking", 911) == "verified"
    assert await env.report(other["idp_id"], "CloseBooking", 912) == "gap"
    [(_, gap)] = await read_log(env.js, "IDP_COMMITMENT_GAP")
    assert gap.body["record"]["requested_action"] == "ReadBooking" and gap.body["record"]["executed_action"] == "CloseBooking"
    [(_, esc)] = await read_log(env.js, "HEM_ESCALATED")
    assert esc.body["trigger"] == "IDP_COMMITMENT_GAP" and esc.body["idp_id"] == other["idp_id"]


# -- §6.2, §11: every code outside the registry is a documented extension ----------------------

_SPEC_CODES = {
    "POLICY_DENY", "MANDATE_SCOPE", "SO_STATE_INVALID", "HEM_PENDING", "MANDATE_REVOKED", "CROSS_PRINCIPAL_UNRESOLVED",
    "MISSION_INVALID", "IDP_MISSION_REF_MISMATCH", "IDP_MISSING", "IDP_MALFORMED", "IDP_DUPLICATE", "IDP_SO_MISMATCH",
    "IDP_MANDATE_MISMATCH", "IDP_THIN_NOT_ACCEPTED",
}


def test_codes_beyond_the_registry_are_documented_as_extensions() -> None:
    """Every REJECT and DENY code the kernel can answer that spec 003 §11 Table 2 does not register is listed in
    docs/kernel.md's extension table."""
    text = (REPO / "docs" / "kernel.md").read_text()
    section = text.split("## Codes beyond spec 003 §11", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([A-Z_]+)` \|", section, re.M))
    ours = set(RejectCode.__args__) | set(DenyCode.__args__)  # type: ignore[attr-defined]
    assert ours - _SPEC_CODES <= documented, sorted(ours - _SPEC_CODES - documented)
    assert documented and not documented & _SPEC_CODES


# -- §4.1, §4.5, §7: every REQUIRED field; §4.2, §5.3: what IDP_SUBMITTED holds; §5.4: the context --------

_STANDARD_REQUIRED = ("idp_id", "session_id", "so_id", "mandate_id", "step_sequence", "requested_action",
                      "declared_goal", "reasoning_basis", "confidence_level", "hem_urgency", "timestamp")
_THIN_REQUIRED = ("idp_id", "session_id", "so_id", "mandate_id", "step_sequence", "requested_action", "timestamp")


@pytest.mark.parametrize("field", (*_STANDARD_REQUIRED, "declared_goal.goal_id", "declared_goal.description",
                                   "reasoning_basis.type", "reasoning_basis.description"))
def test_every_required_standard_field_is_required(field: str) -> None:
    """An IDP_STANDARD missing any REQUIRED field of spec 003 §4.1 (nested ones included) is malformed (§4.5, §5.2(b))."""
    rec = idp(so_id=str(uuid.uuid4()), mandate_id="j-1", step=1, action="CloseBooking")
    outer, _, inner = field.partition(".")
    if inner:
        rec[outer] = {k: v for k, v in rec[outer].items() if k != inner}
    else:
        del rec[outer]
    with pytest.raises(msgspec.ValidationError, match=inner or outer):
        decode_idp(rec)


@pytest.mark.parametrize("field", _THIN_REQUIRED)
def test_every_required_thin_field_is_required(field: str) -> None:
    """An IDP_THIN missing any field §7 says it MUST contain is malformed; without ``profile`` it is read as
    IDP_STANDARD and lacks the reasoning fields."""
    rec = thin(idp(so_id=str(uuid.uuid4()), mandate_id="j-1", step=1, action="ReadBooking"))
    del rec[field]
    with pytest.raises(msgspec.ValidationError, match=field):
        decode_idp(rec)
    with pytest.raises(msgspec.ValidationError):
        decode_idp({k: v for k, v in thin(idp(so_id=str(uuid.uuid4()), mandate_id="j", step=1, action="A")).items()
                    if k != "profile"})


async def test_idp_submitted_holds_what_section_5_3_lists(env: Env) -> None:
    """IDP_SUBMITTED holds the IDP exactly as submitted (metadata uninterpreted), the kernel receipt time beside the
    agent's, the mandate_id, the session_id, audit_accessible (true when absent) and the profile, and is signed by
    the kernel (spec 003 §4.2, §4.5, §5.3, §8.2)."""
    from gateway.kernel.eventlog import check_signature

    meta = {"ticket": "T-1", "nested": {"n": 3, "list": [1, "two", None]}, "unicode": "Zoë"}
    rec = env.idp(1, metadata=meta, timestamp="2026-01-02T03:04:05.5Z")
    assert isinstance(await env.send(rec), Permit)
    [(_, ev)] = await read_log(env.js, "IDP_SUBMITTED")
    b = ev.body
    assert b["idp"] == rec and b["idp"]["metadata"] == meta
    assert b["agent_ts"] == "2026-01-02T03:04:05.5Z" and b["kernel_receipt_ts"] != b["agent_ts"]
    assert b["mandate_id"] == env.jti and b["session_id"] == "s-1"
    assert b["audit_accessible"] is True and b["profile"] == "IDP_STANDARD"
    keys = {k.kid: k.public for k in public_keys(env.cfg.data_path, "kernel")}
    assert check_signature(ev, keys) is None


_GOAL = "5b0e7f0a-1c2d-4e3f-8a9b-0c1d2e3f4a5b"
_MISSION = "6f1c2a4e-2b7d-4c1e-9f3a-1d2e3f4a5b6c"


@pytest.mark.kernel(
    mandate={"mission_ref": _MISSION},
    policy=(f'permit(principal, action, resource) when {{ context.idp.goal_id == "{_GOAL}" && '
            f'context.idp has mission_ref && context.idp.mission_ref == "{_MISSION}" }};\n'),
)
async def test_goal_id_and_mission_ref_are_cedar_context(env: Env) -> None:
    """context.idp.goal_id and context.idp.mission_ref (absent, never null, without one) decide a policy (spec 003 §5.4)."""
    goal = {"goal_id": _GOAL, "description": "Advance the mission"}
    assert isinstance(await env.send(env.idp(1, declared_goal=goal, mission_ref=_MISSION)), Permit)
    assert isinstance(await env.send(env.idp(2, declared_goal=goal)), EnrichedDeny)
    assert isinstance(await env.send(env.idp(3, mission_ref=_MISSION)), EnrichedDeny)
