"""Wire types of the gate: governed actions that transit the kernel (spec 003 §5.1, §8.7; spec 004 §5.2).

An agent submits the transition *and* the action's arguments in one call,
``ActRequest`` on ``{prefix}.agent.{agent}.act`` (core request-reply, queue
group ``pgw-gateway``): ``kernel.transition(mandate, action, idp)`` of spec 003
§5.1 with the arguments the kernel hands on. The kernel validates, commits
``IDP_SUBMITTED``, asks Cedar, and on PERMIT (or a human's approval) sends the
action to its *executor* itself: ``ExecRequest`` on ``{prefix}.exec.{kind}.{action}``,
answered by ``ExecResponse``. Only the gateway's identity may publish there
(the server enforces it), so an agent reaches the action only through the
kernel, and the executed action the commitment check compares (§5.5, §8.7)
is the one the kernel dispatched.

Replies on ``act`` (``ActResult``, tagged on ``result``):

* ``ActDone``: the executor answered; ``status`` ``confirmed`` (it ran, the
  ``response`` is its result) or ``failed`` (it answered with an error);
  ``response_digest`` is the JSON-DIGEST (spec 004) of the ``response`` the
  kernel received, the digest the capsule is bound to;
* ``ActDispatched``: the executor did not answer within its timeout; the
  action may have run (``dispatched_unconfirmed``); the final answer comes
  later as an ``action_result`` outcome (``subjects.wire.ActionResult``);
* the kernel's ``Reject``, ``EnrichedDeny`` and ``HemPending`` of
  ``subjects.idp``: nothing was dispatched (after a HEM approval the result
  arrives as an ``action_result`` outcome).

Executors (``subjects.executor`` is a small SDK; any language works with
these subjects and this JSON): a ``nats.micro`` service ``pgw-exec-{kind}``
serving ``{prefix}.exec.{kind}.{action}`` and ``{prefix}.exec.{kind}._result``
(the crash-recovery query: what became of an idempotency key). The
idempotency key is ``idempotency_key(so_id, idp_id)``: one dispatch, one key,
whoever sends it and however often.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from subjects.errors import SubjectError
from subjects.idp import CedarAction, EnrichedDeny, HemPending, KernelResultBase, Reject
from subjects.util import stable_id
from subjects.wire import ActionResult

# The arguments of a gated call that name what it touches, a path first: the approval card shows them
# first and names them in its question (gateway/kernel/hem.py), a standing approval is judged on them
# (gateway/kernel/scopes.py), and the MCP gate's executor checks them for links (integrations/mcp_gate.py).
PATH_KEYS = ("path", "file_path", "filepath", "file", "filename", "source", "destination", "target", "dir",
             "directory", "folder", "uri", "url", "repo_path")

# The header every dispatch carries besides the body (so a proxy or a log can key on it).
IDEMPOTENCY_HEADER = "Pgw-Idempotency-Key"
# The kernel's queue group on agent.*.act (the same group as agent.*.idp).
ACT_QUEUE = "pgw-gateway"
# An executor kind is one subject token of at most 48 characters; its results bucket is
# PGW_EXEC_{KIND} (upper-cased; kernel.executors refuses two kinds that differ only in case).
KIND_RE = re.compile(r"^[A-Za-z0-9_-]{1,48}$")
# The action token of an executor subject: a Cedar action id that is also one subject token.
ACTION_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
RESULT_ENDPOINT = "_result"

ExecKind = Annotated[str, Meta(pattern=KIND_RE.pattern, description="executor kind (one subject token)")]
IdempotencyKey = Annotated[str, Meta(pattern=r"^[0-9a-f]{32,64}$", description="idempotency key (hex)")]
JsonDigest = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$", description="spec 004 JSON-DIGEST (SHA-256 of JCS)")]


def check_kind(kind: str) -> str:
    """Return ``kind`` if it is a valid executor kind, else raise SubjectError."""
    if not isinstance(kind, str) or not KIND_RE.match(kind):
        raise SubjectError(repr(kind), "executor kind", "must be 1-48 of A-Z, a-z, 0-9, '_', '-'")
    return kind


def check_action_token(action: str) -> str:
    """A gated action must be one subject token: it is the last token of its executor subject."""
    if not isinstance(action, str) or not ACTION_TOKEN_RE.match(action) or action == RESULT_ENDPOINT:
        raise SubjectError(repr(action), "gated action", "must be 1-128 of A-Z, a-z, 0-9, '_', '-' (and not '_result')")
    return action


def exec_bucket(kind: str) -> str:
    """The executor's results bucket: ``PGW_EXEC_{KIND}``."""
    return "PGW_EXEC_" + check_kind(kind).upper()


def exec_service_name(kind: str) -> str:
    """The executor's ``nats.micro`` service name (``nats micro ls`` shows it)."""
    return f"pgw-exec-{check_kind(kind)}"


def idempotency_key(so_id: str, idp_id: str) -> str:
    """The key of the one dispatch of an IDP: the same IDP always gets the same key."""
    return stable_id("exec", so_id.lower(), idp_id.lower())


# ---------------------------------------------------------------------------
# Agent -> kernel: agent.{agent}.act
# ---------------------------------------------------------------------------


class ActRequest(Struct, kw_only=True, omit_defaults=True):
    """Body on ``agent.{agent}.act``: spec 003 §5.1 ``kernel.transition(mandate, action, idp)`` plus
    the action's ``arguments`` the kernel hands to the executor.

    ``idp`` is an IDP of either profile (``subjects.idp.IdpStandard`` / ``IdpThin``,
    or its JSON); the kernel validates it exactly as on ``agent.{agent}.idp``, so a
    malformed one is a ``Reject`` with the path, not a decode error. ``resource``
    is an optional Cedar entity id (``Type::"id"``), as on ``agent.{agent}.idp``.
    """

    mandate: str
    action: CedarAction
    idp: Any
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    resource: str | None = None


class ActDone(KernelResultBase, tag="DONE"):
    """The executor answered: ``confirmed`` with its result, or ``failed`` with its error object.

    ``response_digest`` is the JSON-DIGEST of ``response`` as the kernel received it
    (spec 004 §5.2: the digest a ``confirmed`` effect is bound to).
    """

    idp_id: str
    status: Literal["confirmed", "failed"]
    response: Any = None
    response_digest: JsonDigest | None = None
    event_seq: int | None = None  # STATE_TRANSITIONED's sequence in PGW_EVENTLOG
    verdict_id: str | None = None  # the verdict (and so capsule) id of this action
    warnings: list[Any] = msgspec.field(default_factory=list)


class ActDispatched(KernelResultBase, tag="DISPATCHED"):
    """The executor did not answer within its timeout: the action may have run
    (spec 004 §5.2 ``dispatched_unconfirmed``); the result follows as an
    ``action_result`` outcome when the kernel learns it."""

    idp_id: str
    reason: str
    verdict_id: str | None = None


ActResult = ActDone | ActDispatched | Reject | EnrichedDeny | HemPending

act_result_decoder = msgspec.json.Decoder(ActResult)


# ---------------------------------------------------------------------------
# Kernel -> executor: exec.{kind}.{action}, exec.{kind}._result
# ---------------------------------------------------------------------------


class ExecError(Struct, omit_defaults=True):
    """An executor's clean failure: the action ran (or was refused by the executor) and did not succeed."""

    code: Annotated[str, Meta(min_length=1, max_length=128)]
    message: Annotated[str, Meta(max_length=2000)] = ""


class ExecRequest(Struct, kw_only=True, omit_defaults=True):
    """Body on ``exec.{kind}.{action}``, sent only by the gateway (header ``Pgw-Idempotency-Key`` too)."""

    idempotency_key: IdempotencyKey
    action: CedarAction
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    idp_id: str
    so_id: str
    agent: str
    principal: str
    # The Cedar resource the kernel judged the call against, as the agent declared it (``Type::"id"``);
    # absent when none was declared (the kernel then judged the governed object, ``GovernedObject::"{so_id}"``).
    # An executor that acts on a resource one of its arguments names checks that this names it, and refuses
    # the call otherwise (docs/gate.md "What the executor refuses"): the kernel judges the resource as declared
    # and does not read the arguments (spec 003 §5.4: the resource is an evaluation input).
    resource: str | None = None


class ExecResponse(Struct, kw_only=True, omit_defaults=True):
    """An executor's answer: ``ok`` with ``result``, ``error`` with ``error``. Also, for a key
    claimed before: ``running`` (claimed, no result stored: running now, or its executor died
    while running it); and on ``_result``: ``unknown`` (the key was never claimed here)."""

    status: Literal["ok", "error", "running", "unknown"]
    result: Any = None
    error: ExecError | None = None


class ResultQuery(Struct, kw_only=True):
    """Body on ``exec.{kind}._result``: what became of this key?"""

    idempotency_key: IdempotencyKey


exec_request_decoder = msgspec.json.Decoder(ExecRequest)
exec_response_decoder = msgspec.json.Decoder(ExecResponse)
result_query_decoder = msgspec.json.Decoder(ResultQuery)


# Picked up by ``pgw schema`` (subjects.schemas.EXTRA_MODULES).
WIRE_TYPES: dict[str, Any] = {
    "ActRequest": ActRequest,
    "ActResult": ActResult,
    "ActDone": ActDone,
    "ActDispatched": ActDispatched,
    "ExecRequest": ExecRequest,
    "ExecResponse": ExecResponse,
    "ExecError": ExecError,
    "ResultQuery": ResultQuery,
    "ActionResult": ActionResult,
}
