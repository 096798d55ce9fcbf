"""Transition requests on agent.{agent}.idp: spec 003 §5.2 REJECT codes, Enriched DENY (§6), Cedar (§5.4)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from gateway.kernel.mandate import MandateError, MandateVerifier, issue_mandate
from pgwcore.config import load_config
from pgwcore.keys import kid_of
from subjects.idp import EnrichedDeny, HemPending, Permit, Reject, kernel_result_decoder
from tests.kernel_support import (
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
from tests.logcapture import capture_logs_with_context

AGENT = "bot"


class Env:
    def __init__(self, nc: Any, issuer: Issuer, gw: Any) -> None:
        self.nc, self.issuer, self.gw = nc, issuer, gw
        self.js = nc.jetstream()
        self.so = str(uuid.uuid4())
        self.token, self.jti = issuer.mandate(agent=AGENT, so_id=self.so)

    def idp(self, step: int, action: str = "CloseBooking", **over: Any) -> dict[str, Any]:
        return idp(so_id=self.so, mandate_id=self.jti, step=step, action=action, **over)

    async def send(self, rec: dict[str, Any], *, mandate: str | None = None, agent: str = AGENT, **extra: Any) -> Any:
        return await request(self.nc, agent, {"mandate": mandate or self.token, "action": rec["requested_action"], "idp": rec, **extra})


@pytest.fixture
def issuer(tmp_path: Path) -> Issuer:
    return Issuer(tmp_path / "issuer")


@pytest.fixture
def kernel_env(make_config: Any, nc: Any, issuer: Issuer, tmp_path: Path, request: Any):
    """A gateway with the kernel, the example policies and one trusted issuer; kernel options via a marker."""
    marker = request.node.get_closest_marker("kernel")
    options = dict(marker.kwargs) if marker else {}
    text = options.pop("policy", None)

    async def _make() -> AsyncIterator[Env]:
        cfg = kernel_config(make_config, issuer, policy_dir(tmp_path, text), **options)
        async with running_gateway(cfg, nc) as gw:
            yield Env(nc, issuer, gw)

    return _make


@pytest.fixture
async def env(kernel_env: Any) -> AsyncIterator[Env]:
    async for e in kernel_env():
        yield e


async def test_permit_on_policy(env: Env) -> None:
    """A valid IDP whose action the policy permits gets PERMIT with the IDP_SUBMITTED sequence."""
    r = await env.send(env.idp(1))
    assert isinstance(r, Permit) and r.event_seq >= 1


async def test_request_not_json(env: Env) -> None:
    """A body that is not a JSON object is refused as REQUEST_MALFORMED, and the worker keeps serving."""
    r = await request(env.nc, AGENT, b"\xff not json")
    assert isinstance(r, Reject) and r.error_code == "REQUEST_MALFORMED"
    assert isinstance(await env.send(env.idp(1)), Permit)


async def test_idp_missing(env: Env) -> None:
    """A transition request without an IDP is REJECT IDP_MISSING (spec 003 §5.2(a))."""
    r = await request(env.nc, AGENT, {"mandate": env.token, "action": "CloseBooking"})
    assert isinstance(r, Reject) and r.error_code == "IDP_MISSING"
    verdicts = await stored_verdicts(env.js, "denied")
    assert [v.reason.code for v in verdicts] == ["IDP_MISSING"]


async def test_idp_malformed(env: Env) -> None:
    """An IDP breaking a field rule is REJECT IDP_MALFORMED with the offending path (spec 003 §5.2(b))."""
    r = await env.send(env.idp(1, confidence_level=1.5))
    assert isinstance(r, Reject) and r.error_code == "IDP_MALFORMED"
    assert r.details[0].path == "$.confidence_level"
    assert await read_log(env.js, "IDP_SUBMITTED") == []


async def test_action_must_equal_requested_action(env: Env) -> None:
    """The request's action must be the IDP's requested_action (spec 003 §4.2)."""
    rec = env.idp(1)
    r = await request(env.nc, AGENT, {"mandate": env.token, "action": "ReadBooking", "idp": rec})
    assert isinstance(r, Reject) and r.error_code == "IDP_MALFORMED"


async def test_idp_duplicate(env: Env) -> None:
    """A second submission of a committed idp_id is REJECT IDP_DUPLICATE (spec 003 §5.2(c))."""
    rec = env.idp(1)
    assert isinstance(await env.send(rec), Permit)
    again = {**rec, "step_sequence": 2}
    r = await env.send(again)
    assert isinstance(r, Reject) and r.error_code == "IDP_DUPLICATE"


async def test_mandate_untrusted_issuer(env: Env, tmp_path: Path) -> None:
    """A mandate signed by an issuer the configuration does not trust is MANDATE_INVALID."""
    rogue = Issuer(tmp_path / "rogue")
    token, jti = rogue.mandate(agent=AGENT, so_id=env.so)
    r = await env.send(idp(so_id=env.so, mandate_id=jti, step=1, action="CloseBooking"), mandate=token)
    assert isinstance(r, Reject) and r.error_code == "MANDATE_INVALID"


async def test_mandate_bad_signature(env: Env) -> None:
    """A mandate whose payload was altered after signing is MANDATE_INVALID."""
    head, payload, sig = env.token.split(".")
    tampered = f"{head}.{payload[:-2]}{'A' if payload[-2] != 'A' else 'B'}{payload[-1]}.{sig}"
    r = await env.send(env.idp(1), mandate=tampered)
    assert isinstance(r, Reject) and r.error_code == "MANDATE_INVALID"


async def test_mandate_for_another_agent(env: Env) -> None:
    """A mandate whose sub is another agent is refused: the subject token is the identity."""
    token, jti = env.issuer.mandate(agent="other", so_id=env.so)
    r = await env.send(idp(so_id=env.so, mandate_id=jti, step=1, action="CloseBooking"), mandate=token)
    assert isinstance(r, Reject) and r.error_code == "MANDATE_INVALID"


async def test_mandate_expired(env: Env) -> None:
    """A mandate past exp (beyond the clock skew) is MANDATE_EXPIRED."""
    token, jti = env.issuer.mandate(agent=AGENT, so_id=env.so, ttl_s=-300)
    r = await env.send(idp(so_id=env.so, mandate_id=jti, step=1, action="CloseBooking"), mandate=token)
    assert isinstance(r, Reject) and r.error_code == "MANDATE_EXPIRED"


def test_remembered_mandate_is_still_checked(issuer: Issuer, tmp_path: Path) -> None:
    """A mandate whose signature was verified before is still refused for another agent and after its expiry."""
    cfg = load_config(None, data_dir=str(tmp_path / "data"), kernel={"issuers": {issuer.kid: str(issuer.pem_path)}})
    verifier = MandateVerifier(cfg.kernel)
    token, jti = issuer.mandate(agent=AGENT, so_id=str(uuid.uuid4()), ttl_s=600)
    first = verifier.verify(token, agent=AGENT)
    first.claims["sub"] = "tampered by a caller"
    assert verifier.verify(token, agent=AGENT).jti == jti
    with pytest.raises(MandateError) as other:
        verifier.verify(token, agent="other")
    assert other.value.code == "MANDATE_INVALID"
    with pytest.raises(MandateError) as late:
        verifier.verify(token, agent=AGENT, now=time.time() + 3600)
    assert late.value.code == "MANDATE_EXPIRED"


@pytest.mark.kernel(revoked_jtis=["revoked-1"])
async def test_mandate_revoked(env: Env) -> None:
    """A mandate whose jti is on the revocation list is an Enriched DENY MANDATE_REVOKED (a deny code of spec 003 §6.2)
    with nothing available and no HEM, its IDP committed as IDP_RECEIVED first."""
    token, jti = env.issuer.mandate(agent=AGENT, so_id=env.so, jti="revoked-1")
    rec = idp(so_id=env.so, mandate_id=jti, step=1, action="CloseBooking")
    r = await env.send(rec, mandate=token)
    assert isinstance(r, EnrichedDeny) and r.deny_code == "MANDATE_REVOKED", r
    assert r.available_actions == [] and r.hem_available is False and r.idp_received == rec
    [(seq, received)] = await read_log(env.js, "IDP_RECEIVED")
    assert r.event_seq == seq and received.body["code"] == "MANDATE_REVOKED"


async def test_es256_mandate(make_config: Any, nc: Any, tmp_path: Path) -> None:
    """An ES256 mandate from a trusted P-256 issuer is accepted."""
    from cryptography.hazmat.primitives import serialization

    key = ec.generate_private_key(ec.SECP256R1())
    pem = tmp_path / "es.pem"
    pem.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    cfg = make_config(kernel={"issuers": {"es-1": str(pem)}, "policy_dir": str(policy_dir(tmp_path))})
    so = str(uuid.uuid4())
    token = issue_mandate(key, "es-1", agent=AGENT, so_id=so, principal="alice", actions=["ReadBooking"], jti="j-es")
    async with running_gateway(cfg, nc):
        r = await request(nc, AGENT, {"mandate": token, "idp": idp(so_id=so, mandate_id="j-es", step=1, action="ReadBooking")})
    assert isinstance(r, Permit)
    assert kid_of  # the Ed25519 kid helper is not used for EC keys


async def test_so_mismatch(env: Env) -> None:
    """An IDP so_id other than the mandate's governed object is IDP_SO_MISMATCH (spec 003 §5.2(d))."""
    r = await env.send(idp(so_id=str(uuid.uuid4()), mandate_id=env.jti, step=1, action="CloseBooking"))
    assert isinstance(r, Reject) and r.error_code == "IDP_SO_MISMATCH"


async def test_mandate_mismatch(env: Env) -> None:
    """An IDP mandate_id other than the JWT's jti is IDP_MANDATE_MISMATCH (spec 003 §5.2(e))."""
    r = await env.send(idp(so_id=env.so, mandate_id="someone-else", step=1, action="CloseBooking"))
    assert isinstance(r, Reject) and r.error_code == "IDP_MANDATE_MISMATCH"


async def test_step_sequence_must_increase(env: Env) -> None:
    """A step_sequence equal to or below the last committed one is refused (spec 003 §5.2(f)); another session is independent."""
    assert isinstance(await env.send(env.idp(3)), Permit)
    for step in (3, 2):
        r = await env.send(env.idp(step))
        assert isinstance(r, Reject) and r.error_code == "IDP_STEP_SEQUENCE"
    assert isinstance(await env.send(env.idp(1, session="s-2")), Permit)
    assert isinstance(await env.send(env.idp(4)), Permit)


@pytest.mark.kernel(thin_refused_actions=["ProcessPayment"])
async def test_thin_not_accepted_where_configured(env: Env) -> None:
    """An IDP_THIN for an action configured to need IDP_STANDARD is IDP_THIN_NOT_ACCEPTED (spec 003 §7)."""
    r = await env.send(thin(env.idp(1, "ProcessPayment")))
    assert isinstance(r, Reject) and r.error_code == "IDP_THIN_NOT_ACCEPTED"
    assert isinstance(await env.send(thin(env.idp(2, "ReadBooking"))), Permit)


@pytest.mark.kernel(mismatch_hem_threshold=2)
async def test_mission_ref_mismatch_then_hem(env: Env) -> None:
    """A mission_ref unlike the mandate's is an Enriched DENY with mismatch_detail, logged; the threshold puts the session in HEM."""
    mission, wrong = str(uuid.uuid4()), str(uuid.uuid4())
    env.token, env.jti = env.issuer.mandate(agent=AGENT, so_id=env.so, mission_ref=mission)
    r = await env.send(env.idp(1, mission_ref=wrong))
    assert isinstance(r, EnrichedDeny) and r.deny_code == "IDP_MISSION_REF_MISMATCH"
    assert r.mismatch_detail.expected_mission_ref == mission and r.mismatch_detail.submitted_mission_ref == wrong
    assert r.hem_available is False  # a resubmission with hem_urgency REQUIRED would fail (g) again (spec 003 §6.2)
    assert len(await read_log(env.js, "IDP_MISSION_REF_MISMATCH_REJECTED")) == 1
    r2 = await env.send(env.idp(1, mission_ref=wrong))
    assert isinstance(r2, EnrichedDeny) and r2.hem_available is False
    assert len(await read_log(env.js, "HEM_ESCALATED")) == 1
    r3 = await env.send(env.idp(1, mission_ref=mission))
    assert isinstance(r3, EnrichedDeny) and r3.deny_code == "HEM_PENDING"


async def test_mission_ref_mismatch_promises_no_hem(env: Env) -> None:
    """A mission_ref mismatch DENY says hem_available false, and it is true: resubmitting with hem_urgency REQUIRED
    gets the same DENY and no HEM (spec 003 §6.2, §6.3: hem_available true would oblige the kernel to enter HEM)."""
    mission, wrong = str(uuid.uuid4()), str(uuid.uuid4())
    env.token, env.jti = env.issuer.mandate(agent=AGENT, so_id=env.so, mission_ref=mission)
    r = await env.send(env.idp(1, mission_ref=wrong))
    assert isinstance(r, EnrichedDeny) and r.deny_code == "IDP_MISSION_REF_MISMATCH"
    assert r.hem_available is False
    again = await env.send(env.idp(1, mission_ref=wrong, hem_urgency="REQUIRED"))
    assert isinstance(again, EnrichedDeny) and again.deny_code == "IDP_MISSION_REF_MISMATCH" and again.hem_available is False
    assert await read_log(env.js, "HEM_ESCALATED") == []


async def test_mandate_scope(env: Env) -> None:
    """An action outside the mandate's actions is an Enriched DENY MANDATE_SCOPE, after IDP_SUBMITTED."""
    r = await env.send(env.idp(1, "DeleteBooking"))
    assert isinstance(r, EnrichedDeny) and r.deny_code == "MANDATE_SCOPE"
    assert r.available_actions == ["ReadBooking", "CloseBooking"]
    assert len(await read_log(env.js, "IDP_SUBMITTED")) == 1


@pytest.mark.kernel(suggested_paths={"ProcessPayment": [["ReadBooking", "ProcessPayment"]], "CloseBooking": [["CloseBooking"]]})
async def test_enriched_deny_contents(env: Env) -> None:
    """A policy DENY echoes the IDP, lists the permitted mandate actions and derivable paths, and never quotes policy text (spec 003 §6, §8.3)."""
    rec = env.idp(1, "ProcessPayment")
    r = await env.send(rec)
    assert isinstance(r, EnrichedDeny) and r.deny_code == "POLICY_DENY"
    assert r.idp_received == rec
    assert r.available_actions == ["ReadBooking", "CloseBooking"]
    assert [p.steps for p in r.suggested_paths] == [["ReadBooking", "ProcessPayment"]]
    assert r.hem_available is True
    for leak in ("INSTRUCTION", "reasoning_basis", "context.idp", "when {", "policy0", "example.cedar"):
        assert leak not in r.deny_reason
    denies = await read_log(env.js, "CEDAR_DENY_RECORDED")
    assert denies[0][1].body["deny_code"] == "POLICY_DENY"
    verdicts = await stored_verdicts(env.js, "denied", lambda v: v.reason.code == "POLICY_DENY")
    assert verdicts[-1].reason.code == "POLICY_DENY" and verdicts[-1].approver == "policy"


async def test_policy_reads_confidence_both_ways(env: Env) -> None:
    """context.idp.confidence_level decides: 0.85 is permitted, 0.79 denied (policy: >= 0.8)."""
    assert isinstance(await env.send(env.idp(1, confidence_level=0.85)), Permit)
    r = await env.send(env.idp(2, confidence_level=0.79))
    assert isinstance(r, EnrichedDeny) and r.deny_code == "POLICY_DENY"


async def test_policy_reads_reasoning_type_both_ways(env: Env) -> None:
    """context.idp.reasoning_basis.type decides: INSTRUCTION is permitted to pay, INFERENCE is not."""
    ok = env.idp(1, "ProcessPayment", reasoning_basis={"type": "INSTRUCTION", "description": "Principal asked in session s-1"})
    assert isinstance(await env.send(ok), Permit)
    no = env.idp(2, "ProcessPayment", reasoning_basis={"type": "INFERENCE", "description": "Seems due"})
    r = await env.send(no)
    assert isinstance(r, EnrichedDeny) and r.deny_code == "POLICY_DENY"


async def test_instruction_basis_must_name_its_source(env: Env) -> None:
    """An INSTRUCTION basis that names neither the mandate_id nor the session_id is IDP_MALFORMED (spec 003 §4.3)."""
    bad = env.idp(1, "ProcessPayment", reasoning_basis={"type": "INSTRUCTION", "description": "The principal asked for it"})
    r = await env.send(bad)
    assert isinstance(r, Reject) and r.error_code == "IDP_MALFORMED"
    assert r.details[0].rule == "instruction_source"


@pytest.mark.kernel(policy=(
    'permit(principal, action, resource);\n'
    'forbid(principal, action == Action::"CloseBooking", resource)\n'
    '  when { context.idp.confidence_level.lessThan(decimal("0.5")) };\n'
))
async def test_thin_fails_closed(env: Env) -> None:
    """An IDP_THIN lacking the attribute a policy reads is denied, even where the policy is a forbid (spec 003 §5.4)."""
    assert isinstance(await env.send(env.idp(1, confidence_level=0.9)), Permit)
    r = await env.send(thin(env.idp(2)))
    assert isinstance(r, EnrichedDeny) and r.deny_code == "POLICY_DENY"
    assert isinstance(await env.send(thin(env.idp(3, "ReadBooking"))), Permit)
    sub = (await read_log(env.js, "IDP_SUBMITTED"))[1][1].body
    assert sub["profile"] == "IDP_THIN"
    assert sub["idp_recorded"]["confidence_level"] == 0.5 and sub["idp_recorded"]["reasoning_basis"]["type"] == "UNSPECIFIED"


async def test_unknown_reasoning_type_recorded(env: Env) -> None:
    """An unregistered reasoning type is accepted and recorded as such in IDP_SUBMITTED (spec 003 §4.3)."""
    rec = env.idp(1, reasoning_basis={"type": "urn:example:HUNCH", "description": "gut"})
    assert isinstance(await env.send(rec), Permit)
    body = (await read_log(env.js, "IDP_SUBMITTED"))[0][1].body
    assert body["reasoning_basis_type_registered"] is False
    assert body["idp"]["reasoning_basis"]["type"] == "urn:example:HUNCH"


@pytest.mark.kernel(pii="flag")
async def test_pii_flagged(env: Env) -> None:
    """With kernel.pii = flag, an e-mail address in the goal is flagged in the reply and the log, not rejected (spec 003 §9)."""
    rec = env.idp(1, declared_goal={"goal_id": str(uuid.uuid4()), "description": "Mail the invoice to bob@example.com"})
    r = await env.send(rec)
    assert isinstance(r, Permit) and r.warnings[0].path == "$.declared_goal.description"
    body = (await read_log(env.js, "IDP_SUBMITTED"))[0][1].body
    assert body["pii_markers"] == ["email@$.declared_goal.description"]


@pytest.mark.kernel(pii="reject")
async def test_pii_rejected_when_configured(env: Env) -> None:
    """With kernel.pii = reject, a phone number in the reasoning is IDP_MALFORMED."""
    rec = env.idp(1, reasoning_basis={"type": "INSTRUCTION", "description": "Guest called from +1 415 555 0100"})
    r = await env.send(rec)
    assert isinstance(r, Reject) and r.error_code == "IDP_MALFORMED" and r.details[0].rule == "pii"


async def test_hem_required_blocks_session(env: Env) -> None:
    """hem_urgency REQUIRED puts the session in HEM_PENDING even when Cedar permits; later steps get HEM_PENDING denies
    (spec 003 §4.4), in a new session of the same mandate too; the agent's work on another governed object goes on."""
    r = await env.send(env.idp(1, hem_urgency="REQUIRED"))
    assert isinstance(r, HemPending) and r.trigger == "HEM_URGENCY_REQUIRED"
    esc = (await read_log(env.js, "HEM_ESCALATED"))[0][1].body
    assert esc["cedar"] == "PERMIT"
    r2 = await env.send(env.idp(2, "ReadBooking"))
    assert isinstance(r2, EnrichedDeny) and r2.deny_code == "HEM_PENDING" and r2.hem_available is False
    r3 = await env.send(env.idp(1, "ReadBooking", session="other"))
    assert isinstance(r3, EnrichedDeny) and r3.deny_code == "HEM_PENDING"
    other_so = str(uuid.uuid4())
    token, jti = env.issuer.mandate(agent=AGENT, so_id=other_so)
    elsewhere = idp(so_id=other_so, mandate_id=jti, step=1, action="ReadBooking", session="other")
    assert isinstance(await env.send(elsewhere, mandate=token), Permit)


async def test_resubmission_after_deny_escalates(env: Env) -> None:
    """After a DENY with hem_available, resubmitting the action with hem_urgency REQUIRED enters HEM (spec 003 §6.3)."""
    r = await env.send(env.idp(1, "ProcessPayment"))
    assert isinstance(r, EnrichedDeny) and r.hem_available
    r2 = await env.send(env.idp(2, "ProcessPayment", hem_urgency="REQUIRED"))
    assert isinstance(r2, HemPending)
    assert (await read_log(env.js, "HEM_ESCALATED"))[0][1].body["cedar"] == "DENY"


async def test_uncanonicalizable_metadata(env: Env) -> None:
    """Metadata holding an integer beyond 2^53 cannot be signed canonically (RFC 8785), so the IDP is malformed, not a crash."""
    r = await env.send(env.idp(1, metadata={"big": 2**60}))
    assert isinstance(r, Reject) and r.error_code == "IDP_MALFORMED"
    assert isinstance(await env.send(env.idp(1, metadata={"ticket": "T-1", "n": 3})), Permit)


@pytest.mark.kernel(hem_enabled=False)
async def test_required_without_hem_fails_closed(env: Env) -> None:
    """With HEM disabled, an IDP declaring hem_urgency REQUIRED is denied even where Cedar would permit, with a code of
    its own (HEM_UNAVAILABLE, not POLICY_DENY), and hem_available is false."""
    r = await env.send(env.idp(1, hem_urgency="REQUIRED"))
    assert isinstance(r, EnrichedDeny) and r.deny_code == "HEM_UNAVAILABLE" and r.hem_available is False
    assert (await read_log(env.js, "CEDAR_DENY_RECORDED"))[0][1].body["deny_code"] == "HEM_UNAVAILABLE"
    assert isinstance(await env.send(env.idp(2)), Permit)


async def test_traceparent_is_on_the_request_log_lines(env: Env) -> None:
    """Every log line a transition request causes carries its traceparent (issue 8)."""
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    rec = env.idp(1)
    body = {"mandate": env.token, "action": rec["requested_action"], "idp": rec}
    # merge_contextvars as configured in pgwcore.logs: the per-request context is bound there
    with capture_logs_with_context() as logs:
        msg = await env.nc.request(f"pgw.agent.{AGENT}.idp", msgspec.json.encode(body), timeout=10,
                                   headers={"traceparent": trace})
    assert b"PERMIT" in msg.data
    summary = [e for e in logs if e["event"] == "idp"]
    assert len(summary) == 1 and summary[0]["traceparent"] == trace


async def test_the_reply_carries_none_of_the_requests_headers(env: Env) -> None:
    """The answer to a transition request is the result alone: no header of the request's comes back
    (docs/contract.md §6 "Replies": an echoed Nats-Rollup or KV-Operation is obeyed where it lands)."""
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    rec = env.idp(1)
    msg = await env.nc.request(f"pgw.agent.{AGENT}.idp", msgspec.json.encode({"mandate": env.token, "idp": rec}),
                               timeout=10, headers={"traceparent": trace, "Nats-Rollup": "all", "KV-Operation": "PURGE"})
    assert msg.headers is None
    assert isinstance(kernel_result_decoder.decode(msg.data), Permit)
    msg = await env.nc.request(f"pgw.agent.{AGENT}.idp", b"[]", timeout=10)
    assert msg.headers is None and kernel_result_decoder.decode(msg.data).error_code == "REQUEST_MALFORMED"


SKEW = 30.0  # kernel.clock_skew_s's default, set explicitly below
T = int(time.time())  # the moment the mandates below are first verified


def _static_revoke(v: MandateVerifier, jti: str) -> None:
    v.revoked = frozenset({jti})  # the static list (kernel.revoked_jtis) as if it had named the jti from the start


# (case, the token's exp, its nbf, the moment of the compared call, what changes before it, the refusal or None)
STANDING_CASES = [
    ("static revoked jti", T + 600, None, T, _static_revoke, ("MANDATE_REVOKED", "the mandate has been revoked")),
    ("live revoked jti", T + 600, None, T, lambda v, jti: v.live_revoked.add(jti), ("MANDATE_REVOKED", "the mandate has been revoked")),
    ("expired beyond the skew", T + 600, None, T + 600 + SKEW + 1, None, ("MANDATE_EXPIRED", "the mandate has expired")),
    ("expired within the skew", T + 600, None, T + 600 + SKEW, None, None),
    ("a fractional exp, within the skew", T + 600.5, None, T + 600 + SKEW + 0.25, None, None),
    ("nbf ahead beyond the skew", T + 600, T - 100, T - 100 - SKEW - 1, None, ("MANDATE_INVALID", "the mandate is not yet valid")),
    ("nbf ahead within the skew", T + 600, T - 100, T - 100 - SKEW, None, None),
]


@pytest.mark.parametrize(("exp", "nbf", "at", "change", "refusal"), [c[1:] for c in STANDING_CASES],
                         ids=[c[0] for c in STANDING_CASES])
def test_a_mandate_that_passed_is_still_refused_when_revoked_or_not_yet_valid(
        issuer: Issuer, tmp_path: Path, exp: float, nbf: float | None, at: float, change: Any,
        refusal: tuple[str, str] | None) -> None:
    """For each revocation and time rule, a mandate that passed before (its answer remembered) gets exactly the
    answer of a full check of the same token, agent and moment: the same refusal (code and reason) or the same
    mandate, each accepted call with its own copy of the claims."""
    import jwt

    cfg = load_config(None, data_dir=str(tmp_path / "data"),
                      kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "clock_skew_s": SKEW})
    claims = {"jti": f"standing-{uuid.uuid4()}", "sub": AGENT, "so_id": str(uuid.uuid4()), "principal": "alice",
              "actions": ["CloseBooking"], "iat": T - 200, "exp": exp, **({} if nbf is None else {"nbf": nbf})}
    token = jwt.encode(claims, issuer.key, algorithm="EdDSA", headers={"kid": issuer.kid})
    remembered, full = MandateVerifier(cfg.kernel), MandateVerifier(cfg.kernel)
    first = remembered.verify(token, agent=AGENT, now=T)  # passes: the pair's answer is remembered
    assert first.jti == claims["jti"] and (token, AGENT) in remembered._passed
    for v in (remembered, full):
        if change is not None:
            change(v, claims["jti"])
    full_checks: list[str] = []
    check_claims = remembered._check_claims

    def counted(*args: Any, **kwargs: Any) -> Any:
        full_checks.append("full")
        return check_claims(*args, **kwargs)

    remembered._check_claims = counted  # type: ignore[method-assign]

    def answer(v: MandateVerifier) -> Any:
        try:
            return v.verify(token, agent=AGENT, now=at)
        except MandateError as e:
            return (e.code, e.reason)

    assert (token, AGENT) not in full._passed
    from_full, from_memory = answer(full), answer(remembered)
    assert full_checks == []  # the second call's answer came from the remembered path, not a full check
    assert from_memory == from_full
    if refusal is None:
        assert from_memory.jti == claims["jti"] and from_memory.claims == claims
        assert from_memory.claims is not first.claims and from_memory.claims is not from_full.claims
    else:
        assert from_memory == refusal


# (case, claims over the base ones, relative to the clock at the call, the refusal or None)
CLOCK_CASES = [
    ("nbf ahead within the skew", {"nbf": SKEW / 2}, None),
    ("nbf ahead beyond the skew", {"nbf": 3 * SKEW}, ("MANDATE_INVALID", "the mandate is not yet valid")),
    ("iat ahead within the skew", {"iat": SKEW / 2}, None),
    ("iat ahead beyond the skew", {"iat": 3 * SKEW},
     ("MANDATE_INVALID", "the mandate is not yet valid (issued in the future)")),
    ("nbf not a number", {"nbf": "soon"}, ("MANDATE_INVALID", "the mandate nbf must be a number")),
    ("iat not a number", {"iat": True}, ("MANDATE_INVALID", "the mandate iat must be a number")),
]


@pytest.mark.parametrize(("offsets", "refusal"), [c[1:] for c in CLOCK_CASES], ids=[c[0] for c in CLOCK_CASES])
def test_nbf_and_iat_get_the_clock_skew_and_their_own_refusal(
        issuer: Issuer, tmp_path: Path, offsets: dict[str, Any], refusal: tuple[str, str] | None) -> None:
    """A mandate whose nbf or iat lies ahead of the verifier's clock by less than kernel.clock_skew_s is accepted,
    one further ahead is refused as not yet valid (not as a bad signature), and a non-numeric nbf or iat is
    refused by name; the remembered path gives the same answer a second time."""
    import jwt

    cfg = load_config(None, data_dir=str(tmp_path / "data"),
                      kernel={"issuers": {issuer.kid: str(issuer.pem_path)}, "clock_skew_s": SKEW})
    now = time.time()
    claims: dict[str, Any] = {"jti": f"clock-{uuid.uuid4()}", "sub": AGENT, "so_id": str(uuid.uuid4()),
                              "principal": "alice", "actions": ["CloseBooking"], "iat": int(now), "exp": int(now) + 600}
    claims |= {k: now + v if isinstance(v, float) else v for k, v in offsets.items()}
    token = jwt.encode(claims, issuer.key, algorithm="EdDSA", headers={"kid": issuer.kid})
    v = MandateVerifier(cfg.kernel)
    for _ in range(2):
        if refusal is None:
            assert v.verify(token, agent=AGENT).jti == claims["jti"]
        else:
            with pytest.raises(MandateError) as e:
                v.verify(token, agent=AGENT)
            assert (e.value.code, e.value.reason) == refusal


async def test_a_resource_naming_the_agent_itself_is_refused_before_anything_is_committed(env: Env) -> None:
    """``resource = Agent::"bot"`` from agent bot: Cedar's principal is that entity already, and handing it
    twice made cedarpy fail after IDP_SUBMITTED was committed (KERNEL_UNAVAILABLE, a traceback in the log;
    found by an attack from the docs). Now a REQUEST_MALFORMED before the commit; another agent's entity
    as the resource is evaluated as before, and the kernel goes on serving."""
    r = await env.send(env.idp(1), resource=f'Agent::"{AGENT}"')
    assert isinstance(r, Reject) and r.error_code == "REQUEST_MALFORMED", r
    assert "agent itself" in r.reason
    assert await read_log(env.js, "IDP_SUBMITTED") == []
    other = await env.send(env.idp(1), resource='Agent::"someone-else"')
    assert isinstance(other, Permit), other  # the example policies permit CloseBooking on any resource
