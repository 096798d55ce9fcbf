"""Per-gateway state the pipeline stages share, built once on first use.

The gateway holds it in a ``StageStateCell`` and the pipeline hands it to every
stage as ``ctx.state`` (issue 18: explicit, rather than an attribute set on the
gateway object). This module sits above the stages and imports them; no stage
imports it. What it holds:

- the SR-1 :class:`~gateway.stages.redaction.Redactor` from ``pipeline.secrets``;
- the kind registry completed with configured vendor kinds (their JSON
  Schema files) and ``pipeline.schema_versions`` overrides;
- the ``PGW_DEDUP`` KV bucket (correlationId replay cache, schema and
  clarification round counters, dialogue vetoes), shared by every gateway
  instance and surviving restarts;
- the spec 000 §6.9/§12.2/§12.3 counters (also exported to Prometheus where
  ``pgwcore.metrics`` counts them), kept here so they are testable per gateway;
- the desk hook that remembers a question-space veto (spec 000 §7.2);
- the inbound durable's ack floor, one read shared by dedup's stale-claim
  waiters (``gateway.stages.dedup.AckFloor``).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.stages.base import KindSpec, StageHost
from gateway.stages.dedup import AckFloor
from gateway.stages.dualveto import VetoCache, remember_resolution
from gateway.stages.redaction import Redactor
from pgwcore.logs import get_logger
from pgwcore.publish import KvWriter
from pgwcore.streams import ensure_kv
from subjects.errors import ConfigError

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from gateway.moment_record import MomentRecord

log = get_logger("pgw.pipeline")

DEDUP_BUCKET = "PGW_DEDUP"


class StateHost(StageHost):
    """What building the state reads from the gateway (``gateway.app.Gateway``)."""

    js: JetStreamContext


MAX_DECISION_CLASSES = 32  # decision classes counted apart per agent (Stats.decision_class)
OTHER_CLASS = "other"  # the rest, as pgwcore.metrics.safe_label names a label it will not keep


@dataclass
class Stats:
    """Spec 000 monitoring counts of this gateway instance (§6.9, §12.2, §12.3)."""

    moments: Counter[str] = field(default_factory=Counter)  # agent
    calibration_notes: Counter[str] = field(default_factory=Counter)  # agent
    hatch_suppressions: Counter[tuple[str, str]] = field(default_factory=Counter)  # (agent, hatch)
    resolutions: Counter[tuple[str, str]] = field(default_factory=Counter)  # (agent, decision_class)
    dialogue_hatch: Counter[tuple[str, str]] = field(default_factory=Counter)  # (agent, decision_class)
    def decision_class(self, agent: str, dc: str) -> str:
        """The class ``dc`` is counted under for ``agent``: itself for the agent's first
        ``MAX_DECISION_CLASSES`` classes, ``other`` after them. The agent writes the class (spec
        000 §6.9), so without a bound each new one was a new key here and two new series in
        /metrics for as long as the process ran; the rates of §12.2 stay whole per agent."""
        if (agent, dc) in self.resolutions:
            return dc
        apart = sum(1 for a, c in self.resolutions if a == agent and c != OTHER_CLASS)
        return dc if apart < MAX_DECISION_CLASSES else OTHER_CLASS

    def rate(self, agent: str, what: str) -> float:
        """dialogue-hatch or calibration_note rate for ``agent`` (0 when nothing seen)."""
        if what == "dialogue_hatch":
            num = sum(v for (a, _), v in self.dialogue_hatch.items() if a == agent)
            den = sum(v for (a, _), v in self.resolutions.items() if a == agent)
        else:
            num, den = self.calibration_notes[agent], self.moments[agent]
        return num / den if den else 0.0


@dataclass
class PipelineState:
    redactor: Redactor
    kv: Any
    stats: Stats = field(default_factory=Stats)
    vetoes: Any = None  # dualveto.VetoCache, None when it could not start (then every check reads the bucket)
    writer: Any = None  # publish.KvWriter: the claim and settle writes, group-committed
    ack_floor: Any = None  # dedup.AckFloor: the inbound durable's ack floor, one read for every stale-claim waiter


def load_vendor_kinds(gw: StateHost) -> None:
    """Register configured vendor kinds and apply schema-version overrides."""
    import jsonschema

    cfg = gw.config.pipeline
    for name, vk in cfg.vendor_kinds.items():
        where = f"pipeline.vendor_kinds.{name}.schema_file"
        try:
            schema = json.loads(Path(vk.schema_file).expanduser().read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(where, f"cannot load a JSON Schema: {e}") from e
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as e:
            raise ConfigError(where, f"not a valid JSON Schema 2020-12: {e.message}") from e
        gw.kinds[name] = KindSpec(name, None, vk.schema_version, "record", schema)
    for name, version in cfg.schema_versions.items():
        spec = gw.kinds.get(name)
        if spec is None:
            raise ConfigError(f"pipeline.schema_versions.{name}", "not a kind this gateway supports")
        gw.kinds[name] = KindSpec(spec.name, spec.payload_type, version, spec.handler, spec.json_schema)


async def _veto_cache(gw: StateHost, kv: Any) -> Any:
    cache = VetoCache(kv, DEDUP_BUCKET)
    try:
        await cache.start(gw.js)
    except Exception as e:  # noqa: BLE001 - the check then reads the bucket every time
        log.warning("dual-veto cache did not start; reading the bucket for every moment", error=str(e))
        return None
    return cache


class StageStateCell:
    """One gateway's ``PipelineState``, created on the first ``get()`` (concurrent callers share one build)."""

    def __init__(self, gw: StateHost) -> None:
        self._gw = gw
        self._state: PipelineState | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> PipelineState:
        """The state of the gateway's pipeline, created on first call."""
        if self._state is not None:
            return self._state
        async with self._lock:
            if self._state is None:
                self._state = await self._build()
        return self._state

    async def _build(self) -> PipelineState:
        gw = self._gw
        cfg = gw.config.pipeline
        redactor = Redactor.from_config(cfg.secrets)
        load_vendor_kinds(gw)
        kv = await ensure_kv(gw.js, DEDUP_BUCKET, ttl=cfg.dedup_ttl_s, atomic=True)
        st = PipelineState(redactor=redactor, kv=kv, vetoes=await _veto_cache(gw, kv),
                           writer=KvWriter(gw.js, kv, DEDUP_BUCKET), ack_floor=AckFloor(gw.js))
        on_resolved = getattr(gw.desk, "on_resolved", None)
        if on_resolved is not None:

            async def _cb(rec: MomentRecord) -> None:
                await remember_resolution(st, rec)

            on_resolved(_cb)
        else:  # pragma: no cover - the desk hook is part of this change
            log.warning("moment desk has no on_resolved hook: dual veto not enforced")
        return st
