"""What the moment desk keeps of one moment, and the verdict that closes it.

Split from ``gateway.moments`` (issue 18): the record stored in
``PGW_MOMENTS`` (and its HEM link to an IDP, spec 003), the refusal a
resolution can meet, and the pure functions over a record. The desk
(``gateway.moments``) holds the life cycle: dispatch, resolve, expire, re-drive.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from gateway.security.seen import seen
from subjects.util import stable_id, to_rfc3339
from subjects.wire import (
    ClarificationAnswers,
    DialogueVeto,
    FreeTextAnswer,
    HemDecision,
    MomentExpired,
    OptionChoice,
    Resolution,
    ResolutionOutcome,
    SurfaceItem,
    Verdict,
)

if TYPE_CHECKING:
    from pgwcore.keys import DigestKey


@dataclass(frozen=True)
class HemContext:
    """Links a human-escalation moment to the IDP it gates (spec 003 HEM)."""

    idp_id: str
    session_id: str
    action: str
    # An approval is the human's permit of the gated step (HEM_URGENCY_REQUIRED): the agent then
    # acts, and the capsule of its report (or of the overdue timeout) closes the dispatch.
    permits: bool = False


class HemInfo(msgspec.Struct, frozen=True):
    idp_id: str
    session_id: str
    action: str
    permits: bool = False  # see HemContext


class MomentRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the desk keeps of one moment."""

    moment_id: str
    agent: str
    principal: str
    envelope_id: str
    correlation_id: str
    item: SurfaceItem
    dispatch_verdict_id: str
    created_at: float
    expires_at: float | None = None
    untrusted: bool = False
    hem: HemInfo | None = None
    # An approval of a step its mandate no longer permitted when she gave it (MomentDesk.judge_approval): why.
    void: str | None = None
    status: Literal["pending", "resolved", "expired"] = "pending"
    published: bool = True
    resolution: Resolution | None = None
    resolved_at: float | None = None
    traceparent: str | None = None
    node_id: str | None = None  # the envelope's nodeId (spec 002 "Run event log integration")
    forgotten: bool = False  # the principal's free text was replaced by its digest (spec 000 §13)
    # Where the principal's free text is held apart, erasable (the stream sequence of its message in
    # ``PGW_ANSWER_TEXT``, gateway.moments): the record itself then only ever holds the keyed digests,
    # because a KV bucket's superseded revisions cannot be erased (docs/security.md "Data at rest").
    text_seq: int | None = None


HemCallback = Callable[[MomentRecord, str, Resolution | None], Awaitable[None]]
# Why an approval of this record's step permits nothing now (a code), or None (MomentDesk.judge_approval).
ApprovalJudge = Callable[[MomentRecord], Awaitable[str | None]]


class Refused(Exception):
    """A resolution the desk will not accept; carries the reply code."""

    def __init__(self, code: str, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"{code}: {reason}")


STATE_HEADER = "Pgw-Moment-State"
# ``{created ms};{agent}`` on every desk write: what the agents' index (gateway.moment_list) is derived from.
AGENT_HEADER = "Pgw-Moment-Agent"


def state_header(rec: MomentRecord, forget_at: float | None = None) -> dict[str, str]:
    """What a watcher needs of a record, as a header on its KV write: ``status;expires_at;published``,
    then ``;forget_at`` when the record holds a principal's free text to forget (spec 000 §13).

    Every gateway instance follows every write of ``PGW_MOMENTS`` (expiries,
    re-drives, forgetting, the agents' index); with these headers it follows them
    headers-only, so an instance costs the same whatever the moment's size (issue 18)."""
    exp = "" if rec.expires_at is None else repr(rec.expires_at)
    tail = f";{forget_at!r}" if forget_at is not None else ""
    return {STATE_HEADER: f"{rec.status};{exp};{int(rec.published)}{tail}", AGENT_HEADER: agent_header(rec)}


def created_ms(rec: MomentRecord) -> int:
    return int(rec.created_at * 1000)


def agent_header(rec: MomentRecord) -> str:
    """:data:`AGENT_HEADER`'s value: the moment's creation time (ms) and its agent."""
    return f"{created_ms(rec)};{rec.agent}"


def parse_agent(value: str) -> tuple[int, str] | None:
    """(created ms, agent) from :func:`agent_header`'s value; None if malformed."""
    ms, sep, agent = value.partition(";")
    if not sep or not agent or not ms.isdigit():
        return None
    return int(ms), agent


def parse_state(value: str) -> tuple[str, float | None, bool, float | None] | None:
    """(status, expires_at, published, forget_at) from :func:`state_header`'s value; None if malformed.

    A three-part value (an instance before forget_at existed) has no forget_at."""
    parts = value.split(";")
    if len(parts) not in (3, 4) or parts[0] not in ("pending", "resolved", "expired") or parts[2] not in ("0", "1"):
        return None
    try:
        exp = float(parts[1]) if parts[1] else None
        forget_at = float(parts[3]) if len(parts) == 4 and parts[3] else None
    except ValueError:
        return None
    return parts[0], exp, parts[2] == "1", forget_at


def has_text(res: Resolution | None) -> bool:
    """Whether ``res`` carries principal-authored free text (spec 000 §13)."""
    return (isinstance(res, FreeTextAnswer) or (isinstance(res, DialogueVeto) and bool(res.objection))
            or isinstance(res, ClarificationAnswers))


def blank_text(res: Resolution) -> str | None:
    """Where an answer holds a text of hers that shows nothing (white space, invisible characters only), or None.

    The redaction keeps what a person sees, so such a text became empty and failed its own check: an answer of
    U+200B got ``engine_failure`` and a traceback, and one of a space was recorded and signed as her answer
    (found by a docs-only attack). It is refused as an answer no person gave."""

    if isinstance(res, FreeTextAnswer):
        return None if seen(res.text) else "text"
    if isinstance(res, DialogueVeto):
        return "objection" if res.objection is not None and not seen(res.objection) else None
    if isinstance(res, ClarificationAnswers):
        return next((f"answers.{k}" for k, v in res.answers.items() if not seen(v)), None)
    return None


def forget_text(res: Resolution, digests: DigestKey) -> Resolution:
    """``res`` with each free text replaced by a marker holding its keyed digest (the verdict's ``text_digest``).

    ``[forgotten (spec 000 §13); hmac-sha256:{kid}:{hex}]``: the deployment's digest key
    (pgwcore.keys.DigestKey) checks a guess, nobody else can; a record forgotten before keyed
    digests keeps its ``sha256 {hex}`` marker and still reads."""

    def marker(text: str) -> str:
        return f"[forgotten (spec 000 §13); {digests.digest(text)}]"

    if isinstance(res, FreeTextAnswer):
        return FreeTextAnswer(text=marker(res.text))
    if isinstance(res, DialogueVeto) and res.objection:
        return DialogueVeto(objection=marker(res.objection))
    if isinstance(res, ClarificationAnswers):
        return ClarificationAnswers(answers={k: marker(v) for k, v in res.answers.items()})
    return res


def moment_key(principal: str, moment_id: str) -> str:
    return f"{principal}.{moment_id}"


def hem_decision_of(resolution: Resolution | None) -> str:
    match resolution:
        # 0 Approve; 2 and 3 approve as well and also allow it standing (a gated step's moment,
        # gateway/kernel/scopes.py); 1 Deny. Every other HEM moment has two options only.
        case OptionChoice(index=0 | 2 | 3):
            return "approve"
        case OptionChoice():
            return "deny"
        case FreeTextAnswer():
            return "free_text"
        case DialogueVeto():
            return "dialogue"
    return "expired"


def closing_outcome(rec: MomentRecord) -> ResolutionOutcome | MomentExpired | HemDecision:
    """The outcome that tells the agent a closed moment's end (DESIGN §4.3).

    A function of the stored record alone (its ``ts`` is the record's
    ``resolved_at``), so the message published when the moment closed and the
    one the moment query returns later (``agent.{agent}.moment``) are the same.
    """
    if rec.status == "pending" or rec.resolved_at is None:
        raise ValueError(f"moment {rec.moment_id} is not closed")
    ts = to_rfc3339(rec.resolved_at)
    common: dict[str, Any] = dict(
        agent=rec.agent, ts=ts, untrusted=rec.untrusted, traceparent=rec.traceparent,
        moment_id=rec.moment_id, principal=rec.principal, node_id=rec.node_id,
    )
    res = rec.resolution if rec.status == "resolved" else None
    if rec.hem:
        return HemDecision(
            **common, idp_id=rec.hem.idp_id, session_id=rec.hem.session_id,
            # A void approval permits nothing: the agent is told deny, and why (HemDecision).
            decision="deny" if rec.void else hem_decision_of(res),  # type: ignore[arg-type]
            void=rec.void,  # type: ignore[arg-type]
            # The principal's own words, an answer or an objection, reach the agent (the MCP gate hands them
            # to the model with the refusal, docs/gate.md); forgotten with this outcome (spec 000 §13).
            text=res.text if isinstance(res, FreeTextAnswer) else res.objection if isinstance(res, DialogueVeto) else None,
        )
    if res is None:
        # DESIGN §6: a timeout is a refusal, never a consent.
        return MomentExpired(**common, envelope_id=rec.envelope_id, correlation_id=rec.correlation_id)
    return ResolutionOutcome(
        **common, envelope_id=rec.envelope_id, correlation_id=rec.correlation_id, resolution=res, resolved_at=ts,
    )


def closing_verdict(rec: MomentRecord, ts: str, verdict_class: Literal["resolved", "timeout"], **kw: Any) -> Verdict:
    """The verdict that closes a moment; it supersedes the dispatch verdict (spec 004 §5.4.4)."""
    return Verdict(
        verdict_id=stable_id(verdict_class, rec.moment_id),
        verdict_class=verdict_class,
        ts=ts,
        agent=rec.agent,
        principal=rec.principal,
        action_type="idp.hem" if rec.hem else "pgw.binding_moment",
        action_id=rec.moment_id,
        envelope_id=rec.envelope_id,
        correlation_id=rec.correlation_id,
        moment_id=rec.moment_id,
        idp_id=rec.hem.idp_id if rec.hem else None,
        supersedes=rec.dispatch_verdict_id,
        untrusted=rec.untrusted,
        traceparent=rec.traceparent,
        node_id=rec.node_id,
        **kw,
    )
