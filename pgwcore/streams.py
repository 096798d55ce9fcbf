"""The JetStream streams and KV buckets of DESIGN §2, created idempotently.

A second start changes nothing. A stream that exists with an incompatible
configuration is reported (``StreamConflict``), never silently replaced: the
operator decides whether to migrate it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamInfo,
)
from nats.js.errors import BadRequestError, NotFoundError

from pgwcore.atomic import enable_atomic
from pgwcore.logs import get_logger
from subjects.errors import PgwError
from subjects.names import Subjects

log = get_logger("pgw.streams")

DAY = 86400.0
# DESIGN §7, issue 19: JetStream's duplicate window is per stream and the
# publisher chooses ``Nats-Msg-Id``, so on a stream every agent writes to,
# agent B could pre-use A's id and the *server* would drop A's envelope,
# whatever client A runs. PGW_INBOUND therefore keeps the smallest window
# nats-server accepts (100 ms, err 10052 below it) and the gateway does not
# rely on it: an envelope is deduplicated by the gateway itself, keyed by the
# agent of the subject (authenticated by the server) and the envelope
# (``gateway.stages.base.envelope_key``), and its outcome and verdict carry
# ids derived from that key on streams only the services write to.
INBOUND_DUPLICATE_WINDOW_S = 0.1
# A message of PGW_INBOUND that held a secret leaves it once the gateway is done with it (a turn
# answered or dead-lettered, a transition report recorded); its redacted form is kept in this bucket,
# key ``{agent}.{stream seq}`` (gateway/at_rest.py), and ``pgw replay`` re-drives it in the message's
# place (consumers/replay.py). The copy carries the message's Nats-Msg-Id under this header (a KV write
# must not carry its own: the bucket's stream would deduplicate on it) and its subject under the next
# (``agent.{agent}.envelope`` or ``.transition``; a copy without it is an envelope's).
INBOUND_REDACTED_BUCKET = "PGW_INBOUND_REDACTED"
INBOUND_MSG_ID_HEADER = "Pgw-Inbound-Msg-Id"
INBOUND_SUBJECT_HEADER = "Pgw-Inbound-Subject"


class StreamConflict(PgwError):
    """An existing stream's configuration differs from what the contract needs."""

    def __init__(self, stream: str, differences: dict[str, tuple[object, object]]) -> None:
        self.stream = stream
        self.differences = differences
        diff = "; ".join(f"{k}: have {h!r}, need {w!r}" for k, (h, w) in differences.items())
        super().__init__(
            f"stream {stream} exists with an incompatible configuration ({diff}); "
            "not replacing it - migrate or delete it deliberately"
        )


@dataclass(frozen=True)
class StreamPlan:
    name: str
    config: StreamConfig


def stream_plans(subjects: Subjects, *, replicas: int = 1, duplicate_window_s: float = 3600.0) -> list[StreamPlan]:
    """Every stream of the bus contract (DESIGN §2) under ``subjects.prefix``."""
    dw = duplicate_window_s

    def cfg(name: str, subs: list[str], **kw: object) -> StreamPlan:
        base: dict[str, object] = {
            "name": name,
            "subjects": subs,
            "storage": StorageType.FILE,
            "num_replicas": replicas,
            "duplicate_window": dw,
            "retention": RetentionPolicy.LIMITS,
            "discard": DiscardPolicy.OLD,
        }
        base.update(kw)
        return StreamPlan(name, StreamConfig(**base))  # type: ignore[arg-type]

    return [
        cfg(
            "PGW_INBOUND",
            [subjects.all_agents("envelope"), subjects.all_agents("transition")],
            max_age=7 * DAY,
            duplicate_window=INBOUND_DUPLICATE_WINDOW_S,
        ),
        # allow_atomic: the gateway's group commit (pgwcore.publish) and the signer's capsule
        # batches (consumers.signer) write these in atomic batches.
        cfg("PGW_OUTBOUND", [subjects.all_agents("outcome")], max_age=30 * DAY, allow_atomic=True),
        cfg("PGW_SURFACE", [subjects.all_principals("surface")], max_age=30 * DAY, allow_atomic=True),
        cfg("PGW_VERDICTS", [subjects.all_verdicts], max_age=90 * DAY, allow_atomic=True),
        cfg(
            "PGW_REGISTRATION",
            [subjects.capsule_register],
            retention=RetentionPolicy.WORK_QUEUE,
            allow_atomic=True,
        ),
        cfg("PGW_CAPSULES", [subjects.capsule_registered]),
        cfg("PGW_EVENTLOG", [subjects.all_log], deny_delete=True, deny_purge=True),
        # The event log's anchored heads (gateway/kernel/checkpoint.py), outside the log itself.
        cfg("PGW_CHECKPOINTS", [f"{subjects.prefix}.checkpoint.>"], deny_delete=True, deny_purge=True),
    ]


# JetStream's answer to creating a stream whose name is taken with another configuration.
ERR_STREAM_NAME_IN_USE = 10058

# Fields that must match exactly for the stream to be the one the contract needs.
_CHECKED = ("subjects", "retention", "storage", "deny_delete", "deny_purge", "num_replicas")


def _differences(have: StreamConfig, want: StreamConfig) -> dict[str, tuple[object, object]]:
    out: dict[str, tuple[object, object]] = {}
    for f in _CHECKED:
        h, w = getattr(have, f), getattr(want, f)
        if f == "subjects":
            h, w = sorted(h or []), sorted(w or [])
        if f in ("deny_delete", "deny_purge"):
            h, w = bool(h), bool(w)
        if h != w:
            out[f] = (h, w)
    return out


async def cluster_replicas(js: JetStreamContext) -> int:
    """The replica count the deployment chose: PGW_INBOUND's (``pgw streams --replicas 3``), else 1.

    Services call ``ensure_streams`` / ``ensure_kv`` without a replica count and
    adopt it, so one R3 set-up by the operator makes every stream and bucket R3
    (DESIGN §8 scale-out path) instead of failing with a conflict or creating
    R1 buckets that die with their node.
    """
    try:
        return (await js.stream_info("PGW_INBOUND")).config.num_replicas or 1
    except NotFoundError:
        return 1


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> StreamInfo | None:
    """Create stream ``config.name`` unless it exists: None if this call made it, else the
    existing stream's info (for the caller to check against what it needs).

    ``num_replicas`` left unset adopts the deployment's count (``cluster_replicas``).
    A stream made meanwhile by another process starting at the same time is
    taken as it is (the server refuses our create if that one's configuration
    differs: ``ERR_STREAM_NAME_IN_USE``); any other refusal is raised. A JetStream
    API timeout is asked again for ``START_RETRY_S``.
    """
    return await retrying(lambda: _ensure_stream_once(js, config), f"stream {config.name}", START_RETRY_S)


async def _ensure_stream_once(js: JetStreamContext, config: StreamConfig) -> StreamInfo | None:
    try:
        return await js.stream_info(config.name)
    except NotFoundError:
        pass
    if config.num_replicas is None:  # a copy: the caller's config stays as it passed it
        config = replace(config, num_replicas=await cluster_replicas(js))
    try:
        await js.add_stream(config)
        return None
    except BadRequestError as e:
        if e.err_code != ERR_STREAM_NAME_IN_USE:
            raise
        return await js.stream_info(config.name)


async def ensure_streams(
    js: JetStreamContext, subjects: Subjects, *, replicas: int | None = None, duplicate_window_s: float = 3600.0
) -> dict[str, str]:
    """Create missing streams; return ``{name: "created" | "exists" | "updated"}``.

    ``replicas=None`` adopts the deployment's count (``cluster_replicas``).
    Raises StreamConflict for the first stream whose configuration is incompatible.
    """
    result: dict[str, str] = {}
    if replicas is None:
        replicas = await cluster_replicas(js)
    for plan in stream_plans(subjects, replicas=replicas, duplicate_window_s=duplicate_window_s):
        # Existing, or made meanwhile by another process starting at the same time:
        # checked against the contract either way.
        info = await ensure_stream(js, plan.config)
        if info is None:
            result[plan.name] = "created"
            continue
        diff = _differences(info.config, plan.config)
        if diff:
            raise StreamConflict(plan.name, diff)
        if plan.config.allow_atomic and not info.config.allow_atomic:
            await enable_atomic(js, plan.name)  # added to a stream made before it was planned
        if plan.name == "PGW_INBOUND" and (info.config.duplicate_window or 0) > INBOUND_DUPLICATE_WINDOW_S + 1e-6:
            # A stream made before issue 19 keeps a window an agent could squat in: shrink it
            # (an additive update; the gateway's own dedup does not depend on it).
            cfg = info.config
            cfg.duplicate_window = INBOUND_DUPLICATE_WINDOW_S
            await js.update_stream(cfg)
            result[plan.name] = "updated"
            continue
        result[plan.name] = "exists"
    return result


KV_BUCKETS = {
    # moment state: pending / resolved / expired, first answer wins by CAS.
    "PGW_MOMENTS": {"history": 1},
    # each agent's index of its moments (the moment list, gateway/moment_list.py).
    "PGW_AGENT_MOMENTS": {"history": 1},
    # spec 002 correlationId dedup/replay cache.
    "PGW_DEDUP": {"history": 1},
}


# A JetStream API call that times out while a clustered bucket is being created (an R3 stream
# waits for its peers; a busy or electing cluster answers late) is asked again, for this long:
# creating is idempotent (an existing bucket is opened, a concurrent create is taken as it is).
START_RETRY_S = 60.0


async def ensure_kv(
    js: JetStreamContext, name: str, *, replicas: int | None = None, ttl: float | None = None, atomic: bool = False,
    retry_for: float = START_RETRY_S,
):
    """Open KV bucket ``name``, creating it (file storage) if missing.

    ``replicas=None`` adopts the deployment's count (``cluster_replicas``).
    ``atomic``: the bucket's stream also takes atomic batches (the gateway's
    group commit, ``pgwcore.publish.KvWriter``), added to an existing bucket
    as an additive update. A JetStream API timeout (or "no responders" while
    the cluster elects) is retried for ``retry_for`` seconds, then raised.
    """
    return await retrying(lambda: _ensure_kv_once(js, name, replicas=replicas, ttl=ttl, atomic=atomic),
                           f"bucket {name}", retry_for)


async def retrying(make: Any, what: str, retry_for: float) -> Any:
    """``await make()``, asked again on a JetStream API timeout or no-responders for ``retry_for`` s."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeoutError
    from nats.js.errors import ServiceUnavailableError

    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_for
    delay = 0.25
    while True:
        try:
            return await make()
        except (NatsTimeoutError, NoRespondersError, ServiceUnavailableError) as e:
            if loop.time() + delay > deadline:
                raise
            log.warning("JetStream did not answer while opening a stream or bucket; asking again", what=what,
                        error=type(e).__name__, retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def _ensure_kv_once(js: JetStreamContext, name: str, *, replicas: int | None, ttl: float | None, atomic: bool):
    from nats.js.api import KeyValueConfig
    from nats.js.errors import BucketNotFoundError

    try:
        kv = await js.key_value(name)
    except BucketNotFoundError:
        if replicas is None:
            replicas = await cluster_replicas(js)
        try:
            kv = await js.create_key_value(
                KeyValueConfig(bucket=name, history=1, storage=StorageType.FILE, replicas=replicas, ttl=ttl)
            )
        except BadRequestError as e:
            if e.err_code != ERR_STREAM_NAME_IN_USE:
                raise
            # Made meanwhile by another process starting at the same time, which may
            # already have allowed atomic batches on it, so our create's configuration
            # differs from it and the server refuses the create: open theirs.
            kv = await js.key_value(name)
    if atomic:
        await enable_atomic(js, f"KV_{name}")
    return kv
