"""The machine-checkable slot grammar of spec 000 §5-§6.

Every violation is reported with its own rule name and JSON path, all at once,
so an agent can fix its moment in one round. Section numbers follow the
draft's headings (§6.1 synopsis ... §6.9 meta).
"""

from __future__ import annotations

import re
from typing import Any

from gateway.security.seen import seen, seen_all, seen_pattern
from gateway.security.text import hidden_controls, may_hide
from subjects.constraints import MAX_LIST_ITEMS, MAX_OPTIONS, MIN_OPTIONS
from subjects.util import LINE_BREAKS
from subjects.wire import Detail

SLOT_MAX = 2000
LABEL_MAX = 200
REASONING_MAX = 1000
META_MAX = 1000
REQUIRED = ("synopsis", "findings", "recommendations", "offer", "question")
ALLOWED = (*REQUIRED, "meta")


# spec 000 §6.7: exactly one option is marked, by recommended_idx, and the surfaces draw that mark ("★
# recommended by the agent", or by the gateway's policy); "the two-marked case" is malformed. A label that
# carries the surfaces' mark is a second mark as a person reads it (found by a docs-only attack: "★ recommended
# by the agent" in another option's label showed two recommended options on the terminal and in e-mail).
# Judged on the seen form, and narrow, as a false refusal is a bug (a review): the surfaces' own words
# ("recommended by the agent", "... by the gateway"), or "recommended" set off at the label's end ("Pay now
# (recommended)", "Pay now - RECOMMENDED"). "Recommended settings", "Proceed as recommended", "Skip it (not
# recommended)", "Use the settings recommended by IT", "Hotel Astoria 4★" are labels like any other.
_MARKED = re.compile("|".join(seen_pattern(p) for p in (
    r"\brecommended\s+by\s+the\s+(?:agent|gateway)\b", r"[(\[\-\u2013\u2014:|,*/]\s*recommended\W*$")))


# Both of _MARKED's alternatives hold the word, so a label without it is searched no further (one
# substring scan instead of a regex attempt at every position).
_MARK_WORD = seen("recommended")


def _label_marks(form: str) -> bool:
    """Whether an option's label (its seen form) carries the surfaces' recommendation mark (``_MARKED``)."""
    return _MARK_WORD in form and _MARKED.search(form) is not None


def _check_labels(out: list[Detail], options: list[Any], path: str, forms: list[str] | None = None) -> None:
    """What a person reads of the labels (spec 000 §6.6, §6.7): no label marks itself recommended, and no two
    labels read alike (``seen``: look-alike letters, invisible characters, case, spacing). Two that read alike
    leave her no way to tell which she chose, while the signed answer names one by its index (found by a
    docs-only attack: "Pay now" and "Pay n\u043ew", a Cyrillic o). ``forms``: every label's seen form, when
    the caller folded them already (:func:`check_and_fold`)."""
    first: dict[str, int] = {}
    for i, opt in enumerate(options[:MAX_OPTIONS + 1]):
        label = opt.get("label") if isinstance(opt, dict) else None
        if not isinstance(label, str) or len(label) > LABEL_MAX:
            continue  # reported above
        form = seen(label) if forms is None else forms[i]
        lp = f"{path}.options[{i}].label"
        if _label_marks(form):
            out.append(Detail(message=f"{lp} marks its option recommended; spec 000 §6.7: exactly one option is "
                                      "marked, by recommended_idx, and the surface draws the mark",
                              path=lp, rule="option_marks_recommendation"))
        if form and form in first:
            out.append(Detail(message=f"{lp} reads the same as options[{first[form]}].label once look-alike "
                                      "letters, invisible characters and case are read as a person reads them",
                              path=lp, rule="options_indistinct"))
        first.setdefault(form, i)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _text(out: list[Detail], v: Any, path: str, rule: str, limit: int) -> None:
    # Non-empty as the principal reads it (spec 000 §6): a slot of spaces and invisible
    # characters (" \u200b") renders blank, so its seen form is judged, not its length. The
    # length is judged first: an over-long slot is refused without folding all of it.
    if isinstance(v, str) and len(v) > limit:
        out.append(Detail(message=f"{path} is longer than {limit} characters", path=path, rule="string_too_long"))
    elif not isinstance(v, str) or not seen(v):
        out.append(Detail(message=f"{path} must be a non-empty string (it shows nothing once invisible "
                                  "characters are removed)", path=path, rule=rule))
    # issue 7: spoofing. Bidi controls and tag characters are not ASCII, so an
    # ASCII slot (the common case) skips the per-character scan.
    elif not v.isascii() and (hidden := hidden_controls(v, tags=rule in ("synopsis", "stem", "option_label"))):
        out.append(Detail(message=f"{path} contains an invisible control ({hidden})", path=path, rule="hidden_characters"))


def _label(out: list[Detail], v: Any, path: str) -> None:
    """An option's label: a slot (``_text``) on one line. A line break in it (a CR) let the terminal draw
    another option's text over it, so that she read one option and chose another (found by an attack from
    the docs); every surface shows a label as one line."""
    _text(out, v, path, "option_label", LABEL_MAX)
    if isinstance(v, str) and LINE_BREAKS.search(v):
        out.append(Detail(message=f"{path} must be one line (it holds a line break)", path=path, rule="option_label"))


def _plain(v: Any, limit: int) -> bool:
    """``v`` is an ASCII string without control characters, not blank, within ``limit``: ``_text``
    would find nothing in it (its checks in that order), so the caller need not build the slot's
    path (the common case)."""
    return (isinstance(v, str) and len(v) <= limit and v.isascii() and not v.isspace() and v != ""
            and not may_hide(v))


def _text_list(out: list[Detail], v: Any, path: str, rule: str) -> None:
    if not isinstance(v, list):
        out.append(Detail(message=f"{path} must be an array of strings", path=path, rule=rule))
        return
    if len(v) > MAX_LIST_ITEMS:
        out.append(Detail(message=f"{path} has more than {MAX_LIST_ITEMS} entries", path=path, rule=rule))
    for i, s in enumerate(v[:MAX_LIST_ITEMS]):
        if not _plain(s, SLOT_MAX):
            _text(out, s, f"{path}[{i}]", rule, SLOT_MAX)


_MEMBERS = frozenset(REQUIRED)
_QUESTION_MEMBERS = frozenset(("stem", "options", "recommended_idx", "hatches"))
_OPTION_MEMBERS = frozenset(("label", "reasoning"))
_HATCH_MEMBERS = frozenset(("free_text", "dialogue"))
_WITH_META = frozenset(ALLOWED)
_META_MEMBERS = frozenset(("decision_class", "calibration_note"))


def _plain_moment(bm: Any) -> tuple[list[str], list[Any]] | None:
    """The common moment, judged in one pass: exactly the five required members (and ``meta``), every
    member of the type and count the grammar asks for, and every text within its limit, not blank,
    and printable ASCII (so no control, invisible or line-break character, and nothing for
    ``_text`` to say). Then (the texts the lints fold, in their order: the synopsis, the stem, the
    option labels, the findings, the recommendations; the options); else None, and the moment is
    judged member by member. Each test here is one :func:`check_binding_moment` makes, or a stricter
    one (exact types), so a moment it passes is one the full walk finds nothing in but the labels'
    marks and look-alikes, which :func:`check_and_fold` still judges."""
    if type(bm) is not dict or not (bm.keys() == _MEMBERS or bm.keys() == _WITH_META):
        return None
    meta = bm.get("meta")
    notes: list[Any] = []
    if meta is not None:  # §6.9: both members OPTIONAL, each a text of at most 1,000 characters, or null
        if type(meta) is not dict or not meta.keys() <= _META_MEMBERS:
            return None
        notes = [v for v in meta.values() if v is not None]
        if any(type(v) is not str or len(v) > META_MAX for v in notes):
            return None
    q, findings, recommendations = bm["question"], bm["findings"], bm["recommendations"]
    if (type(q) is not dict or q.keys() != _QUESTION_MEMBERS or type(findings) is not list
            or type(recommendations) is not list or len(findings) > MAX_LIST_ITEMS
            or len(recommendations) > MAX_LIST_ITEMS):
        return None
    options, idx, hatches = q["options"], q["recommended_idx"], q["hatches"]
    if (type(options) is not list or not MIN_OPTIONS <= len(options) <= MAX_OPTIONS or type(idx) is not int
            or not 0 <= idx < len(options) or type(hatches) is not dict or hatches.keys() != _HATCH_MEMBERS
            or type(hatches["free_text"]) is not bool or type(hatches["dialogue"]) is not bool):
        return None
    labels: list[Any] = []
    reasonings: list[Any] = []
    for opt in options:
        if type(opt) is not dict or opt.keys() != _OPTION_MEMBERS:
            return None
        label, reasoning = opt["label"], opt["reasoning"]
        if type(label) is not str or type(reasoning) is not str or len(label) > LABEL_MAX or len(reasoning) > REASONING_MAX:
            return None
        labels.append(label)
        reasonings.append(reasoning)
    texts = [bm["synopsis"], q["stem"], *labels, *findings, *recommendations]
    rest = [bm["offer"], *reasonings, *notes]
    for t in (*texts, *rest):
        if type(t) is not str or len(t) > SLOT_MAX or not t or t.isspace():
            return None
    # One C pass for all of them: printable ASCII holds no control character (so none _text or
    # may_hide would report) and no line break (LINE_BREAKS are controls or not ASCII).
    joined = "".join(texts) + "".join(rest)
    if not (joined.isascii() and joined.isprintable()):
        return None
    return texts, options


def check_and_fold(bm: Any, path: str = "$.payload.binding_moment") -> tuple[list[Detail], list[str] | None]:
    """:func:`check_binding_moment`, and the seen forms of the texts the construction lints read (in the
    order ``lints.check`` folds them) when the moment is the common one (:func:`_plain_moment`), else None:
    the labels are folded once, for the grammar's label rules and for the lints."""
    plain = _plain_moment(bm)
    if plain is None:
        return check_binding_moment(bm, path), None
    texts, options = plain
    forms = seen_all(texts)
    out: list[Detail] = []
    _check_labels(out, options, f"{path}.question", forms[2:2 + len(options)])
    return out, forms


def check_binding_moment(bm: Any, path: str = "$.payload.binding_moment") -> list[Detail]:
    """All grammar violations of ``bm``; an empty list means well-formed."""
    out: list[Detail] = []
    if not isinstance(bm, dict):
        return [Detail(message=f"{path} must be an object (spec 000 §5)", path=path, rule="not_object")]
    for m in REQUIRED:  # spec 000 §5: these members are REQUIRED
        if m not in bm:
            out.append(Detail(message=f"REQUIRED member {m!r} is missing (spec 000 §5)", path=f"{path}.{m}", rule="missing_member"))
    for m in bm:
        if m not in ALLOWED:  # spec 000 §5: "exactly the members specified"
            out.append(Detail(message=f"unknown member {str(m)[:64]!r} (spec 000 §5)", path=f"{path}.{m}", rule="unknown_member"))
    if "synopsis" in bm and not _plain(bm["synopsis"], SLOT_MAX):
        _text(out, bm["synopsis"], f"{path}.synopsis", "synopsis", SLOT_MAX)  # §6.1
    if "findings" in bm:
        _text_list(out, bm["findings"], f"{path}.findings", "findings")  # §6.2
    if "recommendations" in bm:
        _text_list(out, bm["recommendations"], f"{path}.recommendations", "recommendations")  # §6.3
    if "offer" in bm and not _plain(bm["offer"], SLOT_MAX):
        _text(out, bm["offer"], f"{path}.offer", "offer", SLOT_MAX)  # §6.4
    if "question" in bm:
        _check_question(out, bm["question"], f"{path}.question")
    meta = bm.get("meta")
    if meta is not None:  # §6.9: OPTIONAL, both members individually OPTIONAL
        if not isinstance(meta, dict):
            out.append(Detail(message=f"{path}.meta must be an object", path=f"{path}.meta", rule="meta"))
        else:
            for k, v in meta.items():
                if k not in ("decision_class", "calibration_note"):
                    out.append(Detail(message=f"unknown meta member {str(k)[:64]!r}", path=f"{path}.meta.{k}", rule="unknown_member"))
                elif v is not None:
                    _text(out, v, f"{path}.meta.{k}", "meta", META_MAX)
    return out


def _check_question(out: list[Detail], q: Any, path: str) -> None:
    if not isinstance(q, dict):
        out.append(Detail(message=f"{path} must be an object", path=path, rule="question"))
        return
    for m in q:
        if m not in ("stem", "options", "recommended_idx", "hatches"):
            out.append(Detail(message=f"unknown member {str(m)[:64]!r}", path=f"{path}.{m}", rule="unknown_member"))
    if "stem" not in q:
        out.append(Detail(message="REQUIRED member 'stem' is missing (spec 000 §6.5)", path=f"{path}.stem", rule="missing_member"))
    elif not _plain(q["stem"], SLOT_MAX):
        _text(out, q["stem"], f"{path}.stem", "stem", SLOT_MAX)
    options = q.get("options")
    n_options: int | None = None
    if "options" not in q:
        out.append(Detail(message="REQUIRED member 'options' is missing (spec 000 §6.6)", path=f"{path}.options", rule="missing_member"))
    elif not isinstance(options, list):
        out.append(Detail(message="options must be an array (spec 000 §6.6)", path=f"{path}.options", rule="options_type"))
    else:
        n_options = len(options)
        if not MIN_OPTIONS <= n_options <= MAX_OPTIONS:
            out.append(Detail(
                message=f"options has {n_options} entries; spec 000 §6.6 requires {MIN_OPTIONS} to {MAX_OPTIONS}",
                path=f"{path}.options", rule="options_count",
            ))
        for i, opt in enumerate(options[:MAX_OPTIONS + 1]):
            if (isinstance(opt, dict) and len(opt) == 2 and _plain(opt.get("label"), LABEL_MAX)
                    and not LINE_BREAKS.search(opt["label"]) and _plain(opt.get("reasoning"), REASONING_MAX)):
                continue  # exactly label and reasoning, both plain: nothing below would be said
            op = f"{path}.options[{i}]"
            if not isinstance(opt, dict):
                out.append(Detail(message=f"{op} must be an object with label and reasoning", path=op, rule="option_type"))
                continue
            for m in opt:
                if m not in ("label", "reasoning"):
                    out.append(Detail(message=f"unknown member {str(m)[:64]!r}", path=f"{op}.{m}", rule="unknown_member"))
            if "label" not in opt:
                out.append(Detail(message=f"{op}.label is REQUIRED (spec 000 §6.6)", path=f"{op}.label", rule="option_label"))
            else:
                _label(out, opt["label"], f"{op}.label")
            if "reasoning" not in opt:
                out.append(Detail(message=f"{op}.reasoning is REQUIRED (spec 000 §6.6)", path=f"{op}.reasoning", rule="option_reasoning"))
            else:
                _text(out, opt["reasoning"], f"{op}.reasoning", "option_reasoning", REASONING_MAX)
        _check_labels(out, options, path)
    # spec 000 §6.7: present, an integer, non-negative, strictly less than len(options).
    if "recommended_idx" not in q:
        out.append(Detail(message="recommended_idx is REQUIRED (spec 000 §6.7)", path=f"{path}.recommended_idx", rule="recommended_idx_missing"))
    else:
        idx = q["recommended_idx"]
        if not _is_int(idx):
            out.append(Detail(message="recommended_idx must be an integer marking exactly one option (spec 000 §6.7)", path=f"{path}.recommended_idx", rule="recommended_idx_type"))
        elif idx < 0 or (n_options is not None and idx >= n_options):
            out.append(Detail(
                message=f"recommended_idx {idx} is out of range for {n_options} options (spec 000 §6.7)",
                path=f"{path}.recommended_idx", rule="recommended_idx_range",
            ))
    # spec 000 §6.8: hatches is an object with two REQUIRED booleans.
    hatches = q.get("hatches")
    if "hatches" not in q:
        out.append(Detail(message="hatches is REQUIRED (spec 000 §6.8)", path=f"{path}.hatches", rule="missing_member"))
    elif not isinstance(hatches, dict):
        out.append(Detail(message="hatches must be an object (spec 000 §6.8)", path=f"{path}.hatches", rule="hatches_type"))
    else:
        for h in ("free_text", "dialogue"):
            if not isinstance(hatches.get(h), bool):
                out.append(Detail(message=f"hatches.{h} must be a boolean (spec 000 §6.8)", path=f"{path}.hatches.{h}", rule="hatch_not_boolean"))
        for m in hatches:
            if m not in ("free_text", "dialogue"):
                out.append(Detail(message=f"unknown member {str(m)[:64]!r}", path=f"{path}.hatches.{m}", rule="unknown_member"))
