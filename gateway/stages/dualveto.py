"""Dual veto, enforced (spec 000 §7.2) and the resolution rates of §12.2.

When a principal answers binding moment M with the question-space hatch
(``dialogue``), M's stem, option set, stem words and ``decision_class`` are
remembered in ``PGW_DEDUP`` under ``veto.{agent}.{principal}``. Two rules
then apply to a later moment N from that agent to that principal:

1. **Repeat** (``broken_handshake``): N repeats M's stem or M's option set
   ("it SHALL NOT respond by re-emitting the same question"). Compared in
   their seen form (gateway/security/seen.py: compatibility forms, invisible
   characters, UTS #39 look-alikes and case folded), punctuation removed: a
   stem re-emitted with Cyrillic or full-width letters, zero-width characters
   or soft hyphens reads the same to the principal, so it is the same stem.
2. **Same decision, objection not incorporated** (``objection_not_incorporated``):
   N is on the same decision as M, which has not been acknowledged yet, and N
   either closes the dialogue hatch or carries no acknowledgement of the
   objection ("SHALL NOT ... emit a further forced-choice envelope without
   first incorporating the principal's objection"). N is on the same decision
   when it has M's non-empty ``meta.decision_class``, or when its stem words
   (non-stop words) or its option labels overlap M's by a Jaccard similarity
   of at least ``pipeline.dual_veto_similarity`` (default 0.5). The
   acknowledgement is a finding that names M's ``moment_id`` (the agent has
   it from the dialogue resolution), e.g. "Objection to moment 3f2a...: you
   asked why share anything; this asks whether to share at all." The first N
   that passes marks M acknowledged; later moments are held to rule 1 only.

What is not caught: a moment on the same decision with another
``decision_class`` (or none) whose stem and options share less than the
threshold with M's; and whether the acknowledging finding really answers the
objection (a machine cannot judge that; the principal still has both hatches).

The check reads a :class:`VetoCache`, an in-process copy of the ``veto.*``
records kept by an ordered push consumer on the bucket's stream (loaded
explicitly at start, then following every write): a moment that matches no
cached veto passes without a KV read. A match is confirmed against the bucket
before refusing, so a veto the bucket has expired (or deleted) never refuses
anything. A veto this instance records is cached as it is written; one
recorded by another instance arrives as fast as the server pushes it (the
record is written after the principal's answer is published, so an agent
racing it could get through before too). Without the cache (it failed to
start) every check reads the bucket.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec
from nats.js.api import DeliverPolicy
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from gateway.security.seen import seen
from gateway.stages.base import Ctx, Refuse
from pgwcore.kvread import kv_keys
from pgwcore.logs import get_logger
from subjects.wire import BindingMoment, BindingMomentItem, Detail, DialogueVeto

if TYPE_CHECKING:
    from gateway.moment_record import MomentRecord
    from gateway.stages.base import StageState

log = get_logger("pgw.dualveto")
KEEP = 64  # vetoed moments remembered per (agent, principal)

_PUNCT = re.compile(r"[^\w\s]+|_+")  # the underscore too: \w holds it, and "Which_way_should" reads as words
_WS = re.compile(r"\s+")


class Veto(msgspec.Struct):
    moment_id: str
    stem: str
    options: list[str]
    decision_class: str | None = None
    words: list[str] = msgspec.field(default_factory=list)  # the stem's non-stop words
    acknowledged: bool = False  # a later moment on the same decision incorporated the objection (rule 2)


_dec = msgspec.json.Decoder(list[Veto])
_enc = msgspec.json.Encoder()


def norm(text: str) -> str:
    """The seen form of ``text`` without punctuation: what the principal read, as compared here."""
    return _WS.sub(" ", _PUNCT.sub(" ", seen(text))).strip()


def option_set(bm: BindingMoment) -> list[str]:
    return sorted({norm(o.label) for o in bm.question.options})


def stem_words(bm: BindingMoment) -> list[str]:
    from gateway.stages.lints import _STOP

    return sorted({w for w in norm(bm.question.stem).split() if w not in _STOP})


def _jaccard(a: list[str], b: list[str]) -> float:
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 0.0


def _decision_class(bm: BindingMoment) -> str | None:
    return (bm.meta.decision_class or None) if bm.meta else None


def same_decision(v: Veto, bm: BindingMoment, opts: list[str], threshold: float) -> bool:
    """Whether ``bm`` is on the decision vetoed in ``v`` (module docstring, rule 2)."""
    if v.decision_class and _decision_class(bm) == v.decision_class:
        return True
    return (_jaccard([norm(w) for w in v.words], stem_words(bm)) >= threshold
            or _jaccard([norm(o) for o in v.options], opts) >= threshold)


def _incorporates(v: Veto, bm: BindingMoment) -> list[str]:
    """What ``bm`` lacks to incorporate the objection of ``v`` (empty: nothing)."""
    missing = []
    if not bm.question.hatches.dialogue:
        missing.append("dialogue_hatch_closed")
    if not any(v.moment_id in f for f in bm.findings):
        missing.append("objection_not_acknowledged")
    return missing


def _open_vetoes(vetoes: list[Veto], bm: BindingMoment, opts: list[str], threshold: float) -> list[Veto]:
    return [v for v in vetoes if not v.acknowledged and same_decision(v, bm, opts, threshold)]


def _key(agent: str, principal: str) -> str:
    return f"veto.{agent}.{principal}"


class VetoCache:
    """The ``veto.*`` records of the PGW_DEDUP bucket, in process (see the module docstring)."""

    def __init__(self, kv: Any, bucket: str) -> None:
        self.kv = kv
        self.ready = False
        self._bucket = bucket
        self._pre = f"$KV.{bucket}."
        self._stream = f"KV_{bucket}"
        self._entries: dict[str, tuple[int, list[Veto] | None]] = {}  # key -> (revision, vetoes; None if deleted)
        self._sub: Any = None

    async def start(self, js: Any) -> None:
        # Follow first, then load: a record written in between arrives by the
        # consumer; the explicit load does not depend on a watcher's
        # "initial values done" marker (pgwcore.kvread.kv_keys).
        self._sub = await js.subscribe(
            f"{self._pre}veto.>", stream=self._stream, cb=self._on_msg, ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, inactive_threshold=300.0,
        )
        for key in await kv_keys(js, self._bucket, "veto.>"):
            try:
                entry = await self.kv.get(key)
            except KeyNotFoundError:
                continue
            self.apply(key, entry.revision, entry.value)
        self.ready = True

    async def _on_msg(self, msg: Any) -> None:
        op = (msg.headers or {}).get("KV-Operation")
        self.apply(msg.subject[len(self._pre):], msg.metadata.sequence.stream, None if op else msg.data)

    def apply(self, key: str, revision: int, value: bytes | list[Veto] | None) -> None:
        """Record ``key`` at ``revision`` unless a later revision is cached already.

        A value that is no veto record is not the gateway's (``_foreign``): the vetoes cached for the key
        stay, so a running gateway goes on enforcing them (before, it read as "no veto", and the agent's
        vetoed question was delivered again)."""
        have = self._entries.get(key)
        if have is not None and have[0] >= revision:
            return
        if isinstance(value, bytes | bytearray):
            try:
                value = _dec.decode(value) if value else None
            except msgspec.DecodeError:
                _foreign(key)
                value = have[1] if have is not None else None
        self._entries[key] = (revision, value)

    def forget(self, key: str) -> None:
        self._entries.pop(key, None)

    def get(self, key: str) -> list[Veto] | None:
        have = self._entries.get(key)
        return have[1] if have else None


def _foreign(key: str) -> None:
    log.warning("a dual-veto record is no record of the gateway's; the vetoes known for it are kept", key=key[:200])


def _stored(st: StageState, key: str, value: bytes) -> list[Veto]:
    """The vetoes of ``key`` as stored; for a value that is no veto record, those this process knows.

    Such a value is the server's acknowledgement a party aimed at the key (its JetStream publish with
    ``$KV.PGW_DEDUP.veto.…`` as its reply subject, docs/security.md "Replies"). The vetoes known here are
    kept, and written back over it with the next write of the key; a gateway that started after the
    acknowledgement and before that write knows none for the pair (the residual said there)."""
    if not value:
        return []
    try:
        return _dec.decode(value)
    except msgspec.DecodeError:
        _foreign(key)
        known = st.vetoes.get(key) if st.vetoes is not None else None
        return list(known or [])


def _unspaced(text: str) -> str:
    """A normed text with its spacing removed too, as a repeat is compared (docs/pipeline.md: "after NFKC,
    case folding, punctuation and spacing removed"): the same stem with its spaces deleted, or replaced by a
    filler, read as a new question (found by an attack from the docs)."""
    return text.replace(" ", "")


def _repeats(vetoes: list[Veto], stem: str, opts: list[str]) -> tuple[Veto, str] | None:
    stem_u, opts_u = _unspaced(stem), sorted({_unspaced(o) for o in opts})
    for v in vetoes:
        # norm() again: a veto recorded under the earlier fold (NFKC and case only) compares as
        # it is compared now; norm() of a normed text is the normed text.
        what = ("stem" if _unspaced(norm(v.stem)) == stem_u
                else "option set" if sorted({_unspaced(norm(o)) for o in v.options}) == opts_u else None)
        if what:
            return v, what
    return None


async def remember_resolution(st: StageState, rec: MomentRecord) -> None:
    """Desk hook: count the resolution (§12.2) and remember a question-space veto (§7.2)."""
    item = rec.item
    if not isinstance(item, BindingMomentItem) or rec.resolution is None or rec.hem is not None:
        return
    bm = item.binding_moment
    dc = st.stats.decision_class(rec.agent, (bm.meta.decision_class if bm.meta else None) or "none")
    kind = rec.resolution.__struct_config__.tag
    st.stats.resolutions[(rec.agent, dc)] += 1
    try:
        from pgwcore import metrics

        metrics.count_resolution(rec.agent, dc, str(kind))
    except ImportError:  # pragma: no cover
        pass
    if not isinstance(rec.resolution, DialogueVeto):
        return
    st.stats.dialogue_hatch[(rec.agent, dc)] += 1
    veto = Veto(rec.moment_id, norm(bm.question.stem), option_set(bm), decision_class=_decision_class(bm),
                words=stem_words(bm))
    key = _key(rec.agent, rec.principal)
    for _ in range(10):
        try:
            entry = await st.kv.get(key)
            vetoes, rev = _stored(st, key, entry.value), entry.revision
        except KeyNotFoundError:
            vetoes, rev = [], None
        if any(v.moment_id == veto.moment_id for v in vetoes):
            return
        vetoes = [*vetoes, veto][-KEEP:]
        try:
            if rev is None:
                rev = await st.kv.create(key, _enc.encode(vetoes))
            else:
                rev = await st.kv.update(key, _enc.encode(vetoes), last=rev)
            if st.vetoes is not None:
                st.vetoes.apply(key, rev, vetoes)
            log.info("question-space veto remembered", agent=rec.agent, moment_id=rec.moment_id)
            return
        except KeyWrongLastSequenceError:
            continue
    log.error("could not record a question-space veto", agent=rec.agent, moment_id=rec.moment_id)


async def check(ctx: Ctx, st: StageState, principal: str, bm: BindingMoment) -> None:
    """Refuse a moment that repeats a vetoed moment (rule 1) or does not incorporate its objection (rule 2)."""
    key = _key(ctx.agent, principal)
    cache = st.vetoes
    ready = cache is not None and cache.ready
    cached = cache.get(key) if ready else None
    if ready and not cached:
        return  # this pair has no veto: nothing to repeat, nothing to normalize, no read
    stem, opts = norm(bm.question.stem), option_set(bm)
    threshold = ctx.gw.config.pipeline.dual_veto_similarity
    if cached and not _repeats(cached, stem, opts) and not _open_vetoes(cached, bm, opts, threshold):
        return  # no veto matches: no read
    try:  # no cache, or a match to confirm against the bucket before refusing
        entry = await st.kv.get(key)
    except KeyNotFoundError:
        if cache is not None:
            cache.forget(key)  # expired or deleted in the bucket
        return
    vetoes = _stored(st, key, entry.value)
    if cache is not None:
        cache.apply(key, entry.revision, vetoes)
    found = _repeats(vetoes, stem, opts)
    if found:
        v, what = found
        raise Refuse(
            "broken_handshake",
            f"the principal rejected the question of moment {v.moment_id} through the question-space "
            f"hatch; this moment repeats its {what} without incorporating the objection (spec 000 §7.2)",
            details=[Detail(
                message=f"re-deliberate and change the question: the {what} repeats the vetoed moment",
                path="$.payload.binding_moment.question" + (".stem" if what == "stem" else ".options"),
                rule="dual_veto",
            )],
            status="gated",
            verdict_class="denied",
        )
    open_vetoes = _open_vetoes(vetoes, bm, opts, threshold)
    for v in open_vetoes:
        missing = _incorporates(v, bm)
        if not missing:
            continue
        details = []
        if "dialogue_hatch_closed" in missing:
            details.append(Detail(
                message=f"keep the question-space hatch open: the principal rejected the question of moment {v.moment_id}",
                path="$.payload.binding_moment.question.hatches.dialogue", rule="dialogue_hatch_closed"))
        if "objection_not_acknowledged" in missing:
            details.append(Detail(
                message=f"acknowledge the objection: add a finding that names moment {v.moment_id} and says how "
                        "this question incorporates the principal's objection",
                path="$.payload.binding_moment.findings", rule="objection_not_acknowledged"))
        raise Refuse(
            "objection_not_incorporated",
            f"the principal rejected the question of moment {v.moment_id} through the question-space hatch; "
            "this moment is on the same decision but does not incorporate the objection (spec 000 §7.2)",
            details=details,
            status="gated",
            verdict_class="denied",
        )
    if open_vetoes:
        await _mark_acknowledged(st, key, {v.moment_id for v in open_vetoes})


async def _mark_acknowledged(st: StageState, key: str, moment_ids: set[str]) -> None:
    """Close the vetoes ``moment_ids`` for rule 2 (the objection was incorporated); rule 1 still applies."""
    for _ in range(10):
        try:
            entry = await st.kv.get(key)
        except KeyNotFoundError:
            return
        vetoes = _stored(st, key, entry.value)
        for v in vetoes:
            if v.moment_id in moment_ids:
                v.acknowledged = True
        try:
            rev = await st.kv.update(key, _enc.encode(vetoes), last=entry.revision)
        except KeyWrongLastSequenceError:
            continue
        if st.vetoes is not None:
            st.vetoes.apply(key, rev, vetoes)
        return
    log.error("could not mark a question-space veto acknowledged", key=key)
