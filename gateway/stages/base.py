"""What the stages share: the per-envelope context, the refusal signal, and what they read.

The stages import nothing above them (tests/test_architecture.py): the gateway
they run in and the per-gateway stage state reach them through ``Ctx`` as the
two protocols below (``gateway.app.Gateway`` and
``gateway.stages.state.PipelineState`` are what the pipeline passes).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec

from subjects.wire import AIEnvelope, Detail, Refusal

# The gateway's durable consumer of envelopes on PGW_INBOUND (docs/contract.md §1, §4).
INBOUND_DURABLE = "pgw-gateway"

if TYPE_CHECKING:
    from collections.abc import Mapping

    from gateway.moments import MomentDesk
    from pgwcore.config import Config
    from pgwcore.publish import Publisher


@dataclass(frozen=True)
class KindSpec:
    name: str
    payload_type: Any  # a msgspec Struct type, or None for a JSON-Schema-only vendor kind
    schema_version: int
    handler: str  # name of a handler in gateway.stages.route
    json_schema: dict[str, Any] | None = None  # for configured vendor kinds, or a richer published schema

    def schema(self) -> dict[str, Any]:
        """The kind's JSON Schema, generated from the type that validates it."""
        if self.json_schema is not None:
            return self.json_schema
        return msgspec.json.schema(self.payload_type)


class StageHost(Protocol):
    """What the stages read from the gateway they run in."""

    config: Config
    kinds: dict[str, KindSpec]
    desk: MomentDesk
    publisher: Publisher


class StageState(Protocol):
    """The per-gateway state the stages share (built once per gateway by ``gateway.stages.state``)."""

    redactor: Any  # gateway.stages.redaction.Redactor
    kv: Any  # the PGW_DEDUP bucket
    stats: Any  # gateway.stages.state.Stats
    vetoes: Any  # dualveto.VetoCache, or None
    writer: Any  # pgwcore.publish.KvWriter
    ack_floor: Any  # gateway.stages.dedup.AckFloor


@dataclass
class Turn:
    """One inbound message: a single envelope or a JSON array of them (DESIGN §3.2)."""

    agent: str
    subject: str
    stream_seq: int
    body: bytes
    msg_id: str | None
    traceparent: str | None
    num_delivered: int = 1
    principal: str | None = None  # the Pgw-Principal header (gateway.stages.route.resolve_principal)
    headers: Mapping[str, str] | None = None  # every header as sent (gateway/at_rest.py judges them too)
    # (the redactor, the body judged, whether it was plainly clean): gateway.stages.redaction.body_plainly_clean
    clean: tuple[Any, bytes, bool] | None = field(default=None, repr=False, compare=False)
    _digest: tuple[bytes, str] | None = field(default=None, repr=False, compare=False)  # (the body, its sha256)

    @property
    def digest(self) -> str:
        """sha256 of the body: the same turn stored twice (an agent's retry) has the same digest. Computed
        once per body (not a ``functools.cached_property``, whose every first read takes a lock on Python
        3.11); a copy of the turn with another body (``dataclasses.replace``) computes its own."""
        cached = self._digest
        if cached is None or cached[0] is not self.body:
            cached = self._digest = (self.body, hashlib.sha256(self.body).hexdigest())
        return cached[1]


@dataclass
class Ctx:
    """One envelope travelling through the stages."""

    gw: StageHost
    turn: Turn
    index: int
    raw: Any  # the decoded JSON value of this envelope
    state: StageState
    env: AIEnvelope | None = None
    kind: KindSpec | None = None
    payload: Any = None  # the typed payload Struct after the payload stage
    envelope_id: str | None = None
    correlation_id: str | None = None
    untrusted: bool = False
    principal: str | None = None
    warnings: list[Detail] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # The body names no envelopeId for this envelope (an empty body, ``[]``, bytes that are not
    # JSON, an id-less envelope): its bytes alone cannot tell a new send from a retry (see envelope_key).
    anonymous: bool = False
    _key: tuple[bool, str] | None = field(default=None, repr=False, compare=False)  # envelope_key, once

    @property
    def agent(self) -> str:
        return self.turn.agent

    @property
    def node_id(self) -> str | None:
        """The envelope's ``nodeId``, carried by every message it causes (spec 002 "Run event log
        integration"); read from the raw envelope when it did not pass the shape stage."""
        if self.env is not None:
            return self.env.nodeId
        v = self.raw.get("nodeId") if isinstance(self.raw, dict) else None
        return v if isinstance(v, str) and 0 < len(v) <= 128 else None

    def warn(self, message: str, rule: str, path: str | None = None) -> None:
        self.warnings.append(Detail(message=message, rule=rule, path=path))

    @property
    def envelope_key(self) -> str:
        """Which envelope this is, for the gateway's own exactly-once (DESIGN §7, issue 19).

        The agent of the subject (authenticated by the server), the turn's
        bytes and the position in the turn: an agent's retry of a publish
        whose PubAck was lost is stored again (PGW_INBOUND keeps no useful
        duplicate window, ``pgwcore.streams.INBOUND_DUPLICATE_WINDOW_S``) and
        has the same key, so its outcome and verdict carry the same message
        ids and the services' streams store them once. Nothing another agent
        publishes can share it: its subject names another agent.

        An envelope whose body names no ``envelopeId`` (``anonymous``) has no
        identity of its own: the same empty body sent twice is two inputs, and
        each must get its outcome. Its key adds the publish: the ``Nats-Msg-Id``
        (a retry re-using it stays one envelope), else the stream sequence (one
        stored message, whatever its redeliveries).
        """
        cached = self._key
        if cached is not None and cached[0] == self.anonymous:
            return cached[1]  # computed once per envelope (a sha256); again only if ``anonymous`` changed
        if self.anonymous:
            instance = f"id:{self.turn.msg_id}" if self.turn.msg_id else f"seq:{self.turn.stream_seq}"
            key = envelope_key(self.turn.agent, f"{self.turn.digest}\x00{instance}", self.index)
        else:
            key = envelope_key(self.turn.agent, self.turn.digest, self.index)
        self._key = (self.anonymous, key)
        return key



def envelope_key(agent: str, digest: str, index: int) -> str:
    h = hashlib.sha256(f"{agent}\x00{digest}\x00{index}".encode())
    return h.hexdigest()[:32]


class Refuse(Exception):
    """Raised by a stage to refuse the envelope with a spec code.

    ``status`` is the spec 002 EnvelopeOutcome status; ``verdict_class`` the
    DESIGN §6 row (``blocked`` before routing, ``denied`` for policy gates).
    """

    def __init__(
        self,
        code: str,
        reason: str,
        *,
        details: list[Detail] | None = None,
        status: Literal["invalid", "gated", "breached"] = "invalid",
        verdict_class: Literal["blocked", "denied"] = "blocked",
        cap_kind: Literal["envelopes", "schema", "clarification"] | None = None,
        refused_type: str | None = None,
        accepted_types: list[str] | None = None,
        notice: Any = None,
        silent: bool = False,
    ) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason
        self.details = details or []
        self.status = status
        self.verdict_class = verdict_class
        self.cap_kind = cap_kind
        self.refused_type = refused_type
        self.accepted_types = accepted_types
        self.notice = notice
        self.silent = silent  # discard-and-warn: no failure outcome, only a warning

    hint: Any = None  # a best-effort parse of an undecodable body, to read ids back

    @property
    def refusal(self) -> Refusal:
        return Refusal(code=self.code, reason=self.reason, details=self.details)
