"""Construction-discipline lints for binding moments (spec 000 §6, §7.1).

The part of the slot grammar a machine can only approximate. Each lint is
deliberately narrow (a false refusal of a good moment is a bug) and has a
mode from ``pipeline.lints``: ``reject`` makes the moment malformed
(``envelope_invalid``, with the notice fallback of spec 000 §9.3), ``warn``
delivers it with a warning on the outcome, ``off`` skips it.

- ``synopsis_one_sentence`` §6.1: "a single sentence";
- ``synopsis_hedge`` §6.1/§7.1: a synopsis that defers the decision;
- ``leading_stem`` §6.5: a stem that embeds the recommendation or a lean;
- ``findings_restate_synopsis`` §6.2: a finding that restates the synopsis;
- ``recommendation_not_action`` §6.3: a recommendation that names a
  consideration ("weigh the trade-offs") instead of a concrete move;
- ``option_is_hatch`` §6.6: an option that duplicates an escape hatch
  ("Something else (free text)", "Reject the question"): "they do not include
  the escape hatches; the hatches are slot 8".
"""

from __future__ import annotations

import re
from typing import Any

from gateway.security.seen import seen, seen_all, seen_pattern
from subjects.wire import Detail

P = "$.payload.binding_moment"

# Abbreviations whose full stop does not end a sentence.
_ABBREV = re.compile(
    r"\b(?:e\.g|i\.e|etc|vs|mr|mrs|ms|dr|st|no|inc|ltd|co|jr|sr|approx|fig|cf|u\.s|u\.k|a\.m|p\.m)\.",
    re.IGNORECASE,
)
# A sentence end starts where a run of its marks starts (the look-behind): tried from inside a run, it
# would end where the run's own attempt ended, so it can only fail again, and a synopsis of 2,000 dots
# cost a scan of the rest of the run from each of them (27 ms).
_SENTENCE_END = re.compile(r"(?<![.!?])[.!?]+[\"')\]]*\s+(?=[A-Z0-9\"'(\[])")

_HEDGES = [
    r"it depends", r"depending on", r"not sure", r"unsure", r"hard to say", r"difficult to say",
    r"could go either way", r"either way", r"up to you", r"your call", r"let me know",
    r"unclear whether", r"not clear whether", r"perhaps", r"maybe", r"possibly",
    r"might want to", r"may want to", r"you could", r"we could", r"i could",
    r"might be (?:best|better|worth)", r"may be (?:best|better|worth)", r"might make sense",
    r"worth considering", r"we should consider", r"one option (?:is|would be)",
    r"there are (?:several|a few|many|two|some) options", r"i(?:'m| am) not certain",
    r"i(?:'m| am) leaning", r"i lean", r"i think we might", r"not yet decided", r"undecided",
    r"need(?:s)? more (?:time|information|analysis) (?:before|to)",
]
_HEDGE = re.compile(r"\b(?:" + "|".join(_HEDGES) + r")\b", re.IGNORECASE)

_LEADING = [
    r"shouldn'?t (?:we|i|you)", r"should (?:we|i|you) not", r"don'?t you (?:think|agree)",
    r"wouldn'?t it be", r"isn'?t it", r"aren'?t (?:we|you)", r"surely", r"obviously", r"clearly",
    r"the (?:best|right|smart|sensible|obvious|safest|recommended|preferred) (?:option|choice|move|path|answer|way)",
    r"recommend(?:ed|s)?", r"(?:i|we) suggest", r"as (?:i|we) (?:suggested|proposed)",
    r"(?:right|correct|agreed|ok|okay)\s*\?\s*$", r"go ahead and", r"you(?:'d| would) agree",
    r"of course", r"naturally",
]
_LEAD = re.compile(r"\b(?:" + "|".join(_LEADING) + r")", re.IGNORECASE)

_CONSIDERATION = re.compile(
    r"^\s*(?:consider(?:ing)?|weigh(?:ing)?|think(?:ing)? (?:about|through|over)|keep in mind|bear in mind"
    r"|be (?:aware|mindful|careful)|remember|note that|it is (?:important|worth)|it'?s (?:important|worth)"
    r"|reflect on|ponder|take into account|factor in|(?:the )?trade-?offs?|there (?:are|is) (?:a )?trade-?offs?"
    r"|balance (?:the|between)|evaluate (?:the )?(?:pros|trade-?offs?))\b",
    re.IGNORECASE,
)
_TRADEOFF = re.compile(r"\b(?:weigh|consider|balance) (?:the |all )?(?:trade-?offs?|pros and cons|options|risks)\b", re.IGNORECASE)

# An option label that *is* a hatch (§6.6). Anchored to the whole label (after the words that
# only dress it up), so "Reject the vendor's offer" or "Other vendors: ask for quotes" pass.
_HATCH_ANSWER = (
    r"(?:something|anything) else|other|others|none of (?:these|the above|them)|free[- ]?(?:text|form)(?: answer)?"
    r"|(?:write|type|enter|give|supply|provide) (?:in )?(?:my|your|an?) own(?: answer| response| option)?"
    r"|(?:my|your) own (?:answer|response|words|option)|custom(?: answer| response| option)?|write[- ]in"
    r"|(?:let me|i(?:'ll| will)) (?:type|write|specify|answer in my own words)|specify(?: other| another)?"
    r"|other[ ,:-]+(?:please )?specify|(?:an? )?different answer"
)
_HATCH_QUESTION = (
    r"(?:reject|decline|refuse|challenge|question) (?:the|this) (?:question|framing|frame|premise)"
    r"|(?:this is )?(?:the )?wrong question|(?:neither|none)[ ,;:-]+(?:let'?s|let us) (?:discuss|talk)(?: (?:it|this))?"
    r"|(?:let'?s|let us) (?:discuss|talk about) (?:it|this)(?: first| more| further)?"
    r"|reopen (?:the )?(?:deliberation|discussion|question)|(?:i )?(?:don'?t|do not) accept the question"
    r"|not the right question|ask (?:me )?(?:a )?(?:different|another) question|discuss (?:it|this) first"
)
# Compiled for the seen form of a label (gateway/security/seen.py: look-alikes, invisible
# characters and case folded), which is what the principal reads and so what is judged.
_HATCH_LABEL = re.compile(
    seen_pattern(r"^\W*(?:(?:i(?:'d| would) (?:rather|like to)|i want to|please)\s+)?"
                 r"(?P<answer>" + _HATCH_ANSWER + r")?(?P<question>" + _HATCH_QUESTION + r")?"
                 r"(?:\s*[(\[][^)\]]{0,40}[)\]])?\W*$"),
)


# The words a seen label can begin with (after its leading non-word characters) when
# _HATCH_LABEL finds a hatch in it: the first words of its optional lead-in ("i'd rather",
# "please") and of every alternative of _HATCH_ANSWER and _HATCH_QUESTION, all of which begin
# with a letter. A label that begins otherwise is no hatch, and costs no regex attempt.
_HATCH_FIRST = tuple(seen(w) for w in (
    "some", "any", "other", "none", "free", "write", "type", "enter", "give", "supply", "provide",
    "my", "your", "custom", "let", "i", "specify", "a", "different", "reject", "decline", "refuse",
    "challenge", "question", "this", "the", "wrong", "neither", "reopen", "do", "not", "ask",
    "discuss", "please"))
_ASCII_NON_WORD = "".join(c for c in map(chr, range(128)) if not (c.isalnum() or c == "_"))  # \W in ASCII


def hatch_of(label: str, seen_label: str | None = None) -> str | None:
    """``free_text`` or ``dialogue`` when ``label`` merely names that escape hatch (§6.6), else None.

    Judged on the label's seen form (``seen_label``, when the caller folded it already): "Something\u200b
    else", "\u0405omething else" (Cyrillic Dze) and "Some\u00adthing else" all read "Something else" on
    the surface.
    """
    s = seen(label) if seen_label is None else seen_label
    if s.isascii() and not s.lstrip(_ASCII_NON_WORD).startswith(_HATCH_FIRST):
        return None
    m = _HATCH_LABEL.match(s)
    if m is None:
        return None
    if m.group("answer"):
        return "free_text"
    return "dialogue" if m.group("question") else None


# Stop words as they read in a seen form ("them" is "thern" there, "all" is "aii").
_STOP = frozenset(seen(w) for w in
    ["a", "an", "the", "and", "or", "but", "of", "to", "in", "on", "at", "for", "with", "by", "from", "as", "is", "are", "was", "were", "be", "been", "being", "it", "its", "this", "that", "these", "those", "your", "you", "we", "our", "i", "my", "their", "they", "them", "he", "she", "his", "her", "not", "no", "all", "any", "only", "just", "than", "then", "so", "do", "does", "did", "have", "has", "had", "will", "would", "should", "can", "could", "may", "might", "must"])
_WORD = re.compile(r"[a-z0-9]+(?:[-'][a-z0-9]+)*")


# The same patterns folded for seen forms (gateway/security/seen.py): every lint judges the
# text the principal reads, with look-alikes, invisible characters and case folded.
_HEDGE_LOWER = re.compile(seen_pattern(_HEDGE.pattern))
_LEAD_LOWER = re.compile(seen_pattern(_LEAD.pattern))
_CONSIDERATION_SEEN = re.compile(seen_pattern(_CONSIDERATION.pattern))
_TRADEOFF_SEEN = re.compile(seen_pattern(_TRADEOFF.pattern))
_TRADEOFF_VERBS = tuple(seen(v) for v in ("weigh", "consider", "balance"))


def _find(pattern: re.Pattern[str], text: str) -> str | None:
    """The first match of a seen-form ``pattern`` in the seen form ``text``, as it reads there."""
    m = pattern.search(text)
    return m.group(0) if m else None


# Lower-cases ASCII and blanks every byte _WORD never matches: on ASCII text the words are then
# the blank-separated runs, except where a run holds a hyphen or apostrophe (_WORD decides those).
_WORD_BYTES = bytes.maketrans(
    bytes(range(128)),
    bytes(c + 32 if 65 <= c <= 90 else c if (97 <= c <= 122 or 48 <= c <= 57 or c in b"-'") else 32
          for c in range(128)),
)


def _words(text: str) -> list[str]:
    """``_WORD.findall(text.lower())``; ASCII text without a hyphen or apostrophe is split in C
    (a match never spans a byte _WORD cannot match, so the runs between them are matched alone)."""
    if not text.isascii():
        return _WORD.findall(text.lower())
    runs = text.encode().translate(_WORD_BYTES).decode()
    if "-" not in runs and "'" not in runs:
        return runs.split()
    out: list[str] = []
    for run in runs.split():
        if "-" in run or "'" in run:
            out.extend(_WORD.findall(run))
        else:
            out.append(run)
    return out


def sentences(text: str) -> int:
    """How many sentences ``text`` holds (abbreviations and decimals do not split)."""
    if not _SENTENCE_END.search(text):
        # No sentence end at all; removing the dots of abbreviations and
        # decimals below can only take ends away, never make one.
        return 1 if text.strip() else 0
    t = _ABBREV.sub(lambda m: m.group(0).replace(".", ""), text.strip())
    t = re.sub(r"(\d)\.(\d)", r"\1\2", t)
    return len([s for s in _SENTENCE_END.split(t) if s.strip()])


def _norm(text: str) -> str:
    return " ".join(_words(text))


def _tradeoff(text: str) -> bool:
    """Whether the seen form ``text`` weighs trade-offs (``_TRADEOFF``); on ASCII text the regex
    runs only if one of its verbs occurs, so a long recommendation costs a substring scan, not a
    regex attempt at every position (issue 18)."""
    if text.isascii() and not any(v in text for v in _TRADEOFF_VERBS):
        return False
    return _TRADEOFF_SEEN.search(text) is not None


_SHORT_FINDING = 400  # characters: below this a finding is split whole rather than word by word


def restates(finding: str, syn_words: set[str], syn_n: str) -> bool:
    """Whether ``finding`` restates the synopsis (spec 000 §6.2): the same words, or a Jaccard
    similarity of >= 0.75 over non-stop words with at least 3 of them.

    Stops reading the finding as soon as it holds more than ``len(syn_words) / 3`` distinct
    non-stop words the synopsis lacks: with ``a`` shared and ``b`` new words, Jaccard
    ``a / (a + b + c) >= 0.75`` needs ``b <= a / 3 <= len(syn_words) / 3``, and one new word
    already makes the texts differ. So a long finding costs a few words, not all of them."""
    if not syn_words:
        return False
    limit = len(syn_words) / 3
    if len(finding) <= _SHORT_FINDING:
        # A short finding is split whole (one C call): the same answer, since the set of new
        # words only grows as the loop below reads on, so it stops early exactly when the
        # whole finding's new words are more than ``limit``.
        words = _words(finding)
        fw = set(words) - _STOP
        if len(fw - syn_words) > limit:
            return False
    else:
        new: set[str] = set()
        words = []
        for m in _WORD.finditer(finding.lower()):
            w = m.group()
            words.append(w)
            if w not in syn_words and w not in _STOP and w not in new:
                new.add(w)
                if len(new) > limit:
                    return False
        fw = set(words) - _STOP
    if not fw:
        return False
    jaccard = len(fw & syn_words) / len(fw | syn_words)
    return " ".join(words) == syn_n or (jaccard >= 0.75 and len(fw) >= 3)


def check(bm: Any, forms: list[str] | None = None) -> list[tuple[str, Detail]]:
    """Every lint finding of a grammatically valid moment as (lint name, detail).

    Each lint but the sentence count judges the seen form of its slot (gateway/security/seen.py),
    the text the principal reads: a hedge, a leading word or a hatch written with look-alike
    letters, invisible characters or another case is the same hedge, word or hatch. The sentence
    count reads the slot as written, since it needs the capitals that begin a sentence.

    ``forms``: the seen forms of those slots, when the grammar folded them already
    (``moment_grammar.check_and_fold``, on the same texts).
    """
    out: list[tuple[str, Detail]] = []
    raw_syn: str = bm.synopsis
    q = bm.question
    # Every slot a lint reads, folded at once (seen_all): the synopsis, the stem, the option labels,
    # the findings and the recommendations.
    if forms is None:
        forms = seen_all([raw_syn, q.stem, *(o.label for o in q.options), *bm.findings, *bm.recommendations])
    syn, stem = forms[0], forms[1]
    after_labels = 2 + len(q.options)
    labels = forms[2:after_labels]
    findings = forms[after_labels:after_labels + len(bm.findings)]
    recommendations = forms[after_labels + len(bm.findings):]
    n = sentences(raw_syn)
    if n > 1:
        out.append(("synopsis_one_sentence", Detail(
            message=f"the synopsis holds {n} sentences; spec 000 §6.1 asks for a single answer-first sentence",
            path=f"{P}.synopsis", rule="synopsis_one_sentence")))
    hedge = _find(_HEDGE_LOWER, syn)
    if hedge or syn.endswith("?"):
        what = f"{hedge!r}" if hedge else "a question"
        out.append(("synopsis_hedge", Detail(
            message=f"the synopsis hedges ({what}); spec 000 §6.1 requires it to commit to a position, "
                    "or the agent should not emit a binding moment yet (§7.1)",
            path=f"{P}.synopsis", rule="synopsis_hedge")))
    lead = _find(_LEAD_LOWER, stem)
    # The stem embeds the recommendation when it names the recommended option (12 characters or
    # more, normalised) and no other; each text is normalised only once the answer needs it.
    idx = q.recommended_idx
    rec_label = _norm(labels[idx]) if idx < len(labels) else ""
    embeds = False
    if len(rec_label) >= 12:
        stem_n = _norm(stem)
        if rec_label in stem_n:
            embeds = not any(label and label in stem_n
                             for label in (_norm(f) for i, f in enumerate(labels) if i != idx))
    if lead or embeds:
        why = f"it contains {lead!r}" if lead else "it names the recommended option and no other"
        out.append(("leading_stem", Detail(
            message=f"the question stem is leading ({why}); spec 000 §6.5: the lean belongs on the "
                    "recommended option, never in the stem",
            path=f"{P}.question.stem", rule="leading_stem")))
    syn_all = _words(syn)  # each text is split into words once, for both comparisons
    syn_words = set(syn_all) - _STOP
    syn_n = " ".join(syn_all)
    for i, f in enumerate(findings):
        if restates(f, syn_words, syn_n):
            out.append(("findings_restate_synopsis", Detail(
                message=f"finding {i} restates the synopsis; spec 000 §6.2: each finding adds an observation",
                path=f"{P}.findings[{i}]", rule="findings_restate_synopsis")))
    for i, o in enumerate(q.options):
        hatch = hatch_of(o.label, labels[i])
        if hatch:
            out.append(("option_is_hatch", Detail(
                message=f"option {i} ({o.label[:60]!r}) duplicates the {hatch} escape hatch; spec 000 §6.6: the "
                        f"options are the substantive answers, the hatches are slot 8 (question.hatches.{hatch})",
                path=f"{P}.question.options[{i}].label", rule="option_is_hatch")))
    for i, sr in enumerate(recommendations):
        if _CONSIDERATION_SEEN.search(sr) or _tradeoff(sr):
            out.append(("recommendation_not_action", Detail(
                message=f"recommendation {i} names a consideration, not an action; spec 000 §6.3 asks "
                        "for a concrete move that would change state",
                path=f"{P}.recommendations[{i}]", rule="recommendation_not_action")))
    return out


def apply(bm: Any, modes: Any, forms: list[str] | None = None) -> tuple[list[Detail], list[Detail]]:
    """(rejections, warnings) under the configured modes (``forms``: as :func:`check`'s)."""
    reject: list[Detail] = []
    warn: list[Detail] = []
    for name, detail in check(bm, forms):
        mode = getattr(modes, name)
        if mode == "reject":
            reject.append(detail)
        elif mode == "warn":
            warn.append(detail)
    return reject, warn
