"""The server's acknowledgement, aimed at the gateway's stores by an agent (docs/security.md "Replies").

An agent's JetStream publish on its own ``agent.{agent}.envelope`` with a reply subject makes nats-server
send its acknowledgement, ``{"stream": "PGW_INBOUND", "seq": N}``, to that subject with the account's
rights, and a bucket or stream capturing it stores it. No permission names a reply subject, so the server
lets any agent do it. What holds is that every reader skips a record it did not write. A docs-only attack
found readers that did not: the kernel's log positions (every start of the gateway failed after one such
publish), its open permits (every overdue sweep failed), the signer's ledger (no capsule was signed again).

Each test here is the attack through the bus, with an agent's real credentials on a secured server, and
shows the reader goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gateway.kernel.service import KernelService
from pgwcore.kvread import listing
from pgwcore.msgget import last_seq_under
from tests.gauntlet.bed import Bed, flushed, secured_bed
from tests.polling import until

pytestmark = pytest.mark.security
WAIT = 15.0


async def aim(bed: Bed, agent: str, target: str, *, api: bool = False, empty: bool = False,
              erased_ok: bool = False) -> None:
    """``agent`` publishes an empty envelope with ``target`` as its reply subject; returns once the server's
    acknowledgement is stored under ``target`` (read by the services' connection). ``api``: a JetStream API
    request about the agent's own consumer instead, whose answer (``{"type": "io.nats.jetstream.api...``) is
    stored there. ``empty``: a no-wait pull of the agent's own outcome consumer, emptied first, whose answer
    (a ``404 No Messages`` status) is stored there as an empty record. ``erased_ok``: the gateway may erase it
    as soon as it is stored (a held text already due), so a sequence stored after the publish and since erased
    counts too (the target's stream takes no other write that is erased meanwhile)."""
    nc = bed.ncs[f"agent:{agent}"]
    stream = _stream_of(target)
    watch = bed.ncs["_watch"]
    before = (await watch.jetstream().stream_info(stream)).state.last_seq if erased_ok else 0
    pull = f"$JS.API.CONSUMER.MSG.NEXT.PGW_OUTBOUND.outcome-{agent}"
    if empty:
        # Every envelope sent before answered first, so its outcome is not delivered to ``target`` in place of
        # the empty answer (each is published before its input is acknowledged).
        from gateway.pipeline import DURABLE

        async def answered() -> bool:
            info = await bed.ncs["_watch"].jetstream().consumer_info("PGW_INBOUND", DURABLE)
            return info.num_pending == 0 and info.num_ack_pending == 0

        await until(answered, timeout=WAIT, what="the gateway's answer to every envelope sent before")
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        while True:  # the consumer's pending outcomes acknowledged, so the next pull finds none
            await nc.publish(pull, b'{"batch": 1, "no_wait": true}', reply=inbox)
            got = await sub.next_msg(timeout=WAIT)
            if not got.data and (got.headers or {}).get("Status") in ("404", "408"):
                break
            if got.reply:
                await nc.publish(got.reply, b"+ACK")
        await sub.unsubscribe()
        await nc.publish(pull, b'{"batch": 1, "no_wait": true}', reply=target)
    elif api:
        await nc.publish(f"$JS.API.CONSUMER.INFO.PGW_OUTBOUND.outcome-{agent}", b"", reply=target)
    else:
        await nc.publish(bed.config.subjects.envelope(agent), b"{}", reply=target)
    await flushed(nc)
    mark = b'"io.nats.jetstream.api.' if api else b"PGW_INBOUND"

    def found(data: bytes) -> bool:
        return data == b"" if empty else mark in data

    async def erased_since() -> bool:
        # A sequence stored after the publish and gone: deleted inside the stream, or below its first (a stream
        # whose every message is deleted lists no gap).
        got = await watch.request(f"$JS.API.STREAM.INFO.{stream}", b'{"deleted_details": true}', timeout=WAIT)
        state = msgspec.json.decode(got.data)["state"]
        gone = set(state.get("deleted") or [])
        return any(seq in gone or seq < state["first_seq"] for seq in range(before + 1, state["last_seq"] + 1))

    async def stored() -> bool:
        # Any message under the subject, not only the last: another answer aimed there before this one may be
        # stored after it (the server sends a publish's acknowledgement and an API answer from different places).
        if erased_ok and await erased_since():
            return True
        seq = 1
        while True:
            got = await watch.request(f"$JS.API.STREAM.MSG.GET.{stream}",
                                      msgspec.json.encode({"seq": seq, "next_by_subj": target}), timeout=WAIT)
            if b'"message"' not in got.data:
                return False
            if found(_data_of(got.data)):
                return True
            seq = msgspec.json.decode(got.data)["message"]["seq"] + 1

    await until(stored, timeout=WAIT, what=f"the server's answer stored under {target}")


def _stream_of(subject: str) -> str:
    if subject.startswith("$KV."):
        return "KV_" + subject.split(".")[1]
    if ".signer.ledger." in subject:
        return "PGW_SIGNER_LEDGER"
    if subject.endswith(".capsule.registered"):
        return "PGW_CAPSULES"
    if subject.endswith(".capsule.register"):
        return "PGW_REGISTRATION"
    if ".log." in subject:
        return "PGW_EVENTLOG"
    raise ValueError(subject)


def _data_of(reply: bytes) -> bytes:
    import base64

    return base64.b64decode(msgspec.json.decode(reply)["message"].get("data", ""))


def kernel(bed: Bed) -> Any:
    assert bed.gw is not None
    return next(p for p in bed.gw.parts if isinstance(p, KernelService))


@contextlib.asynccontextmanager
async def kernel_bed(tmp_path: Path, *, gateway: dict[str, Any] | None = None,
                     **kernel_cfg: Any) -> AsyncIterator[tuple[Bed, Callable[..., Awaitable[Any]]]]:
    """A secured bed whose kernel trusts one mandate issuer, and ``declare(step)``: agent a declares step
    ``step`` of one session (``ReadBooking``); its IDP record, asserted permitted (``answer=True``: the record and
    the kernel's answer, whatever it is)."""
    from subjects.idp import Permit
    from tests.kernel_support import Issuer, idp, policy_dir, request

    issuer = Issuer(tmp_path / "issuer")
    cfg = {"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path)), **kernel_cfg}
    async with secured_bed(tmp_path, kernel=cfg, **({"gateway": gateway} if gateway else {})) as bed:
        so = str(uuid.uuid4())
        token, jti = issuer.mandate(agent="a", so_id=so, principal="p")

        async def declare(step: int, *, answer: bool = False) -> Any:
            rec = idp(so_id=so, mandate_id=jti, step=step, action="ReadBooking")
            got = await request(bed.ncs["agent:a"], "a", {"mandate": token, "idp": rec})
            if answer:
                return rec, got
            assert isinstance(got, Permit), got
            return rec

        yield bed, declare


async def report(bed: Bed, idp_id: str, action: str = "CloseBooking", kind: str = "booking.close") -> None:
    """Agent a's transition report of step ``idp_id``: ``action`` executed, its effect dispatched."""
    await bed.ncs["agent:a"].jetstream().publish(
        bed.config.subjects.agent("a", "transition"),
        msgspec.json.encode({"idp_id": idp_id, "executed_action": action, "effect": {"type": kind, "status": "dispatched"}}),
        headers={"Nats-Msg-Id": f"a:{uuid.uuid4()}"})


async def test_the_kernels_log_positions_overwritten_do_not_stop_a_start(tmp_path: Path) -> None:
    """``PGW_KERNEL._checkpoint`` and ``_permit_sweep`` hold the last log sequence the rebuild and the overdue
    sweep applied; both names are in the documentation. Overwritten by an agent's acknowledgement, every start of
    the gateway failed (``invalid literal for int()``). Now such a value is read as 0: the gateway starts, walks
    the log again (idempotent), and writes its own position back."""
    async with secured_bed(tmp_path) as bed:
        for key in ("_checkpoint", "_permit_sweep"):
            await aim(bed, "a", f"$KV.PGW_KERNEL.{key}")
        await bed.stop_gateway()
        await bed.start_gateway()  # failed here before
        k = kernel(bed)
        kv = await bed.ncs["_watch"].jetstream().key_value("PGW_KERNEL")
        assert (await kv.get("_checkpoint")).value.isdigit()
        assert await k.overdue.sweep() == 0  # and the sweep reads its position
        assert (await k.state.position("_permit_sweep")) >= 0


async def test_a_foreign_open_permit_does_not_stop_the_overdue_sweep(tmp_path: Path) -> None:
    """Any key of ``PGW_KERNEL_OPEN`` (the permits waiting for their transition report): an agent's
    acknowledgement there made every sweep fail from then on, for every agent. It is deleted and the sweep
    goes on."""
    async with secured_bed(tmp_path) as bed:
        target = "$KV.PGW_KERNEL_OPEN.zz.junk"
        await aim(bed, "b", target)
        k = kernel(bed)
        assert await k.overdue.sweep() == 0  # raised before
        kv = await bed.ncs["_watch"].jetstream().key_value("PGW_KERNEL_OPEN")

        async def gone() -> bool:
            try:
                e = await kv.get("zz.junk")
            except Exception:  # noqa: BLE001 - deleted: not found
                return True
            return not e.value

        assert await gone()


async def test_an_acknowledgement_in_the_signers_ledger_does_not_stop_signing(tmp_path: Path) -> None:
    """``PGW_SIGNER_LEDGER`` (subjects ``signer.ledger.*``, deny delete) is the signer's hash chain; it read
    the head to chain onto from the last record alone, so an agent's acknowledgement stored there stopped all
    signing for good (every batch failed, the verdicts redelivered in a loop, also after a restart). Now the
    record is passed over: the next capsules are signed, by the running signer and by a restarted one, the
    chain is whole across it, and the ledger check lists it as foreign; so too the server's answer to a
    JetStream API request aimed there, and its empty status answer to a no-wait pull."""
    from consumers.ledger_check import check_ledger
    from consumers.signer import LEDGER_STREAM, Signer
    from pgwcore.publish import Publisher
    from tests.stored import stored_msgs
    from tests.test_capsule_model import verdict
    from tests.test_capsule_signer import wait_count

    async with secured_bed(tmp_path) as bed:
        svc = bed.ncs["_watch"]
        js = svc.jetstream()
        pub = Publisher(js, bed.config.subjects)
        async with Signer(bed.config, svc):
            await pub.verdict(verdict("puback-1", "blocked"))
            await wait_count(js, "PGW_REGISTRATION", 1)
            await aim(bed, "a", f"{bed.config.prefix}.signer.ledger.x")
            await aim(bed, "a", f"{bed.config.prefix}.signer.ledger.y", api=True)
            # An empty record (a no-wait pull's 404 answer): read as None, it failed every append, for good
            # (found by a docs-only attack).
            await aim(bed, "a", f"{bed.config.prefix}.signer.ledger.z", empty=True)
            await pub.verdict(verdict("puback-2", "blocked"))
            await wait_count(js, "PGW_REGISTRATION", 2)  # waited forever before
        async with Signer(bed.config, svc):  # a restarted signer reads the head afresh
            await pub.verdict(verdict("puback-3", "blocked"))
            await wait_count(js, "PGW_REGISTRATION", 3)
        stored = await stored_msgs(js, LEDGER_STREAM)
        ledger = check_ledger([m.data for m in stored])
        # Every record but the acknowledgement and the API answer is a link (the gateway's refusal of the
        # empty envelope that carried the acknowledgement has its verdict and capsule too), chained across them.
        # (The refusal's capsule may be linked before or after the API answer is stored.)
        assert ledger.ok and len(ledger.foreign) == 3 and ledger.foreign[0] == 2, ledger
        assert ledger.links == len(stored) - 3 >= 3, ledger
        assert ledger.positions == [n for n in range(1, len(stored) + 1) if n not in ledger.foreign]


async def test_another_agents_acknowledgement_over_a_clarification_counter_blocks_nothing(tmp_path: Path) -> None:
    """``PGW_DEDUP`` key ``clarpr.{agent}.{hash(principal)}`` counts an agent's clarifications to a principal (the
    contract names it). Agent b, bound only to q, aimed its acknowledgement at a's counter for p: every
    clarification a sent p was then refused ``engine_failure`` for the bucket's 30 days. The counter now reads as
    empty and is written over; a's clarifications to p are answered."""
    from gateway.stages.limits import clar_principal_key
    from subjects.client import envelope

    async with secured_bed(tmp_path) as bed:
        await aim(bed, "b", f"$KV.PGW_DEDUP.{clar_principal_key('a', 'p')}")
        a = bed.agents["a"]
        eid = await a.send(envelope("clarification.request", {"questions": [{"id": "q1", "question": "Which account?"}]}),
                           principal="p")
        out = await a.outcome_for(eid)
        assert out.status == "accepted", out


async def test_another_agents_acknowledgement_over_a_veto_keeps_the_veto(tmp_path: Path) -> None:
    """``veto.{agent}.{principal}`` holds the questions a principal rejected through the question-space hatch
    (spec 000 §7.2). Agent b aimed its acknowledgement at a's record for p, and a's vetoed question was delivered
    to p again. The running gateway now keeps the vetoes it knows for the key, refuses the repeat
    (``broken_handshake``), and writes them back over the acknowledgement with the next veto."""
    from subjects.wire import DialogueVeto
    from tests.moments import good_moment

    async with secured_bed(tmp_path) as bed:
        a = bed.agents["a"]
        out = await a.outcome_for(await a.send_moment("p", good_moment()))
        assert out.status == "accepted", out
        reply = await bed.surfaces["p"].resolve(out.moment_id, DialogueVeto(objection="Ask about the vendor first."))
        assert reply.status == "accepted", reply

        async def refused() -> Any:
            o = await a.outcome_for(await a.send_moment("p", good_moment()))
            return o if o.code == "broken_handshake" else None

        await until(refused, timeout=WAIT, what="the veto recorded")
        await aim(bed, "b", "$KV.PGW_DEDUP.veto.a.p")
        again = await a.outcome_for(await a.send_moment("p", good_moment()))
        assert again.code == "broken_handshake", again  # "accepted" before
        # The next veto of the pair writes the known vetoes back over the acknowledgement.
        from tests.test_pipeline_moments import GOOD

        other = GOOD[1]  # another decision altogether (merging a pull request)
        o2 = await a.outcome_for(await a.send_moment("p", other))
        assert o2.status == "accepted", o2
        assert (await bed.surfaces["p"].resolve(o2.moment_id, DialogueVeto(objection="Not now."))).status == "accepted"
        kv = await bed.ncs["_watch"].jetstream().key_value("PGW_DEDUP")

        async def both() -> bool:
            try:
                stored = msgspec.json.decode((await kv.get("veto.a.p")).value)
            except msgspec.DecodeError:
                return False
            return isinstance(stored, list) and len(stored) == 2

        await until(both, timeout=WAIT, what="both vetoes stored over the acknowledgement")


async def test_an_acknowledgement_over_a_correlation_claim_is_taken_as_no_claim(tmp_path: Path) -> None:
    """``corr.{agent}.{sha256(correlationId)}`` is the claim of a correlationId. An acknowledgement aimed there
    made each envelope with that correlationId fail (``engine_failure``, redelivered) until it was dead-lettered.
    It is now taken as no claim: the envelope is answered."""
    from gateway.stages.dedup import corr_key
    from subjects.client import envelope
    from tests.moments import good_moment

    async with secured_bed(tmp_path) as bed:
        await aim(bed, "b", f"$KV.PGW_DEDUP.{corr_key('a', 'run-7:node:0:k')}")
        a = bed.agents["a"]
        body = envelope("vendor.pgw.binding_moment", {"principal": "p", "binding_moment": good_moment()},
                        correlation_id="run-7:node:0:k")
        out = await a.outcome_for(await a.send(body))
        assert out.status == "accepted", out


async def test_pgw_verify_passes_over_an_acknowledgement_in_the_capsule_streams(tmp_path: Path) -> None:
    """``PGW_REGISTRATION`` and ``PGW_CAPSULES`` (kept forever) capture ``capsule.register`` and
    ``capsule.registered``: an agent's acknowledgement there made ``pgw verify --stream`` fail for good, with no
    way to remove it. It is no statement: ``pgw verify`` passes over it and says so, and still verifies every
    capsule and the ledger. So too the server's answer to a JetStream API request aimed there, and its empty
    status answer to a no-wait pull (which failed it as ``not CBOR``; found by a docs-only attack)."""
    import subprocess
    import sys

    from consumers.signer import Signer
    from pgwcore.publish import Publisher
    from tests.test_capsule_model import verdict
    from tests.test_capsule_signer import wait_count

    async with secured_bed(tmp_path) as bed:
        svc = bed.ncs["_watch"]
        js = svc.jetstream()
        async with Signer(bed.config, svc):
            await Publisher(js, bed.config.subjects).verdict(verdict("verify-1", "blocked"))
            await wait_count(js, "PGW_REGISTRATION", 1)
        for subject in ("capsule.register", "capsule.registered"):
            nc = bed.ncs["agent:a"]
            await nc.publish(bed.config.subjects.envelope("a"), b"{}", reply=f"{bed.config.prefix}.{subject}")
            await flushed(nc)
        await aim(bed, "a", f"{bed.config.prefix}.capsule.registered", api=True)
        for subject in ("capsule.register", "capsule.registered"):  # empty records (docs-only attack)
            await aim(bed, "a", f"{bed.config.prefix}.{subject}", empty=True)
        pgw = str(Path(sys.executable).parent / "pgw")
        proc = subprocess.run(  # noqa: ASYNC221 - the CLI as an auditor runs it, to its end
            [pgw, "--server", bed.server.client_url, "--creds", str(bed.auth.service_creds),
             "--data-dir", str(bed.config.data_path), "verify", "--stream", "PGW_REGISTRATION",
             "--stream", "PGW_CAPSULES", "--ledger"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count("SKIP ") == 5 and "publish acknowledgement" in proc.stdout, proc.stdout
        assert "0 failed" in proc.stdout, proc.stdout


@pytest.mark.parametrize("record", ["tr", "idp"])
async def test_an_agent_overwriting_its_own_step_records_does_not_escape_a_commitment_gap(
        tmp_path: Path, record: str) -> None:
    """``tr.{agent}.{idp_id}`` and ``idp.{so_id}.{idp_id}`` of ``PGW_KERNEL`` index a declared step (both in
    the contract, both values the agent's own). An agent aimed its acknowledgement at one before reporting an
    action other than the one it declared: its report read as undeclared (``tr``) or failed until dead-lettered
    (``idp``), no IDP_COMMITMENT_GAP was logged, nobody was asked, and its next step was permitted (found by an
    attack from the docs). The kernel now writes the step's records again from its signed log and judges the
    report as it would have: a commitment gap, escalated, the session held."""
    from gateway.kernel.state import idp_key, tr_key
    from subjects.idp import EnrichedDeny
    from tests.kernel_support import read_log

    async with kernel_bed(tmp_path) as (bed, declare):
        rec = await declare(1)
        key = tr_key("a", rec["idp_id"]) if record == "tr" else idp_key(rec["so_id"], rec["idp_id"])
        await aim(bed, "a", f"$KV.PGW_KERNEL.{key}")
        await report(bed, rec["idp_id"])
        js = bed.ncs["_watch"].jetstream()

        async def gap() -> Any:
            return [e for _, e in await read_log(js, "IDP_COMMITMENT_GAP")]

        [found] = await until(gap, timeout=WAIT, what="the commitment gap logged")
        assert found.body["record"]["idp_id"] == rec["idp_id"]

        async def escalated() -> Any:
            return [e for _, e in await read_log(js, "HEM_ESCALATED") if e.body["trigger"] == "IDP_COMMITMENT_GAP"]

        await until(escalated, timeout=WAIT, what="the gap escalated to the principal")
        _, nxt = await declare(2, answer=True)
        assert isinstance(nxt, EnrichedDeny) and nxt.deny_code == "HEM_PENDING", nxt


async def test_another_agents_acknowledgement_over_an_envelope_id_claim_blocks_nothing(tmp_path: Path) -> None:
    """``authz.{sha256(workflow_id)}.{sha256(envelope_id)}`` claims a spec 001 authorization envelope's
    ``provenance.envelope_id`` in its workflow. Agent b aimed its acknowledgement at the key of an id agent a was
    about to deliver: each delivery of a's envelope failed (``engine_failure``) until dead-lettered, and the
    principal got nothing, for the bucket's 30 days. The value is no claim: it is taken over, a's envelope is
    delivered, and a second delivery of the id is still refused."""
    from gateway.stages import authorization as authz
    from tests.test_pipeline_authorization import WORKFLOWS, env, measurement

    def auth(envelope: dict) -> dict:
        return env("vendor.pgw.authorization", {"workflow_id": "labs", "principal": "p", "envelope": envelope})

    async with secured_bed(tmp_path, pipeline={"workflows": WORKFLOWS}) as bed:
        await aim(bed, "b", f"$KV.PGW_DEDUP.{authz.envelope_id_key('labs', 'm-1')}")
        a = bed.agents["a"]
        out = await a.outcome_for(await a.send(auth(measurement("m-1"))))
        assert out.status == "accepted", out
        again = await a.outcome_for(await a.send(auth(measurement("m-1"))))
        assert (again.status, again.code) == ("gated", "envelope_id_reused"), again


async def test_an_acknowledgement_stored_on_another_agents_subject_is_not_that_agents(tmp_path: Path) -> None:
    """Agent b aims its acknowledgement at agent a's own input subjects (``agent.a.envelope``,
    ``agent.a.transition``): the server stores it in ``PGW_INBOUND`` on a's subject. Read as a's, it made a
    ``blocked`` and a ``denied`` verdict (each signed into a capsule), a signed TRANSITION_REFUSED and an outcome,
    all naming a, which sent nothing (found by an attack from the docs). Both consumers now pass it over: no
    verdict, event or outcome names a, and a's own envelope is answered as ever. So too the server's answer to
    a publish it refused (``{"error": ...}``: b's publish carried an expectation set to fail, so nothing of b's
    is stored and it costs b nothing; found by a second attack from the docs), and its answer to b's JetStream
    API request about b's own consumer (consumer info: found by a review); and ``pgw replay`` of the range
    republishes none of them."""
    from consumers.replay import GATEWAY, Replayer, ReplayRange
    from tests.kernel_support import read_log
    from tests.polling import consumer_drained

    async with secured_bed(tmp_path) as bed:
        nc = bed.ncs["agent:b"]
        refused = [{"Nats-Expected-Last-Sequence": "999999999"}, {"Nats-Expected-Last-Msg-Id": "nope"}]
        for target in (bed.config.subjects.envelope("a"), bed.config.subjects.agent("a", "transition")):
            await nc.publish(bed.config.subjects.envelope("b"), b"{}", reply=target)
            for headers in refused:
                await nc.publish(bed.config.subjects.envelope("b"), b"{}", reply=target, headers=headers)
            await nc.publish("$JS.API.CONSUMER.INFO.PGW_OUTBOUND.outcome-b", b"", reply=target)
        await flushed(nc)
        js = bed.ncs["_watch"].jetstream()

        async def stored_and_taken() -> bool:
            info = await js.stream_info("PGW_INBOUND", subjects_filter=f"{bed.config.prefix}.agent.a.>")
            return (sum((info.state.subjects or {}).values()) >= 8
                    and await consumer_drained(js, "PGW_INBOUND", "pgw-gateway")
                    and await consumer_drained(js, "PGW_INBOUND", "pgw-kernel"))

        await until(stored_and_taken, timeout=WAIT, what="both acknowledgements stored on a's subjects and taken")
        a = bed.agents["a"]
        from tests.moments import good_moment

        out = await a.outcome_for(await a.send_moment("p", good_moment()))
        assert out.status == "accepted", out  # a's first outcome is its own envelope's
        await bed.verdict(lambda v: v.agent == "a" and v.verdict_class == "hitl_dispatched")
        assert [v.verdict_class for v in bed.verdicts if v.agent == "a"] == ["hitl_dispatched"]
        assert not [e for _, e in await read_log(js, "TRANSITION_REFUSED") if e.body.get("agent") == "a"]
        report = await Replayer(bed.ncs["_watch"], bed.config.subjects).replay(
            ReplayRange(subject=f"{bed.config.prefix}.agent.a.>"), GATEWAY, dry_run=True)
        assert [x.action for x in report.actions].count("republish") == 1, report.actions  # a's own envelope


async def test_a_long_refusal_of_the_server_is_taken_for_its_answer(tmp_path: Path) -> None:
    """The server's refusal ``wrong last msg ID: ...`` echoes the id of the stream's last stored message, which
    can be long; such a refusal (past the 512 bytes of an acknowledgement) is still taken for the server's."""
    from pgwcore.atomic import is_pub_ack, stored_by_reply

    async with secured_bed(tmp_path) as bed:
        nc = bed.ncs["agent:b"]
        js = nc.jetstream()
        await js.publish(bed.config.subjects.envelope("b"), b"{}", headers={"Nats-Msg-Id": "b:" + "y" * 2000})
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(bed.config.subjects.envelope("b"), b"{}", reply=inbox,
                         headers={"Nats-Expected-Last-Msg-Id": "nope"})
        answer = await sub.next_msg(timeout=WAIT)
        assert len(answer.data) > 2000 and answer.data.startswith(b'{"error":'), answer.data[:200]
        assert is_pub_ack(answer.data) and stored_by_reply(answer)


async def test_replay_passes_over_an_acknowledgement_among_the_redacted_copies(tmp_path: Path) -> None:
    """``PGW_INBOUND_REDACTED`` keys ``{agent}.{stream seq}`` hold the redacted form of a message that held a
    secret, which ``pgw replay`` reads in its place. An acknowledgement aimed at ``a.{seq}`` was replayed as
    agent a's envelope at that sequence (and a sequence whose original was still stored was listed twice). The
    range now yields each stored message once and no acknowledgement, nor the server's answer to a JetStream
    API request aimed there."""
    from consumers.replay import ReplayRange, read_range

    async with secured_bed(tmp_path) as bed:
        a = bed.agents["a"]
        from tests.moments import good_moment

        out = await a.outcome_for(await a.send_moment("p", good_moment()))
        assert out.status == "accepted", out
        await aim(bed, "b", "$KV.PGW_INBOUND_REDACTED.a.1")  # a's envelope is stream sequence 1
        await aim(bed, "b", "$KV.PGW_INBOUND_REDACTED.a.500")
        await aim(bed, "b", "$KV.PGW_INBOUND_REDACTED.a.501", api=True)
        got = [m async for m in read_range(bed.ncs["_watch"], ReplayRange(stream="PGW_INBOUND"),
                                           prefix=bed.config.prefix)]
        assert [m.seq for m in got if m.subject.endswith(".a.envelope")] == [1], [(m.seq, m.subject) for m in got]
        assert all(b"PGW_INBOUND" not in m.data or b"binding_moment" in m.data for m in got)


async def test_a_foreign_open_dispatch_is_deleted_by_the_gate_sweep(tmp_path: Path) -> None:
    """Any key of ``PGW_KERNEL_GATE`` (the gated actions dispatched and not yet recorded): an agent's
    acknowledgement there made every gate sweep log an error for it, every few seconds, for good. The sweep now
    deletes it and goes on."""
    from tests.logcapture import capture_logs_with_context

    async with secured_bed(tmp_path) as bed:
        await aim(bed, "b", "$KV.PGW_KERNEL_GATE.zz_junk")
        k = kernel(bed)
        with capture_logs_with_context() as logs:
            assert await k.gate_sweep() == 0
        assert not [e for e in logs if e.get("log_level") == "error"], logs
        kv = await bed.ncs["_watch"].jetstream().key_value("PGW_KERNEL_GATE")
        try:
            gone = not (await kv.get("zz_junk")).value
        except Exception:  # noqa: BLE001 - deleted: not found
            gone = True
        assert gone


async def test_a_report_of_an_undeclared_step_over_a_foreign_record_is_refused_once(tmp_path: Path) -> None:
    """The acknowledgement aimed at ``tr.{agent}.{X}`` for a step X the agent never declared, then a report of X:
    the log has no step to write back, so the report is refused as undeclared (as without the value), once, and
    the foreign value is gone (it is not redelivered and the log walked again on each delivery)."""
    from gateway.kernel.state import tr_key
    from tests.kernel_support import read_log

    async with secured_bed(tmp_path) as bed:
        x = str(uuid.uuid4())
        await aim(bed, "a", f"$KV.PGW_KERNEL.{tr_key('a', x)}")
        await report(bed, x)
        js = bed.ncs["_watch"].jetstream()

        async def refused() -> Any:
            return [e for _, e in await read_log(js, "TRANSITION_REFUSED") if e.body.get("idp_id") == x]

        [ev] = await until(refused, timeout=WAIT, what="the report refused as undeclared")
        assert ev.body["reason"] == "no IDP_SUBMITTED for this step", ev.body
        kv = await js.key_value("PGW_KERNEL")
        try:
            gone = not (await kv.get(tr_key("a", x))).value
        except Exception:  # noqa: BLE001 - deleted: not found
            gone = True
        assert gone


async def test_reports_over_foreign_records_share_walks_of_the_log(tmp_path: Path) -> None:
    """Each acknowledgement aimed at a step's ``tr.`` key followed by a report of the step made the kernel walk
    (read and check the signature of) its whole log, one walk per report: two publishes of an agent's cost the
    kernel a pass over every record it ever wrote, and every other agent's reports waited behind it. Twelve such
    pairs (undeclared steps) and one over a declared step now share walks (gateway/kernel/repairs.py): each report
    is judged as before (refused as undeclared once; the declared step's gap logged), in far fewer walks."""
    from gateway.kernel.state import tr_key
    from tests.kernel_support import read_log

    async with kernel_bed(tmp_path) as (bed, declare):
        rec = await declare(1)
        xs = [str(uuid.uuid4()) for _ in range(12)]
        for step in [*xs, rec["idp_id"]]:
            await aim(bed, "a", f"$KV.PGW_KERNEL.{tr_key('a', step)}")
        for step in [*xs, rec["idp_id"]]:
            await report(bed, step)
        js = bed.ncs["_watch"].jetstream()

        async def judged() -> Any:
            refused = [e.body["idp_id"] for _, e in await read_log(js, "TRANSITION_REFUSED")]
            gaps = [e.body["record"]["idp_id"] for _, e in await read_log(js, "IDP_COMMITMENT_GAP")]
            return (refused, gaps) if len(refused) >= len(xs) and gaps else None

        refused, gaps = await until(judged, timeout=WAIT * 2, what="every report judged")
        assert sorted(refused) == sorted(xs)  # each undeclared step refused, once
        assert gaps == [rec["idp_id"]]
        walks = kernel(bed).repairs.walks
        assert 1 <= walks <= 3, walks  # one walk per report before: 13


async def test_a_report_held_for_a_walk_holds_up_no_other_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reports are judged one after another. A report waiting for a walk of the log (here: the walks spaced
    30 s apart, after a first one) is held aside, and the next report, of a declared step, is verified meanwhile;
    before, it waited for the walk."""
    from gateway.kernel import repairs
    from gateway.kernel.state import tr_key
    from tests.kernel_support import read_log

    monkeypatch.setattr(repairs, "MIN_GAP_S", 30.0)
    async with kernel_bed(tmp_path) as (bed, declare):
        rec = await declare(1)
        js = bed.ncs["_watch"].jetstream()

        async def refused_of(step: str) -> Any:
            return [e for _, e in await read_log(js, "TRANSITION_REFUSED") if e.body.get("idp_id") == step]

        first, second = str(uuid.uuid4()), str(uuid.uuid4())
        await aim(bed, "a", f"$KV.PGW_KERNEL.{tr_key('a', first)}")
        await report(bed, first)
        await until(lambda: refused_of(first), timeout=WAIT, what="the first report judged after its walk")
        k = kernel(bed)
        assert k.repairs.walks == 1
        await aim(bed, "a", f"$KV.PGW_KERNEL.{tr_key('a', second)}")
        await report(bed, second)  # its walk may begin 30 s after the first
        await report(bed, rec["idp_id"], "ReadBooking", "booking.read")

        async def verified() -> Any:
            return [e for _, e in await read_log(js, "IDP_COMMITMENT_VERIFIED")
                    if e.body["record"]["idp_id"] == rec["idp_id"]]

        await until(verified, timeout=WAIT, what="the declared step's report verified")
        assert k.repairs.holds(("a", second)) and not await refused_of(second)
        assert k.repairs.walks == 1


async def test_an_acknowledgement_over_the_sweeps_position_does_not_make_it_read_every_permit_again(
        tmp_path: Path) -> None:
    """``PGW_KERNEL._permit_sweep`` is the log position the overdue sweep has read to. An agent's acknowledgement
    there read as 0, so the next sweep read every ``CEDAR_PERMIT_RECORDED`` the log ever held again (and each
    permit's index entry): one publish, a pass over every permit, as often as the agent sent it. The sweep now
    goes on from the position it last swept to and writes it back over the acknowledgement."""
    async with kernel_bed(tmp_path, report_deadline_s=3600) as (bed, declare):
        for step in (1, 2, 3):
            await declare(step)
        k = kernel(bed)
        assert await k.overdue.sweep(now=1e12) == 3  # each permit past its deadline: closed
        read = k.overdue.read_events
        assert read >= 3
        position = await k.state.position("_permit_sweep")
        await aim(bed, "a", "$KV.PGW_KERNEL._permit_sweep")
        assert await k.overdue.sweep(now=1e12) == 0
        assert k.overdue.read_events == read  # read the three permits again before
        assert await k.state.position("_permit_sweep") == position  # its own position back


async def held_behind_a_first_walk(bed: Bed, monkeypatch: pytest.MonkeyPatch, gap_s: float) -> tuple[Any, str]:
    """Walks spaced ``gap_s`` apart, one walk done (a report over a foreign record, refused as undeclared), and
    the key of a second undeclared step aimed at: (the kernel, that step), whose reports are then held."""
    from gateway.kernel import repairs
    from gateway.kernel.state import tr_key
    from tests.kernel_support import read_log

    monkeypatch.setattr(repairs, "MIN_GAP_S", gap_s)
    js = bed.ncs["_watch"].jetstream()
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    await aim(bed, "a", f"$KV.PGW_KERNEL.{tr_key('a', first)}")
    await report(bed, first)

    async def refused() -> Any:
        return [e for _, e in await read_log(js, "TRANSITION_REFUSED") if e.body.get("idp_id") == first]

    await until(refused, timeout=WAIT, what="the first report judged after its walk")
    await aim(bed, "a", f"$KV.PGW_KERNEL.{tr_key('a', second)}")
    return kernel(bed), second


@pytest.mark.parametrize("limit", ["share", "all"])
async def test_an_agent_holds_at_most_its_share_of_held_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                limit: str) -> None:
    """Each held report holds a place of the kernel consumer's unacknowledged messages, which every agent's reports
    need. Past ``MAX_HELD_PER_AGENT`` (3 here, ``share``) an agent's reports over foreign records are dead-lettered
    at once, with the reason, not held (handed back, each came again until max_deliver, holding a place each time;
    found by an attack from the docs). Past ``MAX_HELD`` (3 here, ``all``: the places of every agent taken) a
    report is handed back instead, redelivered later: another agent's flood dead-letters no one's report (found
    by a review). The other reports are judged meanwhile."""
    from gateway.kernel import repairs
    from tests.kernel_support import read_log

    monkeypatch.setattr(repairs, "MAX_HELD_PER_AGENT" if limit == "share" else "MAX_HELD", 3)
    async with kernel_bed(tmp_path) as (bed, declare):
        rec = await declare(1)
        k, step = await held_behind_a_first_walk(bed, monkeypatch, 30.0)
        for _ in range(6):
            await report(bed, step)
        await report(bed, rec["idp_id"], "ReadBooking", "booking.read")  # read after the six
        js = bed.ncs["_watch"].jetstream()

        async def verified() -> Any:
            return [e for _, e in await read_log(js, "IDP_COMMITMENT_VERIFIED")
                    if e.body["record"]["idp_id"] == rec["idp_id"]]

        await until(verified, timeout=WAIT, what="the declared step's report verified")
        assert k.repairs.waiting("a") == 3
        if limit == "all":
            from nats.js.errors import NotFoundError

            try:
                dead = (await js.stream_info("PGW_DEADLETTER")).state.messages
            except NotFoundError:
                dead = 0  # no stream yet: no dead letter at all
            assert dead == 0
            return
        info = await js.stream_info("PGW_DEADLETTER")
        assert info.state.messages == 3
        last = await js.get_msg("PGW_DEADLETTER", info.state.last_seq)
        assert b"waiting for the kernel to write their steps' records again" in last.data
        pending = await js.consumer_info("PGW_INBOUND", "pgw-kernel")
        assert pending.num_ack_pending == 3  # the three held; the others gone, not cycling


async def test_a_held_report_is_kept_in_progress_and_not_redelivered(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A report held for a walk longer than the consumer's ``ack_wait`` (2 s here; the next walk 8 s away) is told
    to the server as in progress, so it is not redelivered meanwhile, and is judged once its walk is done."""
    from tests.kernel_support import read_log

    async with kernel_bed(tmp_path, gateway={"ack_wait_s": 2.0}) as (bed, _):
        k, step = await held_behind_a_first_walk(bed, monkeypatch, 8.0)
        await report(bed, step)
        js = bed.ncs["_watch"].jetstream()
        async def held() -> bool:
            return k.repairs.holds(("a", step))

        await until(held, timeout=WAIT, what="the report held")
        await asyncio.sleep(5.0)  # past two ack_waits: what is awaited is that nothing happens
        info = await js.consumer_info("PGW_INBOUND", "pgw-kernel")
        assert k.repairs.holds(("a", step))
        assert (info.num_ack_pending, info.num_redelivered) == (1, 0)

        async def refused() -> Any:
            return [e for _, e in await read_log(js, "TRANSITION_REFUSED") if e.body.get("idp_id") == step]

        await until(refused, timeout=WAIT, what="the held report judged after its walk")


async def test_refused_publishes_aimed_at_the_event_log_are_passed_over_and_logged_in_bulk(tmp_path: Path) -> None:
    """An agent's publish the server refuses (an expectation set to fail, so nothing of the agent's is stored)
    with an event log subject as its reply subject: the server stores its refusal in ``PGW_EVENTLOG``, for free,
    as fast as the agent sends (found by an attack from the docs). The kernel's start walks the log over them;
    it logged a CRITICAL line for each on every walk (a flood of 700,000 wrote 360 MB at each start). Now the
    first 100 are logged one by one and the rest only counted; the kernel still permits the next step."""
    from structlog.testing import capture_logs

    from gateway.kernel.eventlog import FOREIGN_RECORDS, LOGGED_ONE_BY_ONE

    async with kernel_bed(tmp_path) as (bed, declare):
        await declare(1)
        nc = bed.ncs["agent:b"]
        junk = LOGGED_ONE_BY_ONE + 50
        for _ in range(junk):
            await nc.publish(bed.config.subjects.envelope("b"), b"{}", reply=f"{bed.config.prefix}.log.IDP_SUBMITTED",
                             headers={"Nats-Expected-Last-Sequence": "999999999"})
        await flushed(nc)
        # And an empty status answer (a no-wait pull's 404), which was logged one by one whatever came before.
        await aim(bed, "b", f"{bed.config.prefix}.log.IDP_SUBMITTED", empty=True)
        junk += 1
        js = bed.ncs["_watch"].jetstream()

        async def stored() -> bool:
            info = await js.stream_info("PGW_EVENTLOG", subjects_filter=f"{bed.config.prefix}.log.IDP_SUBMITTED")
            return sum((info.state.subjects or {}).values()) >= junk + 1

        await until(stored, timeout=WAIT, what="the refusals stored in the event log")
        await bed.stop_gateway()
        counted = FOREIGN_RECORDS._value.get()
        with capture_logs() as logs:
            await bed.start_gateway()  # its rebuild walks the log
        alarms = [e for e in logs if e.get("alert_trigger") == "EVENTLOG_FOREIGN_RECORD" and e["log_level"] == "critical"]
        assert len(alarms) == LOGGED_ONE_BY_ONE + 1, len(alarms)
        assert FOREIGN_RECORDS._value.get() - counted == junk
        await declare(2)


@pytest.mark.parametrize("restart", [False, True])
async def test_an_acknowledgement_over_an_answered_moment_does_not_keep_her_words(tmp_path: Path, restart: bool) -> None:
    """Agent a, bound to p, has p's free-text answer, then aims its acknowledgement at the moment's record
    (``$KV.PGW_MOMENTS.p.{moment_id}``). The desk forgot her words from the record's state, which it now could not
    read, so they stayed in ``KV_PGW_ANSWER_TEXT`` and in a's outcome in ``PGW_OUTBOUND`` for good, also after a
    restart (found by an attack from the docs). Now each held text is due ``answer_text_keep_s`` after she
    answered, whatever its record holds: her words are gone from every stream, and from the server's files; so
    too when the gateway restarts before they are due."""
    from subjects.wire import FreeTextAnswer
    from tests.moments import good_moment
    from tests.test_answer_retention import everything_stored

    words = "WORDS-7731 keep this between us, my landlord is the problem"
    async with secured_bed(tmp_path, gateway={"answer_text_keep_s": 3.0}) as bed:
        a, p = bed.agents["a"], bed.surfaces["p"]
        out = await a.outcome_for(await a.send_moment("p", good_moment()))
        assert out.status == "accepted", out
        assert (await p.resolve(out.moment_id, FreeTextAnswer(text=words))).status == "accepted"
        got = await a.resolution_for(out.moment_id, principal="p", timeout=15)
        assert got.resolution == FreeTextAnswer(text=words)  # the agent had her words
        for _ in range(3):  # each write aimed at the record schedules nothing more than the first did
            await aim(bed, "a", f"$KV.PGW_MOMENTS.p.{out.moment_id}")
        for i in range(2):  # acknowledgements among her held texts are no answer of hers: erased, not kept
            await aim(bed, "a", f"$KV.PGW_ANSWER_TEXT.p.{out.moment_id}.junk{i}", erased_ok=True)
        if restart:  # the gateway that saw the answer is gone before her words are due: a new one finds them
            await bed.stop_gateway()
            await bed.start_gateway()
        watch = bed.ncs["_watch"]

        async def forgotten() -> bool:
            return words.encode() not in await everything_stored(watch)

        await until(forgotten, timeout=30, interval=0.3, what="her words gone from every stream")

        async def nothing_held() -> bool:
            info = await watch.jetstream().stream_info("KV_PGW_ANSWER_TEXT", subjects_filter=">")
            return not info.state.subjects

        await until(nothing_held, timeout=30, interval=0.3, what="nothing left under the moment's held texts")
        store = bed.server.data_dir / "jetstream"
        held = [f for f in store.rglob("*") if f.is_file() and words.encode() in f.read_bytes()]
        assert held == [], held


async def test_an_acknowledgement_among_her_held_texts_after_they_are_forgotten_is_erased(tmp_path: Path) -> None:
    """Agent a aims acknowledgements at p's held texts (``$KV.PGW_ANSWER_TEXT.p.{moment_id}.*``) after her words
    were forgotten: each is erased as it lands, by the gateway that is running. Before, only a pass over the key's
    texts (at their due time, or for a foreign record) erased them, so one landing later stayed for good (found
    by a loaded run of the test above)."""
    from subjects.wire import FreeTextAnswer
    from tests.moments import good_moment
    from tests.test_answer_retention import everything_stored

    words = "WORDS-5190 between us only"
    async with secured_bed(tmp_path, gateway={"answer_text_keep_s": 1.0}) as bed:
        a, p = bed.agents["a"], bed.surfaces["p"]
        out = await a.outcome_for(await a.send_moment("p", good_moment()))
        assert (await p.resolve(out.moment_id, FreeTextAnswer(text=words))).status == "accepted"
        watch = bed.ncs["_watch"]

        async def forgotten() -> bool:
            return words.encode() not in await everything_stored(watch)

        await until(forgotten, timeout=30, interval=0.3, what="her words gone from every stream")
        for i in range(3):
            await aim(bed, "a", f"$KV.PGW_ANSWER_TEXT.p.{out.moment_id}.late{i}", erased_ok=True)

        async def nothing_held() -> bool:
            info = await watch.jetstream().stream_info("KV_PGW_ANSWER_TEXT", subjects_filter=">")
            return not info.state.subjects

        await until(nothing_held, timeout=30, interval=0.3, what="nothing left under the moment's held texts")


async def test_a_report_that_cannot_be_recorded_is_refused_once(tmp_path: Path) -> None:
    """A transition report whose effect holds an integer beyond +-(2**53 - 1) has no RFC 8785 form, so its digest
    cannot be taken. It failed ten times and was dead-lettered, and a report naming another action than the one
    declared so escaped its gap check without a word logged (found by an attack from the docs). It is now refused
    as malformed, at once and once (``TRANSITION_REFUSED``), with nothing dead-lettered: the step stays
    unreported, as if no report came."""
    from tests.kernel_support import read_log
    from tests.polling import consumer_drained

    async with kernel_bed(tmp_path) as (bed, declare):
        rec = await declare(1)
        await bed.ncs["agent:a"].jetstream().publish(
            bed.config.subjects.agent("a", "transition"),
            msgspec.json.encode({"idp_id": rec["idp_id"], "executed_action": "SendMail",
                                 "effect": {"type": "mail.sent", "status": "dispatched",
                                            "response": {"n": 123456789012345678901234567890}}}),
            headers={"Nats-Msg-Id": f"a:{uuid.uuid4()}"})
        js = bed.ncs["_watch"].jetstream()

        async def refused() -> Any:
            return [ev for _, ev in await read_log(js, "TRANSITION_REFUSED") if "cannot be recorded" in str(ev.body)]

        [_refusal] = await until(refused, timeout=WAIT, what="the report refused as malformed")
        await until(lambda: consumer_drained(js, "PGW_INBOUND", "pgw-kernel"), timeout=WAIT, what="the report acked")
        info = await js.consumer_info("PGW_INBOUND", "pgw-kernel")
        assert info.num_redelivered == 0, info
        dead = await js.stream_info("PGW_DEADLETTER")
        assert dead.state.messages == 0, dead.state
        assert not await read_log(js, "STATE_TRANSITIONED")


async def deliver(bed: Bed, agent: str, target: str) -> None:
    """``agent`` pulls its own outcome consumer (as it may) with ``target`` as the pull's reply subject, one outcome
    waiting there: the server delivers the outcome to ``target``, and the stream that captures ``target`` stores
    it, under the outcome's own subject (``pgw.agent.{agent}.outcome``) with the gateway's bytes and headers.
    Returns once it is stored there."""
    nc = bed.ncs[f"agent:{agent}"]
    js = bed.ncs["_watch"].jetstream()
    outcome = f"{bed.config.prefix}.agent.{agent}.outcome"
    stream = _stream_of(target)
    before = await last_seq_under(js, stream, outcome)
    await nc.publish(bed.config.subjects.envelope(agent), b"{}")  # refused: an outcome in its consumer

    async def waiting() -> bool:
        return (await js.consumer_info("PGW_OUTBOUND", f"outcome-{agent}")).num_pending > 0

    await until(waiting, timeout=WAIT, what="an outcome waiting in the agent's consumer")
    await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.PGW_OUTBOUND.outcome-{agent}", b'{"batch": 1, "no_wait": true}',
                     reply=target)
    await flushed(nc)

    async def stored() -> bool:
        return await last_seq_under(js, stream, outcome) > before

    await until(stored, timeout=WAIT, what=f"an outcome delivered to {target} stored in {stream}")


async def test_outcomes_delivered_into_the_stores_stop_no_start_and_raise_no_false_alarm(tmp_path: Path) -> None:
    """An agent may pull its own outcome consumer with any reply subject: the server delivers the outcome there,
    and a store that captures that subject keeps it under the outcome's subject (found by a docs-only attack).
    In ``PGW_REVOKED`` one such record made every later start of the gateway fail (the revocation watch waited
    for the stream's last sequence, which it never sees); in the event log ``pgw log verify`` reported a missing
    sequence, a false gap; in the capsule streams and the signer's ledger ``pgw verify`` failed for good. Now the
    gateway starts and permits, the log check lists such a record as foreign (not missing, the chain whole across
    it), and ``pgw verify`` passes over it."""
    import subprocess
    import sys

    from consumers.signer import Signer
    from gateway.kernel.eventlog import verify_stream
    from tests.test_capsule_signer import wait_count

    async with kernel_bed(tmp_path) as (bed, declare):
        await declare(1)
        prefix = bed.config.prefix
        targets = ["$KV.PGW_REVOKED.x", "$KV.PGW_MOMENTS.x", "$KV.PGW_KERNEL_GATE.x", "$KV.PGW_KERNEL_OPEN.x",
                   f"{prefix}.log.IDP_SUBMITTED", f"{prefix}.signer.ledger.x", f"{prefix}.capsule.registered"]
        async with Signer(bed.config, bed.ncs["_watch"]):  # its ledger (and a capsule of each refusal)
            for target in targets:
                await deliver(bed, "b", target)
            await wait_count(bed.ncs["_watch"].jetstream(), "PGW_REGISTRATION", len(targets))
        await bed.stop_gateway()
        await bed.start_gateway()  # failed at every start before (the revocations' watch)
        await declare(2)
        # The moment list reads the desk's index once the desk has followed the bucket: it waited for the stream's
        # last sequence, the delivered outcome, and every agent's list failed after 3 s until the next moment.
        asked = await bed.ncs["agent:b"].request(f"{prefix}.agent.b.moment", b'{"list": "open"}', timeout=WAIT)
        assert msgspec.json.decode(asked.data)["status"] == "listed", asked.data
        # The gate's sweep lists its bucket, which holds no key here (no gated call) but such a record: the
        # listing waited out its timeout (10 s) at every sweep (a review).
        js_watch = bed.ncs["_watch"].jetstream()
        got = await asyncio.wait_for(listing(js_watch, await js_watch.key_value("PGW_KERNEL_GATE"), "PGW_KERNEL_GATE"), 5)
        assert got == ([], []), got
        js = bed.ncs["_watch"].jetstream()
        k = kernel(bed)
        result = await verify_stream(js, k.subjects, k.eventlog.keys)
        assert not [p for p in result.problems if (p["problem"] or "").startswith("missing")], result.problems
        assert [p["subject"] for p in result.problems] == [f"{prefix}.agent.b.outcome"], result.problems
        pgw = str(Path(sys.executable).parent / "pgw")
        proc = subprocess.run(  # noqa: ASYNC221 - the CLI as an auditor runs it, to its end
            [pgw, "--server", bed.server.client_url, "--creds", str(bed.auth.service_creds),
             "--data-dir", str(bed.config.data_path), "verify", "--stream", "PGW_CAPSULES", "--ledger"],
            capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "SKIP PGW_CAPSULES#" in proc.stdout and "message it delivered" in proc.stdout, proc.stdout


async def test_a_record_aimed_at_a_verdicts_ledger_subject_does_not_hide_its_link(tmp_path: Path) -> None:
    """The signer finds a verdict's link by its subject (``signer.ledger.{verdict_id}``, the last message there).
    A record aimed at that subject after the link (here the empty answer to a no-wait pull) hid it: a verdict
    superseding it waited for its parent for ever, and the verdict redelivered after the ledger's duplicate window
    was linked a second time (a review). Now the subject's last link is found before such a record: the verdict
    superseding it is signed."""
    from consumers.ledger_check import check_ledger
    from consumers.signer import LEDGER_STREAM, Signer
    from pgwcore.publish import Publisher
    from tests.stored import stored_msgs
    from tests.test_capsule_model import verdict
    from tests.test_capsule_signer import wait_count

    async with secured_bed(tmp_path) as bed:
        svc = bed.ncs["_watch"]
        js = svc.jetstream()
        pub = Publisher(js, bed.config.subjects)
        v = verdict("hidden-1", "hitl_dispatched", decision="needs_input", moment_id="ab" * 16, action_id="bot:m1")
        await pub.verdict(v)
        async with Signer(bed.config, svc) as signer:
            await wait_count(js, "PGW_REGISTRATION", 1)
            await aim(bed, "a", signer._ledger_subject(v.verdict_id), empty=True)
            # Its resolution supersedes it: signed with its parent's capsule found (it waited for ever before).
            await pub.verdict(verdict("hidden-2", "resolved", decision="accept", approver="human", human_disposed=True,
                                      supersedes=v.verdict_id, resolution_kind="option", option_index=0,
                                      moment_id="ab" * 16, action_id="bot:m1"))
            await wait_count(js, "PGW_REGISTRATION", 2)
        ledger = check_ledger([m.data for m in await stored_msgs(js, LEDGER_STREAM)])
        assert ledger.ok and ledger.links == 2 and len(set(ledger.capsule_ids)) == 2, ledger
