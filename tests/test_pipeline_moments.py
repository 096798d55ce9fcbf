"""Spec 000 as far as a gateway can enforce it: construction-discipline lints,
malformed fallback, hatch suppression, expiry, dual veto, single surface,
the monitored rates, and the trust boundary for moments."""

from __future__ import annotations

import copy

import msgspec
import pytest

from gateway.moment_record import HemContext
from gateway.stages import lints
from pgwcore.config import LintsConfig
from subjects.client import Surface
from subjects.wire import (
    BindingMoment,
    BindingMomentItem,
    ClarificationItem,
    DialogueVeto,
    MomentExpired,
    NoticeItem,
    OptionChoice,
    WithdrawnItem,
)
from tests.moments import GOOD_MOMENT, good_moment
from tests.pipeline_helpers import Recorder, env, moment_env, running_gateway
from tests.polling import until


def bm(d: dict) -> BindingMoment:
    return msgspec.convert(d, BindingMoment)


def _moment(synopsis, findings, recs, stem, options, rec_idx=0, **meta):
    return {
        "synopsis": synopsis,
        "findings": findings,
        "recommendations": recs,
        "offer": "Ask for detail on any item.",
        "question": {
            "stem": stem,
            "options": [{"label": lbl, "reasoning": r} for lbl, r in options],
            "recommended_idx": rec_idx,
            "hatches": {"free_text": True, "dialogue": True},
        },
        **({"meta": meta} if meta else {}),
    }


GOOD = [
    GOOD_MOMENT,
    _moment(
        "Merge PR #482 today; the flaky test is unrelated to the change.",
        ["CI failed once on test_upload_timeout, then passed on retry.", "The same test failed on main twice this week.",
         "The diff touches only the billing module."],
        ["Merge the PR now.", "Open a ticket to quarantine test_upload_timeout."],
        "What should happen to PR #482?",
        [("Merge it now", "The failure is a known flake on main."), ("Wait for a clean run", "Costs about 40 minutes.")],
    ),
    _moment(
        "Book the 7:05 a.m. flight on Tuesday, e.g. to make the 11:00 meeting with 2.5 hours to spare.",
        ["The 9:40 flight lands at 10:55, too late for the meeting.", "Both fares are within the travel policy."],
        ["Book UA 1432 departing 7:05 a.m.", "Add the hotel for Tuesday night."],
        "Which flight should I book for Tuesday?",
        [("UA 1432 at 7:05", "Arrives with time to spare."), ("UA 1610 at 9:40", "Later start, but you miss the first 15 minutes."),
         ("Take the train", "Slower, but you can work on board.")],
        decision_class="travel",
    ),
    _moment(
        "Decline the vendor's auto-renewal: usage fell 60% since March.",
        ["Seats used dropped from 50 to 20.", "The contract renews on 1 July at the same price.",
         "A 20-seat plan costs 40% less."],
        ["Reply to the vendor declining auto-renewal.", "Request a quote for a 20-seat plan."],
        "How should we handle the contract renewal on 1 July?",
        [("Decline and re-quote", "Matches current usage."), ("Renew as is", "No effort, but pays for 30 idle seats.")],
    ),
    _moment(
        "Grant Dana read-only access to the finance folder until the audit ends.",
        ["Dana joined the audit team on Monday.", "Write access would let her change closed periods."],
        ["Add Dana to the finance-readers group.", "Set the access to expire on 30 June."],
        "What access should Dana get to the finance folder?",
        [("Read-only until 30 June", "Enough for the audit."), ("Full access", "Lets her fix errors directly."),
         ("No access", "She works from exported reports instead.")],
        decision_class="permission-delta",
    ),
]

BAD = {
    "synopsis_one_sentence": dict(synopsis="Ship the release on Friday. QA has signed off on the build."),
    "synopsis_hedge": dict(synopsis="It depends on whether the client agrees, so maybe we ship Friday."),
    "leading_stem": dict(question_stem="Shouldn't we just send the 2025 tax summary only?"),
    "findings_restate_synopsis": dict(findings0="Share only your 2025 tax summary with Harbor Accounting, not the full ledger."),
    "recommendation_not_action": dict(recs0="Weigh the trade-offs between privacy and convenience."),
    "option_is_hatch": dict(option2="Something else (free text)"),
}


def bad_moment(lint: str) -> dict:
    m = copy.deepcopy(GOOD_MOMENT)
    change = BAD[lint]
    if "synopsis" in change:
        m["synopsis"] = change["synopsis"]
    if "question_stem" in change:
        m["question"]["stem"] = change["question_stem"]
    if "findings0" in change:
        m["findings"][0] = change["findings0"]
    if "recs0" in change:
        m["recommendations"][0] = change["recs0"]
    if "option2" in change:
        m["question"]["options"][2]["label"] = change["option2"]
    return m


@pytest.mark.parametrize("moment", GOOD, ids=range(len(GOOD)))
def test_good_moments_pass_every_lint(moment):
    """Realistic well-constructed moments raise no lint finding (a false refusal is a bug)."""
    assert lints.check(bm(moment)) == []


@pytest.mark.parametrize("lint", sorted(BAD))
def test_each_bad_moment_is_caught_by_its_lint(lint):
    """Each construction-discipline violation is reported under its own lint name."""
    found = {name for name, _ in lints.check(bm(bad_moment(lint)))}
    assert lint in found


def test_stem_naming_only_the_recommended_option_is_leading():
    """A stem that embeds the recommended option's label (and no other) is leading."""
    m = good_moment(stem="Should Harbor Accounting get the send the 2025 tax summary only option?")
    assert "leading_stem" in {n for n, _ in lints.check(bm(m))}


def test_modes_reject_warn_off():
    """Lint modes decide: reject refuses, warn only warns, off ignores."""
    m = bm(bad_moment("synopsis_hedge"))
    assert lints.apply(m, LintsConfig())[0]
    rej, warn = lints.apply(m, LintsConfig(synopsis_hedge="warn"))
    assert not rej and warn
    assert lints.apply(m, LintsConfig(synopsis_hedge="off")) == ([], [])


@pytest.mark.parametrize("label", ["Something else (free text)", "Other (please specify)", "Reject the question",
                                   "Neither - let's discuss", "This is the wrong question"])
async def test_option_duplicating_a_hatch_is_refused(nats_server, tmp_path, nc, label):
    """An option whose label is an escape hatch (spec 000 §6.6: the options do not include the hatches) is a
    malformed moment: envelope_invalid with rule option_is_hatch, and no decision reaches the principal."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        m = good_moment()
        m["question"]["options"][2]["label"] = label
        out = await rec.roundtrip("planner", moment_env("alice", m))
        assert (out.code, out.details[0].rule) == ("envelope_invalid", "option_is_hatch")
        assert out.details[0].path == "$.payload.binding_moment.question.options[2].label"
        assert not [i for i in rec.items if isinstance(i, BindingMomentItem)]


def test_substantive_options_that_mention_hatch_words_pass():
    """Options that only share a word with a hatch ("Reject the vendor's offer", "Other vendors: ask for quotes") pass."""
    for label in ["Reject the vendor's offer", "Other vendors: ask for quotes", "Discuss the contract with legal",
                  "Something else entirely: renegotiate the term", "Custom plan for 20 seats"]:
        assert lints.hatch_of(label) is None, label


async def test_lint_reject_refuses_with_notice(nats_server, tmp_path, nc):
    """A hedged synopsis is a malformed moment: the agent gets envelope_invalid, the principal a notice with the conventional payload."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        e = moment_env("alice", bad_moment("synopsis_hedge"), conventional={"text": "Harbor asked for the ledger."})
        out = await rec.roundtrip("planner", e)
        assert (out.code, out.details[0].rule) == ("envelope_invalid", "synopsis_hedge")
        notice = await rec.item(lambda i: isinstance(i, NoticeItem))
        assert notice.conventional == {"text": "Harbor asked for the ledger."} and "hedges" in notice.diagnostic
        assert not [i for i in rec.items if isinstance(i, BindingMomentItem)]


async def test_lint_warn_delivers_with_warning(nats_server, tmp_path, nc):
    """Under warn, a finding that restates the synopsis is delivered with a warning on the outcome."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        out = await rec.roundtrip("planner", moment_env("alice", bad_moment("findings_restate_synopsis")))
        assert out.status == "accepted"
        assert any(w.rule == "findings_restate_synopsis" for w in out.warnings)


async def test_malformed_moment_with_conventional_gives_notice(nats_server, tmp_path, nc):
    """A moment with one option is refused to the agent; the surface gets a notice with the conventional payload and a diagnostic."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        m = good_moment()
        m["question"]["options"] = m["question"]["options"][:1]
        out = await rec.roundtrip("planner", moment_env("alice", m, conventional=["row 1", "row 2"]))
        assert out.code == "envelope_invalid"
        notice = await rec.item(lambda i: isinstance(i, NoticeItem))
        assert notice.conventional == ["row 1", "row 2"] and notice.principal == "alice"
        assert "options" in notice.diagnostic


async def test_malformed_moment_without_conventional_still_gets_a_fallback_notice(nats_server, tmp_path, nc):
    """spec 000 §9.3 "the fallback is always available": a malformed moment sent without ``conventional`` gives the
    principal a notice with a plain payload the gateway wrote; an agent not bound to the principal gets none (§8.4)."""
    agents = {"planner": {"principals": ["alice"]}, "other": {"principals": ["bob"]}}
    async with running_gateway(nats_server, str(tmp_path / "d"), agents=agents), Recorder(nc) as rec:
        m = good_moment()
        m["question"]["options"] = m["question"]["options"][:1]
        out = await rec.roundtrip("planner", moment_env("alice", m))
        assert out.code == "envelope_invalid"
        notice = await rec.item(lambda i: isinstance(i, NoticeItem) and i.agent == "planner")
        assert notice.principal == "alice" and "options" in notice.diagnostic
        assert "planner" in notice.conventional["text"] and "Nothing was decided" in notice.conventional["text"]
        stray = await rec.roundtrip("other", moment_env("alice", m, conventional={"text": "spam"}))
        assert stray.code == "envelope_invalid"
        await rec.verdict(lambda v: v.agent == "other" and v.verdict_class == "blocked")
        assert not [i for i in rec.items if isinstance(i, NoticeItem) and i.agent == "other"]


async def test_moment_item_carries_the_conventional_payload(nats_server, tmp_path, nc):
    """A well-formed moment's surface item carries the envelope's conventional payload (spec 000 §8.1, §9.3), so a
    surface that cannot render the envelope falls back by itself."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        out = await rec.roundtrip("planner", moment_env("alice", good_moment(), conventional={"rows": [1, 2]}))
        item = await rec.item(lambda i: isinstance(i, BindingMomentItem) and i.moment_id == out.moment_id)
        assert item.conventional == {"rows": [1, 2]}
        pending = await Surface(nc, "alice").pending()
        assert [i.conventional for i in pending if isinstance(i, BindingMomentItem)] == [{"rows": [1, 2]}]


async def test_hatch_false_is_delivered_and_recorded(nats_server, tmp_path, nc):
    """A moment with the dialogue hatch closed is delivered, and recorded as a hatch suppression (warning, verdict, counter)."""
    async with running_gateway(nats_server, str(tmp_path / "d")) as gw, Recorder(nc) as rec:
        m = good_moment(hatches={"free_text": True, "dialogue": False})
        out = await rec.roundtrip("planner", moment_env("alice", m))
        assert out.status == "accepted"
        assert any(w.rule == "hatch_suppression" for w in out.warnings)
        v = await rec.verdict(lambda v: v.verdict_class == "hitl_dispatched")
        assert v.details["hatch_suppressed"] == ["dialogue"]
        st = await gw.stage_state.get()
        assert st.stats.hatch_suppressions[("planner", "dialogue")] == 1
        assert st.stats.hatch_suppressions[("planner", "free_text")] == 0


async def test_expiry_withdraws_and_records_expired(nats_server, tmp_path, nc):
    """On expires_in_s the surface gets withdrawn, the signer a timeout verdict, the agent moment_expired."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        out = await rec.roundtrip("planner", moment_env("alice", good_moment(), expires_in_s=1))
        w = await rec.item(lambda i: isinstance(i, WithdrawnItem), timeout=15)
        assert (w.moment_id, w.reason) == (out.moment_id, "expired")
        # spec 004 §5.4.1: an unanswered decision timed out ("expired" is a deferral's TTL)
        v = await rec.verdict(lambda v: v.verdict_class == "timeout")
        assert v.decision == "reject" and v.human_disposed is False
        await rec.until(lambda: next((o for o in rec.outcomes if isinstance(o, MomentExpired)), None))


async def test_dual_veto_broken_handshake(nats_server, tmp_path, nc):
    """After a dialogue answer, a repeat of the stem or of the option set is broken_handshake; a re-deliberated moment passes."""
    async with running_gateway(nats_server, str(tmp_path / "d")) as gw, Recorder(nc) as rec:
        out = await rec.roundtrip("planner", moment_env("alice", good_moment()))
        reply = await Surface(nc, "alice").resolve(out.moment_id, DialogueVeto(objection="Why share anything?"))
        assert reply.status == "accepted"
        await rec.verdict(lambda v: v.verdict_class == "resolved")
        st = await gw.stage_state.get()
        await rec.until(lambda: st.stats.dialogue_hatch[("planner", "consent")] == 1)
        same_stem = good_moment()
        same_stem["question"]["stem"] = "which records should harbor accounting receive for the 2025 filing"
        same_stem["question"]["options"] = [{"label": "A", "reasoning": "a"}, {"label": "B", "reasoning": "b"}]
        o1 = await rec.roundtrip("planner", moment_env("alice", same_stem))
        assert (o1.status, o1.code) == ("gated", "broken_handshake")
        same_opts = good_moment(stem="What should Harbor get now?")
        o2 = await rec.roundtrip("planner", moment_env("alice", same_opts))
        assert o2.code == "broken_handshake"
        other_principal = await rec.roundtrip("planner", moment_env("bob", good_moment()))
        assert other_principal.status == "accepted"
        fresh = good_moment(stem="Should Harbor Accounting stay your accountant for 2026?")
        fresh["question"]["options"] = [{"label": "Keep Harbor", "reasoning": "Continuity."},
                                        {"label": "Switch firms", "reasoning": "Addresses your objection."}]
        fresh["findings"].append(f"Your objection to moment {out.moment_id}: this asks about Harbor itself instead.")
        o3 = await rec.roundtrip("planner", moment_env("alice", fresh))
        assert o3.status == "accepted"


def _reworded(extra: bool = True, **over) -> dict:
    """GOOD_MOMENT's decision asked again: a reworded stem and one extra option (a walk-around of rule 1)."""
    m = good_moment(stem="What should Harbor Accounting get from us for the 2025 filing?", **over)
    if extra:
        m["question"]["options"].append({"label": "Send the summary and the Q4 ledger", "reasoning": "A middle way."})
    return m


async def test_dual_veto_cannot_be_walked_around_by_rewording(nats_server, tmp_path, nc):
    """After a dialogue veto, a reworded stem with one extra option and the dialogue hatch closed is refused
    (objection_not_incorporated: hatch closed, objection not acknowledged), by decision_class and, without one,
    by similarity; a moment that keeps the hatch open and names the vetoed moment in a finding passes and closes
    the veto, after which only an exact repeat is refused (spec 000 §7.2)."""
    async with running_gateway(nats_server, str(tmp_path / "d")) as gw, Recorder(nc) as rec:
        out = await rec.roundtrip("planner", moment_env("alice", good_moment()))
        await Surface(nc, "alice").resolve(out.moment_id, DialogueVeto(objection="Why share anything?"))
        st = await gw.stage_state.get()
        await rec.until(lambda: st.stats.dialogue_hatch[("planner", "consent")] == 1)
        await until(lambda: _cached(st), timeout=10, what="the veto in the cache")
        walk = _reworded(hatches={"free_text": True, "dialogue": False})
        o1 = await rec.roundtrip("planner", moment_env("alice", walk))
        assert (o1.status, o1.code) == ("gated", "objection_not_incorporated"), o1
        assert {d.rule for d in o1.details} == {"dialogue_hatch_closed", "objection_not_acknowledged"}
        v = await rec.verdict(lambda v: v.envelope_id == o1.envelope_id)
        assert v.decision == "reject" and v.reason.code == "objection_not_incorporated"
        no_class = _reworded()
        del no_class["meta"]
        o2 = await rec.roundtrip("planner", moment_env("alice", no_class))
        assert (o2.code, [d.rule for d in o2.details]) == ("objection_not_incorporated", ["objection_not_acknowledged"])
        unrelated = good_moment(stem="Which printer should the office lease next year?")
        unrelated["question"]["options"] = [{"label": "Lease the laser", "reasoning": "Cheaper per page."},
                                            {"label": "Lease the inkjet", "reasoning": "Prints photos."}]
        del unrelated["meta"]
        assert (await rec.roundtrip("planner", moment_env("alice", unrelated))).status == "accepted"
        ok = _reworded()
        ok["findings"].append(f"You rejected moment {out.moment_id} ('why share anything'): this adds a middle way.")
        assert (await rec.roundtrip("planner", moment_env("alice", ok))).status == "accepted"
        later = _reworded(extra=False)
        later["question"]["stem"] = "Which files go to Harbor Accounting this year?"
        later["question"]["options"] = [{"label": "The summary by portal", "reasoning": "Encrypted."},
                                        {"label": "The summary by post", "reasoning": "No account needed."}]
        assert (await rec.roundtrip("planner", moment_env("alice", later))).status == "accepted"
        assert (await rec.roundtrip("planner", moment_env("alice", good_moment()))).code == "broken_handshake"


async def _cached(st) -> object:
    return st.vetoes.get("veto.planner.alice")


async def test_dual_veto_recorded_elsewhere_and_cached_vetoes_confirmed(nats_server, tmp_path, nc):
    """A veto another instance records reaches this gateway's veto cache and is enforced; a veto only
    the cache holds (expired or deleted in the bucket) never refuses a moment."""
    from gateway.stages import dualveto

    async with running_gateway(nats_server, str(tmp_path / "d")) as gw, Recorder(nc) as rec:
        assert (await rec.roundtrip("planner", moment_env("alice", good_moment()))).status == "accepted"
        st = await gw.stage_state.get()
        assert st.vetoes is not None and st.vetoes.ready
        bm = msgspec.convert(good_moment(), BindingMoment)
        veto = dualveto.Veto("m-elsewhere", dualveto.norm(bm.question.stem), dualveto.option_set(bm))
        kv = await nc.jetstream().key_value("PGW_DEDUP")
        await kv.put("veto.planner.alice", msgspec.json.encode([veto]))  # as another instance would
        async def cached() -> object:  # in-process state no bus message announces
            return st.vetoes.get("veto.planner.alice")

        await until(cached, timeout=10, what="the veto pushed into the cache")
        o = await rec.roundtrip("planner", moment_env("alice", good_moment()))
        assert (o.status, o.code) == ("gated", "broken_handshake")
        st.vetoes.apply("veto.planner.bob", 1 << 60, [veto])  # cached, absent from the bucket
        assert (await rec.roundtrip("planner", moment_env("bob", good_moment()))).status == "accepted"
        assert st.vetoes.get("veto.planner.bob") is None


async def test_option_answers_do_not_trigger_dual_veto(nats_server, tmp_path, nc):
    """An option answer is not a veto: the same question may be asked again."""
    async with running_gateway(nats_server, str(tmp_path / "d")) as gw, Recorder(nc) as rec:
        out = await rec.roundtrip("planner", moment_env("alice", good_moment()))
        await Surface(nc, "alice").resolve(out.moment_id, OptionChoice(index=0))
        await rec.verdict(lambda v: v.verdict_class == "resolved")
        st = await gw.stage_state.get()
        await rec.until(lambda: st.stats.resolutions[("planner", "consent")] == 1)
        assert (await rec.roundtrip("planner", moment_env("alice", good_moment()))).status == "accepted"


async def test_single_surface_bindings(nats_server, tmp_path, nc):
    """With bindings configured, only configured agent-principal pairs pass (principal_not_bound otherwise)."""
    agents = {"planner": {"principals": ["alice"]}}
    async with running_gateway(nats_server, str(tmp_path / "d"), agents=agents), Recorder(nc) as rec:
        assert (await rec.roundtrip("planner", moment_env("alice", good_moment()))).status == "accepted"
        o = await rec.roundtrip("planner", moment_env("bob", good_moment()))
        assert (o.status, o.code) == ("gated", "principal_not_bound")
        o = await rec.roundtrip("stranger", moment_env("alice", good_moment()))
        assert o.code == "principal_not_bound"


async def test_open_mode_any_pair_passes(nats_server, tmp_path, nc):
    """With no bindings at all, any agent may address any principal (open mode)."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        assert (await rec.roundtrip("stranger", moment_env("zed", good_moment()))).status == "accepted"


async def test_calibration_note_rate(nats_server, tmp_path, nc):
    """calibration_note is counted per agent against the moments delivered (spec 000 §6.9)."""
    async with running_gateway(nats_server, str(tmp_path / "d")) as gw, Recorder(nc) as rec:
        noted = good_moment()
        noted["meta"] = {"decision_class": "consent", "calibration_note": "I understated the ledger risk earlier."}
        await rec.roundtrip("planner", moment_env("alice", noted))
        await rec.roundtrip("planner", moment_env("alice", good_moment(stem="Who should receive the 2024 summary?")))
        st = await gw.stage_state.get()
        assert st.stats.rate("planner", "calibration_note") == 0.5


async def test_untrusted_propagates_to_item_outcome_verdict(nats_server, tmp_path, nc):
    """meta.contentTrust untrusted marks the surface item, the outcome and the verdict untrusted: a clarification's,
    a malformed moment's refusal and an untrusted moment's refusal (no untrusted moment is delivered, spec 002)."""
    async with running_gateway(nats_server, str(tmp_path / "d")), Recorder(nc) as rec:
        ask = env("clarification.request", {"questions": [{"id": "q", "question": "Which year?"}]}, content_trust="untrusted")
        out = await rec.roundtrip("planner", ask, headers={"Pgw-Principal": "alice"})
        assert out.untrusted
        item = await rec.item(lambda i: isinstance(i, ClarificationItem))
        assert item.untrusted
        v = await rec.verdict(lambda v: v.verdict_class == "hitl_dispatched")
        assert v.untrusted
        bad = await rec.roundtrip("planner", moment_env("alice", good_moment(recommended_idx=5), content_trust="untrusted"))
        assert bad.untrusted
        rv = await rec.verdict(lambda v: v.envelope_id == bad.envelope_id)
        assert rv.untrusted
        gated = await rec.roundtrip("planner", moment_env("alice", good_moment(), content_trust="untrusted"))
        assert (gated.code, gated.untrusted) == ("untrusted_content_blocks_approval", True)
        gv = await rec.verdict(lambda v: v.envelope_id == gated.envelope_id)
        assert gv.untrusted and gv.verdict_class == "denied"
        assert not [i for i in rec.items if isinstance(i, BindingMomentItem)]


async def test_untrusted_moment_cannot_approve(nats_server, tmp_path, nc):
    """An untrusted moment that gates an action cannot be approved: untrusted_content_blocks_approval."""
    async with running_gateway(nats_server, str(tmp_path / "d")) as gw:
        mid = await gw.desk.dispatch(
            agent="planner", principal="alice", binding_moment=bm(good_moment()), envelope_id="e-1",
            correlation_id="c-1", untrusted=True, hem=HemContext(idp_id="i-1", session_id="s-1", action="pay"),
        )
        reply = await Surface(nc, "alice").resolve(mid, OptionChoice(index=0))
        assert (reply.status, reply.code) == ("refused", "untrusted_content_blocks_approval")


async def test_decision_classes_counted_apart_are_bounded(nats_server, tmp_path, nc):
    """The agent writes meta.decision_class (spec 000 §6.9): each new class its principal answered was a new key in
    the rates and two new series in /metrics for the life of the process. Past MAX_DECISION_CLASSES an agent's
    further classes are counted as ``other``, and its rates stay whole."""
    import uuid

    from gateway.stages.state import MAX_DECISION_CLASSES, OTHER_CLASS
    from pgwcore import metrics

    agent = f"flood{uuid.uuid4().hex[:8]}"  # the metrics registry is the process's: a name of this test's own
    n = MAX_DECISION_CLASSES + 8
    async with running_gateway(nats_server, str(tmp_path / "d")) as gw, Recorder(nc) as rec:
        for i in range(n):
            m = good_moment(stem=f"Which summary should go out, number {i}?")
            m["meta"] = {"decision_class": f"class-{i}"}
            out = await rec.roundtrip(agent, moment_env("alice", m))
            assert out.status == "accepted", out
            await Surface(nc, "alice").resolve(out.moment_id, OptionChoice(index=0))
        st = await gw.stage_state.get()
        await rec.until(lambda: sum(v for (a, _), v in st.stats.resolutions.items() if a == agent) == n, timeout=30)
        classes = {c for (a, c) in st.stats.resolutions if a == agent}
        assert len(classes) == MAX_DECISION_CLASSES + 1 and OTHER_CLASS in classes
        assert st.stats.resolutions[(agent, OTHER_CLASS)] == n - MAX_DECISION_CLASSES
        series = {s.labels["decision_class"] for f in metrics.REGISTRY.collect() for s in f.samples
                  if s.name == "pgw_resolutions_total" and s.labels.get("agent") == agent}
        assert len(series) == MAX_DECISION_CLASSES + 1, sorted(series)
        assert sum(metrics.REGISTRY.get_sample_value("pgw_resolutions_total", {"agent": agent, "decision_class": c})
                   for c in series) == n
