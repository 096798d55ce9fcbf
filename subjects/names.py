"""Subject builders and parsers for the bus contract (DESIGN §2).

Every subject starts with a configurable prefix (``pgw`` by default).
``{agent}`` and ``{principal}`` are single tokens matching
``[A-Za-z0-9_-]{1,64}``; a principal handle ``~alice`` is written ``alice``.
Anything else raises :class:`SubjectError`: a token is never mangled into a
valid one, because two different names must never map to one subject.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Literal

from subjects.errors import SubjectError
from subjects.gate import RESULT_ENDPOINT, check_action_token, check_kind

TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64}){0,3}$")
VERDICT_CLASSES = (
    "blocked",
    "denied",
    "hitl_dispatched",
    "resolved",
    "expired",
    "executed",
    "errored",
    "engine_failure",
    "timeout",  # a kernel PERMIT whose transition report never came (gateway/kernel/overdue.py)
)
LOG_EVENT_RE = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")

AgentChannel = Literal["envelope", "idp", "transition", "outcome", "moment", "act"]
PrincipalChannel = Literal["surface", "resolve", "pending"]
# Issue 17 (docs/notifications.md): a surface's presence, and its Web Push subscription
# requests to the notifier. Not JetStream: core request-reply and publish.
PUSH_VERBS = ("key", "subscribe", "unsubscribe")
PushVerb = Literal["key", "subscribe", "unsubscribe"]


def check_token(value: object, what: str = "token") -> str:
    """Return ``value`` if it is a valid subject token, else raise SubjectError."""
    if not isinstance(value, str):
        raise SubjectError(repr(value), what, "must be a string")
    if not TOKEN_RE.match(value):
        if value == "":
            why = "must not be empty"
        elif len(value) > 64:
            why = "must be at most 64 characters"
        else:
            why = "may contain only A-Z, a-z, 0-9, '_' and '-'"
        raise SubjectError(value, what, why)
    return value


def agent_token(agent: str) -> str:
    """Validate an agent id for use as a subject token."""
    return check_token(agent, "agent token")


def principal_unhandled(principal: str) -> str:
    """A principal handle (``~alice`` or ``alice``) without its one leading ``~`` (spec 000 §3), unchecked."""
    return principal[1:] if isinstance(principal, str) and principal.startswith("~") else principal


def principal_token(principal: str) -> str:
    """Map a principal handle (``~alice`` or ``alice``) to its subject token.

    Only one leading ``~`` is removed (spec 000 §3 handles); the rest must be a
    valid token as it stands.
    """
    return check_token(principal_unhandled(principal), "principal token")


@dataclass(frozen=True, slots=True)
class ParsedSubject:
    """A subject split into its role, the identity token and the channel."""

    role: Literal["agent", "principal", "verdict", "capsule", "log", "capabilities", "notify", "exec"]
    token: str | None
    channel: str | None


@dataclass(frozen=True, slots=True)
class Subjects:
    """All subjects of the contract under one prefix."""

    prefix: str = "pgw"

    def __post_init__(self) -> None:
        if not _PREFIX_RE.match(self.prefix):
            raise SubjectError(self.prefix, "subject prefix", "must be 1-4 dot-separated tokens")

    # -- agent side -------------------------------------------------------
    def agent(self, agent: str, channel: AgentChannel) -> str:
        return f"{self.prefix}.agent.{agent_token(agent)}.{channel}"

    def envelope(self, agent: str) -> str:
        return self.agent(agent, "envelope")

    def idp(self, agent: str) -> str:
        return self.agent(agent, "idp")

    def transition(self, agent: str) -> str:
        return self.agent(agent, "transition")

    def outcome(self, agent: str) -> str:
        return self.agent(agent, "outcome")

    def act(self, agent: str) -> str:
        """Request-reply: a governed action submitted through the kernel's gate
        (``subjects.gate.ActRequest``; spec 003 §5.1)."""
        return self.agent(agent, "act")

    def moment(self, agent: str) -> str:
        """Request-reply: the state of one of the agent's moments, and the outcome that closed it
        (served by the gateway; subjects/momentquery.py)."""
        return self.agent(agent, "moment")

    # -- principal side ---------------------------------------------------
    def principal(self, principal: str, channel: PrincipalChannel) -> str:
        return f"{self.prefix}.principal.{principal_token(principal)}.{channel}"

    def surface(self, principal: str) -> str:
        return self.principal(principal, "surface")

    def resolve(self, principal: str) -> str:
        return self.principal(principal, "resolve")

    def pending(self, principal: str) -> str:
        """Request-reply snapshot of a principal's pending items (served by the gateway)."""
        return self.principal(principal, "pending")

    def presence(self, principal: str) -> str:
        """A surface of the principal is open (core publish; docs/notifications.md)."""
        return f"{self.prefix}.principal.{principal_token(principal)}.presence"

    def push(self, principal: str, verb: PushVerb) -> str:
        """Web Push subscription requests to the notifier: ``key``, ``subscribe``, ``unsubscribe``."""
        if verb not in PUSH_VERBS:
            raise SubjectError(str(verb), "push verb", f"must be one of {PUSH_VERBS}")
        return f"{self.prefix}.principal.{principal_token(principal)}.push.{verb}"

    # -- executors (subjects/gate.py): only the gateway publishes here ------------
    def exec(self, kind: str, action: str) -> str:
        """An executor's action subject ``exec.{kind}.{action}`` (core request-reply)."""
        return f"{self.prefix}.exec.{check_kind(kind)}.{check_action_token(action)}"

    def exec_result(self, kind: str) -> str:
        """An executor's result query ``exec.{kind}._result`` (crash recovery)."""
        return f"{self.prefix}.exec.{check_kind(kind)}.{RESULT_ENDPOINT}"

    def exec_all(self, kind: str) -> str:
        """Every subject of one executor kind (its subscribe permission)."""
        return f"{self.prefix}.exec.{check_kind(kind)}.>"

    @property
    def all_exec(self) -> str:
        """Every executor subject (only the gateway's identity may publish here)."""
        return f"{self.prefix}.exec.>"

    # -- downstream -------------------------------------------------------
    def verdict(self, verdict_class: str) -> str:
        if verdict_class not in VERDICT_CLASSES:
            raise SubjectError(verdict_class, "verdict class", f"must be one of {VERDICT_CLASSES}")
        return f"{self.prefix}.verdict.{verdict_class}"

    def log(self, event: str) -> str:
        if not LOG_EVENT_RE.match(event):
            raise SubjectError(event, "log event", "must be UPPER_SNAKE_CASE")
        return f"{self.prefix}.log.{event}"

    @property
    def capsule_register(self) -> str:
        return f"{self.prefix}.capsule.register"

    @property
    def capsule_registered(self) -> str:
        return f"{self.prefix}.capsule.registered"

    @property
    def capabilities(self) -> str:
        return f"{self.prefix}.capabilities"

    # -- wildcards used by the gateway's own consumers ---------------------
    def all_agents(self, channel: AgentChannel) -> str:
        return f"{self.prefix}.agent.*.{channel}"

    def all_principals(self, channel: PrincipalChannel) -> str:
        return f"{self.prefix}.principal.*.{channel}"

    @property
    def all_presence(self) -> str:
        return f"{self.prefix}.principal.*.presence"

    @property
    def all_push(self) -> str:
        return f"{self.prefix}.principal.*.push.*"

    @property
    def notify_deadletter(self) -> str:
        """Notifications given up on after every retry (the notifier's dead letter)."""
        return f"{self.prefix}.notify.deadletter"

    @property
    def all_verdicts(self) -> str:
        return f"{self.prefix}.verdict.*"

    @property
    def all_log(self) -> str:
        return f"{self.prefix}.log.*"

    # -- parsing ------------------------------------------------------------
    def parse(self, subject: str) -> ParsedSubject:
        """Split a concrete subject of this contract; raise SubjectError otherwise.

        Remembered per prefix and subject (``ParsedSubject`` is frozen): the hot paths parse the
        same few subjects, one per agent or principal, on every message, and a parse costs as
        much as the rest of a message's bookkeeping in the gateway's envelope worker. A refused
        subject is not remembered."""
        return _parse(self.prefix, subject)


@functools.lru_cache(maxsize=4096)
def _parse(prefix: str, subject: str) -> ParsedSubject:
    head = prefix + "."
    if not subject.startswith(head):
        raise SubjectError(subject, "subject", f"does not start with prefix {prefix!r}")
    parts = subject[len(head) :].split(".")
    match parts:
        case ["agent", token, ("envelope" | "idp" | "transition" | "outcome" | "moment" | "act") as ch]:
            return ParsedSubject("agent", agent_token(token), ch)
        case ["principal", token, ("surface" | "resolve" | "pending" | "presence") as ch]:
            return ParsedSubject("principal", check_token(token, "principal token"), ch)
        case ["principal", token, "push", verb] if verb in PUSH_VERBS:
            return ParsedSubject("principal", check_token(token, "principal token"), f"push.{verb}")
        case ["exec", kind, action]:
            check_kind(kind)
            if action != RESULT_ENDPOINT:
                check_action_token(action)
            return ParsedSubject("exec", kind, action)
        case ["notify", "deadletter"]:
            return ParsedSubject("notify", None, "deadletter")
        case ["verdict", cls] if cls in VERDICT_CLASSES:
            return ParsedSubject("verdict", None, cls)
        case ["capsule", ("register" | "registered") as ch]:
            return ParsedSubject("capsule", None, ch)
        case ["log", event] if LOG_EVENT_RE.match(event):
            return ParsedSubject("log", None, event)
        case ["capabilities"]:
            return ParsedSubject("capabilities", None, None)
    raise SubjectError(subject, "subject", "is not a subject of the bus contract")
