"""The ``capabilities`` responder (spec 002 "Capability handshake integration", DESIGN §3.4).

Request-reply on ``{prefix}.capabilities`` (queue group ``pgw-gateway``, so
any instance answers). The document lists

- ``supportedEnvelopes``: every kind the kind stage accepts - the four
  universal kinds always among them - sorted;
- ``schemaVersions``: the advertised version per kind (the one the payload
  stage checks ``schemaVersion`` against);
- ``limits``: ``envelopesPerTurn``, ``schemaRounds``, ``clarificationRounds``;
- ``envelopeStrictness`` and ``envelopeContracts.advertised``;
- ``pgw``: this host's choices where spec 002 leaves room (principal header,
  missing ``meta.source``, ``schema.request`` for an unknown kind);
- ``schemas``: each kind's JSON Schema, generated from the very type that
  validates it (``msgspec.json.schema``) or, for a configured vendor kind,
  its own schema file - so the document and the validator cannot drift.

It also prepares the pipeline's shared state at start (redactor, kinds,
dedup bucket, desk hook), so a misconfigured secrets file or vendor schema
fails the gateway at start with the field named.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from gateway.stages.kind import UNIVERSAL_KINDS
from gateway.stages.route import PRINCIPAL_HEADER

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from gateway.app import Gateway

QUEUE = "pgw-gateway"


class Limits(msgspec.Struct, rename="camel"):
    envelopes_per_turn: int
    schema_rounds: int
    clarification_rounds: int


class EnvelopeContracts(msgspec.Struct):
    advertised: bool


class HostNotes(msgspec.Struct, rename="camel"):
    """This host's choices where spec 002 leaves room (vendor namespace ``pgw``, issue 15)."""

    # the NATS header that names a clarification's principal (meta.pgw.principal: deprecated)
    principal_header: str
    # meta.source absent: "synthesized" (Migration default, warn) or "refused" (strict)
    missing_meta_source: Literal["synthesized", "refused"]
    # schema.request for a kind not in supportedEnvelopes
    schema_request_unknown_kind: Literal["accept", "refuse"]


class CapabilityDocument(msgspec.Struct, rename="camel"):
    """spec 002 capability fields of this host (camelCase on the wire, as the spec names them)."""

    supported_envelopes: list[str]
    schema_versions: dict[str, int]
    limits: Limits
    envelope_strictness: Literal["warn", "strict"]
    envelope_contracts: EnvelopeContracts
    schemas: dict[str, dict[str, Any]]
    pgw: HostNotes | None = None


capability_decoder = msgspec.json.Decoder(CapabilityDocument)
_enc = msgspec.json.Encoder()


def document(gw: Gateway) -> CapabilityDocument:
    cfg = gw.config.pipeline
    kinds = dict(gw.kinds)
    missing = [k for k in UNIVERSAL_KINDS if k not in kinds]
    assert not missing, f"universal kinds missing from the registry: {missing}"  # spec 002 RFC 0094
    names = sorted(kinds)
    return CapabilityDocument(
        supported_envelopes=names,
        schema_versions={k: kinds[k].schema_version for k in names},
        limits=Limits(cfg.envelopes_per_turn, cfg.schema_rounds, cfg.clarification_rounds),
        envelope_strictness=cfg.envelope_strictness,
        envelope_contracts=EnvelopeContracts(advertised=bool(cfg.contracts)),
        schemas={k: kinds[k].schema() for k in names},
        pgw=HostNotes(
            principal_header=PRINCIPAL_HEADER,
            missing_meta_source="refused" if cfg.envelope_strictness == "strict" else "synthesized",
            schema_request_unknown_kind=cfg.schema_request_unknown_kind,
        ),
    )


class CapabilitiesPart:
    """A gateway part (``GATEWAY_PARTS``): answers ``capabilities`` requests."""

    name = "capabilities"

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._sub: Any = None
        self._body: bytes | None = None

    async def __aenter__(self) -> CapabilitiesPart:
        await self.gw.stage_state.get()
        self._body = _enc.encode(document(self.gw))
        self._sub = await self.gw.rnc.subscribe(self.gw.subjects.capabilities, queue=QUEUE, cb=self._on_request)
        return self

    async def _on_request(self, msg: Msg) -> None:
        if self.gw.responder.admits(msg):
            await self.gw.responder.answer(msg, self._body or _enc.encode(document(self.gw)))

    async def drain(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()
