"""Every ``$JS.API.*`` verb, who may call it and why (issue 19: the permission review).

The table in docs/security.md §1 is generated from this catalogue *and* the
permission lists :mod:`gateway.security.permissions` builds: for each verb a
concrete sample subject is matched against each role's allow/deny lists with
nats-server's own rules (``*`` one token, ``>`` the rest, a deny wins), so the
table says what the server will do, not what someone meant.
``python -m gateway.security.jsapi`` prints it; ``tests/test_security_review.py``
fails when the page and the code disagree.

Wildcards in a NATS subject match whole tokens only, so a consumer *name
prefix* cannot be granted: ops therefore gets no consumer verb at all and
reads history by message get (``STREAM.MSG.GET`` with ``next_by_subj``), which
changes nothing and touches nobody's consumer (consumers/tail.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.security.permissions import (
    OUTBOUND_STREAM,
    SURFACE_STREAM,
    Permissions,
    agent_durable,
    permissions_for,
    principal_durable,
)
from pgwcore.identity import Party
from pgwcore.msgget import subject_matches
from pgwcore.slack_config import SLACK_BUCKET, slack_durable
from subjects.gate import exec_bucket


def may_publish(perms: Permissions, subject: str) -> bool:
    """What the server decides for a PUB on ``subject`` (deny wins over allow)."""
    if any(subject_matches(d, subject) for d in perms.pub_deny):
        return False
    return any(subject_matches(a, subject) for a in perms.pub_allow)


@dataclass(frozen=True)
class Verb:
    """One API verb: a sample subject (``{own}``/``{other}`` = a durable) and the reason for the grants."""

    name: str
    sample: str
    writes: bool
    why: str


# Consumer samples run on ``{stream}``, the stream the actor pulls from (PGW_SURFACE
# for principals and the rest, PGW_OUTBOUND for agents); ``{own}`` is the actor's own
# durable when it has one, ``{other}`` another party's durable on that stream.
VERBS: tuple[Verb, ...] = (
    Verb("INFO", "$JS.API.INFO", False, "account limits and usage; ops dashboards"),
    Verb("STREAM.NAMES / LIST", "$JS.API.STREAM.NAMES", False, "discover streams; services at start, ops"),
    Verb("STREAM.INFO", "$JS.API.STREAM.INFO.PGW_SURFACE", False, "services check stream config at start; ops reads state"),
    Verb("STREAM.CREATE / UPDATE", "$JS.API.STREAM.CREATE.PGW_SURFACE", True, "services create the contract streams and KV buckets at start"),
    Verb("STREAM.DELETE / PURGE", "$JS.API.STREAM.PURGE.PGW_SURFACE", True, "services only (tests, `pgw streams`); never ops"),
    Verb("STREAM.MSG.GET", "$JS.API.STREAM.MSG.GET.PGW_SURFACE", False, "read one message by seq or subject: the ops history path (reads any subject, so not agents/principals)"),
    Verb("STREAM.MSG.DELETE", "$JS.API.STREAM.MSG.DELETE.PGW_SURFACE", True, "services only (KV housekeeping)"),
    Verb("DIRECT.GET", "$JS.API.DIRECT.GET.KV_PGW_MOMENTS", False, "KV reads by the services; ops may read (bypasses subject permissions, so not agents/principals)"),
    Verb("STREAM.SNAPSHOT / RESTORE", "$JS.API.STREAM.SNAPSHOT.PGW_SURFACE", True, "services only (backups are an operator's server-level task)"),
    Verb("CONSUMER.CREATE (named)", "$JS.API.CONSUMER.CREATE.{stream}.{other}.pgw.>", True, "services pre-create every durable; a create also updates or re-filters an existing one"),
    Verb("CONSUMER.CREATE (ephemeral)", "$JS.API.CONSUMER.CREATE.{stream}", True, "services only: an ephemeral consumer reads any subject of the stream"),
    Verb("CONSUMER.DURABLE.CREATE", "$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{other}", True, "legacy create form: services only"),
    Verb("CONSUMER.DELETE", "$JS.API.CONSUMER.DELETE.{stream}.{other}", True, "services only (part/rotate)"),
    Verb("CONSUMER.PAUSE / UNPIN", "$JS.API.CONSUMER.PAUSE.{stream}.{other}", True, "services only: a pause withholds a party's deliveries"),
    Verb("CONSUMER.INFO (own)", "$JS.API.CONSUMER.INFO.{stream}.{own}", False, "a party checks its own durable; ops reads any"),
    Verb("CONSUMER.INFO (other's)", "$JS.API.CONSUMER.INFO.{stream}.{other}", False, "ops and services only"),
    Verb("CONSUMER.NAMES / LIST", "$JS.API.CONSUMER.NAMES.{stream}", False, "ops and services: names are not content"),
    Verb("CONSUMER.MSG.NEXT (own)", "$JS.API.CONSUMER.MSG.NEXT.{stream}.{own}", True, "a party pulls its own durable (DESIGN §7)"),
    Verb("CONSUMER.MSG.NEXT (other's)", "$JS.API.CONSUMER.MSG.NEXT.{stream}.{other}", True, "a pull takes a message from its owner until the ack wait: services only"),
    Verb("$JS.ACK (own durable)", "$JS.ACK.{stream}.{own}.1.1.1.0.0", True, "a party acks what it pulled from its own durable"),
    Verb("$JS.ACK (other's)", "$JS.ACK.{stream}.{other}.1.1.1.0.0", True, "services only: an ack consumes (and on a work queue deletes)"),
    Verb("CONSUMER.LEADER.STEPDOWN", "$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{other}", True, "services only (cluster operations)"),
    Verb("ACCOUNT / META / SERVER", "$JS.API.META.LEADER.STEPDOWN", True, "services only (cluster operations)"),
    Verb("$KV.> (KV put/delete)", "$KV.PGW_MOMENTS.x", True, "services only: KV buckets are gateway state"),
    # A party's own bucket, where it has one (an executor's PGW_EXEC_K, the Slack surface's
    # PGW_SLACK keys P.*); for the others the sample is a gateway bucket, as above.
    Verb("STREAM.CREATE (own bucket)", "$JS.API.STREAM.CREATE.{bucket}", True, "an executor creates its results bucket `PGW_EXEC_K` at start (the gateway creates `PGW_SLACK` for the Slack surface)"),
    Verb("DIRECT.GET (own bucket)", "$JS.API.DIRECT.GET.{bucket}.{ownkey}", False, "an executor reads its stored results; the Slack surface its own keys `P.*` of `PGW_SLACK`, by subject"),
    Verb("$KV put/delete (own bucket)", "{ownkey}", True, "an executor stores its results by idempotency key; the Slack surface writes its own keys `P.*`"),
)

# The roles shown, with the party that stands for each (names are examples).
ROLE_COLUMNS: tuple[tuple[str, Party], ...] = (
    ("agent", Party("agent", "a")),
    ("principal", Party("principal", "p")),
    ("gateway", Party("service", "gateway")),
    ("signer", Party("service", "signer")),
    ("registrar", Party("service", "registrar")),
    ("notifier", Party("service", "notifier")),
    ("ops", Party("ops", "oncall")),
    ("audit", Party("audit", "auditor")),
    ("executor", Party("executor", "k")),
    ("slack", Party("slack", "p")),
)


def _stream_and_durables(party: Party) -> tuple[str, str, str]:
    """(stream, own durable, another party's durable) for the samples."""
    if party.role == "agent":
        return OUTBOUND_STREAM, agent_durable(party.name), agent_durable("someone-else")
    own = {"principal": principal_durable, "slack": slack_durable}.get(party.role, lambda n: f"{party.role}-{n}")(party.name)
    return SURFACE_STREAM, own, principal_durable("someone-else")


def _own_bucket(party: Party) -> tuple[str, str]:
    """(the KV stream of the party's own bucket, a key subject it owns there); a gateway bucket for the rest."""
    if party.role == "executor":
        bucket = exec_bucket(party.name)
        return f"KV_{bucket}", f"$KV.{bucket}.0123456789abcdef0123456789abcdef"
    if party.role == "slack":
        return f"KV_{SLACK_BUCKET}", f"$KV.{SLACK_BUCKET}.{party.name}.x"
    return "KV_PGW_MOMENTS", "$KV.PGW_MOMENTS.x"


def sample_subject(verb: Verb, party: Party) -> str:
    stream, own, other = _stream_and_durables(party)
    bucket, ownkey = _own_bucket(party)
    return (verb.sample.replace("{stream}", stream).replace("{own}", own).replace("{other}", other)
            .replace("{bucket}", bucket).replace("{ownkey}", ownkey))


def grants(prefix: str, verb: Verb, party: Party) -> bool:
    return may_publish(permissions_for(prefix, party), sample_subject(verb, party))


def matrix(prefix: str = "pgw", columns: Iterable[tuple[str, Party]] = ROLE_COLUMNS) -> list[tuple[Verb, dict[str, bool]]]:
    cols = list(columns)
    return [(v, {name: grants(prefix, v, party) for name, party in cols}) for v in VERBS]


def markdown(prefix: str = "pgw", cell: Callable[[bool], str] = lambda ok: "yes" if ok else "—") -> str:
    """The docs/security.md table: one row per verb, one column per role."""
    names = [n for n, _ in ROLE_COLUMNS]
    out = ["| verb | " + " | ".join(names) + " | why |", "|---|" + "---|" * len(names) + "---|"]
    for verb, row in matrix(prefix):
        cells = " | ".join(cell(row[n]) for n in names)
        out.append(f"| `{verb.name}` | {cells} | {verb.why} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
