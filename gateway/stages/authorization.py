"""``vendor.pgw.authorization``: RFC-0010 authorization envelopes (spec 001, DESIGN §3.4).

Order of checks, each a refusal to the agent (status ``gated``, a ``denied``
verdict) with a code the agent can act on:

1. ``unknown_workflow``: the ``workflow_id`` is not declared in
   ``[pipeline.workflows]`` (spec 001 "Workflow-Level Authoritative Intent":
   every workflow MUST declare its intent; undeclared = no authority);
2. ``unknown_authorization_kind``: the variant is none of the six (spec 001
   "Client Requirement": unknown kinds fail closed, rendered BLOCKED);
3. ``envelope_invalid``: the variant does not match its normative minimum schema;
4. ``authority_not_permitted``: measurement / classification / action from a
   ``non_authoritative`` (or ``NON_AUTHORITATIVE_ONLY``) workflow;
5. ``provenance_required``: an authoritative variant without at least one
   ``provenance.oracle_records`` entry (spec 001 Provenance);
6. ``oracle_record_invalid``: an oracle record that is not an
   :class:`OracleVerificationRecord` (spec 001 names the type but gives no
   fields; ours mirrors the per-oracle entry of its ``OracleConflict``:
   ``oracle_id``, ``tier``, ``verified_at`` as RFC 3339, optional ``value``
   and ``reference``); one that does not decode gets this code at step 3;
7. ``provenance_invalid``: ``provenance.generated_at`` is not an RFC 3339
   timestamp (spec 001 Provenance);
8. ``forbidden_marker``: a soft-authority marker (the configured ones, plus a
   narrative's own ``policy.forbidden_markers``) in ANY string the principal
   may see: narrative text, refusal message and hint, action and its
   parameters, classification label, dispute axes and values; in every
   workflow (spec 001 Binding Rules: non-authoritative workflows MUST still
   enforce forbidden markers);
9. ``narrative_policy_violation``: narrative text that does not follow its
   ``grammar_mode`` (attributive / hedged / educational) or carries precise
   numbers under ``max_specificity = "general"``;
10. ``envelope_id_reused``: an authoritative variant whose
    ``provenance.envelope_id`` was already delivered in this workflow (spec
    001 Provenance: "Unique identifier for audit"). Seen ids are claimed with
    a CAS ``create`` in the ``PGW_DEDUP`` bucket under
    ``authz.{sha256(workflow_id)}.{sha256(envelope_id)}`` (value: the claiming
    envelope's ``Ctx.envelope_key``, so a redelivery of the same message is
    not a reuse); they live as long as the bucket's TTL
    (``pipeline.dedup_ttl_s``). An id is claimed only when the envelope is
    about to be delivered, so a refused envelope does not burn its id;
11. ``oracle_verification_failed`` (:func:`verify_oracles`): no record at a
    verified tier (every one is ``unverified``), a record from an oracle the
    workflow does not declare (``oracles = [...]``, when declared), or a
    record verified in the future. What is NOT verified: spec 001 defines no
    oracle signature, so a record's origin is the agent's word; ``reference``
    is carried, not fetched.

``enforcement_mode`` (spec 001 Binding Rules; docs/pipeline.md): ``INLINE``
runs check 11 before the surface item is published; ``ASYNC`` publishes the
item first and runs check 11 after, and when it fails withdraws the item
(a ``withdrawn`` item for it, then a refusal item) and refuses the envelope;
``NON_AUTHORITATIVE_ONLY`` refuses authoritative variants (check 4).

``scrub_measurements`` strips numbers with units from narrative text before
delivery. The principal's surface receives an ``authorization`` item: the
accepted envelope, or for a refusal a ``refusal`` variant with code
``BLOCKED`` / ``POLICY_VIOLATION`` and a user message that carries no
control-plane detail (no oracle, threshold or workflow internals) and an
opaque ``audit_id``. An agent's own ``refusal`` is shown with its code, but
(spec 001 RefusalReason: "MUST NOT leak control-plane details", "audit_id
... opaque to user") its ``audit_id`` is replaced by the item's opaque id
(the agent's id is kept in the outcome's ``audit_id_opaque`` warning and the
log) and a ``user_message`` / ``recovery_hint`` that fails
:func:`control_plane_detail` is replaced by the gateway's own text for that
code (warning ``control_plane_detail_withheld``).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from gateway.security.seen import seen, seen_cased, seen_pattern
from gateway.security.skeleton import CharTable
from gateway.security.text import HAN, visible
from subjects.wire import Detail

# ---------------------------------------------------------------------------
# RFC-0010 types (spec 001 "Supporting Types"), tag field ``kind``
# ---------------------------------------------------------------------------

Text = Annotated[str, Meta(min_length=1, max_length=4000)]
Id = Annotated[str, Meta(min_length=1, max_length=256)]


Rfc3339 = Annotated[str, Meta(min_length=1, max_length=64, extra_json_schema={"format": "date-time"})]
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(?:\.\d{1,9})?(?:[Zz]|[+-]\d{2}:\d{2})$")


def rfc3339(value: object) -> datetime | None:
    """``value`` as an aware datetime if it is an RFC 3339 ``date-time`` (RFC 3339 §5.6), else None."""
    if not isinstance(value, str) or not _RFC3339.match(value):
        return None
    try:
        return datetime.fromisoformat(value.upper().replace("Z", "+00:00").replace(" ", "T"))
    except ValueError:  # well-shaped but not a date (month 13, hour 25)
        return None


class OracleVerificationRecord(Struct, omit_defaults=True):
    """One oracle's verification of the claim (spec 001 Provenance ``oracle_records``).

    Spec 001 names the type without fields; these are the fields it gives an
    oracle's reading in ``OracleConflict``, plus an optional ``reference`` to
    the oracle's own record. Unknown fields are allowed (the spec is open).
    """

    oracle_id: Id
    tier: Literal["primary", "secondary", "cross_domain", "unverified"]
    verified_at: Rfc3339  # checked by check_provenance
    value: Any = None
    reference: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None


class Provenance(Struct, omit_defaults=True):
    """Authoritative basis of a claim; at least one oracle record (checked with its own code).

    A record that does not decode is refused as ``oracle_record_invalid``
    (:func:`decode`), not as a malformed envelope.
    """

    oracle_records: Annotated[list[OracleVerificationRecord], Meta(max_length=64)]
    generated_at: Rfc3339  # checked by check_provenance
    envelope_id: Id
    derived_from: list[Id] | None = None


class NarrativePolicy(Struct):
    grammar_mode: Literal["attributive", "hedged", "educational"]
    forbidden_markers: Annotated[list[Annotated[str, Meta(max_length=200)]], Meta(max_length=256)]
    max_specificity: Literal["general", "contextualized"]
    scrub_measurements: bool


class RefusalReason(Struct, omit_defaults=True):
    code: Literal["BLOCKED", "UNRESOLVABLE", "POLICY_VIOLATION", "EMERGENCY_ESCALATION"]
    user_message: Text
    audit_id: Id
    recovery_hint: Text | None = None


class OracleReading(Struct):
    oracle_id: Id
    tier: Literal["primary", "secondary", "cross_domain", "unverified"]
    value: Any
    verified_at: Annotated[str, Meta(max_length=64)]


class OracleConflict(Struct):
    axis: Id
    oracles: Annotated[list[OracleReading], Meta(max_length=64)]
    resolution_attempted: bool
    escalation_required: bool


class Measurement(Struct, tag_field="kind", tag="measurement"):
    value: float
    provenance: Provenance


class Classification(Struct, tag_field="kind", tag="classification"):
    label: Text
    provenance: Provenance


class Action(Struct, tag_field="kind", tag="action", omit_defaults=True):
    action: Text
    provenance: Provenance
    params: dict[str, Any] | None = None


class Narrative(Struct, tag_field="kind", tag="narrative"):
    text: Text
    policy: NarrativePolicy


class Refusal(Struct, tag_field="kind", tag="refusal"):
    reason: RefusalReason


class DisputeSummary(Struct, tag_field="kind", tag="dispute_summary"):
    sources: Annotated[list[OracleConflict], Meta(min_length=1, max_length=64)]


AuthorizationEnvelope = Measurement | Classification | Action | Narrative | Refusal | DisputeSummary
KINDS = ("measurement", "classification", "action", "narrative", "refusal", "dispute_summary")
AUTHORITATIVE = ("measurement", "classification", "action")


class AuthorizationEnvelopePayload(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Payload of ``vendor.pgw.authorization`` as published in the capability document."""

    workflow_id: Annotated[str, Meta(min_length=1, max_length=128)]
    envelope: AuthorizationEnvelope
    principal: Annotated[str, Meta(min_length=1, max_length=65)] | None = None


# ---------------------------------------------------------------------------
# Policy
# ---------------------------------------------------------------------------

_UNITS = (
    r"%|percent|per ?cent|mg/dl|mmol/l|mg|mcg|µg|μg|kg|g|lbs?|oz|ml|l|mmhg|bpm|°[cf]?|degrees?|kcal|cal|iu|units?"
    r"|mm|cm|m|km|mi|miles?|ft|inch(?:es)?|sec(?:onds?)?|ms|min(?:utes?)?|hrs?|hours?|days?|weeks?|months?|years?"
    r"|kb|mb|gb|tb|hz|khz|mhz|ghz|kw|kwh|ma|psi|kpa|ppm|usd|eur"
)
# A number's digits and commas are taken whole (possessive): no unit, decimal point or space begins with
# one, so giving some back never lets the rest match, and the matches are the same. Taken greedily, each
# place a number may start in a run like "1,1,1,..." tried every unit at each place on the way back
# (4,000 characters, the most a spec 001 text holds: 1.4 s).
MEASUREMENT_PATTERN = re.compile(
    r"(?:[$€£]\s?\d[\d,]*+(?:\.\d+)?)|(?:\b\d[\d,]*+(?:\.\d+)?\s?(?:" + _UNITS + r")(?![A-Za-z]))",
    re.IGNORECASE,
)
_MEASUREMENT_START = re.compile(r"[$€£]|\b\d", re.IGNORECASE)  # where MEASUREMENT_PATTERN can begin
_DIGITS_AND_COMMAS = re.compile(r"[\d,]*+")


class _Measurements:
    """``MEASUREMENT_PATTERN``'s ``finditer``, ``search`` and ``sub``, the same matches, in time linear in the text.

    The pattern tried every place a number may begin: in "1,1,1,..." each digit after a comma, each
    attempt reading the rest of the run (4,000 characters: 21 ms). Here a place is tried as the
    pattern's search tries it (``match`` there: leftmost first, the same alternatives in order, ``\\b``
    judged by the character before it), and once a number fails, the rest of its run of digits and
    commas is skipped: from any later digit of the run the pattern's ``\\d[\\d,]*+`` ends where it ended,
    and what follows is judged alike, so it fails there too."""

    def finditer(self, text: str) -> Iterator[re.Match[str]]:
        pos = 0
        while (start := _MEASUREMENT_START.search(text, pos)) is not None:
            p = start.start()
            m = MEASUREMENT_PATTERN.match(text, p)
            if m is not None:
                yield m
                pos = m.end()  # never empty: at least a digit
            elif text[p] in "$€£":
                pos = p + 1
            else:
                pos = _DIGITS_AND_COMMAS.match(text, p).end()  # type: ignore[union-attr]  # always matches

    def search(self, text: str) -> re.Match[str] | None:
        return next(self.finditer(text), None)

    def sub(self, repl: str, text: str) -> str:
        """``text`` with each measurement replaced by ``repl``, as written (no group references)."""
        out: list[str] = []
        at = 0
        for m in self.finditer(text):
            out += (text[at:m.start()], repl)
            at = m.end()
        out.append(text[at:])
        return "".join(out)


MEASUREMENT = _Measurements()
_NUMBER = re.compile(r"\d")
_ATTRIBUTION = re.compile(
    r"\b(?:according to|as reported by|reported by|reports?|says|said|states?|stated|notes?|noted"
    r"|per the|cites?|cited|writes?|wrote|claims?|claimed|suggests?|indicates?|source[sd]?)\b",
    re.IGNORECASE,
)
_HEDGE = re.compile(
    r"\b(?:may|might|could|possibly|perhaps|likely|unlikely|appears?|seems?|suggests?|tends? to|often|in some cases"
    r"|generally|typically|it is possible)\b",
    re.IGNORECASE,
)
_DIRECTIVE = re.compile(
    r"\b(?:you should|you must|you need to|you have to|your (?:result|diagnosis|dose|account|case) (?:is|shows)"
    r"|take \d|i recommend|we recommend|do not take|stop taking)\b",
    re.IGNORECASE,
)


# A marker is found as whole words: where it begins with a word character (``\w``: ``str.isalnum()`` or
# ``_``) no word character comes before it, where it ends with one none comes after it (a marker that
# begins or ends otherwise, "!!!", is found after or before anything). That is judged without compiling a
# pattern per marker (an agent's own 256 markers of up to 200 characters were 256 patterns compiled per
# envelope, 0.5 s at their longest fold): :func:`_bounded` writes every character that is no word
# character as _END, itself, _START, and the text between a _START and an _END. Then ``m`` is in ``t`` as
# whole words exactly when ``_marker_form(m)`` is a substring of ``_bounded(t)``: inside the marker both
# read alike, as each mark depends only on the character beside it; a marker beginning with a word
# character begins with _START, which ``_bounded(t)`` has before it only where ``t`` begins or a character
# that is no word character comes before it, and one ending with a word character ends with _END, which
# follows it only where ``t`` ends or such a character follows. Neither mark is in a seen form (seen()
# drops every control character), so they meet only each other.
#
# Scripts written without spaces between words (Han, kana, Thai, Lao, Khmer, Myanmar) have no word
# boundary to find: their characters are read as no word characters here, so a marker in them is found
# wherever it stands, and a Latin marker in their text ("これはverifiedです") stands as a word.
_START, _END = "\x00", "\x01"
# Thai, Lao, Myanmar, Khmer, kana (with half-width katakana), and the Han ideographs.
_UNSPACED = ((0x0E00, 0x0EFF), (0x1000, 0x109F), (0x1780, 0x17FF), (0x3040, 0x30FF), (0x31F0, 0x31FF),
             (0xFF66, 0xFF9F), *HAN)


def _word_char(ch: str) -> bool:
    cp = ord(ch)
    return (ch.isalnum() or ch == "_") and not any(lo <= cp <= hi for lo, hi in _UNSPACED)


_BOUNDED = CharTable(lambda ch: ch if _word_char(ch) else f"{_END}{ch}{_START}")


def _bounded(seen_text: str) -> str:
    return f"{_START}{seen_text.translate(_BOUNDED)}{_END}"


def _marker_form(seen_marker: str) -> str:
    """``_bounded(seen_marker)`` without the marks its edges need not meet (an edge that is no word character)."""
    b = seen_marker.translate(_BOUNDED)
    return (_START if _word_char(seen_marker[0]) else "") + b + (_END if _word_char(seen_marker[-1]) else "")


# What a reader takes for a word's edge is a character that is not a letter or a digit, whatever it folds
# to: "verified—nothing", "verified|approved", "verified™", "_verified_" read "verified" as a word, while
# their seen forms join it to a letter (the em dash folds to a katakana mark, the bar to "l", the trade
# mark to "tm") or to ``_``. So each marker of letters, digits and spaces is also looked for in the text's
# reader words (:func:`_reader_words`), case folded, then in their seen form. There a word also ends:
# - at a letter drawn raised or lowered (a modifier letter, a superscript or subscript: "verified" then
#   U+1D40 U+1D39 for a trade mark), a click letter drawn as a bar (U+01C0), a tatweel between two words;
# - at a combining mark that draws a line under, through or between letters ("official\u0332verified"),
#   and at a character an enclosing mark encloses ("verifiedA\u20dd");
# - where the script changes from one letter to the next ("verified" then a Cyrillic word, or a Greek iota
#   drawn as a bar). A disguise mixing scripts inside the marker ("verified" with a Cyrillic ie) is read by
#   the seen form of the text as written (above).
# Case is folded first: the seen form folds each letter to its look-alike prototype, and a capital's (the
# Cyrillic capital ve, like "B") need not be its small letter's, so a Cyrillic word in capitals read as
# another word than in small letters.
_READER_BYTES = bytes(c if chr(c).isalnum() or chr(c).isspace() or c < 0x20 or c >= 0x7F else 0x20 for c in range(256))
_LINE_MARKS = frozenset([0x0332, 0x0333, *range(0x0335, 0x0339), *range(0x035C, 0x0363)])
_ENCLOSING = "\u0488\u0489\u1abe\u20dd-\u20e0\u20e2-\u20e4\ua670-\ua672"
_ENCLOSED = re.compile(f".?[{_ENCLOSING}]")
_SCRIPTS: dict[str, str] = {}  # a script's name (its letters' first name word) -> its code, a private-use character


def _script_code(ch: str) -> str:
    base = unicodedata.normalize("NFKC", ch)[:1] or ch  # full-width and mathematical letters: their script's
    words = unicodedata.name(base, "?").replace("-", " ").split()
    name = words[1] if words[0] == "EXTENDED" and len(words) > 1 else words[0]
    code = _SCRIPTS.get(name)
    if code is None:
        code = chr(0xE000 + len(_SCRIPTS) % 0x1900)
        if len(_SCRIPTS) < 0x1900:
            _SCRIPTS[name] = code
    return code


def _reader_class(ch: str) -> str:
    """A space for what ends a word, ``"\x00"`` for what seen() drops (controls, formats, marks), ``"0"`` for a
    digit any script writes, else the code of the letter's (or digit's) script."""
    cp = ord(ch)
    if ch.isspace():
        return " "
    cat = unicodedata.category(ch)
    if cat[0] == "C":
        return "\x00"
    if cat[0] == "M":
        return " " if cp in _LINE_MARKS or cat == "Me" else "\x00"
    if cat == "Nd":
        return "0" if unicodedata.normalize("NFKC", ch).isascii() else _script_code(ch)
    if cat[0] == "L" and cat != "Lm" and not 0x01C0 <= cp <= 0x01C3 \
            and not unicodedata.decomposition(ch).startswith(("<super>", "<sub>")):
        return _script_code(ch)
    return " "


_CLASS = CharTable(_reader_class)
_AS_READ = CharTable(lambda ch: " " if _reader_class(ch) == " " else ch)
# A letter's script code, then any marks, then a letter of another script: a word ends there.
_SCRIPT_CHANGE = re.compile("([\ue000-\uf8ff])\x00*(?!\\1)(?=[\ue000-\uf8ff])")


def _reader_words(text: str) -> str:
    """``text`` with every character that ends a word for a reader written as a space, and a space where the
    script changes between two letters (the comment above)."""
    if text.isascii():
        return text.encode().translate(_READER_BYTES).decode()
    if _ENCLOSED.search(text) is not None:
        text = _ENCLOSED.sub(" ", text)
    words = text.translate(_AS_READ)
    cuts = [m.end() for m in _SCRIPT_CHANGE.finditer(text.translate(_CLASS))]
    if not cuts:
        return words
    return " ".join(words[a:b] for a, b in zip([0, *cuts], [*cuts, len(words)], strict=True))


def _read_form(text: str) -> str:
    """The seen form of ``text``'s reader words, case folded first."""
    return seen(_reader_words(text).casefold())


class Markers:
    """Forbidden markers folded once, judged against many texts (every string of an envelope)."""

    def __init__(self, markers: list[str]) -> None:
        # (marker, its seen form, for a marker of letters, digits and spaces of one script the seen form of
        # its reader words, else None)
        self._forms = [(m, s, _read_form(m) if _reader_words(m) == m else None) for m in markers if (s := seen(m))]
        self._marker_forms: dict[str, str] = {}

    def _form(self, s: str) -> str:
        f = self._marker_forms.get(s)
        if f is None:
            f = self._marker_forms[s] = _marker_form(s)
        return f

    def first_in(self, text: str) -> str | None:
        """The first marker (in the given order) ``text`` carries, matched as whole words in the seen
        form of both (gateway/security/seen.py): "v\u0435r\u0456fied" (Cyrillic ie and i) reads "verified";
        or, for a marker of letters, digits and spaces, in the seen form of the text's reader words:
        "verified\u2014nothing" reads "verified"."""
        t = seen(text)
        tw = _read_form(text)
        # A substring search each: most texts end here.
        present = [(m, s, r) for m, s, r in self._forms if s in t or (r and r in tw)]
        if not present:
            return None
        bt = _bounded(t)
        btw = bt if tw == t else _bounded(tw)
        for m, s, r in present:
            if (s in t and self._form(s) in bt) or (r and r in tw and self._form(r) in btw):
                return m
        return None


def has_marker(text: str, markers: list[str]) -> str | None:
    """The first of ``markers`` ``text`` carries, as whole words in the seen form of both (:class:`Markers`)."""
    return Markers(markers).first_in(text)


def _strings(value: Any, path: str) -> list[tuple[str, str]]:
    """Every string in a JSON value (keys included), with its path."""
    if isinstance(value, str):
        return [(path, value)]
    out: list[tuple[str, str]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out += [(f"{path}.{k}", str(k)), *_strings(v, f"{path}.{k}")]
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _strings(v, f"{path}[{i}]")
    return out


def visible_strings(env: AuthorizationEnvelope) -> list[tuple[str, str]]:
    """``(path, text)`` of every string of ``env`` a surface shows the principal (consumers/surfaces/model.py)."""
    at = "$.payload.envelope"
    match env:
        case Narrative():
            return [(f"{at}.text", env.text)]
        case Refusal():
            r = env.reason
            out = [(f"{at}.reason.user_message", r.user_message)]
            return out + ([(f"{at}.reason.recovery_hint", r.recovery_hint)] if r.recovery_hint else [])
        case Action():
            return [(f"{at}.action", env.action), *_strings(env.params, f"{at}.params"), (f"{at}.provenance.envelope_id", env.provenance.envelope_id)]
        case Classification():
            return [(f"{at}.label", env.label), (f"{at}.provenance.envelope_id", env.provenance.envelope_id)]
        case Measurement():
            return [(f"{at}.provenance.envelope_id", env.provenance.envelope_id)]
        case DisputeSummary():
            out = []
            for i, src in enumerate(env.sources):
                out.append((f"{at}.sources[{i}].axis", src.axis))
                for j, o in enumerate(src.oracles):
                    out += [(f"{at}.sources[{i}].oracles[{j}].oracle_id", o.oracle_id)]
                    out += _strings(o.value, f"{at}.sources[{i}].oracles[{j}].value")
            return out
    return []


# Control-plane vocabulary a principal-facing refusal text must not carry
# (spec 001 RefusalReason: "MUST NOT leak control-plane details that enable
# probing"; user_message: "no oracle/threshold details").
_CONTROL_WORDS = re.compile(seen_pattern(
    r"\b(?:oracles?|thresholds?|workflows?|provenance|enforcement[_ ]mode|authoritative[_ ]intent"
    r"|non[_ -]authoritative|audit[_ ]ids?|cedar|gateway|pipeline|policy rules?|tiers?)\b"))
_CONTROL_CASED = re.compile(r"\b(?:" + "|".join(re.escape(seen(w).upper()) for w in (
    "INLINE", "ASYNC", "NON_AUTHORITATIVE_ONLY", "BLOCKED", "UNRESOLVABLE", "POLICY_VIOLATION",
    "EMERGENCY_ESCALATION")) + r")\b")
_IDENTIFIER = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")  # snake_case: config keys, rule codes
_COMPARISON = re.compile(r"\d\s*(?:[<>]=?|[≤≥])\s*[-+]?\.?\d")  # "5.9 > 5.5"
# "no oracle/threshold details": words that name where a check draws its line, or what it read
# against it ("The lab reading of 5.9 exceeds the cutoff of 5.5"). With them, the message tells
# the asker which way to move a value to get past the check, number or not.
_THRESHOLD_WORDS = re.compile(seen_pattern(
    r"\b(?:cut ?-?offs?|limits?|exceed\w*|surpass\w*|maxim\w*|minim\w*|max|min|ceilings?|ranges?"
    r"|readings?|scores?|levels?|measured|measurements?)\b"))
# A number beside a comparing word ("above 7", "not within 120") is the line itself. The words are
# judged on the seen form, the numbers on the text as rendered (any script's digits, full-width,
# superscript, circled: NFKC folds them to digits) and on the seen form (a letter that reads as a
# digit, "\u01bc"); spelled numbers count too ("above five").
_COMPARING_WORDS = re.compile(seen_pattern(
    r"\b(?:above|below|over|under|within|beyond|outside|between|than|at (?:least|most)|up to)\b"))
_SPELLED = re.compile(seen_pattern(
    r"\b(?:zero|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen"
    r"|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|hundreds?|thousands?"
    r"|millions?|billions?|percent|dozens?)\b"))
_SEEN_DIGIT = re.compile(r"[2-9]")  # the seen form reads 0 and 1 as the letters o and i


def _number(rendered: str, t: str) -> str | None:
    """A number in the text: a digit of any script as rendered, a digit the seen form reads, a spelled one."""
    m = re.search(r"\d", rendered) or _SEEN_DIGIT.search(t) or _SPELLED.search(t)
    return m.group(0) if m else None


def control_plane_detail(text: str, names: Sequence[str] = ()) -> str | None:
    """What in ``text`` is control-plane detail (a word, identifier, comparison or configured name), or None.

    Control-plane words (oracle, workflow, tier ...), threshold words (cutoff, limit, exceeds,
    reading ...), identifiers and names are judged on the seen form (gateway/security/seen.py),
    the cased codes on the seen form with case kept; comparisons ("5.9 > 5.5") and measurements
    (a number with a unit) on the text as rendered (NFKC, invisible characters removed: the fold
    reads the digit 1 as the letter i); a comparing word and a number anywhere in the text
    ("above 7") on both. A number alone ("call 911") is not detail.
    """
    t = seen(text)
    rendered = visible(unicodedata.normalize("NFKC", text))
    for rx, form in ((_CONTROL_WORDS, t), (_THRESHOLD_WORDS, t), (_CONTROL_CASED, seen_cased(text)), (_IDENTIFIER, t),
                     (_COMPARISON, rendered), (MEASUREMENT, rendered)):
        m = rx.search(form)
        if m:
            return m.group(0)
    cmp = _COMPARING_WORDS.search(t)
    num = _number(rendered, t) if cmp else None
    if cmp and num:
        return f"{cmp.group(0)} … {num}"
    return has_marker(text, [n for n in names if len(n) >= 3])


def scrub_measurements(text: str) -> str:
    return MEASUREMENT.sub("[measurement removed]", text)


class PolicyRefusal(Exception):
    def __init__(self, code: str, reason: str, path: str, user_code: str = "POLICY_VIOLATION") -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.path = path
        self.user_code = user_code

    @property
    def detail(self) -> Detail:
        return Detail(message=self.reason, path=self.path, rule=self.code)


def decode(raw: Any) -> AuthorizationEnvelope:
    """The typed variant; an unknown ``kind`` fails closed (spec 001)."""
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if kind not in KINDS:
        shown = kind[:64] if isinstance(kind, str) else type(kind).__name__
        raise PolicyRefusal(
            "unknown_authorization_kind",
            f"authorization kind {shown!r} is not one of {', '.join(KINDS)}; unknown kinds are BLOCKED (spec 001)",
            "$.payload.envelope.kind",
            user_code="BLOCKED",
        )
    try:
        return msgspec.convert(raw, AuthorizationEnvelope)
    except msgspec.ValidationError as e:
        msg = str(e)
        where = msg.rsplit("at `", 1)[-1].rstrip("`").replace("$", "$.payload.envelope", 1) if "at `" in msg else "$.payload.envelope"
        if where.startswith("$.payload.envelope.provenance.oracle_records["):
            raise PolicyRefusal(
                "oracle_record_invalid",
                f"an oracle record is not an OracleVerificationRecord {{oracle_id, tier, verified_at, value?, reference?}}: {msg}",
                where,
            ) from None
        raise PolicyRefusal("envelope_invalid", f"the {kind} envelope does not match spec 001: {msg}", where, "BLOCKED") from None


def enforce(env: AuthorizationEnvelope, workflow: Any, narrative_cfg: Any, *, untrusted: bool = False) -> AuthorizationEnvelope:
    """Apply spec 001's inline checks (1-9 of the module docstring); return the envelope to deliver."""
    kind = env.__struct_config__.tag
    if untrusted and kind in AUTHORITATIVE:
        # spec 002 "Trust boundary": untrusted content never grants authority.
        raise PolicyRefusal(
            "untrusted_content_blocks_approval",
            f"a {kind} envelope grants authority; this one carries untrusted content (spec 002 Trust boundary)",
            "$.meta.contentTrust",
        )
    non_auth = workflow.authoritative_intent == "non_authoritative" or workflow.enforcement_mode == "NON_AUTHORITATIVE_ONLY"
    if isinstance(env, Measurement | Classification | Action):
        if non_auth:
            raise PolicyRefusal(
                "authority_not_permitted",
                f"a {kind} envelope is authoritative; this workflow declares non_authoritative intent (spec 001)",
                "$.payload.envelope.kind",
            )
        check_provenance(env.provenance, kind)
    # spec 001 Binding Rules: forbidden markers in every workflow, on every
    # string the principal may see (not only a narrative's text).
    own = env.policy.forbidden_markers if isinstance(env, Narrative) else []
    markers = Markers([*narrative_cfg.forbidden_markers, *own])  # folded once for every string
    for path, text in visible_strings(env):
        hit = markers.first_in(text)
        if hit:
            raise PolicyRefusal(
                "forbidden_marker",
                f"{path.rsplit('.', 1)[-1]} carries the soft-authority marker {hit!r} (spec 001 forbidden markers)",
                path,
                # An agent's own refusal keeps its code (an EMERGENCY_ESCALATION is not lost), in the gateway's words.
                user_code=env.reason.code if isinstance(env, Refusal) else "POLICY_VIOLATION",
            )
    if isinstance(env, Narrative):
        text = scrub_measurements(env.text) if env.policy.scrub_measurements else env.text
        if narrative_cfg.enforce_grammar_mode:
            mode = env.policy.grammar_mode
            bad = (
                (mode == "attributive" and not _ATTRIBUTION.search(text))
                or (mode == "hedged" and not _HEDGE.search(text))
                or (mode == "educational" and _DIRECTIVE.search(text))
            )
            if bad:
                raise PolicyRefusal(
                    "narrative_policy_violation",
                    {
                        "attributive": "an attributive narrative must attribute its claims to a source",
                        "hedged": "a hedged narrative must hedge its claims",
                        "educational": "an educational narrative must not direct the reader's own case",
                    }[mode],
                    "$.payload.envelope.text",
                )
            if env.policy.max_specificity == "general" and not env.policy.scrub_measurements and MEASUREMENT.search(text):
                raise PolicyRefusal(
                    "narrative_policy_violation",
                    "max_specificity 'general' forbids precise measurements; scrub them or use 'contextualized'",
                    "$.payload.envelope.text",
                )
        if text != env.text:
            env = Narrative(text=text, policy=env.policy)
    return env


def check_provenance(prov: Provenance, kind: str) -> None:
    """spec 001 Provenance: at least one well-formed oracle record, an RFC 3339 ``generated_at``."""
    at = "$.payload.envelope.provenance"
    if not prov.oracle_records:
        raise PolicyRefusal(
            "provenance_required",
            f"a {kind} envelope needs provenance.oracle_records with at least one record (spec 001)",
            f"{at}.oracle_records",
        )
    for i, rec in enumerate(prov.oracle_records):
        if rfc3339(rec.verified_at) is None:
            raise PolicyRefusal(
                "oracle_record_invalid",
                f"oracle record {i}: verified_at {rec.verified_at[:64]!r} is not an RFC 3339 timestamp",
                f"{at}.oracle_records[{i}].verified_at",
            )
    if rfc3339(prov.generated_at) is None:
        raise PolicyRefusal(
            "provenance_invalid",
            f"provenance.generated_at {prov.generated_at[:64]!r} is not an RFC 3339 timestamp (spec 001 Provenance)",
            f"{at}.generated_at",
        )


CLOCK_SKEW = timedelta(seconds=60)


def verify_oracles(env: AuthorizationEnvelope, workflow: Any, now: datetime | None = None) -> None:
    """Check 11 of the module docstring (the oracle verification of spec 001 Binding Rules); raise PolicyRefusal."""
    if not isinstance(env, Measurement | Classification | Action):
        return
    now = now or datetime.now(UTC)
    at = "$.payload.envelope.provenance.oracle_records"
    records = env.provenance.oracle_records
    declared = list(getattr(workflow, "oracles", []) or [])
    for i, rec in enumerate(records):
        if declared and rec.oracle_id not in declared:
            raise PolicyRefusal(
                "oracle_verification_failed",
                f"oracle record {i} names oracle {rec.oracle_id[:64]!r}, which this workflow does not declare",
                f"{at}[{i}].oracle_id",
            )
        when = rfc3339(rec.verified_at)
        if when is not None and when > now + CLOCK_SKEW:
            raise PolicyRefusal(
                "oracle_verification_failed",
                f"oracle record {i} was verified at {rec.verified_at!r}, in the future",
                f"{at}[{i}].verified_at",
            )
    if all(rec.tier == "unverified" for rec in records):
        raise PolicyRefusal(
            "oracle_verification_failed",
            "every oracle record has tier 'unverified'; an authoritative claim needs a verified oracle (spec 001)",
            at,
        )


def envelope_id_key(workflow_id: str, envelope_id: str) -> str:
    """The PGW_DEDUP key that claims ``provenance.envelope_id`` within a workflow (check 10)."""
    w = hashlib.sha256(workflow_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    e = hashlib.sha256(envelope_id.encode("utf-8", "surrogatepass")).hexdigest()[:48]
    return f"authz.{w}.{e}"


USER_MESSAGES = {
    "BLOCKED": "This item could not be shown because its format is not recognised. Nothing was authorised.",
    "POLICY_VIOLATION": "This item was withheld because it did not meet the policy that applies here. Nothing was authorised.",
    "UNRESOLVABLE": "The agent could not settle this request. Nothing was authorised.",
    "EMERGENCY_ESCALATION": "The agent could not handle this and asks for it to be escalated. If this is urgent, contact a person now.",
}
WITHDRAWN_MESSAGE = "An item shown to you earlier could not be verified and was withdrawn. Do not rely on it. Nothing was authorised."


def user_refusal(code: str, audit_id: str, message: str | None = None) -> Refusal:
    """A refusal variant a user may see: no control-plane detail (spec 001 RefusalReason)."""
    user_code: Any = code if code in USER_MESSAGES else "POLICY_VIOLATION"
    return Refusal(reason=RefusalReason(
        code=user_code,
        user_message=message or USER_MESSAGES[user_code],
        audit_id=audit_id,
        recovery_hint="Ask the agent to send it again in a supported form." if user_code == "BLOCKED" else None,
    ))


def shown_refusal(env: Refusal, audit_id: str, names: Sequence[str]) -> tuple[Refusal, list[Detail]]:
    """An agent's refusal as the principal may see it, and the warnings for the agent (spec 001 RefusalReason).

    The agent's ``audit_id`` is replaced by ``audit_id`` (opaque, the item's);
    a message with control-plane detail becomes the gateway's own text for the
    code, a hint with it is dropped.
    """
    r = env.reason
    at = "$.payload.envelope.reason"
    warnings = [Detail(
        message=f"the principal sees audit_id {audit_id!r}; this agent's audit_id {r.audit_id!r} is kept here for audit",
        path=f"{at}.audit_id", rule="audit_id_opaque",
    )]
    message, hint = r.user_message, r.recovery_hint
    leak = control_plane_detail(message, names)
    if leak is not None:
        message = USER_MESSAGES[r.code]
        warnings.append(Detail(message=f"user_message withheld: it carries control-plane detail ({leak[:64]!r})",
                               path=f"{at}.user_message", rule="control_plane_detail_withheld"))
    if hint is not None:
        leak = control_plane_detail(hint, names)
        if leak is not None:
            hint = None
            warnings.append(Detail(message=f"recovery_hint withheld: it carries control-plane detail ({leak[:64]!r})",
                                   path=f"{at}.recovery_hint", rule="control_plane_detail_withheld"))
    return Refusal(reason=RefusalReason(code=r.code, user_message=message, audit_id=audit_id, recovery_hint=hint)), warnings
