"""The lints' fast paths answer exactly what the plain computation answers (issue 18).

``lints.restates`` stops reading a long finding early and ``lints._tradeoff``
skips the regex when none of its verbs occurs; both are compared here with
the straightforward computation on generated text, including the boundary
cases (restatements, near-restatements, stop words only, case and
non-ASCII letters).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.security.seen import seen
from gateway.stages import lints

VOCAB = ["harbor", "ledger", "tax", "summary", "filing", "send", "the", "and", "of", "2025", "Weigh", "consider",
         "BALANCE", "trade-offs", "pros", "cons", "options", "risks", "all", "only", "Harbor's", "ſend", "K"]
texts = st.lists(st.sampled_from(VOCAB), max_size=30).map(" ".join)


def _reference_restates(f: str, syn: str) -> bool:
    syn_all = lints._words(syn)
    syn_words = set(syn_all) - lints._STOP
    f_all = lints._words(f)
    fw = set(f_all) - lints._STOP
    if not fw or not syn_words:
        return False
    jaccard = len(fw & syn_words) / len(fw | syn_words)
    return " ".join(f_all) == " ".join(syn_all) or (jaccard >= 0.75 and len(fw) >= 3)


def _restates(f: str, syn: str) -> bool:
    syn_all = lints._words(syn)
    return lints.restates(f, set(syn_all) - lints._STOP, " ".join(syn_all))


@settings(max_examples=400, deadline=None)
@given(texts, texts)
def test_restates_matches_the_plain_computation(f: str, syn: str) -> None:
    assert _restates(f, syn) == _reference_restates(f, syn)


@settings(max_examples=200, deadline=None)
@given(texts)
def test_a_finding_that_is_the_synopsis_or_a_shuffle_of_it(syn: str) -> None:
    words = syn.split()
    for f in (syn, " ".join(reversed(words)), syn + " and the", syn + " unrelated words here"):
        assert _restates(f, syn) == _reference_restates(f, syn)


def test_known_answers() -> None:
    syn = "Share only your 2025 tax summary with Harbor Accounting, not the full ledger."
    assert _restates("Share only your 2025 tax summary with Harbor Accounting, not the full ledger", syn)
    assert _restates("Harbor Accounting gets your 2025 tax summary only, not the full ledger.", syn)
    assert not _restates("Harbor requested the full ledger for the 2025 filing. " * 40, syn)


@settings(max_examples=400, deadline=None)
@given(texts)
def test_tradeoff_matches_the_regex(r: str) -> None:
    assert lints._tradeoff(seen(r)) == (lints._TRADEOFF_SEEN.search(seen(r)) is not None)


def test_tradeoff_known_answers() -> None:
    assert lints._tradeoff(seen("Weigh the trade-offs before sending."))
    assert lints._tradeoff(seen("BALANCE all risks"))
    assert not lints._tradeoff(seen("Send the 2025 tax summary PDF through the client portal. " * 40))
    assert lints._tradeoff(seen("Соnsider the options"))  # Cyrillic U+0421 and U+043E read as C and o
    assert not lints._tradeoff(seen("Conſider the options"))  # UTS #39: the long s is drawn, and read, as f
