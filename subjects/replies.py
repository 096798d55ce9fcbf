"""The reply rule of the bus contract: a reply goes only to the party that asked (docs/contract.md §6).

NATS does not check a requester's right to the reply subject it names: whoever answers a
request publishes on that subject with the *answerer's* permissions. A service that answered
whatever ``reply`` a request carried could be made to write where only it may: another
principal's surface, the verdict stream, the event log, a KV bucket (docs/security.md
"Replies"). So every request the project serves is answered through one path
(``pgwcore.respond.Responder``; the executor SDK in ``subjects/executor.py``) that asks this
module first:

- **Who asked.** A request subject names the party that may publish it (docs/contract.md §2,
  §8): ``agent.{a}.idp`` / ``.act`` / ``.moment`` only agent ``a``; ``principal.{p}.resolve``
  / ``.pending`` principal ``p`` or its Slack surface; ``principal.{p}.push.*`` principal
  ``p``; ``kernel.audit.{n}`` auditor ``n``; ``kernel.approvals.{p}`` principal ``p``;
  ``kernel.revoke`` an ops user; ``exec.>`` the
  gateway; ``capabilities``, ``ops.{service}.status`` and the services API (``$SRV.>``) any
  party. :func:`askers` gives that list.
- **Where that party may hear.** Each party has one reply prefix, ``_INBOX_{role}_{name}``
  (``pgwcore/identity.py``; operator mode derives the same from the user JWT), and the server
  lets nobody else subscribe under it. A reply subject is admitted when its first token is
  the prefix of one of the askers and the rest is a literal subject (nats' own request inbox
  ``{prefix}.{nuid}.{token}``, or any inbox the party made under it).
- **A server without per-party credentials** (a development or test server: the answering
  connection itself uses nats' default ``_INBOX``) gives everyone the shared ``_INBOX.``
  prefix; there the rule also admits ``_INBOX.…`` and still refuses everything else, so a
  request can never turn the answer into a publish on a contract subject.

Anything else gets no answer. The answer never carries the request's headers (nats-py's
``Msg.respond`` copies them: an echoed ``Nats-Rollup`` or ``KV-Operation`` would be obeyed by
the server had the reply reached a stream).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.micro.service import Service, ServicePing

# The roles of docs/contract.md §1, each a reply prefix ``_INBOX_{role}_{name}``
# (pgwcore/identity.py takes its list from here). No role holds an underscore, so the prefix
# splits into role and name at its first one.
ROLES: tuple[str, ...] = ("agent", "principal", "service", "ops", "audit", "slack", "executor", "responder")
DEFAULT_INBOX = "_INBOX"  # nats' shared prefix: only on a server without per-party credentials
ANY = "*"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# White space (``\s`` of a str pattern is the set ``str.isspace`` accepts) or a control character:
# what no literal subject holds. One search in C, where a check per character cost 1.5 us a reply.
_NOT_LITERAL = re.compile(r"[\s\x00-\x1f\x7f]")
# The gateway's two identities: alone, or all services in one process (`pgw up`).
_GATEWAY_NAMES = ("gateway", "services")


@dataclass(frozen=True, slots=True)
class Asker:
    """A party that may have sent a request: a role and a name (``ANY`` for either)."""

    role: str
    name: str = ANY

    @property
    def label(self) -> str:
        return f"{self.role}:{self.name}"


ANYONE = (Asker(ANY, ANY),)
NOBODY: tuple[Asker, ...] = ()


def inbox_prefix(role: str, name: str) -> str:
    """The one reply prefix of party ``role:name`` (``_INBOX_agent_planner``)."""
    return f"_INBOX_{role}_{name}"


def askers(prefix: str, subject: str) -> tuple[Asker, ...]:
    """The parties that may publish the request ``subject`` (docs/contract.md §2 and §8).

    ``prefix`` is the deployment's subject prefix (``pgw``). A subject that is no request of
    the contract has no asker: nothing is answered on it.
    """
    if subject.startswith("$SRV."):
        return ANYONE  # the services API: ops' discovery, and the services' own probes
    head = prefix + "."
    if not subject.startswith(head):
        return NOBODY
    t = subject[len(head):].split(".")
    match t:
        case ["agent", agent, ("idp" | "act" | "moment")]:
            return (Asker("agent", agent),)
        case ["principal", principal, ("resolve" | "pending")]:
            return (Asker("principal", principal), Asker("slack", principal))
        case ["principal", principal, "push", _verb]:
            return (Asker("principal", principal),)
        case ["capabilities"] | ["ops", _, "status"]:
            return ANYONE
        case ["kernel", "revoke"]:
            return (Asker("ops", ANY),)
        case ["kernel", "audit", auditor]:
            return (Asker("audit", auditor),)
        case ["kernel", "approvals", principal]:
            return (Asker("principal", principal),)
        case ["exec", _kind, _action]:
            return tuple(Asker("service", n) for n in _GATEWAY_NAMES)
    return NOBODY


def _literal(rest: str) -> bool:
    """``rest`` (what follows the prefix) is one or more literal tokens: no wildcard, no empty
    token, no white space or control character (no subject a publish could not name)."""
    if not rest:
        return False
    for tok in rest.split("."):
        if not tok or tok in ("*", ">"):
            return False
    return _NOT_LITERAL.search(rest) is None


def reply_allowed(reply: str, who: tuple[Asker, ...], *, shared_inbox: bool) -> bool:
    """May a request from one of ``who`` be answered on ``reply``?

    ``shared_inbox``: the server gives no party a prefix of its own (the answering connection
    uses nats' default ``_INBOX``), so ``_INBOX.…`` is every party's inbox.
    """
    if not who or not reply:
        return False
    first, dot, rest = reply.partition(".")
    if not dot or not _literal(rest):
        return False
    if first == DEFAULT_INBOX:
        return shared_inbox
    if not first.startswith("_INBOX_"):
        return False
    role, sep, name = first[len("_INBOX_"):].partition("_")
    if not sep or role not in ROLES or not _NAME_RE.match(name):
        return False
    return any(a.role in (ANY, role) and a.name in (ANY, name) for a in who)


def describe(who: tuple[Asker, ...]) -> str:
    """``agent:planner``, ``principal:alice or slack:alice``, ``anyone``, ``nobody``: for a log line."""
    if not who:
        return "nobody"
    if who == ANYONE:
        return "anyone"
    return " or ".join(a.label for a in who)


def request_kind(prefix: str, subject: str) -> str:
    """A bounded name of the request ``subject`` for a metric label: ``idp``, ``resolve``,
    ``push``, ``capabilities``, ``audit``, ``exec``, ``srv``... (never a party's name)."""
    if subject.startswith("$SRV."):
        return "srv"
    head = prefix + "."
    t = subject[len(head):].split(".") if subject.startswith(head) else []
    match t:
        case ["agent", _, kind] | ["principal", _, kind] if kind in ("idp", "act", "moment", "resolve", "pending"):
            return kind
        case ["principal", _, "push", _]:
            return "push"
        case ["capabilities"]:
            return "capabilities"
        case ["kernel", "revoke"]:
            return "revoke"
        case ["kernel", "audit", _]:
            return "audit"
        case ["kernel", "approvals", _]:
            return "approvals"
        case ["ops", _, "status"]:
            return "status"
        case ["exec", _, _]:
            return "exec"
    return "other"


def shared_inbox(nc: Any) -> bool:
    """The connection ``nc`` uses nats' default ``_INBOX`` (a server without per-party credentials)."""
    return bytes(getattr(nc, "_inbox_prefix", b"")) == DEFAULT_INBOX.encode()


class ReplyGate:
    """The reply rule applied to a received request: :meth:`admits` before any work is done,
    :meth:`answer` to send the reply (no request header is ever copied onto it).

    ``prefix`` is the subject prefix; ``on_refused(msg, who)`` is told of each refusal (the
    platform's :class:`pgwcore.respond.Responder` logs it and counts it).
    """

    def __init__(self, prefix: str, on_refused: Callable[[Any, tuple[Asker, ...]], None] | None = None) -> None:
        self.prefix = prefix
        self._on_refused = on_refused

    def allowed(self, msg: Any) -> bool:
        """``msg`` carries no reply (nothing to answer), or one of its asker's inboxes."""
        if not msg.reply:
            return True
        return reply_allowed(msg.reply, askers(self.prefix, msg.subject), shared_inbox=shared_inbox(msg._client))

    def admits(self, msg: Any) -> bool:
        """Serve ``msg``? A request whose reply subject is no inbox of a party that may send it is
        not served at all (no work, no write, no answer) and reported to ``on_refused``."""
        if self.allowed(msg):
            return True
        if self._on_refused is not None:
            self._on_refused(msg, askers(self.prefix, msg.subject))
        return False

    async def answer(self, msg: Any, payload: bytes) -> bool:
        """Send ``payload`` to ``msg``'s asker on the connection the request came in on, with no
        headers; False (and nothing sent) when there is no reply or the rule refuses it."""
        if not msg.reply or not self.admits(msg):
            return False
        await self._send(msg._client, msg.reply, payload)
        return True

    async def _send(self, nc: Any, reply: str, payload: bytes) -> None:
        await nc.publish(reply, payload)


class GuardedService(Service):
    """nats' services-API ``Service`` answering PING, INFO and STATS through ``responder``."""

    def __init__(self, nc: Any, config: Any, responder: ReplyGate) -> None:
        super().__init__(nc, config)
        self._responder = responder

    async def _handle_ping_request(self, msg: Any) -> None:
        if self._responder.admits(msg):
            await self._responder.answer(msg, json.dumps(self._ping_body()).encode())

    def _ping_body(self) -> dict[str, Any]:
        return ServicePing(id=self._id, name=self._name, version=self._version, metadata=self._metadata).to_dict()

    async def _handle_info_request(self, msg: Any) -> None:
        if self._responder.admits(msg):
            await self._responder.answer(msg, json.dumps(self.info().to_dict()).encode())

    async def _handle_stats_request(self, msg: Any) -> None:
        if self._responder.admits(msg):
            await self._responder.answer(msg, json.dumps(self.stats().to_dict()).encode())
