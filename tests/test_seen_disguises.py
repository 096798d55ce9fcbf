"""Every text rule judges the seen form: each disguise of a refused text is refused through the bus.

The disguises come from one generator (tests/disguises.py): look-alike letters
of several scripts, zero-width and format characters, soft hyphens,
full-width, combining marks, case, spacing and mixtures. For each rule, each
example it refuses is sent in every disguise by the agent ``planner`` on
``pgw.agent.planner.envelope`` (a JetStream publish, as an agent's client
does), all through one gateway, and each outcome is read back from the bus.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from gateway.security.seen import seen
from gateway.security.text import visible
from gateway.stages import authorization as authz
from subjects.client import Surface
from subjects.wire import AuthorizationItem, BindingMomentItem, DialogueVeto
from tests.disguises import DISGUISES, disguises
from tests.moments import good_moment
from tests.pipeline_helpers import Recorder, env, moment_env, running_gateway

HATCH_LABELS = ["Something else (free text)", "Reject the question", "None of these", "Let's discuss it first"]
HEDGED = ["It depends on what Harbor needs for the 2025 filing.", "Maybe share only the 2025 summary with Harbor."]
LEADING = ["Shouldn't we send only the 2025 tax summary to Harbor?", "Obviously the summary is enough, which do we send?"]
WORKFLOWS = {"chat": {"authoritative_intent": "non_authoritative", "enforcement_mode": "NON_AUTHORITATIVE_ONLY"}}


async def _all(rec: Recorder, bodies: list[dict[str, Any]]) -> list[Any]:
    """Send every body as its own turn at once, then read each outcome back."""
    for b in bodies:
        await rec.send("planner", b)
    return await asyncio.gather(*(rec.outcome(b["envelopeId"], timeout=60) for b in bodies))


def test_every_disguise_reads_as_the_text_it_disguises() -> None:
    """The generator's disguises change the characters, never the seen form (so each rule must refuse them)."""
    for text in [*HATCH_LABELS, *HEDGED, *LEADING, "verified", "The oracle threshold was not met."]:
        made = disguises(text)
        assert len(made) >= len(DISGUISES) - 2, text
        for name, d in made:
            assert seen(d) == seen(text), (name, d)
            assert seen(visible(d)) == seen(d), (name, d)  # what the surface renders reads the same


async def test_a_disguised_hatch_or_blank_option_is_refused(nats_server, tmp_path, nc) -> None:
    """An option label naming a hatch, in any disguise, and a label of spaces and invisible characters are refused
    (spec 000 §6.6) and no binding moment reaches the principal."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        bodies = []
        for label in HATCH_LABELS:
            for _name, d in [("plain", label), *disguises(label)]:
                m = good_moment()
                m["question"]["options"][2]["label"] = d
                bodies.append(moment_env("alice", m))
        blanks = [" \u200b", "\u00ad", "\u2060\ufeff", " \u200b\u200c ", "\u034f"]
        for d in blanks:
            m = good_moment()
            m["question"]["options"][2]["label"] = d
            bodies.append(moment_env("alice", m))
        outs = await _all(rec, bodies)
        for body, out in zip(bodies, outs, strict=True):
            label = body["payload"]["binding_moment"]["question"]["options"][2]["label"]
            rules = {d.rule for d in out.details or []}
            want = "option_label" if label in blanks else "option_is_hatch"
            assert out.code == "envelope_invalid" and want in rules, (label, out.code, rules)
        assert not [i for i in rec.items if isinstance(i, BindingMomentItem)]


async def test_an_option_label_with_a_line_break_is_refused(nats_server, tmp_path, nc) -> None:
    """An option label holding a line break, a CR above all, is refused: on the terminal surface a CR drew the
    next option's text over the label, so she read "Hold the wire" and chose "Send 95,000 EUR to the new
    IBAN", as the signed verdict then recorded (found by an attack from the docs). Each of the characters a
    line breaks at. And a moment stored before (built here past the grammar) shows the label on one line, and
    its stem and each reasoning too (a line break there drew a row that read as an option, found re-running
    the attack)."""
    from consumers.surfaces.model import plan_item
    from consumers.surfaces.text import render_plan

    disguised = "Send 95,000 EUR to the new IBAN{}  1. Hold the wire              "
    breaks = ["\r", "\n", "\r\n", "\v", "\f", "\x1c", "\x85", "\u2028", "\u2029"]
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        bodies = []
        for br in breaks:
            m = good_moment()
            m["question"]["options"][0]["label"] = disguised.format(br)
            bodies.append(moment_env("alice", m))
        outs = await _all(rec, bodies)
        for br, out in zip(breaks, outs, strict=True):
            rules = {d.rule for d in out.details or []}
            assert out.code == "envelope_invalid" and "option_label" in rules, (br, out.code, rules)
        assert not [i for i in rec.items if isinstance(i, BindingMomentItem)]
    m = good_moment()
    m["question"]["options"][0]["label"] = disguised.format("\r")
    m["question"]["stem"] += "\n  9. Fake row in the stem"  # a stem or a reasoning drew a row like an option
    m["question"]["options"][1]["reasoning"] += "\r\n  8. Fake row in a reasoning"
    item = {"item": "binding_moment", "agent": "planner", "principal": "alice", "created_at": "2026-12-07T00:00:00Z",
            "moment_id": "a" * 32, "envelope_id": "e-1", "correlation_id": "c-1", "binding_moment": m}
    shown = "\n".join(render_plan(plan_item(item), width=120))
    assert "\r" not in shown and "1. Send 95,000 EUR to the new IBAN   1. Hold the wire" in shown, shown
    rows = [line.strip() for line in shown.split("\n")]
    assert not [r for r in rows if r.startswith(("9. Fake", "8. Fake"))], shown


async def test_a_disguised_hedge_or_leading_stem_is_refused(nats_server, tmp_path, nc) -> None:
    """A hedged synopsis (spec 000 §6.1) and a leading stem (§6.5), in any disguise, are refused."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        bodies, want = [], []
        for text in HEDGED:
            for _name, d in [("plain", text), *disguises(text)]:
                m = good_moment()
                m["synopsis"] = d
                bodies.append(moment_env("alice", m))
                want.append("synopsis_hedge")
        for text in LEADING:
            for _name, d in [("plain", text), *disguises(text)]:
                bodies.append(moment_env("alice", good_moment(stem=d)))
                want.append("leading_stem")
        outs = await _all(rec, bodies)
        for body, rule, out in zip(bodies, want, outs, strict=True):
            rules = {d.rule for d in out.details or []}
            assert out.code == "envelope_invalid" and rule in rules, (body["payload"]["binding_moment"], rules)
        assert not [i for i in rec.items if isinstance(i, BindingMomentItem)]


async def test_a_disguised_repeat_of_a_vetoed_question_is_refused(nats_server, tmp_path, nc) -> None:
    """After alice's dialogue veto, the same stem or the same option labels in any disguise are broken_handshake
    (spec 000 §7.2), even from a moment that acknowledges the objection and keeps the dialogue hatch open; also
    with the spaces removed, or replaced by Hangul fillers (found by an attack from the docs: "spacing removed",
    the docs said, and the stem without spaces was delivered to her)."""
    async with running_gateway(nats_server, str(tmp_path / "d")) as gw, Recorder(nc) as rec:
        first = await rec.roundtrip("planner", moment_env("alice", good_moment()))
        reply = await Surface(nc, "alice").resolve(first.moment_id, DialogueVeto(objection="Why share anything?"))
        assert reply.status == "accepted"
        st = await gw.stage_state.get()
        await rec.until(lambda: st.stats.dialogue_hatch[("planner", "consent")] == 1)
        await rec.until(lambda: st.vetoes is None or st.vetoes.get("veto.planner.alice"))
        base = good_moment()
        ack = f"Your objection to moment {first.moment_id}: this asks it again."
        bodies = []
        unspaced = {"spaces removed": lambda t: t.replace(" ", ""),
                    "Hangul fillers for spaces": lambda t: t.replace(" ", "\u3164"),
                    "underscores for spaces": lambda t: t.replace(" ", "_")}
        for f in [*DISGUISES.values(), *unspaced.values()]:
            same_stem = copy.deepcopy(base)
            same_stem["question"]["stem"] = f(base["question"]["stem"])
            same_stem["question"]["options"] = [{"label": "Keep Harbor", "reasoning": "Continuity."},
                                                {"label": "Switch firms", "reasoning": "Fresh start."}]
            same_stem["findings"].append(ack)
            same_stem["meta"] = {"decision_class": "retention"}
            same_opts = copy.deepcopy(base)
            same_opts["question"]["stem"] = "What should Harbor get from us now?"
            for o in same_opts["question"]["options"]:
                o["label"] = f(o["label"])
            same_opts["findings"].append(ack)
            same_opts["meta"] = {"decision_class": "retention"}
            bodies += [moment_env("alice", same_stem), moment_env("alice", same_opts)]
        outs = await _all(rec, bodies)
        for body, out in zip(bodies, outs, strict=True):
            assert (out.status, out.code) == ("gated", "broken_handshake"), (body["payload"]["binding_moment"]["question"],
                                                                              out.code, out.reason)
        assert [i.moment_id for i in rec.items if isinstance(i, BindingMomentItem)] == [first.moment_id]


def _auth(envelope: dict[str, Any]) -> dict[str, Any]:
    return env("vendor.pgw.authorization", {"workflow_id": "chat", "principal": "alice", "envelope": envelope})


def _narrative(text: str) -> dict[str, Any]:
    return {"kind": "narrative", "text": text, "policy": {"grammar_mode": "hedged", "forbidden_markers": [],
                                                           "max_specificity": "contextualized",
                                                           "scrub_measurements": False}}


def _refusal(message: str) -> dict[str, Any]:
    return {"kind": "refusal", "reason": {"code": "UNRESOLVABLE", "user_message": message, "audit_id": "a-1"}}


@pytest.mark.parametrize("marker", ["verified", "approved", "certified", "clinically proven"])
async def test_a_disguised_forbidden_marker_is_refused(nats_server, tmp_path, nc, marker) -> None:
    """A soft-authority marker in any disguise, in a narrative or an agent refusal's user_message, is refused as
    forbidden_marker (spec 001 Binding Rules) and nothing reaches the principal."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"workflows": WORKFLOWS}), \
            Recorder(nc) as rec:
        bodies = []
        for _name, d in [("plain", marker), *disguises(marker)]:
            bodies.append(_auth(_narrative(f"The result may be {d} by the lab.")))
            bodies.append(_auth(_refusal(f"This is {d}, please wait.")))
        outs = await _all(rec, bodies)
        for body, out in zip(bodies, outs, strict=True):
            assert out.code == "forbidden_marker", (body["payload"]["envelope"], out.code, out.reason)
        # The principal is told of each refusal (spec 001's refusal variant), in the gateway's words only.
        await rec.until(lambda: len([i for i in rec.items if isinstance(i, AuthorizationItem)]) == len(bodies), 30)
        for item in rec.items:
            assert item.envelope["kind"] == "refusal" and seen(marker) not in seen(str(item.envelope)), item.envelope


EDGES = ["\u2014", "|", "%", "\u00d72", "\u2122", "\u00b9", "_", "\u30fc", "\u4e00",
         # the second attack: a raised T M, a click and a Greek iota drawn as bars, a low line, a tatweel
         "\u1d40\u1d39", "\u01c0", "\u03b9", "\u0332", "\u0640"]


async def test_a_forbidden_marker_beside_a_symbol_is_refused(nats_server, tmp_path, nc) -> None:
    """A marker beside a dash, a bar, a symbol, a footnote mark or an underscore reads as a word and is refused,
    though the seen form joins it to what the neighbour folds to (the em dash to a katakana mark, the bar to a
    letter); inside a longer word it is delivered (the docs-only attack of the ninth session)."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"workflows": WORKFLOWS}), \
            Recorder(nc) as rec:
        bodies = []
        for edge in EDGES:
            bodies.append(_auth(_narrative(f"The result may be verified{edge}the lab says.")))
            bodies.append(_auth(_refusal(f"This is approved{edge} please wait.")))
        # An agent's own marker in Cyrillic, sent in capitals and after a Latin word.
        own = "\u043f\u0440\u043e\u0432\u0435\u0440\u0435\u043d\u043e"
        for text in ("It may be: \u041f\u0420\u041e\u0412\u0415\u0420\u0415\u041d\u041e.", f"It may be ok{own}."):
            narrative = _narrative(text)
            narrative["policy"]["forbidden_markers"] = [own]
            bodies.append(_auth(narrative))
        delivered = [_auth(_narrative("The result may be unverified by the lab.")),
                     _auth(_narrative("It may be reapproved|officially later."))]
        outs = await _all(rec, [*bodies, *delivered])
        for body, out in zip(bodies, outs, strict=False):
            assert out.code == "forbidden_marker", (body["payload"]["envelope"], out.code, out.reason)
        for body, out in zip(delivered, outs[len(bodies):], strict=True):
            assert out.status == "accepted", (body["payload"]["envelope"], out.code, out.reason)


async def test_disguised_control_plane_detail_is_withheld(nats_server, tmp_path, nc) -> None:
    """An agent refusal whose user_message names a control-plane word, in any disguise, reaches the principal
    with the gateway's own message instead (spec 001 RefusalReason)."""
    leaky = ["The oracle did not answer in time.", "Your reading crossed the threshold.", "The lab workflow is busy."]
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"workflows": WORKFLOWS}), \
            Recorder(nc) as rec:
        bodies = [_auth(_refusal(d)) for text in leaky for _n, d in [("plain", text), *disguises(text)]]
        outs = await _all(rec, bodies)
        for body, out in zip(bodies, outs, strict=True):
            rules = {w.rule for w in out.warnings}
            assert out.status == "accepted" and "control_plane_detail_withheld" in rules, body["payload"]["envelope"]
        await rec.until(lambda: len([i for i in rec.items if isinstance(i, AuthorizationItem)]) == len(bodies), 30)
        for item in rec.items:
            if isinstance(item, AuthorizationItem):
                assert item.envelope["reason"]["user_message"] == authz.USER_MESSAGES["UNRESOLVABLE"]


async def test_disguised_threshold_detail_is_withheld(nats_server, tmp_path, nc) -> None:
    """An agent refusal whose user_message gives the reading a check took or the line it draws ("The lab reading of
    5.9 exceeds the cutoff of 5.5 set for this check."), in any disguise, reaches the principal with the gateway's own
    message and none of its numbers, while a message with a number and no line ("Call 911 now.") is shown as written
    (spec 001 RefusalReason: "no oracle/threshold details")."""
    leaky = ["The lab reading of 5.9 exceeds the cutoff of 5.5 set for this check.",
             "Your result is above 7, so this cannot go ahead.",
             "The value you gave is outside the allowed range."]
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"workflows": WORKFLOWS}), \
            Recorder(nc) as rec:
        bodies = [_auth(_refusal(d)) for text in leaky for _n, d in [("plain", text), *disguises(text)]]
        clean = _auth(_refusal("Call 911 now."))
        outs = await _all(rec, [*bodies, clean])
        for body, out in zip(bodies, outs, strict=False):
            rules = {w.rule for w in out.warnings}
            assert out.status == "accepted" and "control_plane_detail_withheld" in rules, body["payload"]["envelope"]
        assert "control_plane_detail_withheld" not in {w.rule for w in outs[-1].warnings}
        await rec.until(lambda: len([i for i in rec.items if isinstance(i, AuthorizationItem)]) == len(bodies) + 1, 30)
        for item in rec.items:
            if not isinstance(item, AuthorizationItem):
                continue
            shown = item.envelope["reason"]["user_message"]
            if item.envelope_id == clean["envelopeId"]:
                assert shown == "Call 911 now."
                continue
            assert shown == authz.USER_MESSAGES["UNRESOLVABLE"]
            assert not any(n in seen(str(item.envelope)) for n in ("5.9", "5.5", " 7,")), item.envelope
