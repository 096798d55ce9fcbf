"""The chaos checker itself (tests/chaos/checker.py): it must see every kind of fault."""

from __future__ import annotations

from tests.chaos.checker import classify

ACKED = {"m1": "moment", "r1": "refused"}


def _o(eid: str) -> dict:
    return {"outcome": "envelope_outcome", "envelope_id": eid}


def _i(eid: str) -> dict:
    return {"item": "binding_moment", "envelope_id": eid}


def _v(eid: str, vid: str) -> dict:
    return {"verdict_id": vid, "envelope_id": eid}


def test_clean_history_is_delivered_once() -> None:
    """One outcome each, one item and verdict for the moment: everything delivered once."""
    rep = classify(ACKED, [_o("m1"), _o("r1")], [_i("m1")], [_v("m1", "a"), _v("r1", "b")], sent=2)
    assert rep.ok and rep.delivered_once == 2


def test_missing_outcome_is_lost() -> None:
    """An acknowledged envelope without an outcome is classified lost."""
    rep = classify(ACKED, [_o("m1")], [_i("m1")], [_v("m1", "a")], sent=2)
    assert rep.lost == ["r1"] and not rep.ok


def test_moment_without_its_surface_item_is_lost() -> None:
    """A binding moment whose surface item never appeared is lost, even with an outcome."""
    rep = classify(ACKED, [_o("m1"), _o("r1")], [], [_v("m1", "a"), _v("r1", "b")], sent=2)
    assert rep.lost == ["m1"]


def test_second_outcome_or_item_is_duplicated() -> None:
    """Two outcomes, or two surface items, for one envelope are duplicates."""
    rep = classify(ACKED, [_o("m1"), _o("r1"), _o("r1")], [_i("m1"), _i("m1")],
                   [_v("m1", "a"), _v("r1", "b")], sent=2)
    assert sorted(rep.duplicated) == ["m1", "r1"]


def test_repeated_verdict_id_is_duplicated() -> None:
    """The same verdict id stored twice is a duplicated verdict."""
    rep = classify(ACKED, [_o("m1"), _o("r1")], [_i("m1")], [_v("m1", "a"), _v("m1", "a"), _v("r1", "b")], sent=2)
    assert rep.verdicts_duplicated == ["a"] and not rep.ok


def test_output_nobody_sent_is_unexpected() -> None:
    """Outputs for an envelope that was never acknowledged are unexpected."""
    rep = classify(ACKED, [_o("m1"), _o("r1"), _o("ghost")], [_i("m1")], [_v("m1", "a"), _v("r1", "b")], sent=2)
    assert rep.unexpected == ["outcome for 'ghost'"]


def test_capsules_once_missing_and_twice() -> None:
    """Each verdict must have exactly one capsule: missing and doubled ones are reported."""
    verdicts = [_v("m1", "a"), _v("r1", "b")]
    ok = classify(ACKED, [_o("m1"), _o("r1")], [_i("m1")], verdicts, sent=2, capsule_verdict_ids=["a", "b"])
    assert ok.ok and ok.capsuled_once == 2
    bad = classify(ACKED, [_o("m1"), _o("r1")], [_i("m1")], verdicts, sent=2, capsule_verdict_ids=["a", "a"])
    assert bad.not_capsuled == ["b"] and bad.capsuled_twice == ["a"] and not bad.ok


def test_withdrawn_items_are_not_deliveries() -> None:
    """A 'withdrawn' surface item (moment closed) does not count as a second delivery."""
    rep = classify(ACKED, [_o("m1"), _o("r1")], [_i("m1"), {"item": "withdrawn", "envelope_id": "m1"}],
                   [_v("m1", "a"), _v("r1", "b")], sent=2)
    assert rep.ok
