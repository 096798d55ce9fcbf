"""The reply rule as a hostile party meets it (docs/security.md "Replies", docs/contract.md §6).

Generated from docs/contract.md: every request subject of §2 (the core request-reply rows, and
the services API the ops row names) that a party's own credentials let it publish (§8, matched
as the server matches), for an agent, a principal, an executor, an ops user and an auditor, is
sent with every hostile reply subject (each stream's subjects of §4, each bucket's keys of §5,
``exec.>``, ``log.*``, another party's inbox, the JetStream API) and every hostile header. All of
it through a real nats-server, in two beds:

- ``pgw up`` in a subprocess, on its own server with the nkey block it generates;
- the same services in this process on a server in operator mode (JWT users).

Afterwards: no stream and no bucket changed (every message count and last sequence as before),
alice's pending moment still answerable, no executor called, nothing delivered on a hostile
reply subject (an ops user hears every contract subject; the victims hear their inboxes), and
each service still answers each party's own request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from gateway.security import Party
from gateway.security.jsapi import may_publish
from gateway.security.permissions import permissions_for
from pgwcore.config import Config, load_config
from pgwcore.connect import close_quietly, connect
from subjects.client import Agent, Surface
from subjects.executor import Executor
from tests.gauntlet.bed import flushed
from tests.moments import good_moment
from tests.polling import until

pytestmark = [pytest.mark.security]

ROOT = Path(__file__).resolve().parent.parent
CONTRACT = ROOT / "docs" / "contract.md"
PGW = str(Path(sys.executable).parent / "pgw")
PREFIX = "pgw"
WAIT = 20.0  # guard only: each wait is for an event
TABLE = "hostile reply subjects and headers"

AGENT, OTHER_AGENT = "a1", "a2"
PRINCIPAL, OTHER_PRINCIPAL = "alice", "bob"
OPS, AUDITOR, KIND, ACTION = "olive", "carol", "files", "WriteFile"
ATTACKERS = [Party("agent", AGENT), Party("principal", PRINCIPAL), Party("executor", KIND),
             Party("ops", OPS), Party("audit", AUDITOR)]
# Each template variable of the contract's subjects, as the attacker's own (or a victim's) name.
NAMES = {"agent": AGENT, "principal": PRINCIPAL, "auditor": AUDITOR, "kind": KIND, "action": ACTION,
         "service": "gateway", "verb": "subscribe", "event": "MANDATE_REVOKED", "verdict_class": "blocked",
         "stream": "PGW_INBOUND", "verdict_id": "v1"}
HOSTILE_HEADERS: list[dict[str, str] | None] = [
    None,
    {"Nats-Rollup": "all"},
    {"Nats-Rollup": "sub"},
    {"KV-Operation": "PURGE"},
    {"KV-Operation": "DEL"},
    {"Nats-Msg-Id": "hostile"},
    {"Nats-Expected-Last-Sequence": "0"},
    {"Nats-Expected-Last-Subject-Sequence": "0"},
    {"Nats-TTL": "1s"},
]


# -- what docs/contract.md says ----------------------------------------------------------

def _section(number: int) -> str:
    text = CONTRACT.read_text(encoding="utf-8")
    m = re.search(rf"^## {number}\. .*?(?=^## {number + 1}\. )", text, re.S | re.M)
    assert m, f"docs/contract.md has no section {number}"
    return m.group(0)


def _rows(number: int) -> list[list[str]]:
    rows = []
    for line in _section(number).splitlines():
        if line.startswith("| `"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def _fill(template: str, **names: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: {**NAMES, **names}[m.group(1)], template)


def request_templates() -> list[str]:
    """§2's request subjects (core request-reply) with the prefix, and the services API it names."""
    out: list[str] = []
    for row in _rows(2):
        subject = re.findall(r"`([^`]+)`", row[0])[0]
        if "request-reply" in row[4]:  # the transport column
            out.append(f"{PREFIX}.{subject}")
        out += [s for s in dict.fromkeys(re.findall(r"`(\$SRV\.[A-Z]+)`", " ".join(row))) if s not in out]
    assert len(out) >= 12, out  # idp, act, exec x2, moment, resolve, pending, push, capabilities, revoke, audit, status, $SRV
    return out


def requests_of(party: Party) -> list[str]:
    """The request subjects ``party`` may publish, as the server decides (deny wins over allow)."""
    perms = permissions_for(PREFIX, party)
    subjects = [_fill(t, **{party.role if party.role != "audit" else "auditor": party.name}) for t in request_templates()]
    return sorted({s for s in subjects if may_publish(perms, s)})


def stream_subjects() -> list[str]:
    """One concrete subject of each subject pattern of each stream of §4, a victim's where it names a party."""
    out = []
    for row in _rows(4):
        for pattern in re.findall(r"`([^`]+)`", row[1]):
            parts = pattern.split(".")
            tokens = []
            for i, tok in enumerate(parts):
                if tok == "*":  # a victim's name where the token names a party, else an event or a class
                    tokens.append({"agent": OTHER_AGENT, "principal": PRINCIPAL, "verdict": "blocked", "log": "MANDATE_REVOKED"}
                                  .get(parts[i - 1] if i else "", "x"))
                else:
                    tokens.append("eventlog" if tok == ">" else tok)
            out.append(f"{PREFIX}." + ".".join(tokens))
    out += [f"{PREFIX}.agent.{AGENT}.outcome", f"{PREFIX}.principal.{OTHER_PRINCIPAL}.surface",
            f"{PREFIX}.log.STATE_TRANSITIONED"]
    return sorted(set(out))


def bucket_names() -> list[str]:
    names = []
    for row in _rows(5):
        name = re.findall(r"`([^`]+)`", row[0])[0]
        names.append(name.replace("{KIND}", KIND.upper()))
    return names


def hostile_replies(moment_id: str) -> list[str]:
    buckets = [f"$KV.{b}.{PRINCIPAL}.{moment_id}" if b == "PGW_MOMENTS" else f"$KV.{b}.x" for b in bucket_names()]
    return [
        *stream_subjects(),
        *buckets,
        f"{PREFIX}.exec.{KIND}.{ACTION}",
        f"{PREFIX}.exec.{KIND}._result",
        f"_INBOX_agent_{OTHER_AGENT}.x.y", f"_INBOX_principal_{OTHER_PRINCIPAL}.x.y",
        f"_INBOX_ops_{OPS}.x", "_INBOX_service_services.x", "_INBOX_service_gateway.x",
        "_INBOX.x.y",  # nats' shared inbox: nobody's on a server with per-party credentials
        "$JS.API.STREAM.PURGE.PGW_SURFACE", "$JS.API.STREAM.DELETE.PGW_EVENTLOG",
        "$JS.API.CONSUMER.DELETE.PGW_SURFACE.surface-alice", "$JS.API.STREAM.MSG.DELETE.KV_PGW_REVOKED",
        "$SRV.PING", f"{PREFIX}.capabilities", f"{PREFIX}.kernel.revoke",
    ]


def test_the_matrix_is_generated_from_the_contract() -> None:
    """The generator reads what the contract names, so a new request subject, stream or bucket joins the matrix."""
    assert f"{PREFIX}.agent.{AGENT}.idp" in requests_of(Party("agent", AGENT))
    assert f"{PREFIX}.principal.{PRINCIPAL}.push.subscribe" in requests_of(Party("principal", PRINCIPAL))
    assert f"{PREFIX}.kernel.audit.{AUDITOR}" in requests_of(Party("audit", AUDITOR))
    assert "$SRV.PING" in requests_of(Party("ops", OPS)) and f"{PREFIX}.kernel.revoke" in requests_of(Party("ops", OPS))
    assert f"{PREFIX}.exec.{KIND}.{ACTION}" not in requests_of(Party("agent", AGENT))
    replies = hostile_replies("m")
    for s in (f"{PREFIX}.principal.{PRINCIPAL}.surface", f"{PREFIX}.verdict.blocked", f"{PREFIX}.log.MANDATE_REVOKED",
              f"{PREFIX}.agent.{OTHER_AGENT}.outcome", f"$KV.PGW_MOMENTS.{PRINCIPAL}.m", "$KV.PGW_REVOKED.x",
              f"{PREFIX}.checkpoint.eventlog", f"{PREFIX}.capsule.register"):
        assert s in replies, s


# -- the beds ------------------------------------------------------------------------

@dataclass
class Bed:
    mode: str
    config: Config
    url: str
    creds: Path
    conns: dict[str, Any] = field(default_factory=dict)
    executor_calls: list[Any] = field(default_factory=list)
    refused_metric: Any = None  # in-process only: the services' pgw_replies_refused_total
    log: Path | None = None  # `pgw up`'s JSON log

    async def conn(self, party: Party) -> Any:
        if party.label not in self.conns:
            self.conns[party.label] = await connect(self.url, creds=str(self.creds / party.filename), name=party.label)
        return self.conns[party.label]


def _config_toml(data: Path) -> str:
    return f"""
[server]
port = -1
monitor_port = -1
websocket_port = -1
[agents.{AGENT}]
principals = ["{PRINCIPAL}"]
[agents.{OTHER_AGENT}]
principals = ["{OTHER_PRINCIPAL}"]
[security]
ops = ["{OPS}"]
auditors = ["{AUDITOR}"]
[kernel.executors.{KIND}]
actions = ["{ACTION}"]
"""


@contextlib.asynccontextmanager
async def pgw_up_bed(tmp: Path) -> AsyncIterator[Bed]:
    """`pgw up` in a subprocess, as `make run` starts it, with the parties above configured."""
    from tests.test_up import read_until

    cfg = tmp / "pgw.toml"
    data = tmp / "data"
    cfg.write_text(_config_toml(data))
    env = {**os.environ, "PGW_LOG_LEVEL": "WARNING"}
    log = tmp / "pgw-up.log"
    with log.open("wb") as err:
        # A plain Popen: tests.test_up.read_until reads its stdout with select, as test_up does (it returns at once).
        proc = subprocess.Popen([PGW, "--config", str(cfg), "--data-dir", str(data), "--log-format", "json", "up"],  # noqa: ASYNC220
                                stdout=subprocess.PIPE, stderr=err, env=env)
    try:
        _, m = read_until(proc, r"NATS\s+(nats://127\.0\.0\.1:\d+)", timeout=90)
        config = load_config(cfg, data_dir=str(data))
        yield Bed("pgw up", config, m.group(1), data / "creds", log=log)
    finally:
        proc.send_signal(2)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.asynccontextmanager
async def operator_bed(tmp: Path) -> AsyncIterator[Bed]:
    """The same services in this process, on a server in operator mode (one JWT user per party)."""
    from gateway.security.accounts import operator_auth
    from pgwcli.commands.up import UP_SERVICES, load_factory
    from pgwcore.metrics import REPLIES_REFUSED
    from pgwcore.server import EmbeddedServer
    from pgwcore.service import run_services
    from pgwcore.streams import ensure_streams

    data = tmp / "data"
    base = load_config(None, data_dir=str(data), agents={AGENT: {"principals": [PRINCIPAL]}, OTHER_AGENT: {"principals": [OTHER_PRINCIPAL]}},
                       security={"ops": [OPS], "auditors": [AUDITOR]},
                       kernel={"executors": {KIND: {"actions": [ACTION]}}})
    auth = operator_auth(base, tenant="acme")
    server = EmbeddedServer(tmp / "nats", port=-1, monitor_port=-1, websocket_port=-1, authorization=auth.server_block)
    await server.start()
    stop = asyncio.Event()
    task: asyncio.Task[None] | None = None
    nc = None
    try:
        config = msgspec.structs.replace(base, nats_url=server.client_url, creds=str(auth.service_creds))
        nc = await connect(server.client_url, creds=config.creds, name="services")
        await ensure_streams(nc.jetstream(), config.subjects)
        services = [load_factory(n)(config, nc) for n in UP_SERVICES if n != "surface-slack"]
        started = asyncio.Event()
        task = asyncio.create_task(run_services(services, stop, on_started=started.set))
        await asyncio.wait_for(started.wait(), 60)
        yield Bed("operator mode", config, server.client_url, auth.party_creds_dir, refused_metric=REPLIES_REFUSED)
    finally:
        stop.set()
        if task is not None:
            await asyncio.wait_for(task, 60)
        if nc is not None:
            await close_quietly(nc)
        await server.stop()


BEDS = {"pgw up": pgw_up_bed, "operator": operator_bed}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=list(BEDS))
async def bed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bed]:
    async with BEDS[request.param](tmp_path_factory.mktemp("replies")) as b:
        try:
            yield b
        finally:
            for c in b.conns.values():
                with contextlib.suppress(Exception):
                    await close_quietly(c, timeout=2)


# -- the stores, before and after ------------------------------------------------------------

async def store_state(js: Any) -> dict[str, tuple[int, int]]:
    """Every stream (contract streams and KV buckets): (messages, last sequence)."""
    out = {}
    for info in await js.streams_info():
        out[info.config.name] = (info.state.messages, info.state.last_seq)
    return out


async def quiet(js: Any) -> None:
    """Wait until the signer has taken every verdict (its durable has nothing pending or unacked)."""
    async def drained() -> bool:
        ci = await js.consumer_info("PGW_VERDICTS", "pgw-signer")
        return ci.num_pending == 0 and ci.num_ack_pending == 0

    await until(drained, timeout=WAIT, what="the signer taking its verdicts")


async def own_request(bed: Bed, party: Party, subject: str) -> bytes:
    """The party's own request, answered on its own inbox: the service still serves it."""
    nc = await bed.conn(party)
    body = b'{"list": "open"}' if subject.endswith(".moment") else b"{}"
    reply = await nc.request(subject, body, timeout=WAIT)
    return reply.data


ANYONE_SUBJECTS = (f"{PREFIX}.capabilities", "$SRV.")  # docs/contract.md §6: answered to any party's inbox
MICRO_SERVICES = 4  # gateway, signer, registrar, notifier each register with the services API


def acceptable(party: Party, subject: str, reply: str) -> bool:
    """What the contract lets a request be answered on (written out here, not taken from the code):
    the asker's own inbox; for a request anyone may send, any party's inbox."""
    if reply.startswith(f"_INBOX_{party.role}_{party.name}."):
        return True
    return subject.startswith(ANYONE_SUBJECTS) and re.match(r"^_INBOX_[a-z]+_[A-Za-z0-9_-]+\.", reply) is not None


def refusals_expected(attempts: list[tuple[Party, str, str, dict[str, str] | None]]) -> int:
    """Log lines (and metric counts) the services write for ``attempts``: one per request, one per
    registration for the services API (every registered service hears ``$SRV.PING``)."""
    return sum(MICRO_SERVICES if subject.startswith("$SRV.") else 1 for _, subject, _, _ in attempts)


async def refusals_seen(bed: Bed, since: Any) -> tuple[int, list[dict[str, Any]]]:
    """How many refusals the services have written since ``since``: the log lines of `pgw up`, or the metric."""
    if bed.log is not None:
        lines = [ln for ln in bed.log.read_text(errors="replace").splitlines() if "request not answered" in ln]
        recs = [msgspec.json.decode(ln) for ln in lines]
        return len(recs) - since, recs[since:]
    return int(_refused(bed) - since), []


@pytest.mark.asyncio(loop_scope="module")
async def test_no_hostile_reply_subject_or_header_changes_anything(bed: Bed, security_table) -> None:
    """Every request subject x hostile reply x hostile header, by agent, principal, executor, ops and auditor."""
    ops_party = Party("ops", OPS)
    ops = await bed.conn(ops_party)
    service = await connect(bed.url, creds=str(bed.creds / Party("service", "services").filename), name="probe")
    sjs = service.jetstream()
    try:
        # alice has a pending moment, opened by a1: the target of the $KV.PGW_MOMENTS reply.
        agent = Agent(await bed.conn(Party("agent", AGENT)), AGENT, prefix=PREFIX)
        surface = Surface(await bed.conn(Party("principal", PRINCIPAL)), PRINCIPAL, prefix=PREFIX)
        await agent.send_moment(PRINCIPAL, good_moment())
        items = await until(surface.pending, timeout=WAIT, what="alice's moment pending")
        moment_id = items[0].moment_id

        executor = Executor(await bed.conn(Party("executor", KIND)), KIND, prefix=PREFIX)

        @executor.action(ACTION)
        async def write(args: dict[str, Any]) -> dict[str, Any]:
            bed.executor_calls.append(args)
            return {"ok": True}

        async with executor:
            await quiet(sjs)
            replies = hostile_replies(moment_id)
            heard: list[str] = []

            async def hear(msg: Any) -> None:
                if not msg.reply:  # an answer (the attack's own requests carry their hostile reply)
                    heard.append(msg.subject)

            # An ops user hears every contract subject; each victim its own inbox.
            await ops.subscribe(f"{PREFIX}.>", cb=hear)
            await (await bed.conn(Party("agent", OTHER_AGENT))).subscribe(f"_INBOX_agent_{OTHER_AGENT}.x.>", cb=hear)
            await (await bed.conn(Party("principal", OTHER_PRINCIPAL))).subscribe(f"_INBOX_principal_{OTHER_PRINCIPAL}.x.>", cb=hear)
            await ops.subscribe(f"_INBOX_ops_{OPS}.x", cb=hear)
            for c in bed.conns.values():
                await flushed(c)
            before = await store_state(sjs)
            seen_before = (await refusals_seen(bed, 0))[0] if bed.log is not None else _refused(bed)

            attempts = [(party, subject, reply, headers)
                        for party in ATTACKERS for subject in requests_of(party)
                        for reply in replies if not acceptable(party, subject, reply)
                        for headers in HOSTILE_HEADERS]
            for party, subject, reply, headers in attempts:
                body = b'{"list": "open"}' if subject.endswith(".moment") else b"{}"
                await (await bed.conn(party)).publish(subject, body, reply=reply, headers=headers)
            for c in bed.conns.values():
                await flushed(c)
            # Every attempt reaches its service and is refused there: wait for the last refusal.
            expected = refusals_expected(attempts)
            async def all_refused() -> bool:  # the services' log (or metric) names every refusal
                return (await refusals_seen(bed, seen_before))[0] >= expected

            with contextlib.suppress(TimeoutError):  # short of it is reported below, with what changed
                await until(all_refused, timeout=60, interval=0.1, what="every refusal logged")
            count, recs = await refusals_seen(bed, seen_before)
            await flushed(ops)
            await quiet(sjs)
            after = await store_state(sjs)
            for c in bed.conns.values():
                await flushed(c)

            # Each service still answers its own party, on every subject.
            for party in ATTACKERS:
                for subject in requests_of(party):
                    assert await own_request(bed, party, subject), f"{party.label}: no answer on {subject}"
    finally:
        await close_quietly(service, timeout=2)

    changed = {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}
    targets = set(replies)
    landed = sorted({s for s in heard if s in targets or s.startswith(("_INBOX_agent_", "_INBOX_principal_", "_INBOX_ops_"))})
    ok = not changed and not landed and not bed.executor_calls and count == expected
    security_table.record(TABLE if bed.mode == "pgw up" else f"{TABLE} (operator mode)",
                          f"{len(attempts)} requests, hostile reply and headers", "agent, principal, executor, ops, audit",
                          "every service", "not served, no store changed",
                          f"{count}/{expected} refused, none changed" if ok else f"changed {sorted(changed)} landed {landed[:5]}", ok)
    assert not changed, f"{bed.mode}: stores changed by hostile replies: {changed}"
    assert not landed, f"{bed.mode}: messages delivered on hostile reply subjects: {landed[:20]}"
    assert not bed.executor_calls, f"{bed.mode}: the executor was called {len(bed.executor_calls)} times"
    assert count == expected, f"{bed.mode}: {count} refusals logged for {expected} expected"
    assert {p.role for p, *_ in attempts} == {"agent", "principal", "ops", "audit"}  # the executor may send no request
    for rec in recs[:50]:  # the security line names the request, the reply subject and who may ask
        assert rec["level"] == "warning" and rec["request"] and rec["reply"] and rec["party"], rec
    if bed.log is not None:  # every service's endpoints were allowed to start (ops.{service}.status included)
        violations = [ln for ln in bed.log.read_text(errors="replace").splitlines() if "permissions violation" in ln]
        assert not violations, violations[:5]

    # alice's moment is intact: she sees it and her answer is taken.
    surface = Surface(await bed.conn(Party("principal", PRINCIPAL)), PRINCIPAL, prefix=PREFIX)
    item = next(i for i in await surface.pending() if i.moment_id == moment_id)
    reply = await surface.choose(item, 0)
    assert reply.status == "accepted", reply


def _refused(bed: Bed) -> float:
    if bed.refused_metric is None:
        return 0.0
    return sum(s.value for fam in bed.refused_metric.collect() for s in fam.samples if s.name.endswith("_total"))


@pytest.mark.asyncio(loop_scope="module")
async def test_a_publish_acknowledgement_aimed_at_a_store_breaks_no_reader(bed: Bed, security_table) -> None:
    """What the reply rule cannot stop (docs/security.md "Replies", "What the server still does"): an agent's
    JetStream publish on its own envelope subject with a reply subject that a stream or bucket captures makes the
    server store its acknowledgement there. Such a record is the server's fixed `{"stream", "seq"}` body; every
    reader skips it: alice still sees her pending moment, the agent still lists its moments, the gateway answers."""
    a1 = await bed.conn(Party("agent", AGENT))
    agent = Agent(a1, AGENT, prefix=PREFIX)
    surface = Surface(await bed.conn(Party("principal", PRINCIPAL)), PRINCIPAL, prefix=PREFIX)
    await agent.send_moment(PRINCIPAL, good_moment())
    # (Not the agent's outcome: the first test's agent, on the same durable, may take it.)
    before = await until(surface.pending, timeout=WAIT, what="alice's moment pending")
    targets = [f"$KV.PGW_MOMENTS.{PRINCIPAL}.zzz", f"$KV.PGW_MOMENTS.{PRINCIPAL}.{uuid_hex()}",
               f"$KV.PGW_MOMENTS.{OTHER_PRINCIPAL}.zzz", f"{PREFIX}.verdict.blocked"]
    for reply in targets:
        await a1.publish(f"{PREFIX}.agent.{AGENT}.envelope", b"{}", reply=reply)
    await flushed(a1)
    ops = await bed.conn(Party("ops", OPS))
    async def stored() -> bool:  # the residual: the server stores its acknowledgement, after the envelope
        got = await ops.request("$JS.API.STREAM.MSG.GET.KV_PGW_MOMENTS",
                                msgspec.json.encode({"last_by_subj": targets[0]}), timeout=WAIT)
        return b'"message"' in got.data

    await until(stored, timeout=WAIT, what="the acknowledgement stored under alice's key")
    after = await surface.pending()
    assert [i.moment_id for i in after] == [i.moment_id for i in before], (before, after)
    listed = await agent.list_moments("open")
    assert listed.status != "refused" and any(m.moment_id == before[0].moment_id for m in listed.moments or []), listed
    reply = await surface.choose(after[0], 0)
    assert reply.status == "accepted", reply
    security_table.record(TABLE if bed.mode == "pgw up" else f"{TABLE} (operator mode)",
                          "publish acknowledgement aimed at a bucket", f"agent:{AGENT}", f"principal:{PRINCIPAL}",
                          "readers skip it", "pending, list and answer unaffected", True)


def uuid_hex() -> str:
    import uuid

    return uuid.uuid4().hex
