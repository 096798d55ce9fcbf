"""What each party may publish and subscribe to (DESIGN §7), as allow/deny lists.

Agents and principals get allow lists naming only their own subjects. On top
of that every agent and principal gets an explicit deny list for the
JetStream APIs that bypass subject permissions (nats-server #3202, #8274):
whoever may create a consumer or direct-get a message can read any subject
of a stream, so these parties can only *pull* from the one durable consumer
the gateway created for them. A deny always wins over an allow in
nats-server, so the deny list never names a subject the allow list needs.

Services are trusted infrastructure: they manage streams, consumers and KV
buckets (``$JS.API.>``), but each publishes only the contract subjects it
produces. They take no request on that connection: each service answers
requests on a second one, as ``responder:{service}``, which may publish on
no contract subject, stream, bucket or API and has no ``allow_responses``
(nats-server grants a reply subject under ``allow_responses`` even where
the deny list names it), so a request whose reply subject names a stream
cannot make a service write it (docs/security.md "Replies").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pgwcore.identity import Party
from pgwcore.slack_config import SLACK_BUCKET, slack_durable
from subjects.client import outcome_durable
from subjects.names import principal_token

# Stream names are fixed by the contract (pgwcore/streams.py), whatever the prefix.
OUTBOUND_STREAM = "PGW_OUTBOUND"
SURFACE_STREAM = "PGW_SURFACE"

# The JetStream bypasses (DESIGN §7): never granted to agents or principals.
JS_BYPASS_DENY: tuple[str, ...] = (
    "$JS.API.CONSUMER.CREATE.>",
    "$JS.API.CONSUMER.DURABLE.CREATE.>",
    "$JS.API.CONSUMER.DELETE.>",
    "$JS.API.CONSUMER.LIST.>",
    "$JS.API.CONSUMER.NAMES.>",
    "$JS.API.CONSUMER.PAUSE.>",
    "$JS.API.CONSUMER.UNPIN.>",
    "$JS.API.CONSUMER.LEADER.>",
    "$JS.API.DIRECT.GET.>",
    "$JS.API.STREAM.>",
    "$JS.API.ACCOUNT.>",
    "$JS.API.META.>",
    "$JS.API.SERVER.>",
    "$KV.>",
    "$O.>",
    "$SYS.>",
)

_SERVICE_COMMON_PUB = ("$JS.API.>", "$JS.ACK.>", "$JS.FC.>", "$KV.>", "$SRV.>")


def agent_durable(agent: str) -> str:
    """Name of the durable consumer on PGW_OUTBOUND the gateway pre-creates for ``agent``."""
    return outcome_durable(agent)


def principal_durable(principal: str) -> str:
    """Name of the durable consumer on PGW_SURFACE the gateway pre-creates for ``principal``."""
    return f"surface-{principal_token(principal)}"


@dataclass(frozen=True)
class Permissions:
    """One user's publish/subscribe allow and deny lists."""

    pub_allow: tuple[str, ...] = ()
    pub_deny: tuple[str, ...] = ()
    sub_allow: tuple[str, ...] = ()
    sub_deny: tuple[str, ...] = ()
    allow_responses: bool = False
    notes: dict[str, str] = field(default_factory=dict)

    def union(self, other: Permissions) -> Permissions:
        def merge(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(dict.fromkeys(a + b))

        return Permissions(
            merge(self.pub_allow, other.pub_allow),
            merge(self.pub_deny, other.pub_deny),
            merge(self.sub_allow, other.sub_allow),
            merge(self.sub_deny, other.sub_deny),
            self.allow_responses or other.allow_responses,
        )


def _pull_only(stream: str, durable: str) -> tuple[str, ...]:
    # Pull next batch, ack/nak the deliveries, read the consumer's own info:
    # nothing that creates, changes or lists consumers (DESIGN §7).
    return (
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
        f"$JS.API.CONSUMER.INFO.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    )


def agent_permissions(prefix: str, agent: str) -> Permissions:
    """Agent A: publish its own envelope/idp/transition, query its own moments; read only its own outcomes."""
    own = Party("agent", agent)
    base = f"{prefix}.agent.{agent}"
    return Permissions(
        pub_allow=(
            f"{base}.envelope",
            f"{base}.idp",
            f"{base}.transition",
            f"{base}.moment",  # request-reply: its own moments' state (subjects/momentquery.py)
            f"{base}.act",  # request-reply: a gated action, through the kernel (subjects/gate.py)
            f"{prefix}.capabilities",
            *_pull_only(OUTBOUND_STREAM, agent_durable(agent)),
        ),
        # An agent must not forge its own outcomes into PGW_OUTBOUND.
        # Nor reach an executor except through the kernel (spec 003 §8.7, docs/gate.md): the
        # allow list has no exec subject; the deny keeps a later, wider allow from granting one.
        pub_deny=(f"{base}.outcome", f"{prefix}.exec.>", *JS_BYPASS_DENY),
        sub_allow=(f"{base}.outcome", f"{own.inbox_prefix}.>"),
    )


def principal_permissions(prefix: str, principal: str) -> Permissions:
    """Principal P: receive its own surface items, answer and list its own moments.

    Issue 17 (docs/notifications.md): P also says a surface of its own is open
    (``presence``) and manages its own Web Push subscriptions (``push.*``, answered
    by the notifier on P's own inbox).
    """
    own = Party("principal", principal)
    base = f"{prefix}.principal.{principal}"
    return Permissions(
        pub_allow=(
            f"{base}.resolve",
            f"{base}.pending",
            f"{base}.presence",
            f"{base}.push.key",
            f"{base}.push.subscribe",
            f"{base}.push.unsubscribe",
            f"{prefix}.capabilities",
            f"{prefix}.kernel.approvals.{principal}",  # request: her standing approvals (docs/gate.md)
            *_pull_only(SURFACE_STREAM, principal_durable(principal)),
        ),
        # A surface must not forge items into its own surface stream.
        pub_deny=(f"{base}.surface", *JS_BYPASS_DENY),
        sub_allow=(f"{base}.surface", f"{own.inbox_prefix}.>"),
    )


def slack_permissions(prefix: str, principal: str) -> Permissions:
    """The Slack surface of principal P: P's items (its own durable), P's answers, P's records.

    It may answer and list only P's moments, read only P's surface items (pulling its own
    durable ``slack-P``, never creating one) and read and write only the keys ``P.*`` of
    ``PGW_SLACK``: by direct get *by subject*, so the server can confine the read to P's
    keys (a ``STREAM.MSG.GET`` names its key in the body and is not granted).
    """
    own = Party("slack", principal)
    base = f"{prefix}.principal.{principal}"
    kv = f"$KV.{SLACK_BUCKET}.{principal}"
    # The JetStream bypasses of agents and principals, less the two forms this role needs
    # confined to its own keys (granted by the allow list below, which names nothing else).
    deny = tuple(d for d in JS_BYPASS_DENY if d not in ("$JS.API.DIRECT.GET.>", "$KV.>"))
    return Permissions(
        pub_allow=(
            f"{base}.resolve",
            f"{base}.pending",
            f"{prefix}.capabilities",
            *_pull_only(SURFACE_STREAM, slack_durable(principal)),
            f"{kv}.>",
            f"$JS.API.DIRECT.GET.KV_{SLACK_BUCKET}.{kv}.>",
        ),
        pub_deny=(f"{base}.surface", *deny),
        sub_allow=(f"{own.inbox_prefix}.>",),
    )


def _requests(prefix: str, name: str) -> tuple[str, ...]:
    """The request subjects service ``name`` answers (docs/contract.md §2), besides the services
    API (``$SRV.>``, ``ops.{name}.status``): taken on its ``responder`` connection only."""
    p = prefix
    match name:
        case "gateway":
            return (
                f"{p}.agent.*.idp",
                f"{p}.agent.*.act",  # gated actions (gateway/kernel/gate.py)
                f"{p}.agent.*.moment",  # the agents' moment queries (gateway/app.py)
                f"{p}.principal.*.resolve",
                f"{p}.principal.*.pending",
                f"{p}.capabilities",
                f"{p}.kernel.>",  # mandate revocation and audit queries (gateway/kernel/)
            )
        case "notifier":
            return (f"{p}.principal.*.push.*",)  # every principal's Web Push requests
        case "signer" | "registrar":
            return ()
        case "services":
            return tuple(dict.fromkeys(s for n in ("gateway", "signer", "registrar", "notifier") for s in _requests(p, n)))
    raise ValueError(f"unknown service {name!r}")


def reply_deny(prefix: str) -> tuple[str, ...]:
    """What an answering connection may never publish: every contract subject (all streams'
    subjects, ``exec.>``, ``log.>``) and the JetStream, KV, object store, system and services
    APIs. Inboxes stay open to it, the services' own included (a service's probe of another
    through the services API is answered there)."""
    return (f"{prefix}.>", "$JS.>", "$KV.>", "$O.>", "$SYS.>", "$SRV.>")


def responder_permissions(prefix: str, name: str) -> Permissions:
    """The connection service ``name`` takes requests on and answers from (pgwcore/respond.py).

    It subscribes to the service's request subjects and the services API, and publishes only
    answers: any subject but :func:`reply_deny`'s. NATS wildcards match whole tokens, so the
    server cannot confine an answer to the *asker's* ``_INBOX_{role}_{name}``: that is the
    reply rule's work (subjects/replies.py); the server's part is that no answer reaches a
    stream, a bucket or an API. No ``allow_responses``: nats-server would let it publish on any
    reply subject it receives, the denied ones included.
    """
    own = Party("responder", name)
    # Each service registers its own status endpoint; `services` runs all four in one process.
    names = ("gateway", "signer", "registrar", "notifier") if name == "services" else (name,)
    return Permissions(
        pub_allow=(">",),
        pub_deny=reply_deny(prefix),
        sub_allow=(*_requests(prefix, name), "$SRV.>", *(f"{prefix}.ops.{n}.status" for n in dict.fromkeys((*names, name))),
                   f"{own.inbox_prefix}.>"),
    )


def service_permissions(prefix: str, name: str) -> Permissions:
    """The gateway, signer, registrar and notifier; ``services`` is all of them in one process.

    The service's writes and reads; its requests (and the services API) are its responder's."""
    own = Party("service", name)
    common = Permissions(pub_allow=_SERVICE_COMMON_PUB, sub_allow=(f"{own.inbox_prefix}.>",))
    p = prefix
    match name:
        case "gateway":
            mine = Permissions(
                pub_allow=(
                    f"{p}.agent.*.outcome",
                    f"{p}.principal.*.surface",
                    f"{p}.verdict.*",
                    f"{p}.log.>",  # kernel event log
                    f"{p}.checkpoint.>",  # its anchored heads (gateway/kernel/checkpoint.py)
                    f"{p}.deadletter.>",  # poison messages (gateway/deadletter.py, issue 8)
                    f"{p}.agent.*.envelope",  # re-publish an envelope whose msg id was squatted (security/squat.py)
                    f"{p}.exec.>",  # the gate: only the kernel sends to executors (gateway/kernel/gate.py)
                ),
                sub_allow=(
                    "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>",  # ditto: crashed-worker path
                    f"{p}.agent.*.envelope",  # core watch for squatted msg ids (security/squat.py)
                ),
            )
        case "signer":
            # signer.ledger.*: the signer's hash-chain records (consumers/signer.py).
            mine = Permissions(pub_allow=(f"{p}.capsule.register", f"{p}.signer.ledger.*"))
        case "registrar":
            mine = Permissions(pub_allow=(f"{p}.capsule.registered", f"{p}.capsule.deadletter"))
        case "notifier":
            # Reads PGW_SURFACE through its own durable ($JS.API above), hears every presence,
            # dead-letters what it gives up on (docs/notifications.md); its responder answers push.*.
            mine = Permissions(
                pub_allow=(f"{p}.notify.deadletter",),
                sub_allow=(f"{p}.principal.*.presence",),
            )
        case "services":
            mine = Permissions()
            for n in ("gateway", "signer", "registrar", "notifier"):
                mine = mine.union(service_permissions(prefix, n))
            # Ops commands run by `pgw up`'s own tools (tail, demo) read the bus.
            mine = mine.union(Permissions(sub_allow=(f"{p}.>",)))
        case _:
            raise ValueError(f"unknown service {name!r}")
    return common.union(mine)


# What ops may call: reads of streams, consumers and messages (DESIGN §1 "read-only
# on every stream", §7), nothing that creates, changes or consumes state (issue 19).
OPS_JS_READS: tuple[str, ...] = (
    "$JS.API.INFO",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.STREAM.INFO.*",
    "$JS.API.STREAM.MSG.GET.*",  # the ops history path (consumers/tail.py): no consumer at all
    "$JS.API.DIRECT.GET.*",
    "$JS.API.DIRECT.GET.*.>",
    "$JS.API.CONSUMER.NAMES.*",
    "$JS.API.CONSUMER.LIST.*",
    "$JS.API.CONSUMER.INFO.*.*",
)

# Belt and braces: the allow list above already leaves these out; the deny makes a
# later, wider allow (a ``$JS.API.>`` someone adds) unable to grant them to ops.
OPS_WRITE_DENY: tuple[str, ...] = (
    "$JS.API.CONSUMER.CREATE.>",
    "$JS.API.CONSUMER.DURABLE.CREATE.>",
    "$JS.API.CONSUMER.DELETE.>",
    "$JS.API.CONSUMER.PAUSE.>",
    "$JS.API.CONSUMER.UNPIN.>",
    "$JS.API.CONSUMER.RESET.>",
    "$JS.API.CONSUMER.MSG.NEXT.>",
    "$JS.API.CONSUMER.LEADER.>",
    "$JS.API.STREAM.CREATE.>",
    "$JS.API.STREAM.UPDATE.>",
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.PURGE.>",
    "$JS.API.STREAM.MSG.DELETE.>",
    "$JS.API.STREAM.SNAPSHOT.>",
    "$JS.API.STREAM.RESTORE.>",
    "$JS.API.STREAM.LEADER.>",
    "$JS.API.STREAM.PEER.>",
    "$JS.API.ACCOUNT.>",
    "$JS.API.META.>",
    "$JS.API.SERVER.>",
    "$JS.ACK.>",
    "$JS.FC.>",
    "$KV.>",
    "$O.>",
    "$SYS.>",
)

# Subscriptions in a queue group would take requests away from the services'
# own queue groups (an IDP or a resolve answered by nobody): ops subscribes plainly.
NO_QUEUE_GROUPS = "> *"


def ops_permissions(prefix: str, name: str) -> Permissions:
    """Ops: read every contract subject and stream, change nothing (DESIGN §1, §7; issue 19)."""
    own = Party("ops", name)
    return Permissions(
        pub_allow=(
            *OPS_JS_READS,
            f"{prefix}.capabilities",
            # nats.micro discovery of the services (pgwcore/micro.py): ping, info, stats.
            "$SRV.PING", "$SRV.PING.>", "$SRV.INFO", "$SRV.INFO.>", "$SRV.STATS", "$SRV.STATS.>",
            # An operator may revoke a mandate: the request is signed by a revoker key and
            # checked by the kernel (gateway/kernel/revocation.py), so this grants no authority.
            f"{prefix}.kernel.revoke",
        ),
        pub_deny=OPS_WRITE_DENY,
        sub_allow=(f"{prefix}.>", f"{own.inbox_prefix}.>"),
        sub_deny=(NO_QUEUE_GROUPS,),
    )


def audit_permissions(prefix: str, name: str) -> Permissions:
    """Audit principal: ask the kernel under its own name (gateway/kernel/audit.py); nothing else.

    No stream access at all: an auditor sees the log only through the kernel,
    which withholds ``audit_accessible: false`` IDPs and logs every query.
    """
    own = Party("audit", name)
    return Permissions(
        pub_allow=(f"{prefix}.kernel.audit.{name}", f"{prefix}.capabilities"),
        pub_deny=JS_BYPASS_DENY,
        sub_allow=(f"{own.inbox_prefix}.>",),
    )


def executor_permissions(prefix: str, kind: str) -> Permissions:
    """Executor of kind K (docs/gate.md): serve ``exec.K.>`` (a queue group, answering the gateway's
    requests), register with the services API, and keep its results in its own bucket
    ``PGW_EXEC_{K}``; it publishes on no contract subject, and no party but the gateway may
    publish to it."""
    from subjects.gate import exec_bucket

    own = Party("executor", kind)
    stream = f"KV_{exec_bucket(kind)}"
    return Permissions(
        pub_allow=(
            f"$KV.{exec_bucket(kind)}.>",
            f"$JS.API.STREAM.INFO.{stream}",
            f"$JS.API.STREAM.CREATE.{stream}",
            f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>",
        ),
        sub_allow=(f"{prefix}.exec.{kind}.>", "$SRV.>", f"{own.inbox_prefix}.>"),
        allow_responses=True,
    )


# One builder per role: a new role (say, an auditor) is one function and one entry here.
RoleBuilder = Callable[[str, str], Permissions]
ROLE_BUILDERS: dict[str, RoleBuilder] = {
    "agent": agent_permissions,
    "principal": principal_permissions,
    "service": service_permissions,
    "ops": ops_permissions,
    "audit": audit_permissions,
    "slack": slack_permissions,
    "executor": executor_permissions,
    "responder": responder_permissions,
}


def permissions_for(prefix: str, party: Party) -> Permissions:
    try:
        build = ROLE_BUILDERS[party.role]
    except KeyError:
        raise ValueError(f"no permissions defined for role {party.role!r}") from None
    return build(prefix, party.name)
