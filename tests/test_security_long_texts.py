"""Long texts from a hostile agent: judged in full, refused where too long, and never kept.

Every text rule judges a text's seen form (gateway/security/seen.py), and the seen form of a
short text is remembered. An agent may send strings of up to ``limits.max_string_chars`` (64,000
characters) in envelopes of up to a megabyte; the gateway held the seen form of each in a cache
of 8,192 entries, string and form, so a few thousand envelopes made it hold gigabytes, and folded
every character of a non-ASCII text in a Python call of its own (25 ms for one such string).

Here the agent ``planner`` sends, through the bus as an agent's client does: binding moments
whose findings are 60,000 characters of look-alike letters and invisible characters (each a new
text), and spec 001 narratives of 4,000 characters (the most their schema takes) carrying a
disguised forbidden marker at their very end. Afterwards: each moment was refused as too long and none reached the principal; each
narrative was refused for the marker (a long text is judged to its last character); and neither
seen-form cache holds any text longer than ``CACHED_CHARS``. And narratives naming 256 markers of their
own, of the longest fold the schema allows (each compiled into a pattern per envelope until the ninth
session), are judged by them: refused where a marker stands as words, delivered where it does not.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from gateway.security import seen as seen_mod
from subjects.wire import AuthorizationItem, BindingMomentItem
from tests.disguises import disguises
from tests.moments import good_moment
from tests.pipeline_helpers import Recorder, env, moment_env, running_gateway

pytestmark = pytest.mark.security

WORKFLOWS = {"chat": {"authoritative_intent": "non_authoritative", "enforcement_mode": "NON_AUTHORITATIVE_ONLY"}}
LONG = 60_000
NARRATIVE = 4_000  # spec 001's text limit (gateway/stages/authorization.py ``Text``)


def _long_text(n: int, salt: int) -> str:
    """``n`` characters a reader sees as Latin words: Cyrillic look-alikes, zero-width spaces, a number."""
    word = f"\u0405h\u0430r\u0435d\u200b l\u0435dg\u0435r {salt} "
    return (word * (n // len(word) + 1))[:n]


def _cached_texts() -> list[str]:
    """Every text either seen-form cache holds now (the keys of each lru_cache's own dict)."""
    out: list[str] = []
    for cached in (seen_mod._seen_short, seen_mod._seen_cased_short):
        for ref in gc.get_referents(cached):
            if isinstance(ref, dict):
                out += [k for k in ref if isinstance(k, str)]
    return out


async def test_long_hostile_texts_are_judged_whole_refused_and_not_kept(nats_server, tmp_path, nc) -> None:
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"workflows": WORKFLOWS}), \
            Recorder(nc) as rec:
        moments = []
        for i in range(6):
            m = good_moment()
            m["findings"] = [_long_text(LONG, 100 * i + k) for k in range(7)]
            moments.append(moment_env("alice", m))
        marker = dict(disguises("verified"))["Cyrillic look-alikes"]
        tail = f" It is {marker}."
        narratives = [env("vendor.pgw.authorization", {"workflow_id": "chat", "principal": "alice", "envelope": {
            "kind": "narrative", "text": _long_text(NARRATIVE - len(tail), 1000 + i) + tail,
            "policy": {"grammar_mode": "hedged", "forbidden_markers": [], "max_specificity": "contextualized",
                       "scrub_measurements": False}}}) for i in range(4)]
        assert all(len(n["payload"]["envelope"]["text"]) == NARRATIVE for n in narratives)
        bodies: list[dict[str, Any]] = [*moments, *narratives]
        for b in bodies:
            await rec.send("planner", b)
        outs = await asyncio.gather(*(rec.outcome(b["envelopeId"], timeout=120) for b in bodies))

        for out in outs[: len(moments)]:
            rules = {d.rule for d in out.details or []}
            assert out.code == "envelope_invalid" and rules == {"string_too_long"}, (out.code, rules)
        for out in outs[len(moments):]:
            assert out.code == "forbidden_marker", (out.code, out.reason)
        assert not [i for i in rec.items if isinstance(i, BindingMomentItem)]
        # The principal is told of each refused narrative in the gateway's words, never the agent's long text.
        await rec.until(lambda: len([i for i in rec.items if isinstance(i, AuthorizationItem)]) == len(narratives), 30)
        assert all(len(str(i.envelope)) < 2_000 for i in rec.items if isinstance(i, AuthorizationItem))

    held = _cached_texts()
    assert held, "the caches were found and hold the short texts judged"
    assert max(map(len, held)) <= seen_mod.CACHED_CHARS, max(map(len, held))


def test_an_over_long_slot_is_refused_before_it_is_folded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grammar judges a slot's length before its seen form: 64,000 characters are refused as too long
    without folding them (folding is the costliest thing the grammar does with a text)."""
    from gateway.stages import moment_grammar

    def no_fold(text: str) -> str:
        assert len(text) <= moment_grammar.SLOT_MAX, f"folded a text of {len(text)} characters"
        return seen_mod.seen(text)

    m = good_moment()
    m["findings"] = [_long_text(LONG, 1)]
    monkeypatch.setattr(moment_grammar, "seen", no_fold)
    details = moment_grammar.check_binding_moment(m)
    assert [d.rule for d in details] == ["string_too_long"], details


async def test_an_agents_own_longest_markers_are_judged_through_the_bus(nats_server, tmp_path, nc) -> None:
    """spec 001's ``policy.forbidden_markers``: 256 of 200 characters each, every one folding to 3,600
    (U+FDFA), new in each envelope. Whole words are refused, the same characters inside a word delivered."""
    async with running_gateway(nats_server, str(tmp_path / "d"), pipeline={"workflows": WORKFLOWS}), \
            Recorder(nc) as rec:
        bodies = []
        for i in range(3):
            own = [f"{i}x{k} " + "\ufdfa" * 190 for k in range(256)]
            for text in (f"It may rain, {own[255]}.", f"It may rain, y{own[255]}."):
                bodies.append(env("vendor.pgw.authorization", {"workflow_id": "chat", "principal": "alice", "envelope": {
                    "kind": "narrative", "text": text, "policy": {
                        "grammar_mode": "hedged", "forbidden_markers": own, "max_specificity": "contextualized",
                        "scrub_measurements": False}}}))
        for b in bodies:
            await rec.send("planner", b)
        outs = await asyncio.gather(*(rec.outcome(b["envelopeId"], timeout=120) for b in bodies))
        for whole, inside in zip(outs[::2], outs[1::2], strict=True):
            assert whole.code == "forbidden_marker", (whole.code, whole.reason)
            assert inside.status == "accepted", (inside.code, inside.reason)
        # The principal reads each delivered narrative as sent, and of each refused one the gateway's words only.
        await rec.until(lambda: len([i for i in rec.items if isinstance(i, AuthorizationItem)]) == len(bodies), 30)
        shown = [str(i.envelope) for i in rec.items if isinstance(i, AuthorizationItem)]
        assert sum("\ufdfa" in text for text in shown) == len(bodies) // 2, [t[:80] for t in shown]
