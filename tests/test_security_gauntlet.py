"""The hostile-input gauntlet (issue 7): every corpus case through every inbound subject.

One secured bed (the generated authorization block, the gateway as the
service user, each agent and principal as itself) takes the whole corpus,
one case at a time, on each inbound subject:

* ``agent.a.envelope`` (JetStream): each case gets its outcome and a verdict;
  cases that must be rejected get a refusal code;
* ``agent.a.idp`` (request): each case gets a kernel reply that is a refusal;
* ``agent.a.transition`` (JetStream): each case gets a ``denied`` verdict
  (the kernel's refusal record; DESIGN §4.3 has no transition outcome);
* ``principal.p.resolve`` (request): each case gets a ``refused`` reply.

After each subject's corpus a valid message still goes through, the durable
consumer has nothing pending, and the process's peak memory stayed bounded.
Results are recorded per (subject, category) for the ``make security`` table.
"""

from __future__ import annotations

import asyncio
import json
import re
import resource
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import pytest_asyncio

from subjects.momentquery import moment_state_decoder
from subjects.wire import EnvelopeOutcome, OptionChoice, resolve_reply_decoder
from tests.gauntlet.bed import Bed, secured_bed
from tests.gauntlet.corpus import (
    Case,
    envelope_cases,
    generic_cases,
    idp_cases,
    moment_query_cases,
    resolve_cases,
    transition_cases,
)
from tests.moments import GOOD_MOMENT
from tests.polling import until
from tests.stored import stored_json

pytestmark = [pytest.mark.security, pytest.mark.asyncio(loop_scope="module")]
TABLE = "hostile-input gauntlet"
WAIT = 30.0
MUST_REFUSE = {
    "JSON n_ (must reject)", "invalid UTF-8", "resource / number attacks", "overlong strings",
    "floats for integers / decimal strings", "out of range", "schema", "Unicode bidi / tag characters",
}
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


@dataclass
class Tally:
    cases: int = 0
    refused: int = 0
    handled: int = 0
    failures: list[str] = field(default_factory=list)
    worst_s: float = 0.0
    worst: str = ""


class Results:
    def __init__(self, subject: str) -> None:
        self.subject = subject
        self.by_cat: dict[str, Tally] = defaultdict(Tally)

    def add(self, case: Case, refused: bool, failure: str | None, dt: float) -> None:
        t = self.by_cat[case.category]
        t.cases += 1
        t.refused += refused
        t.handled += failure is None
        if dt >= t.worst_s:
            t.worst_s, t.worst = dt, case.name
        if failure:
            t.failures.append(f"{case.name}: {failure}")

    def record(self, table: Any) -> list[str]:
        bad: list[str] = []
        for cat, t in sorted(self.by_cat.items()):
            ok = not t.failures
            expected = "refused" if cat in MUST_REFUSE else "handled (outcome + verdict)"
            observed = f"{t.refused}/{t.cases} refused, {t.handled}/{t.cases} ok, slowest {t.worst_s:.2f}s ({t.worst[:24]})"
            table.record(TABLE, cat, self.subject, f"{t.cases} cases", expected, observed, ok)
            bad += t.failures
        return bad


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def bed(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bed]:
    """The secured bed, with a server max_payload above 10 MB so the gateway's own limit is what refuses."""
    async with secured_bed(tmp_path_factory.mktemp("gauntlet"), server_kw={"max_payload": 16 * 1024 * 1024}) as b:
        yield b


def expected_outcomes(body: bytes, cap: int) -> int:
    """How many outcomes one turn yields: one per envelope (those past envelopesPerTurn cap.breached),
    or one for a turn longer than limits.max_turn_envelopes, refused whole."""
    try:
        v = json.loads(body)
    except (ValueError, RecursionError):
        return 1
    return len(v) if isinstance(v, list) and v and len(v) <= cap else 1


async def settled_consumer(bed: Bed, durable: str) -> Any:
    """Consumer info once the last delivery is acked (the ack follows the outcome publish); after
    WAIT the info as it is, for the caller's assertions to report."""
    js = bed.ncs["_watch"].jetstream()

    async def settled() -> Any:
        info = await js.consumer_info("PGW_INBOUND", durable)
        return info if info.num_ack_pending == 0 and info.num_pending == 0 else None

    try:
        return await until(settled, timeout=WAIT, interval=0.02)
    except TimeoutError:
        return await js.consumer_info("PGW_INBOUND", durable)


async def next_outcomes(bed: Bed, agent: str, n: int) -> list[Any]:
    it = bed.agents[agent].outcomes()
    return [await asyncio.wait_for(anext(it), WAIT) for _ in range(n)]


async def test_envelope_subject(bed: Bed, security_table) -> None:
    """Every hostile envelope body gets an outcome and a verdict, must-reject ones a refusal, and a valid envelope still goes through."""
    js = bed.ncs["agent:a"].jetstream(timeout=WAIT)
    subject = bed.config.subjects.envelope("a")
    cap = bed.config.limits.max_turn_envelopes
    res = Results("agent.a.envelope")
    seen_verdicts: set[str] = set()
    cases = [(c, None) for c in generic_cases()] + list(envelope_cases("a", "p"))
    failed_turns: list[int] = []

    async def on_failure(turn: Any, msg: Any) -> bool:
        failed_turns.append(turn.stream_seq)  # the worker crashed on it: nak, redelivery loop
        return False

    assert bed.gw is not None
    bed.gw.failure_hooks.append(on_failure)
    for n, (case, ident) in enumerate(cases):
        t0 = time.perf_counter()
        mid = f"a:{ident}" if ident and _SAFE_ID.match(ident) else f"a:g{n}"
        if ident and mid == f"a:g{n}":
            mid = None  # an id that cannot be a header: send without one
        headers = {"Nats-Msg-Id": mid} if mid else None
        failure: str | None = None
        refused = False
        try:
            await js.publish(subject, case.body, headers=headers)
            outs = await next_outcomes(bed, "a", expected_outcomes(case.body, cap))
            for out in outs:
                assert isinstance(out, EnvelopeOutcome), out
                refused = out.status != "accepted"
                v = await bed.verdict(lambda v, o=out: v.agent == "a" and v.verdict_id not in seen_verdicts
                                      and v.envelope_id == o.envelope_id)
                seen_verdicts.add(v.verdict_id)
                if refused:
                    assert v.decision == "reject" and out.code, (out.code, v.verdict_class)
            if case.category in MUST_REFUSE and not refused:
                failure = f"accepted (expected a refusal): {outs[-1]}"
        except (AssertionError, TimeoutError, Exception) as e:  # noqa: BLE001 - a row must be written either way
            failure = f"{type(e).__name__}: {str(e)[:160]}"
        res.add(case, refused, failure, time.perf_counter() - t0)

    # The stream keeps flowing: a valid envelope after the corpus is accepted.
    good = {"type": "vendor.pgw.binding_moment", "envelopeId": "after-gauntlet", "correlationId": "after-gauntlet",
            "meta": {"source": "ai-generation", "ts": "2026-01-01T00:00:00Z"},
            "payload": {"principal": "p", "binding_moment": GOOD_MOMENT}}
    await bed.agents["a"].send(good)
    after = await bed.agents["a"].outcome_for("after-gauntlet", timeout=WAIT)
    info = await settled_consumer(bed, "pgw-gateway")
    live = after.status == "accepted" and info.num_ack_pending == 0 and info.num_pending == 0
    security_table.record(TABLE, "valid envelope after corpus", "agent.a.envelope", "consumer pgw-gateway",
                          "accepted, nothing pending", f"{after.status}, ack_pending {info.num_ack_pending}, "
                          f"pending {info.num_pending}", live)
    security_table.record(TABLE, "worker failures (nak / redelivery)", "agent.a.envelope", "envelope worker",
                          "0", str(len(failed_turns)), not failed_turns)
    bad = res.record(security_table)
    assert not bad, "\n".join(bad)
    assert live, (after, info)
    assert not failed_turns, f"the worker failed on stream seqs {failed_turns}"


async def test_idp_subject(bed: Bed, security_table) -> None:
    """Every hostile transition request gets a refusal reply from the kernel, and the kernel still answers afterwards."""
    nc = bed.ncs["agent:a"]
    subject = bed.config.subjects.idp("a")
    res = Results("agent.a.idp")
    for case in generic_cases() + idp_cases():
        t0 = time.perf_counter()
        failure, refused = None, False
        try:
            reply = await nc.request(subject, case.body, timeout=WAIT)
            doc = msgspec.json.decode(reply.data)
            refused = (isinstance(doc, dict) and doc.get("result") in ("REJECT", "DENY")) or "error_code" in doc
            if not refused:
                failure = f"not refused: {reply.data[:160]!r}"
        except Exception as e:  # noqa: BLE001
            failure = f"{type(e).__name__}: {str(e)[:160]}"
        res.add(case, refused, failure, time.perf_counter() - t0)
    # Liveness: a well-formed request is still answered (with the kernel's verdict on it).
    reply = await nc.request(subject, json.dumps({"mandate": "a.b.c", "action": "Read", "idp": {}}).encode(), timeout=WAIT)
    alive = bool(reply.data)
    security_table.record(TABLE, "request after corpus is answered", "agent.a.idp", "kernel", "answered",
                          reply.data[:60].decode(errors="replace"), alive)
    bad = res.record(security_table)
    assert not bad, "\n".join(bad)
    assert alive


async def test_transition_subject(bed: Bed, security_table) -> None:
    """Every hostile transition report yields a denied verdict for its sender, and the kernel's consumer is not stalled."""
    js = bed.ncs["agent:a"].jetstream(timeout=WAIT)
    subject = bed.config.subjects.transition("a")
    res = Results("agent.a.transition")
    seen: set[str] = {v.verdict_id for v in bed.verdicts}
    for n, case in enumerate(generic_cases() + transition_cases()):
        t0 = time.perf_counter()
        failure, refused = None, False
        try:
            await js.publish(subject, case.body, headers={"Nats-Msg-Id": f"a:t{n}"})
            v = await bed.verdict(lambda v: v.agent == "a" and v.verdict_id not in seen and v.verdict_class == "denied")
            seen.add(v.verdict_id)
            refused = v.decision == "reject"
        except Exception as e:  # noqa: BLE001
            failure = f"{type(e).__name__}: {str(e)[:160]}"
        res.add(case, refused, failure, time.perf_counter() - t0)
    info = await settled_consumer(bed, "pgw-kernel")
    live = info.num_ack_pending == 0 and info.num_pending == 0
    security_table.record(TABLE, "consumer after corpus", "agent.a.transition", "consumer pgw-kernel",
                          "nothing pending", f"ack_pending {info.num_ack_pending}, pending {info.num_pending}", live)
    bad = res.record(security_table)
    assert not bad, "\n".join(bad)
    assert live


async def test_resolve_subject(bed: Bed, security_table) -> None:
    """Every hostile resolution is refused, the moment stays pending, and a valid answer afterwards is accepted."""
    await bed.agents["a"].send({"type": "vendor.pgw.binding_moment", "envelopeId": "resolve-target",
                                "correlationId": "resolve-target",
                                "meta": {"source": "ai-generation", "ts": "2026-01-01T00:00:00Z"},
                                "payload": {"principal": "p", "binding_moment": GOOD_MOMENT}})
    out = await bed.agents["a"].outcome_for("resolve-target", timeout=WAIT)
    assert out.status == "accepted" and out.moment_id
    nc = bed.ncs["principal:p"]
    subject = bed.config.subjects.resolve("p")
    res = Results("principal.p.resolve")
    for case in generic_cases() + resolve_cases(out.moment_id):
        t0 = time.perf_counter()
        failure, refused = None, False
        try:
            reply = resolve_reply_decoder.decode((await nc.request(subject, case.body, timeout=WAIT)).data)
            refused = reply.status == "refused" and bool(reply.code)
            if not refused:
                failure = f"not refused: {reply}"
        except Exception as e:  # noqa: BLE001
            failure = f"{type(e).__name__}: {str(e)[:160]}"
        res.add(case, refused, failure, time.perf_counter() - t0)
    final = await bed.surfaces["p"].resolve(out.moment_id, OptionChoice(index=0))
    security_table.record(TABLE, "valid answer after corpus", "principal.p.resolve", "moment", "accepted",
                          final.status, final.status == "accepted")
    bad = res.record(security_table)
    assert not bad, "\n".join(bad)
    assert final.status == "accepted", final


async def test_moment_query_subject(bed: Bed, security_table) -> None:
    """Every hostile moment query is refused with a code, and a well-formed one afterwards is still answered."""
    await bed.agents["a"].send({"type": "vendor.pgw.binding_moment", "envelopeId": "query-target",
                                "correlationId": "query-target",
                                "meta": {"source": "ai-generation", "ts": "2026-01-01T00:00:00Z"},
                                "payload": {"principal": "p", "binding_moment": GOOD_MOMENT}})
    out = await bed.agents["a"].outcome_for("query-target", timeout=WAIT)
    assert out.status == "accepted" and out.moment_id
    nc = bed.ncs["agent:a"]
    subject = bed.config.subjects.moment("a")
    res = Results("agent.a.moment")
    for case in generic_cases() + moment_query_cases(out.moment_id):
        t0 = time.perf_counter()
        failure, refused = None, False
        try:
            reply = moment_state_decoder.decode((await nc.request(subject, case.body, timeout=WAIT)).data)
            refused = reply.status == "refused" and reply.refusal is not None and bool(reply.refusal.code)
            if not refused:
                failure = f"not refused: {reply}"
        except Exception as e:  # noqa: BLE001
            failure = f"{type(e).__name__}: {str(e)[:160]}"
        res.add(case, refused, failure, time.perf_counter() - t0)
    state = await bed.agents["a"].moment_state(out.moment_id)
    security_table.record(TABLE, "valid query after corpus", "agent.a.moment", "moment", "pending",
                          state.status, state.status == "pending")
    listed = [m.moment_id for m in await bed.agents["a"].open_moments()]
    security_table.record(TABLE, "valid list after corpus", "agent.a.moment", "list", "lists the pending moment",
                          str(listed)[:80], out.moment_id in listed)
    bad = res.record(security_table)
    assert not bad, "\n".join(bad)
    assert state.status == "pending", state
    assert out.moment_id in listed, listed


async def test_memory_stays_bounded(bed: Bed, security_table) -> None:
    """After the whole corpus (10 MB bodies, 10,000-deep nesting, 100k arrays) the process's peak RSS stayed bounded."""
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ok = peak_mb < 1024
    security_table.record(TABLE, "peak memory of test process + gateway", "all subjects", "RSS",
                          "< 1024 MB", f"{peak_mb:.0f} MB", ok)
    assert ok, peak_mb


UNREADABLE_SUBJECTS = ["pgw.agent.bad~agent.envelope", "pgw.agent." + "x" * 65 + ".envelope", "pgw.agent.ünï.envelope"]


@pytest.mark.asyncio(loop_scope="function")
async def test_unidentifiable_sender_is_a_logged_drop(gateway, nc, security_table) -> None:
    """A message whose subject names no valid agent (open mode, no server auth) is dropped with a logged reason; the next valid envelope goes through."""
    import structlog

    from subjects.client import Agent

    js = nc.jetstream()
    with structlog.testing.capture_logs() as logs:
        for s in UNREADABLE_SUBJECTS:
            await js.publish(s, b'{"type": "error"}')
        agent = Agent(nc, "after-drop")
        try:
            await agent.send({"type": "vendor.pgw.binding_moment", "envelopeId": "after-drop-1",
                              "correlationId": "after-drop-1",
                              "meta": {"source": "ai-generation", "ts": "2026-01-01T00:00:00Z"},
                              "payload": {"principal": "alice", "binding_moment": GOOD_MOMENT}})
            out = await agent.outcome_for("after-drop-1", timeout=WAIT)
        finally:
            await agent.close()
    drops = [e for e in logs if e.get("event") == "dropped message on an invalid subject"]
    ok = out.status == "accepted" and len(drops) == len(UNREADABLE_SUBJECTS)
    security_table.record(TABLE, "sender unidentifiable (bad subject token)", "open mode", "envelope worker",
                          "logged drop; next accepted", f"{len(drops)} drops logged; next {out.status}", ok)
    assert ok, (out, drops)


EMPTY_INPUTS = {"empty body": (b"", "empty_body"), "empty array": (b"[]", "empty_turn"),
                "word joiner only": ("\u2060".encode(), "invisible_body")}


@pytest.mark.asyncio(loop_scope="function")
async def test_empty_inputs_each_get_one_outcome_verdict_and_capsule_every_time(tmp_path, security_table) -> None:
    """An empty body, [] and a lone U+2060, each published twice by a raw nats-py agent (with and without a
    Nats-Msg-Id), get one refusal outcome per publish with their own rule, a verdict and a capsule each."""
    from consumers.signer import Signer
    from gateway.security import agent_durable
    from subjects.wire import outcome_decoder
    from tests.test_capsule_signer import wait_count
    from tests.test_security_squat import raw_agent

    async with secured_bed(tmp_path) as bed:
        a = await raw_agent(bed, "a")
        js = bed.ncs["_watch"].jetstream()
        sub = await a.jetstream().pull_subscribe_bind(agent_durable("a"), "PGW_OUTBOUND")
        subject = bed.config.subjects.envelope("a")
        got: list[tuple[str, str | None, str | None]] = []
        try:
            async with Signer(bed.config, bed.ncs["_watch"]):
                for name, (body, rule) in EMPTY_INPUTS.items():
                    for attempt in range(2):
                        if attempt == 0:
                            await a.publish(subject, body)  # core NATS, no header: as the nats CLI does
                        else:
                            await a.jetstream().publish(subject, body, headers={"Nats-Msg-Id": f"a:{name}-{attempt}"})
                        msgs = await sub.fetch(1, timeout=WAIT)
                        await msgs[0].ack()
                        out = outcome_decoder.decode(msgs[0].data)
                        assert isinstance(out, EnvelopeOutcome)
                        got.append((name, out.code, out.details[0].rule if out.details else None))
                        assert (out.code, got[-1][2]) == ("invalid_envelope_shape", rule), (name, attempt, out)
                n = 2 * len(EMPTY_INPUTS)
                await wait_count(js, "PGW_VERDICTS", n)
                await wait_count(js, "PGW_REGISTRATION", n)  # one capsule per verdict
            verdicts = [v for v in await stored_json(js, "PGW_VERDICTS") if v["agent"] == "a"]
            assert len({v["verdict_id"] for v in verdicts}) == n, verdicts
            assert all(v["decision"] == "reject" and v["reason"]["code"] == "invalid_envelope_shape" for v in verdicts)
        finally:
            await a.close()
    security_table.record(TABLE, "empty / [] / U+2060 bodies, each sent twice", "agent.a.envelope", "raw agent",
                          "one outcome + verdict + capsule per publish", f"{len(got)} outcomes", True)
