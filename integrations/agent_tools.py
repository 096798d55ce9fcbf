"""What the MCP tools do, without MCP: the agent's side of the gateway as plain calls.

Each call takes the tool's arguments (a JSON object) and returns a
``ToolAnswer``: a JSON-able body and whether it is a tool error the model
should act on. Nothing here raises on bad input: a malformed argument, a
gateway refusal and a kernel REJECT are answers, never crashes of the server.

The waits are ``subjects.client.Agent``'s: outcomes come from the agent's
durable consumer on ``PGW_OUTBOUND``, and every wait first asks the gateway
for the moment's state (``agent.{agent}.moment``), so a resolution that
arrived while this process was down, or that an earlier process of this
server read and died with, is returned by ``await_moment`` after a restart.

Two more things make a restart lose nothing (docs/integrations.md "Restart
guarantees"): ``ask_principal`` and ``clarify`` take an optional idempotency
key, ``request_key``, which becomes the envelope's ``correlationId`` (as the
LangGraph and Agents SDK integrations derive theirs), so the same call made
again, after a restart too, is answered by the gateway's dedup (stage 8,
spec 002 "Replay determinism") with the same moment instead of a second one;
and ``list_moments`` gives a host that lost track of a moment its id.
Without a key nothing is derived from the call's content: a person may
rightly be asked the same question twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from subjects.client import Agent, envelope
from subjects.constraints import MAX_LIST_ITEMS, HexId
from subjects.errors import PgwError, RefusedError
from subjects.idp import (
    HemPending,
    IdpStandard,
    IdpThin,
    Reject,
    TransitionReport,
    TransitionRequest,
    kernel_result_decoder,
)
from subjects.momentquery import DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT
from subjects.names import principal_token
from subjects.util import stable_id
from subjects.wire import (
    BindingMomentPayload,
    ClarificationAnswers,
    ClarificationQuestion,
    DialogueVeto,
    EnvelopeOutcome,
    FreeTextAnswer,
    HemDecision,
    MomentExpired,
    OptionChoice,
    Outcome,
    ResolutionOutcome,
)

Principal = Annotated[str, Meta(min_length=1, max_length=65, description="principal handle: alice or ~alice")]
RequestKey = Annotated[str, Meta(
    min_length=1, max_length=200,
    description="idempotency key: the same key asks the same moment again (after a restart too) and returns its "
                "answer instead of asking a second time; a new question needs a new key",
)]
# A progress callback: (elapsed seconds, message). The MCP layer turns it into a progress notification.
Progress = Callable[[float, str], Awaitable[None]]


class AskPrincipalArgs(BindingMomentPayload):
    """Arguments of ``ask_principal``: the ``vendor.pgw.binding_moment`` payload plus an optional idempotency key."""

    request_key: RequestKey | None = None


class ClarifyArgs(Struct, forbid_unknown_fields=True):
    """Arguments of ``clarify``: spec 002 ``clarification.request`` plus the principal it is for."""

    principal: Principal
    questions: Annotated[list[ClarificationQuestion], Meta(min_length=1, max_length=MAX_LIST_ITEMS)]
    contextType: Annotated[str, Meta(max_length=128)] | None = None  # noqa: N815 - spec 002's own name
    request_key: RequestKey | None = None


class ListMomentsArgs(Struct, forbid_unknown_fields=True):
    """Arguments of ``list_moments``: which of the agent's moments, how many (the moment query's list form)."""

    which: Literal["open", "closed", "all"] = "open"
    limit: Annotated[int, Meta(ge=1, le=MAX_LIST_LIMIT)] = DEFAULT_LIST_LIMIT


class DeclareIntentArgs(Struct, forbid_unknown_fields=True):
    """Arguments of ``declare_intent``: the kernel.transition() call of spec 003 §5.1."""

    mandate: Annotated[str, Meta(min_length=1, description="the mandate (JWT) the agent acts under")]
    idp: dict[str, Any]  # IdpStandard or IdpThin, chosen by ``profile`` (spec 003 §7): see input_schema
    action: str | None = None
    resource: str | None = None
    wait_for_decision: bool = True  # on HEM_PENDING, wait for the principal's decision


class AwaitMomentArgs(Struct, forbid_unknown_fields=True):
    """Arguments of ``await_moment``: a moment an earlier call left open."""

    moment_id: HexId


# Tool name -> (argument Struct, description). The input schemas come from these Structs.
TOOLS: dict[str, tuple[type[Struct], str]] = {
    "ask_principal": (
        AskPrincipalArgs,
        "Ask your principal a binding moment (spec 000: synopsis, findings, recommendations, offer, "
        "a question with 2-4 options each with label and reasoning, recommended_idx, both hatches) and "
        "wait for the answer. The result says which of the three kinds the principal chose: an option "
        "(index and label), free text (they revise the answer), or dialogue (they reject the question). "
        "No answer before expires_in_s is status 'expired': treat it as a refusal, never as consent. "
        "A malformed moment comes back as an error listing every rule it breaks; fix them and ask again. "
        "Give a request_key (any string unique to this question) so that asking again after an interruption "
        "returns this moment's answer instead of asking the principal a second time.",
    ),
    "clarify": (
        ClarifyArgs,
        "Ask your principal clarification questions (spec 002 clarification.request); returns their "
        "answers keyed by question id, or status 'expired'. request_key: as for ask_principal.",
    ),
    "declare_intent": (
        DeclareIntentArgs,
        "Declare an intent (spec 003 IDP) before acting. Returns PERMIT (go ahead, then call "
        "report_transition), an Enriched DENY (deny_code, available_actions, suggested_paths), a REJECT "
        "with its code (the declaration is malformed: an error), or HEM_PENDING followed by the "
        "principal's decision (approve, deny, free_text, dialogue or expired).",
    ),
    "report_transition": (
        TransitionReport,
        "After acting on a PERMIT, report what you executed: idp_id, executed_action and the effect "
        "(type, status, ...). The kernel checks it against what you declared.",
    ),
    "await_moment": (
        AwaitMomentArgs,
        "Wait again for the answer to a moment an interrupted ask_principal or clarify left open "
        "(its moment_id is in the progress messages and in list_moments); a closed one returns its answer at once.",
    ),
    "list_moments": (
        ListMomentsArgs,
        "List your own moments, newest first: 'open' (still awaiting the principal), 'closed' (answered or "
        "expired) or 'all', each with moment_id, principal, kind, status, synopsis and times. After an "
        "interruption, find the moment you were waiting for here and call await_moment with its moment_id.",
    ),
}


# Tools that may put a binding moment before the principal (spec 000 §8.2: a tool that may emit one
# SHOULD say so in tools/list, RECOMMENDED name ``emits_binding_moment``): ask_principal sends one,
# declare_intent may be escalated to the gateway's own human-escalation moment (HEM, spec 003).
EMITS_BINDING_MOMENT = frozenset({"ask_principal", "declare_intent"})

# spec 000 §6.8: "Both members SHALL default to true", while §5 and §6.8 also call them REQUIRED.
# Read together (docs/conformance.md): the wire envelope must carry both (an explicit false is the
# only suppression, and it is recorded, §12.3); the authoring tool applies the default, so a model
# that leaves a hatch out asks with it open.
HATCH_DEFAULTS = {"free_text": True, "dialogue": True}


def with_hatch_defaults(args: dict[str, Any]) -> dict[str, Any]:
    """``ask_principal``'s arguments with an omitted hatch (or ``hatches``) filled in as true (spec 000 §6.8)."""
    bm = args.get("binding_moment")
    question = bm.get("question") if isinstance(bm, dict) else None
    if not isinstance(question, dict):
        return args  # malformed: the gateway lists what is wrong
    hatches = question.get("hatches", {})
    if not isinstance(hatches, dict):
        return args
    filled = {**HATCH_DEFAULTS, **hatches}
    if filled == hatches:
        return args
    return {**args, "binding_moment": {**bm, "question": {**question, "hatches": filled}}}


def input_schema(struct: type[Struct]) -> dict[str, Any]:
    """The Struct's JSON Schema with the Struct itself at the top (MCP wants ``type: object`` there)."""
    schema = msgspec.json.schema(struct)
    defs = dict(schema.get("$defs", {}))
    top = defs.pop(struct.__name__)
    if struct is AskPrincipalArgs:
        # spec 000 §6.8 default (see HATCH_DEFAULTS): optional here, true when left out.
        hatches = defs["Hatches"]
        hatches.pop("required", None)
        for name in HATCH_DEFAULTS:
            hatches["properties"][name]["default"] = True
        hatches["description"] = ("spec 000 §6.8 escape hatches; each defaults to true when omitted. Set one to "
                                  "false only where that revision is genuinely inapplicable (it is recorded).")
        defs["Question"]["required"] = [r for r in defs["Question"].get("required", []) if r != "hatches"]
        defs["Question"]["properties"]["hatches"] = {"$ref": "#/$defs/Hatches", "default": dict(HATCH_DEFAULTS)}
    if struct is DeclareIntentArgs:
        # The two IDP profiles are untagged Structs (``profile`` is optional in IDP_STANDARD), which
        # msgspec cannot put in one union; their schemas are published side by side instead.
        (standard, thin), idp_defs = msgspec.json.schema_components([IdpStandard, IdpThin])
        defs.update(idp_defs)
        top["properties"]["idp"] = {"anyOf": [standard, thin], "description": "the Intent Declaration Primitive (spec 003 §4.1)"}
    return {**top, "$defs": defs} if defs else top


@dataclass(frozen=True)
class ToolAnswer:
    body: dict[str, Any]
    is_error: bool = False


def _invalid(e: Exception) -> ToolAnswer:
    return ToolAnswer({"status": "invalid", "code": "invalid_arguments", "reason": str(e)}, is_error=True)


def _unavailable(reason: str) -> ToolAnswer:
    return ToolAnswer({"status": "unavailable", "code": "gateway_unavailable", "reason": reason}, is_error=True)


def refusal_answer(out: EnvelopeOutcome) -> ToolAnswer:
    """The gateway's refusal with every violated rule, for the model to fix and retry."""
    body: dict[str, Any] = {"status": out.status, "code": out.code, "reason": out.reason}
    body["violations"] = [msgspec.to_builtins(d) for d in out.details]
    return ToolAnswer(body, is_error=True)


def closing_answer(final: Outcome, labels: list[str] | None = None) -> ToolAnswer:
    """A moment's closing outcome as a tool result; the three kinds of spec 000 §7.3 stay distinct."""
    match final:
        case ResolutionOutcome(resolution=OptionChoice(index=i)):
            body: dict[str, Any] = {"status": "resolved", "kind": "option", "index": i}
            if labels is not None and i < len(labels):
                body["label"] = labels[i]
        case ResolutionOutcome(resolution=FreeTextAnswer(text=text)):
            body = {"status": "resolved", "kind": "free_text", "text": text}
        case ResolutionOutcome(resolution=DialogueVeto(objection=objection)):
            body = {"status": "resolved", "kind": "dialogue", "objection": objection}
        case ResolutionOutcome(resolution=ClarificationAnswers(answers=answers)):
            body = {"status": "answered", "answers": answers}
        case MomentExpired():
            # DESIGN §6: an expiry is a refusal, never a consent.
            body = {"status": "expired", "reason": "the principal did not answer before the moment expired"}
        case HemDecision(decision=decision, text=text, idp_id=idp_id, void=void):
            body = {"status": "decided", "decision": decision, "idp_id": idp_id}
            if text is not None:
                body["text"] = text
            if void is not None:  # she approved; the mandate no longer stood, so the step is not permitted
                body["void"] = void
                body["reason"] = "the principal approved after the mandate lapsed: the approval permits nothing"
        case _:
            body = {"status": "unexpected", "outcome": msgspec.to_builtins(final)}
    body["moment_id"] = getattr(final, "moment_id", None)
    return ToolAnswer(body)


def _request_key(args: dict[str, Any]) -> str | None:
    """The call's idempotency key, checked as the tool's schema says (a malformed one is invalid_arguments)."""
    key = args.get("request_key")
    try:
        return None if key is None else msgspec.convert(key, RequestKey)  # type: ignore[arg-type]
    except msgspec.ValidationError as e:
        raise ValueError(f"{e} - at `$.request_key`") from None


def correlation_of(tool: str, key: str | None) -> str | None:
    """The envelope's correlationId for a ``request_key``: the gateway's dedup (stage 8, spec 002 "Replay
    determinism") answers the same key with the same moment. Hashed, so any key is a valid correlationId and
    SR-1 redaction never rewrites it; per tool, so a key reused across tools is not a kind conflict."""
    return None if key is None else "mcp-" + stable_id("mcp", tool, key, length=40)


def _labels(args: dict[str, Any]) -> list[str]:
    """The option labels of an accepted moment (the gateway checked their shape)."""
    question = args["binding_moment"]["question"]
    return [str(o["label"]) for o in question["options"]]


class AgentTools:
    """One agent's tools over one NATS connection."""

    def __init__(self, agent: Agent, *, progress_every: float = 2.0, request_timeout: float = 10.0) -> None:
        self.agent = agent
        self.progress_every = progress_every
        self.request_timeout = request_timeout

    async def call(self, name: str, arguments: dict[str, Any], progress: Progress | None = None) -> ToolAnswer:
        if name not in TOOLS:
            return ToolAnswer({"status": "invalid", "reason": f"unknown tool {name!r}"}, is_error=True)
        try:
            match name:
                case "ask_principal":
                    return await self.ask_principal(arguments, progress)
                case "clarify":
                    return await self.clarify(arguments, progress)
                case "declare_intent":
                    return await self.declare_intent(arguments, progress)
                case "report_transition":
                    return await self.report_transition(arguments)
                case "list_moments":
                    return await self.list_moments(arguments)
                case _:
                    return await self.await_moment(arguments, progress)
        except RefusedError as e:
            # The gateway said no to a moment query: unknown_moment (never opened by this agent) or a refusal.
            return ToolAnswer({"status": "refused", "code": e.code, "reason": e.reason}, is_error=True)
        except (PgwError, msgspec.ValidationError, ValueError) as e:
            return _invalid(e)
        except TimeoutError:
            return _unavailable(f"the gateway did not answer within {self.request_timeout:g} s; is it running?")
        except NoRespondersError:
            # A JetStream publish with no stream and a request nobody serves both end here.
            return _unavailable(f"no gateway answered {name}: is one running on this NATS server "
                                "(pgw up), with its streams and, for declare_intent, its IDP kernel?")
        except NatsError as e:
            return _unavailable(f"the bus refused the call: {e}")

    async def _wait(self, moment_id: str, what: str, progress: Progress | None, principal: str | None = None) -> Outcome:
        """The outcome that closes ``moment_id``, with a progress call every ``progress_every`` seconds.

        ``Agent.final_outcome`` asks the gateway first, so an answer an earlier
        process of this server read and lost is returned, not waited for.
        """
        task = asyncio.ensure_future(self.agent.final_outcome(moment_id, principal=principal))
        start = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.progress_every)
                if done:
                    return task.result()
                if progress is not None:
                    await progress(time.monotonic() - start, f"waiting for {what} (moment {moment_id})")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _accepted(self, eid: str) -> EnvelopeOutcome:
        return await self.agent.outcome_for(eid, timeout=self.request_timeout)

    async def ask_principal(self, args: dict[str, Any], progress: Progress | None) -> ToolAnswer:
        key = _request_key(args)
        args = with_hatch_defaults(args)
        principal = principal_token(str(args.get("principal", "")))
        # The moment goes to the gateway as given: its shape stage lists every violated rule (spec 000 §6).
        payload = {**{k: v for k, v in args.items() if k != "request_key"}, "principal": principal}
        eid = uuid.uuid4().hex
        cid = correlation_of("ask_principal", key)
        await self.agent.send(envelope("vendor.pgw.binding_moment", payload, envelope_id=eid, correlation_id=cid))
        return await self._answered(eid, principal, key, progress, lambda final: closing_answer(final, _labels(args)))

    async def clarify(self, args: dict[str, Any], progress: Progress | None) -> ToolAnswer:
        parsed = msgspec.convert(args, ClarifyArgs)
        principal = principal_token(parsed.principal)
        payload = {k: v for k, v in args.items() if k not in ("principal", "request_key")}
        eid = uuid.uuid4().hex
        cid = correlation_of("clarify", parsed.request_key)
        await self.agent.send(envelope("clarification.request", payload, envelope_id=eid, correlation_id=cid), principal=principal)
        return await self._answered(eid, principal, parsed.request_key, progress, closing_answer)

    async def _answered(
        self, eid: str, principal: str, key: str | None, progress: Progress | None, answer: Callable[[Outcome], ToolAnswer]
    ) -> ToolAnswer:
        """The envelope's acceptance, then the outcome that closes its moment, as the tool's result.

        ``replayed``: the gateway answered a ``request_key`` it had seen with the moment that key opened before.
        """
        out = await self._accepted(eid)
        if out.status != "accepted" or not out.moment_id:
            return refusal_answer(out)
        if progress is not None:
            again = " (asked before under this request_key)" if out.replayed else ""
            await progress(0.0, f"moment {out.moment_id} delivered to {principal}{again}")
        try:
            result = answer(await self._wait(out.moment_id, principal, progress, principal))
        except (NatsError, TimeoutError) as e:
            # The moment is open: the error carries its id, for await_moment once the bus is back.
            return ToolAnswer({"status": "unavailable", "code": "gateway_unavailable", "moment_id": out.moment_id,
                               "reason": f"the wait for moment {out.moment_id} was cut: {e}; call await_moment with it"},
                              is_error=True)
        if key is not None:
            result.body["request_key"] = key
            result.body["replayed"] = out.replayed
        return result

    async def list_moments(self, args: dict[str, Any]) -> ToolAnswer:
        parsed = msgspec.convert(args, ListMomentsArgs)
        state = await self.agent.list_moments(parsed.which, limit=parsed.limit)
        moments = [msgspec.to_builtins(m) for m in state.moments or []]
        return ToolAnswer({"status": "listed", "which": parsed.which, "moments": moments, "more": state.more})

    async def await_moment(self, args: dict[str, Any], progress: Progress | None) -> ToolAnswer:
        parsed = msgspec.convert(args, AwaitMomentArgs)
        return closing_answer(await self._wait(parsed.moment_id, "the principal", progress))

    async def declare_intent(self, args: dict[str, Any], progress: Progress | None) -> ToolAnswer:
        # The IDP goes to the kernel as given, so a malformed one is the kernel's REJECT with its code.
        request = TransitionRequest(
            mandate=args.get("mandate"), action=args.get("action"), resource=args.get("resource"), idp=args.get("idp")
        )
        subject = self.agent.subjects.idp(self.agent.agent)
        msg = await self.agent.nc.request(subject, msgspec.json.encode(request), timeout=self.request_timeout)
        result = kernel_result_decoder.decode(msg.data)
        body = msgspec.to_builtins(result)
        if isinstance(result, Reject):
            return ToolAnswer(body, is_error=True)  # spec 003 §5.2: fix the declaration and declare again
        if isinstance(result, HemPending) and args.get("wait_for_decision", True):
            final = await self._wait(result.moment_id, "the principal's escalation decision", progress)
            body["decision"] = closing_answer(final).body
        return ToolAnswer(body)

    async def report_transition(self, args: dict[str, Any]) -> ToolAnswer:
        report = msgspec.convert(args, TransitionReport)
        # One report per IDP (spec 003 §5.5): the message id makes a retried call the same message.
        ack = await self.agent.js.publish(
            self.agent.subjects.transition(self.agent.agent),
            msgspec.json.encode(report),
            headers={"Nats-Msg-Id": f"{self.agent.agent}:{report.idp_id}"},
        )
        return ToolAnswer({"status": "recorded", "idp_id": report.idp_id, "stream_seq": ack.seq, "duplicate": ack.duplicate})
