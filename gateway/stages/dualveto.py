"""Dual veto, enforced (spec 000 §7.2) and the resolution rates of §12.2.

When a principal answers binding moment M with the question-space hatch
(``dialogue``), M's stem and option set are remembered in ``PGW_DEDUP`` under
``veto.{agent}.{principal}``. A later moment from that agent to that principal
that repeats M's stem, or M's option set, is "a question-space hatch that
leads only to another menu" and is refused with ``broken_handshake``.

Repeats are compared after normalisation (NFKC, case-folded, punctuation and
extra whitespace removed), so re-wording only the capitals or the question
mark does not get through; a moment that incorporates the objection (a new
stem and a new option set) does.
"""

from __future__ import annotations

import re
import unicodedata
from typing import TYPE_CHECKING, Any

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from gateway.logs import get_logger
from gateway.stages.base import Ctx, Refuse
from subjects.wire import BindingMoment, BindingMomentItem, Detail, DialogueVeto

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.moments import MomentRecord
    from gateway.stages.state import PipelineState

log = get_logger("pgw.dualveto")
KEEP = 64  # vetoed moments remembered per (agent, principal)

_PUNCT = re.compile(r"[^\w\s]+")
_WS = re.compile(r"\s+")


class Veto(msgspec.Struct):
    moment_id: str
    stem: str
    options: list[str]


_dec = msgspec.json.Decoder(list[Veto])
_enc = msgspec.json.Encoder()


def norm(text: str) -> str:
    t = unicodedata.normalize("NFKC", text).casefold()
    return _WS.sub(" ", _PUNCT.sub(" ", t)).strip()


def option_set(bm: BindingMoment) -> list[str]:
    return sorted({norm(o.label) for o in bm.question.options})


def _key(agent: str, principal: str) -> str:
    return f"veto.{agent}.{principal}"


async def remember_resolution(gw: Gateway, st: PipelineState, rec: MomentRecord) -> None:
    """Desk hook: count the resolution (§12.2) and remember a question-space veto (§7.2)."""
    item = rec.item
    if not isinstance(item, BindingMomentItem) or rec.resolution is None or rec.hem is not None:
        return
    bm = item.binding_moment
    dc = (bm.meta.decision_class if bm.meta else None) or "none"
    kind = rec.resolution.__struct_config__.tag
    st.stats.resolutions[(rec.agent, dc)] += 1
    try:
        from gateway import metrics

        metrics.count_resolution(rec.agent, dc, str(kind))
    except ImportError:  # pragma: no cover
        pass
    if not isinstance(rec.resolution, DialogueVeto):
        return
    st.stats.dialogue_hatch[(rec.agent, dc)] += 1
    veto = Veto(rec.moment_id, norm(bm.question.stem), option_set(bm))
    key = _key(rec.agent, rec.principal)
    for _ in range(10):
        try:
            entry = await st.kv.get(key)
            vetoes, rev = _dec.decode(entry.value), entry.revision
        except KeyNotFoundError:
            vetoes, rev = [], None
        if any(v.moment_id == veto.moment_id for v in vetoes):
            return
        vetoes = [*vetoes, veto][-KEEP:]
        try:
            if rev is None:
                await st.kv.create(key, _enc.encode(vetoes))
            else:
                await st.kv.update(key, _enc.encode(vetoes), last=rev)
            log.info("question-space veto remembered", agent=rec.agent, moment_id=rec.moment_id)
            return
        except KeyWrongLastSequenceError:
            continue
    log.error("could not record a question-space veto", agent=rec.agent, moment_id=rec.moment_id)


async def check(ctx: Ctx, st: PipelineState, principal: str, bm: BindingMoment) -> None:
    """Refuse a moment that repeats a vetoed moment's stem or option set (spec 000 §7.2)."""
    try:
        entry = await st.kv.get(_key(ctx.agent, principal))
    except KeyNotFoundError:
        return
    vetoes: list[Any] = _dec.decode(entry.value)
    stem, opts = norm(bm.question.stem), option_set(bm)
    for v in vetoes:
        what = "stem" if v.stem == stem else "option set" if v.options == opts else None
        if what:
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
