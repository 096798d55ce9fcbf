"""Thin async clients of the bus contract, over nats-py.

``Agent`` publishes envelopes and reads its outcomes; ``Surface`` reads a
principal's items and answers them. An agent or surface author needs nothing
but this module and a NATS connection.

    agent = await Agent.connect("planner", creds=".pgw/creds/agent-planner.creds")
    decision = await agent.approve("alice", "send the Q3 invoice")   # -> Decision
    res = await agent.ask("alice", moment, timeout=600)              # -> ResolutionOutcome

    surface = Surface(nc, "alice")
    async for item in surface.items():             # pending first, then live
        await surface.resolve(item.moment_id, OptionChoice(index=0))
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from subjects.approval import Decision, approval_moment, decision_of
from subjects.approvals import (
    ApprovalsReply,
    ApprovalsRequest,
    approvals_reply_decoder,
    approvals_subject,
)
from subjects.creds import connect_options
from subjects.errors import NoConnectionError, RefusedError
from subjects.idp import canonical_id
from subjects.momentquery import (
    ListWhich,
    MomentQuery,
    MomentState,
    MomentSummary,
    moment_state_decoder,
)
from subjects.names import Subjects, agent_token, principal_token
from subjects.util import now_rfc3339
from subjects.wire import (
    BindingMoment,
    BindingMomentItem,
    ClarificationItem,
    DialogueVeto,
    EnvelopeOutcome,
    FreeTextAnswer,
    NoticeItem,
    OptionChoice,
    Outcome,
    PendingReply,
    Resolution,
    ResolutionOutcome,
    ResolveReply,
    ResolveRequest,
    SurfaceItem,
    WithdrawnItem,
    outcome_decoder,
    pending_reply_decoder,
    resolve_reply_decoder,
    surface_item_decoder,
)

_enc = msgspec.json.Encoder()
OUTBOUND_STREAM = "PGW_OUTBOUND"
PRINCIPAL_HEADER = "Pgw-Principal"  # names a clarification's principal (issue 15; docs/pipeline.md)
BINDING_MOMENT_KIND = "vendor.pgw.binding_moment"
DEFAULT_URL = "nats://127.0.0.1:4222"  # where `pgw up` serves
# How long past its expiry an ask waits for the gateway's word on it (the moment_expired
# outcome) before it gives up with TimeoutError: the gateway's clock ends a question, not ours.
EXPIRY_GRACE_S = 10.0


def outcome_durable(agent: str) -> str:
    """Name of the durable consumer that carries ``agent``'s outcomes."""
    return f"outcome-{agent_token(agent)}"


async def ensure_agent_consumer(js: JetStreamContext, agent: str, *, prefix: str = "pgw") -> str:
    """Create (idempotently) the durable consumer an agent pulls its outcomes from.

    The gateway pre-creates it, so an agent needs no right to create consumers
    (DESIGN §7, nats-server #3202).
    """
    durable = outcome_durable(agent)
    await ensure_pull_durable(js, OUTBOUND_STREAM, durable, Subjects(prefix).outcome(agent))
    return durable


async def ensure_pull_durable(js: JetStreamContext, stream: str, durable: str, filter_subject: str) -> None:
    """Create (idempotently) a durable pull consumer on one subject that a party may only pull from."""
    await js.add_consumer(
        stream,
        ConsumerConfig(
            durable_name=durable,
            filter_subject=filter_subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=30,
        ),
    )


def envelope(
    type: str,
    payload: Any,
    *,
    envelope_id: str | None = None,
    correlation_id: str | None = None,
    content_trust: str | None = None,
    node_id: str | None = None,
    source: str = "ai-generation",
    **meta: Any,
) -> dict[str, Any]:
    """Build a spec 002 AI Envelope as a plain dict."""
    eid = envelope_id or uuid.uuid4().hex
    m: dict[str, Any] = {"source": source, "ts": now_rfc3339(), **meta}
    if content_trust:
        m["contentTrust"] = content_trust
    env: dict[str, Any] = {
        "type": type,
        "envelopeId": eid,
        "correlationId": correlation_id or eid,
        "payload": payload,
        "meta": m,
    }
    if node_id:
        env["nodeId"] = node_id
    return env


class Agent:
    """An agent runtime's side of the bus."""

    def __init__(
        self, nc: Client, agent: str, *, prefix: str = "pgw", request_timeout: float = 5.0, recheck_every: float = 30.0
    ) -> None:
        self.nc = nc
        self.agent = agent_token(agent)
        self.subjects = Subjects(prefix)
        self.js = nc.jetstream()
        self._sub: Any = None
        self._pump: asyncio.Task[None] | None = None
        self._shutting_down = False  # close() in progress: the pump stops even if a cancel is swallowed (below)
        self._waiters: list[tuple[Any, asyncio.Future[Outcome]]] = []
        self._unclaimed: asyncio.Queue[Outcome] = asyncio.Queue()
        self._sent: dict[str, None] = {}  # msg ids published by this process (DESIGN §7)
        self._finals: dict[str, None] = {}  # moments whose final outcome a wait has had
        self.request_timeout = request_timeout  # the moment query's
        self.recheck_every = recheck_every  # seconds between moment queries while a wait goes on
        self._owns_connection = False  # made by connect(): close() closes it too

    @classmethod
    async def connect(
        cls, agent: str, *, creds: str | os.PathLike[str] | None = None, url: str | None = None, **kw: Any
    ) -> Agent:
        """Agent ``agent`` on a NATS connection of its own, which :meth:`close` closes.

        ``url``: default ``$NATS_URL``, else ``nats://127.0.0.1:4222``. ``creds``: the agent's
        credentials file as ``pgw up`` and ``pgw creds`` write it (``{data}/creds/agent-NAME.creds``),
        or a JWT ``.creds`` file; the connection replies on the agent's own inbox
        (subjects/creds.py). A file of another party is refused before connecting.
        Other keywords go to ``Agent(...)``. No server, or credentials the server refuses:
        NoConnectionError at once, saying which (never a retry loop); once connected, the
        connection reconnects by itself.
        """
        import nats

        url = url or os.environ.get("NATS_URL") or DEFAULT_URL
        opts: dict[str, Any] = {"name": f"agent-{agent}", "error_cb": _connection_error}
        if creds is not None:
            opts.update(connect_options(creds, "agent", agent_token(agent)))
        try:  # one attempt first: nats-py would retry a refusal for minutes, printing each
            probe = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=1, **opts)
        except Exception as e:  # noqa: BLE001 - said in one line, with what to do
            auth = "authorization" in str(e).lower()
            why = f"{type(e).__name__}: {e}"
            if auth:
                why += (f"; the server wants agent {agent}'s own credentials: Agent.connect({agent!r}, "
                        f"creds='.pgw/creds/agent-{agent}.creds')" if creds is None else
                        f"; the server does not take {creds} (is agent {agent} configured, and the server "
                        "restarted since its credentials were made?)")
            raise NoConnectionError(url, why, auth=auth) from None
        await probe.close()
        self = cls(await nats.connect(url, **opts), agent, **kw)
        self._owns_connection = True
        return self

    async def send(self, body: dict[str, Any] | list[dict[str, Any]], *, principal: str | None = None) -> str:
        """Publish one envelope (or a turn: a list of them); return the (first) envelope id.

        ``principal`` names the principal a ``clarification.request`` is for, in the
        ``Pgw-Principal`` header (the official EnvelopeMeta is closed; ``meta.pgw.principal``
        is deprecated).
        """
        first = body[0] if isinstance(body, list) else body
        eid = str(first["envelopeId"])
        subject, data, mid = self.subjects.envelope(self.agent), _enc.encode(body), f"{self.agent}:{eid}"
        extra = {PRINCIPAL_HEADER: principal_token(principal)} if principal is not None else {}
        retry = mid in self._sent  # our own earlier attempt may be the stored one
        self._sent[mid] = None
        if len(self._sent) > 10_000:
            self._sent.pop(next(iter(self._sent)))
        ack = await self.js.publish(subject, data, headers={"Nats-Msg-Id": mid, **extra})
        if ack.duplicate and not retry:
            # DESIGN §7: someone pre-used our id to get this envelope dropped;
            # re-send under an unguessable id (gateway dedup absorbs a true repeat).
            await self.js.publish(subject, data, headers={"Nats-Msg-Id": f"{mid}:{uuid.uuid4().hex}", **extra})
        return eid

    async def send_moment(
        self,
        principal: str,
        moment: BindingMoment | dict[str, Any],
        *,
        expires_in_s: int | None = None,
        conventional: Any = None,
        **env_kw: Any,
    ) -> str:
        payload: dict[str, Any] = {
            "principal": principal_token(principal),
            "binding_moment": msgspec.to_builtins(moment),
        }
        if expires_in_s is not None:
            payload["expires_in_s"] = expires_in_s
        if conventional is not None:
            payload["conventional"] = conventional
        return await self.send(envelope(BINDING_MOMENT_KIND, payload, **env_kw))

    async def ask(
        self,
        principal: str,
        moment: BindingMoment | dict[str, Any],
        *,
        timeout: float | None = None,
        expires_in_s: int | None = None,
        **kw: Any,
    ) -> ResolutionOutcome:
        """Send a binding moment and wait for the principal's resolution.

        ``timeout`` (seconds) is how long the principal has to answer: it is the moment's
        expiry (``expires_in_s``, rounded up to whole seconds), so a question nobody
        answers in time is withdrawn from every surface of the principal (a
        ``withdrawn`` item, reason ``expired``), and the call raises RefusedError
        ``expired``. The wait ends with the gateway's word on the expiry, or
        ``EXPIRY_GRACE_S`` after it at the latest (TimeoutError). An explicit
        ``expires_in_s`` sets the expiry instead, and ``timeout`` is then only this
        call's wait. Neither: the moment stays open until answered, and the call waits.

        Raises RefusedError if the gateway refuses the moment or it expires.
        """
        if timeout is not None and expires_in_s is None:
            expires_in_s = max(1, math.ceil(timeout))
            timeout = expires_in_s + EXPIRY_GRACE_S
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        await self._ensure_pump()
        eid = kw.get("envelope_id") or uuid.uuid4().hex
        kw["envelope_id"] = eid
        accepted = self._expect(lambda o: isinstance(o, EnvelopeOutcome) and o.envelope_id == eid)
        await self.send_moment(principal, moment, expires_in_s=expires_in_s, **kw)
        out = await asyncio.wait_for(accepted, _left(deadline))
        assert isinstance(out, EnvelopeOutcome)
        if out.status != "accepted" or not out.moment_id:
            raise RefusedError(out.code or out.status, out.reason or "refused")
        return await self.resolution_for(out.moment_id, principal=principal, timeout=_left(deadline))

    async def approve(
        self,
        principal: str,
        action: str,
        findings: list[str] | None = None,
        *,
        recommend: Literal["approve", "reject"] = "approve",
        timeout: float | None = None,
        **kw: Any,
    ) -> Decision:
        """Ask ``principal`` yes or no: may the agent do ``action`` ("send the Q3 invoice to ACME")?

        The moment is spec 000's two-option case (subjects/approval.py): ``Approve`` /
        ``Reject``, ``findings`` as its facts, the agent's lean ``recommend``, both hatches
        open. The answer is a :class:`Decision` of the same kinds as every other way to
        ask: ``approve``, ``reject``, ``free_text`` (the principal's own words, in
        ``text``), ``dialogue`` (the question itself rejected, the objection in
        ``text``), or ``expired`` once ``timeout`` seconds pass unanswered (the moment is
        then withdrawn from her surfaces). Only ``approve`` is a consent
        (``decision.approved``). Other keywords go to :meth:`ask`; RefusedError if the
        gateway refuses the question.
        """
        moment = approval_moment(action, list(findings or []), recommend=recommend)
        return await self.decide(principal, moment, timeout=timeout, **kw)

    async def decide(self, principal: str, moment: BindingMoment, **kw: Any) -> Decision:
        """:meth:`ask` with a yes/no moment of subjects/approval.py (a framework's own wording of
        one): the answer as a :class:`Decision`, an expiry as ``Decision("expired")``."""
        try:
            res = await self.ask(principal, moment, **kw)
        except RefusedError as e:
            if e.code == "expired":
                return decision_of(None)
            raise
        return decision_of(res)

    async def final_outcome(self, moment_id: str, *, principal: str | None = None, timeout: float | None = None) -> Outcome:
        """The outcome that closes ``moment_id``: the principal's resolution, or its expiry.

        Asks the gateway first (``agent.{agent}.moment``, subjects/momentquery.py), so an
        answer this agent's durable consumer already handed out (to a process that died
        before acting on it, or to a sibling process of the same agent) is not waited for
        in vain; then waits on the consumer, asking again every ``recheck_every`` seconds.
        ``principal`` (whom the moment went to) saves the gateway a lookup. Raises
        RefusedError ``unknown_moment`` when the gateway knows no such moment of this agent.
        """
        await self._ensure_pump()
        fut = self._expect(lambda o: getattr(o, "moment_id", None) == moment_id and not isinstance(o, EnvelopeOutcome))
        try:
            return await asyncio.wait_for(self._closing(fut, moment_id, principal), timeout)
        finally:
            if not fut.done():
                fut.cancel()  # the pump drops cancelled waiters

    async def _closing(self, fut: asyncio.Future[Outcome], moment_id: str, principal: str | None) -> Outcome:
        while True:
            state = None if fut.done() else await self._query(moment_id, principal)
            if fut.done():
                break
            if state is not None and state.status == "closed" and state.outcome is not None:
                self._settled(moment_id)
                return state.outcome
            if state is not None and state.status == "unknown":
                raise RefusedError("unknown_moment", f"the gateway knows no moment {moment_id} of agent {self.agent}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(fut), self.recheck_every)
                break
        self._settled(moment_id, drop_copies=False)
        return fut.result()

    async def _query(self, moment_id: str, principal: str | None) -> MomentState | None:
        """The gateway's answer to the moment query; None when no gateway answers it, the bus is reconnecting,
        or the gateway could not read the moment this time (then the consumer decides, and the next recheck
        asks again)."""
        try:
            return await self.moment_state(moment_id, principal=principal)
        except (NatsError, TimeoutError, RefusedError):  # no responders, timeouts, a reconnecting connection
            return None

    async def moment_state(self, moment_id: str, *, principal: str | None = None) -> MomentState:
        """Ask the gateway for the state of this agent's moment ``moment_id`` (subjects/momentquery.py).

        ``closed`` carries the outcome that closed it, the same message the
        outcome subject carried. RefusedError if the gateway refuses the query.
        """
        return await self._moment_request(MomentQuery(moment_id=moment_id, principal=principal_token(principal) if principal is not None else None))

    async def list_moments(self, which: ListWhich = "open", *, limit: int | None = None, principal: str | None = None) -> MomentState:
        """This agent's own moments, newest first: ``open`` (pending), ``closed`` or ``all``; at most ``limit``
        (default 20, at most 50). The reply's ``moments`` and ``more`` (there are more than were returned)."""
        query = MomentQuery(list_=which, limit=limit, principal=principal_token(principal) if principal is not None else None)
        return await self._moment_request(query)

    async def open_moments(self, *, limit: int | None = None, principal: str | None = None) -> list[MomentSummary]:
        """This agent's moments still awaiting their principal, newest first: the ids to wait on again
        (``final_outcome``) after a restart lost track of them."""
        return list((await self.list_moments("open", limit=limit, principal=principal)).moments or [])

    async def _moment_request(self, query: MomentQuery) -> MomentState:
        msg = await self.nc.request(self.subjects.moment(self.agent), _enc.encode(query), timeout=self.request_timeout)
        state = moment_state_decoder.decode(msg.data)
        if state.status == "refused":
            refusal = state.refusal
            raise RefusedError(refusal.code if refusal else "refused", refusal.reason if refusal else "the gateway refused the query")
        return state

    def _settled(self, moment_id: str, *, drop_copies: bool = True) -> None:
        """Remember a moment whose final outcome was handed out, so a late copy is not left unclaimed."""
        self._finals[moment_id] = None
        if len(self._finals) > 10_000:
            self._finals.pop(next(iter(self._finals)))
        if not drop_copies:
            return
        kept = [o for o in self._drain_unclaimed() if getattr(o, "moment_id", None) != moment_id or isinstance(o, EnvelopeOutcome)]
        for o in kept:
            self._unclaimed.put_nowait(o)

    def _drain_unclaimed(self) -> list[Outcome]:
        out: list[Outcome] = []
        while not self._unclaimed.empty():
            out.append(self._unclaimed.get_nowait())
        return out

    async def resolution_for(self, moment_id: str, *, principal: str | None = None, timeout: float | None = None) -> ResolutionOutcome:
        """Wait for the principal's answer to ``moment_id``; RefusedError if it expires."""
        final = await self.final_outcome(moment_id, principal=principal, timeout=timeout)
        if not isinstance(final, ResolutionOutcome):
            raise RefusedError("expired", "the moment expired before the principal answered")
        return final

    async def outcome_for(self, envelope_id: str, timeout: float | None = None) -> EnvelopeOutcome:
        """Wait for the envelope outcome of ``envelope_id``."""
        await self._ensure_pump()
        out = await asyncio.wait_for(
            self._expect(lambda o: isinstance(o, EnvelopeOutcome) and o.envelope_id == envelope_id), timeout
        )
        assert isinstance(out, EnvelopeOutcome)
        return out

    async def act(
        self, mandate: str, action: str, idp: Any, arguments: dict[str, Any] | None = None, *,
        resource: str | None = None, timeout: float = 30.0,
    ) -> Any:
        """A gated action through the kernel (``subjects/gate.py``, docs/gate.md): the IDP and the
        arguments in one request on ``agent.{agent}.act``; returns the ``ActResult`` (``ActDone``,
        ``ActDispatched``, or the kernel's ``Reject`` / ``EnrichedDeny`` / ``HemPending``).
        After ``HemPending`` or ``ActDispatched`` the result comes by ``action_result``."""
        from subjects.gate import ActRequest, act_result_decoder

        req = ActRequest(mandate=mandate, action=action, idp=idp, arguments=arguments or {}, resource=resource)
        msg = await self.nc.request(self.subjects.act(self.agent), _enc.encode(req), timeout=timeout)
        return act_result_decoder.decode(msg.data)

    async def action_result(self, idp_id: str, timeout: float | None = None) -> Any:
        """Wait for the ``action_result`` outcome of a gated action (``subjects.wire.ActionResult``)."""
        from subjects.wire import ActionResult

        await self._ensure_pump()
        return await asyncio.wait_for(
            self._expect(lambda o: isinstance(o, ActionResult) and canonical_id(o.idp_id) == canonical_id(idp_id)), timeout
        )

    async def outcomes(self) -> AsyncIterator[Outcome]:
        """Every outcome no ``ask``/``outcome_for`` call is waiting for, in order."""
        await self._ensure_pump()
        while True:
            yield await self._unclaimed.get()

    def _expect(self, pred: Any) -> asyncio.Future[Outcome]:
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        # Something already pulled but unclaimed may be the one.
        kept: list[Outcome] = []
        while not self._unclaimed.empty():
            o = self._unclaimed.get_nowait()
            if not fut.done() and pred(o):
                fut.set_result(o)
            else:
                kept.append(o)
        for o in kept:
            self._unclaimed.put_nowait(o)
        if not fut.done():
            self._waiters.append((pred, fut))
        return fut

    async def _ensure_pump(self) -> None:
        if self._pump is not None:
            return
        durable = outcome_durable(self.agent)
        # pull_subscribe_bind does not check that the consumer exists: ask first.
        # The gateway creates it for configured agents (and the other agent
        # parties); an agent the configuration does not name (open mode, no
        # authentication) creates it itself. The stream keeps every outcome, so
        # a consumer created after the first envelope still delivers them all.
        try:
            await self.js.consumer_info(OUTBOUND_STREAM, durable)
        except NotFoundError:
            await ensure_agent_consumer(self.js, self.agent, prefix=self.subjects.prefix)
        self._sub = await self.js.pull_subscribe_bind(durable, OUTBOUND_STREAM)
        self._shutting_down = False
        self._pump = asyncio.create_task(self._run_pump(), name=f"agent-{self.agent}-outcomes")

    async def _run_pump(self) -> None:
        # Not `while True`: on Python 3.11 a cancel that lands as a fetch's own timeout fires is
        # turned into TimeoutError by asyncio.wait_for and lost, and the loop would go on for ever.
        while not self._shutting_down:
            try:
                msgs = await self._sub.fetch(64, timeout=1.0)
            except (NatsTimeout, TimeoutError):
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    # The cancel that wait_for turned into its timeout (above): a program that ends without
                    # close() cancels this task at exit, and it went on fetching, so the program never ended.
                    raise asyncio.CancelledError from None
                continue
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - reconnecting; try again
                if self.nc.is_closed:
                    return  # closed for good: nothing to wait for
                await asyncio.sleep(0.2)
                continue
            for m in msgs:
                try:
                    out = outcome_decoder.decode(m.data)
                except (msgspec.DecodeError, UnicodeDecodeError):  # msgspec raises the latter for bad UTF-8 keys
                    await m.term()
                    continue
                claimed = False
                for pred, fut in self._waiters:
                    if not fut.done() and pred(out):
                        fut.set_result(out)  # every wait on it: two waits on one moment both end
                        claimed = True
                mid = None if isinstance(out, EnvelopeOutcome) else getattr(out, "moment_id", None)
                if claimed and mid is not None:
                    self._settled(mid, drop_copies=False)  # _expect took any earlier copy already
                elif not claimed and mid not in self._finals:  # a late copy of a final already handed out is dropped
                    self._unclaimed.put_nowait(out)
                # Acked on reading: an answer read and then lost with this process is asked of the gateway
                # again by the next final_outcome (the moment query), so nothing is lost on a restart.
                await m.ack()
            self._waiters = [(p, f) for p, f in self._waiters if not f.done()]

    async def close(self) -> None:
        self._shutting_down = True
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
            self._pump = None
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        if self._owns_connection and not self.nc.is_closed:
            await self.nc.drain()


async def _connection_error(e: Exception) -> None:
    """A connection of ``Agent.connect`` losing its server: it reconnects, quietly (nats-py would print
    a traceback for each attempt); what the agent is waiting for fails or times out on its own."""


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (a loop time), None for no deadline; never below zero."""
    return None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())


PRESENCE_TTL_S = 30  # docs/notifications.md: sent on open, every ttl_s/3 s, ttl_s 0 on close


class Presence:
    """Tells the notifier a surface of the principal is open (issue 17, docs/notifications.md).

    Publishes ``{"instance", "surface", "ttl_s"}`` on ``principal.P.presence`` at
    start and every ``ttl_s / 3`` seconds; :meth:`stop` sends ``ttl_s: 0`` (gone).
    While any surface of P is present the notifier sends P no notification.
    Core NATS, best effort: a lost message only means one interval without presence.
    """

    def __init__(self, nc: Client, principal: str, *, surface: str = "terminal", prefix: str = "pgw",
                 ttl_s: int = PRESENCE_TTL_S) -> None:
        if not isinstance(ttl_s, int) or not 3 <= ttl_s <= 3600:
            raise ValueError(f"presence ttl_s must be an integer from 3 to 3600, not {ttl_s!r}")
        self.nc = nc
        self.subject = Subjects(prefix).presence(principal)
        self.surface = surface
        self.ttl_s = ttl_s
        self.instance = uuid.uuid4().hex
        self._task: asyncio.Task[None] | None = None

    async def _send(self, ttl_s: int) -> None:
        body = _enc.encode({"instance": self.instance, "surface": self.surface, "ttl_s": ttl_s})
        await self.nc.publish(self.subject, body)

    async def start(self) -> None:
        """Announce the surface and keep it announced until :meth:`stop`."""
        if self._task is not None:
            return
        await self._send(self.ttl_s)
        await self.nc.flush()
        self._task = asyncio.create_task(self._keep_alive(), name="pgw-presence")

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            with contextlib.suppress(Exception):  # reconnecting: the next beat will do
                await self._send(self.ttl_s)

    async def stop(self) -> None:
        """Say the surface is gone (``ttl_s: 0``) and stop the heartbeat. Idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(Exception):
            await self._send(0)
            await self.nc.flush()

    async def __aenter__(self) -> Presence:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def item_key(item: SurfaceItem) -> str:
    return getattr(item, "moment_id", None) or getattr(item, "item_id", "")


class Surface:
    """A principal's surface: read items, answer moments."""

    def __init__(self, nc: Client, principal: str, *, prefix: str = "pgw", timeout: float = 10.0,
                 surface: str = "terminal", presence: bool = True) -> None:
        self.nc = nc
        self.principal = principal_token(principal)
        self.subjects = Subjects(prefix)
        self.timeout = timeout
        # While items() runs, the notifier knows this surface is open and stays quiet (issue 17).
        self.presence = Presence(nc, self.principal, surface=surface, prefix=prefix) if presence else None

    async def close(self) -> None:
        """Stop announcing presence (sends ``ttl_s: 0``). Idempotent."""
        if self.presence is not None:
            await self.presence.stop()

    async def _request(self, subject: str, body: bytes) -> Any:
        """A request to the gateway, asked again while nobody is there to take it (the server says so at
        once: a gateway starting, or its answering connection reconnecting after a server restart), up
        to ``timeout`` in all; a request somebody took is never sent twice."""
        deadline = asyncio.get_running_loop().time() + self.timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            try:
                return await self.nc.request(subject, body, timeout=max(left, 0.1))
            except NoRespondersError:
                if left <= 0.2:
                    raise
                await asyncio.sleep(0.1)  # nobody subscribed yet: no event to await but the gateway's return

    async def pending(self) -> list[SurfaceItem]:
        """Items still awaiting this principal (also those sent while it was offline); a part of them when
        there are more than one reply holds (:meth:`pending_reply` says so)."""
        return list((await self.pending_reply()).items)

    async def pending_reply(self) -> PendingReply:
        """The gateway's pending reply: ``items``, and ``more`` when they are a part of the list."""
        msg = await self._request(self.subjects.pending(self.principal), b"{}")
        return pending_reply_decoder.decode(msg.data)

    async def items(self) -> AsyncIterator[SurfaceItem]:
        """Pending items first, then live ones; each item once; ``withdrawn`` as it happens."""
        queue: asyncio.Queue[SurfaceItem] = asyncio.Queue()

        async def on_msg(msg: Any) -> None:
            try:
                queue.put_nowait(surface_item_decoder.decode(msg.data))
            except (msgspec.DecodeError, UnicodeDecodeError) as e:  # bad UTF-8 keys raise the latter
                # spec 000 §9.3: what cannot be rendered falls back to a notice,
                # never to a partial decision and never to silence.
                queue.put_nowait(
                    NoticeItem(
                        agent="unknown",
                        principal=self.principal,
                        created_at=now_rfc3339(),
                        untrusted=True,
                        item_id=hashlib.sha256(msg.data).hexdigest()[:32],
                        envelope_id="",
                        diagnostic=f"this surface could not read an item: {str(e)[:200]}",
                        conventional=msg.data[:4096].decode("utf-8", "replace"),
                    )
                )

        sub = await self.nc.subscribe(self.subjects.surface(self.principal), cb=on_msg)
        await self.nc.flush()
        if self.presence is not None:
            await self.presence.start()
        seen: set[str] = set()
        withdrawn: set[str] = set()
        try:
            for item in await self.pending():
                seen.add(item_key(item))
                yield item
            while True:
                item = await queue.get()
                key = item_key(item)
                if isinstance(item, WithdrawnItem):
                    if key in withdrawn:
                        continue
                    withdrawn.add(key)
                elif key in seen or key in withdrawn:
                    continue
                seen.add(key)
                yield item
        finally:
            await self.close()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def resolve(self, moment_id: str, resolution: Resolution) -> ResolveReply:
        """Answer a moment; the reply says accepted, or why refused."""
        body = _enc.encode(ResolveRequest(moment_id=moment_id, resolution=resolution))
        msg = await self._request(self.subjects.resolve(self.principal), body)
        return resolve_reply_decoder.decode(msg.data)

    async def choose(self, item: BindingMomentItem, index: int) -> ResolveReply:
        return await self.resolve(item.moment_id, OptionChoice(index=index))

    async def answer(self, item: BindingMomentItem, text: str) -> ResolveReply:
        return await self.resolve(item.moment_id, FreeTextAnswer(text=text))

    async def reject_question(self, item: BindingMomentItem, objection: str | None = None) -> ResolveReply:
        return await self.resolve(item.moment_id, DialogueVeto(objection=objection))

    async def approvals(self, revoke: str | None = None) -> ApprovalsReply:
        """Her live standing approvals (docs/gate.md "Standing approvals"), or ``revoke`` the one of that scope_id."""
        req = ApprovalsRequest(op="revoke", scope_id=revoke) if revoke else ApprovalsRequest(op="list")
        msg = await self.nc.request(approvals_subject(self.subjects.prefix, self.principal), _enc.encode(req),
                                    timeout=self.timeout)
        return approvals_reply_decoder.decode(msg.data)


__all__ = [
    "Agent",
    "BindingMomentItem",
    "ClarificationItem",
    "Decision",
    "Presence",
    "Surface",
    "ensure_agent_consumer",
    "envelope",
    "outcome_durable",
]
