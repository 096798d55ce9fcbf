"""The gateway service: the envelope worker, the resolution, pending and moment-query services.

Stateless workers: all state lives in JetStream streams and KV buckets, so
any number of instances can run (queue group ``pgw-gateway`` and one shared
durable consumer).

Agents' outcome consumers (``outcome-{agent}`` on ``PGW_OUTBOUND``) are
created at start for the configured agents (and by the security part for the
other agent parties); an agent the configuration does not name can only exist
without authentication, where it creates its own (``subjects.client.Agent``).
The gateway no longer creates one on an agent's first envelope (issue 18):
that was a JetStream API call and a file-store consumer per new agent on the
hot path (about 4 ms of server CPU each), a consumer per agent forever, and
past the server's consumer limit every new agent's envelopes failed. The
stream keeps outcomes (limits retention), so a consumer created later still
delivers them all.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from nats.aio.client import Client

from gateway.moment_list import list_moments
from gateway.moment_record import Refused, blank_text, closing_outcome
from gateway.moments import MomentDesk
from gateway.pipeline import EnvelopeWorker
from gateway.stages.kind import BUILTIN_KINDS, KindSpec
from gateway.stages.state import StageStateCell
from pgwcore import tracing
from pgwcore.config import OPEN_MODE_LINE, Config
from pgwcore.keys import load_or_create_digest_key
from pgwcore.logs import get_logger
from pgwcore.publish import Publisher
from pgwcore.respond import Responder, release_requests_connection, requests_connection
from pgwcore.streams import ensure_streams
from subjects.client import ensure_agent_consumer
from subjects.errors import SubjectError
from subjects.momentquery import MomentState, moment_query_decoder
from subjects.wire import PendingReply, Refusal, ResolveReply, Verdict, resolve_request_decoder

if TYPE_CHECKING:
    from nats.aio.msg import Msg

    from gateway.stages.base import Ctx
    from subjects.wire import Outcome

log = get_logger("pgw.gateway")
QUEUE = "pgw-gateway"
_enc = msgspec.json.Encoder()

# In-process parts started with the gateway: "module:Class", constructed as
# Class(gateway), each an async context manager with ``drain()``.
GATEWAY_PARTS: list[str] = [
    "gateway.metrics_part:MetricsPart",  # issue 8: counters, nats.micro, consumer lag, /metrics
    "gateway.deadletter:DeadLetters",  # issue 8: poison messages after max_deliver
    "gateway.security.part:SecurityPart",  # issue 7: Nats-Msg-Id binding, per-principal durables
    "gateway.kernel.service:KernelService",  # issue 4: IDP kernel (spec 003)
    "gateway.capabilities:CapabilitiesPart",  # issue 3: capabilities responder, pipeline state
]


class Gateway:
    name = "gateway"

    def __init__(self, config: Config, nc: Client) -> None:
        self.config = config
        self.nc = nc
        self.js = nc.jetstream()
        # Every request the gateway answers goes through this one path (docs/security.md "Replies").
        self.responder = Responder(config.prefix, "gateway")
        # The connection requests are taken on (pgwcore/respond.py): the process's answering
        # connection on a server with per-party credentials, else ``nc``. Set on entering.
        self.rnc: Client = nc
        self.subjects = config.subjects
        self.publisher = Publisher(self.js, self.subjects)
        # Every digest of a principal's text is keyed with the deployment's digest key (pgwcore/keys.py).
        self.desk = MomentDesk(self.js, self.subjects, self.publisher,
                               answer_text_keep_s=config.gateway.answer_text_keep_s,
                               digests=load_or_create_digest_key(config.data_path, create=config.keys.create,
                                                                 keys_dir=config.keys_path))
        self.kinds: dict[str, KindSpec] = dict(BUILTIN_KINDS)
        self.stage_state = StageStateCell(self)  # what the stages share, passed to them as ctx.state
        self.publisher.scrub_verdict = self._scrub_verdict  # SR-1 over the kernel's and the desk's verdicts too
        self.outcome_hooks: list[Callable[[Ctx, Outcome], Awaitable[None]]] = []
        self.failure_hooks: list[Callable[[Any, Msg], Awaitable[bool]]] = []
        self.timing_hooks: list[Callable[[str, float], None]] = []
        self.worker = EnvelopeWorker(self)
        self.parts: list[Any] = []
        self._subs: list[Any] = []
        self._stack = contextlib.AsyncExitStack()
        self._drained = False

    async def _scrub_verdict(self, verdict: Verdict) -> tuple[Verdict, bytes]:
        """SR-1 over a verdict before it is published: it becomes a capsule (spec 004 §8.1, -05 {#privacy});
        with its JSON text, encoded once."""
        return (await self.stage_state.get()).redactor.scrub_json(verdict)

    async def __aenter__(self) -> Gateway:
        await ensure_streams(self.js, self.subjects, duplicate_window_s=self.config.gateway.duplicate_window_s)
        self.rnc = await requests_connection(self.nc)
        await self.desk.start()
        for agent in self.config.agents:
            await ensure_agent_consumer(self.js, agent, prefix=self.subjects.prefix)
        if not self.config.agents:
            log.warning(OPEN_MODE_LINE)  # the one place it is said (pgwcore/config.py)
        try:
            for spec in GATEWAY_PARTS:
                module, _, attr = spec.partition(":")
                part = getattr(importlib.import_module(module), attr)(self)
                await self._stack.enter_async_context(part)
                self.parts.append(part)
            self._subs.append(await self.rnc.subscribe(self.subjects.all_principals("resolve"), queue=QUEUE, cb=self._on_resolve))
            self._subs.append(await self.rnc.subscribe(self.subjects.all_principals("pending"), queue=QUEUE, cb=self._on_pending))
            self._subs.append(await self.rnc.subscribe(self.subjects.all_agents("moment"), queue=QUEUE, cb=self._on_moment))
            await self.worker.start()
            await self.nc.flush()
            await self.rnc.flush()
            for part in self.parts:  # found by the services API only now that it serves (MetricsPart.ready)
                ready = getattr(part, "ready", None)
                if ready is not None:
                    await ready()
        except BaseException:
            # A part that fails at start (e.g. a bad configuration) must not leave
            # the parts started before it running (their tasks would outlive us).
            await self.drain()
            await self._stack.aclose()
            await self.desk.close()
            await self._release_requests()
            raise
        return self

    async def drain(self) -> None:
        """Stop taking work, finish in-flight work. Idempotent."""
        if self._drained:
            return
        self._drained = True
        for part in self.parts:
            leaving = getattr(part, "leaving", None)
            if leaving is not None:
                with contextlib.suppress(Exception):
                    await leaving()
        await self.worker.drain()
        for part in reversed(self.parts):
            try:
                await part.drain()
            except Exception:
                log.exception("part drain failed; continuing", part=type(part).__name__)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.drain()
        self._subs = []

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()
        await self._stack.aclose()
        await self.desk.close()
        await self._release_requests()

    async def _release_requests(self) -> None:
        rnc, self.rnc = self.rnc, self.nc
        await release_requests_connection(self.nc, rnc)

    async def traceparent(self, headers: Any) -> str | None:
        """The W3C ``traceparent`` of an inbound message's ``headers``, if well-formed and free of secrets
        (``pgwcore.tracing.accepted``); what every entry point carries on, logs and stores."""
        value = (headers or {}).get("traceparent")
        if value is None:
            return None
        return tracing.accepted(value, (await self.stage_state.get()).redactor)

    # -- principal.{p}.resolve -------------------------------------------
    async def _on_resolve(self, msg: Msg) -> None:
        if not self.responder.admits(msg):
            return
        reply = await self.handle_resolve(msg.subject, msg.data, await self.traceparent(msg.headers))
        await self.responder.answer(msg, _enc.encode(reply))

    async def handle_resolve(self, subject: str, data: bytes, traceparent: str | None = None) -> ResolveReply:
        structlog.contextvars.clear_contextvars()
        if traceparent:  # the surface's own trace, on every log line this answer causes
            structlog.contextvars.bind_contextvars(traceparent=traceparent)
        try:
            principal = self.subjects.parse(subject).token or ""
        except SubjectError:
            return ResolveReply(status="refused", code="invalid_subject", reason="not a resolve subject")
        try:
            req = resolve_request_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.info("resolution refused", principal=principal, code="invalid_resolution")
            return ResolveReply(status="refused", code="invalid_resolution", reason=str(e)[:300])
        except Exception:  # noqa: BLE001 - hostile input (e.g. recursion) must not kill the callback
            return ResolveReply(status="refused", code="invalid_resolution", reason="undecodable resolution")
        blank = blank_text(req.resolution)
        if blank is not None:
            log.info("resolution refused", principal=principal, code="invalid_resolution")
            return ResolveReply(status="refused", moment_id=req.moment_id, code="invalid_resolution",
                                reason=f"the answer's {blank} shows nothing (only white space or invisible characters)")
        try:
            # SR-1 covers the principal's own words too (docs/pipeline.md "SR-1 redaction"):
            # a free-text answer becomes the agent's outcome, the KV record and a digest.
            resolution = (await self.stage_state.get()).redactor.scrub_struct(req.resolution)
            reply = await self.desk.resolve(principal, req.moment_id, resolution)
        except Refused as r:
            reply = ResolveReply(status="refused", moment_id=req.moment_id, code=r.code, reason=r.reason)
        except Exception:
            log.exception("resolution failed", principal=principal, moment_id=req.moment_id)
            reply = ResolveReply(status="refused", moment_id=req.moment_id, code="engine_failure", reason="the gateway could not record the answer; try again")
        log.info("resolution", principal=principal, moment_id=req.moment_id, status=reply.status, code=reply.code)
        return reply

    # -- principal.{p}.pending -------------------------------------------
    async def _on_pending(self, msg: Msg) -> None:
        if not self.responder.admits(msg):
            return
        try:
            principal = self.subjects.parse(msg.subject).token or ""
            items = await self.desk.pending(principal)
        except Exception:
            log.exception("pending lookup failed", subject=msg.subject[:200])
            items = []
        await self.responder.answer(msg, pending_reply(items, self.nc.max_payload - PENDING_HEADROOM))

    # -- agent.{a}.moment --------------------------------------------------
    async def _on_moment(self, msg: Msg) -> None:
        if not self.responder.admits(msg):
            return
        reply = await self.handle_moment_query(msg.subject, msg.data)
        await self.responder.answer(msg, _enc.encode(reply))

    async def handle_moment_query(self, subject: str, data: bytes) -> MomentState:
        """The state of one of the agent's moments, and the outcome that closed it (subjects/momentquery.py);
        or, for ``list``, the agent's own moments, newest first (gateway/moment_list.py).

        The agent is the subject's token, which only that agent may publish on
        (DESIGN §7); another agent's moment is ``unknown``, like a missing one,
        and a list holds only the subject's agent's moments.
        """
        try:
            agent = self.subjects.parse(subject).token or ""
        except SubjectError:
            return MomentState("refused", refusal=Refusal("invalid_subject", "not a moment query subject"))
        try:
            query = moment_query_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return MomentState("refused", refusal=Refusal("invalid_query", str(e)[:300]))
        except Exception:  # noqa: BLE001 - hostile input (e.g. recursion) must not kill the callback
            return MomentState("refused", refusal=Refusal("invalid_query", "undecodable moment query"))
        if query.list_ is not None:
            try:
                moments, more = await list_moments(self.desk, agent, query.list_, limit=query.limit, principal=query.principal)
            except Exception:
                log.exception("moment list failed", agent=agent)
                return MomentState("refused", refusal=Refusal("engine_failure", "the gateway could not list the moments; try again"))
            return MomentState("listed", moments=moments, more=more)
        assert query.moment_id is not None  # MomentQuery.__post_init__: one of moment_id and list
        try:
            rec = await self.desk.find(agent, query.moment_id, query.principal)
        except Exception:
            log.exception("moment query failed", agent=agent, moment_id=query.moment_id)
            return MomentState("refused", query.moment_id, refusal=Refusal("engine_failure", "the gateway could not read the moment; try again"))
        if rec is None:
            return MomentState("unknown", query.moment_id)
        if rec.status == "pending":
            return MomentState("pending", query.moment_id)
        return MomentState("closed", query.moment_id, outcome=closing_outcome(rec))


async def wait_forever(stop: asyncio.Event) -> None:
    await stop.wait()


PENDING_HEADROOM = 4096  # of max_payload: the reply's own envelope and the server's protocol line


def pending_reply(items: list[Any], budget: int) -> bytes:
    """``PendingReply`` of ``items`` (oldest first) within ``budget`` bytes: all of them when they fit; else each
    agent's oldest in turn while they fit, in their order, and ``more``. One agent's many large moments made the
    reply larger than the server takes, so she got no answer and no surface could list any moment, another
    agent's included, for as long as they stayed (found by a docs-only attack)."""
    whole = _enc.encode(PendingReply(items=items))
    if len(whole) <= budget:
        return whole
    queues: dict[str, collections.deque[tuple[int, Any, int]]] = {}
    for i, item in enumerate(items):
        queues.setdefault(getattr(item, "agent", ""), collections.deque()).append((i, item, len(_enc.encode(item)) + 1))
    chosen: list[tuple[int, Any]] = []
    used = len(_enc.encode(PendingReply(items=[], more=True)))
    while queues:
        for agent in list(queues):
            i, item, size = queues[agent].popleft()
            if used + size <= budget:
                chosen.append((i, item))
                used += size
            if not queues[agent]:
                del queues[agent]
        if used >= budget:
            break
    chosen.sort(key=lambda c: c[0])
    return _enc.encode(PendingReply(items=[item for _, item in chosen], more=True))
