"""The kernel event log: commit before Cedar (spec 003 §5.3), signatures and hash chain (§8.2), rebuild (§8.4)."""

from __future__ import annotations

import argparse
import asyncio
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest
import rfc8785
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.kernel.eventlog import EventLog, verify_stream, with_signature
from gateway.kernel.service import KernelService
from pgwcli.commands.kernel import verify_command
from pgwcore.connect import connect
from pgwcore.keys import SigningKey, kid_of, load_or_create, public_keys
from subjects.idp import EnrichedDeny, LogEvent, Permit, Reject, b64url
from subjects.util import now_rfc3339
from tests.kernel_support import (
    Issuer,
    idp,
    kernel_config,
    policy_dir,
    read_log,
    request,
    running_gateway,
)

AGENT = "bot"

# Strings that could confuse a byte-level splice of the signature into the JCS form.
_TRICKY = st.lists(
    st.sampled_from(['"', "\\", ",", ":", '"ts":"', '"sig":', "}", "{", "\n", "\x00", "\u2028", "\U0001f600", "a"])
    | st.characters(blacklist_categories=("Cs",)),
    max_size=12,
).map("".join)
# Nested members named like the event's own, so ',"ts":' also occurs inside the body.
_KEYS = st.sampled_from(["ts", "sig", "body", "a"]) | _TRICKY
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53) + 1, 2**53 - 1) | st.floats(allow_nan=False, allow_infinity=False) | _TRICKY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=5),
    max_leaves=20,
)


def kernel_of(gw: Any) -> KernelService:
    return next(p for p in gw.parts if isinstance(p, KernelService))


def keys_of(config: Any) -> dict[str, Any]:
    return {k.kid: k.public for k in public_keys(config.data_path, "kernel")}


@pytest.fixture
def setup(make_config: Any, tmp_path: Path) -> tuple[Any, Issuer, str, str, str]:
    issuer = Issuer(tmp_path / "issuer")
    cfg = kernel_config(make_config, issuer, policy_dir(tmp_path))
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent=AGENT, so_id=so)
    return cfg, issuer, so, token, jti


async def test_idp_submitted_is_stored_before_cedar(setup: Any, nc: Any, nats_server: Any) -> None:
    """IDP_SUBMITTED is acked and readable from the stream before Cedar runs, and the outcome event follows, for a permit and a denial (spec 003 §5.3)."""
    cfg, _issuer, so, token, jti = setup
    reader = await connect(nats_server.client_url)
    order: list[tuple[str, str]] = []
    try:
        async with running_gateway(cfg, nc) as gw:
            kernel = kernel_of(gw)
            real_append, real_many = kernel.eventlog.append, kernel.policy.evaluate_many

            async def append(event_type: str, body: Any, **kw: Any) -> Any:
                res = await real_append(event_type, body, **kw)
                # A separate client must already find the event: the server acked it.
                raw = await reader.jetstream().get_msg("PGW_EVENTLOG", res.seq)
                stored = msgspec.json.decode(raw.data)
                order.append((f"stored:{stored['event_type']}", stored["body"].get("idp_id", "")))
                return res

            def evaluate_many(actions: list[str], **kw: Any) -> Any:
                order.append(("cedar", kw["context"]["idp"]["idp_id"]))
                return real_many(actions, **kw)

            kernel.eventlog.append = append  # type: ignore[method-assign]
            kernel.policy.evaluate_many = evaluate_many  # type: ignore[method-assign]
            ok = idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking", confidence_level=0.9)
            no = idp(so_id=so, mandate_id=jti, step=2, action="CloseBooking", confidence_level=0.2)
            r1 = await request(nc, AGENT, {"mandate": token, "idp": ok})
            r2 = await request(nc, AGENT, {"mandate": token, "idp": no})
    finally:
        await reader.close()
    assert isinstance(r1, Permit) and isinstance(r2, EnrichedDeny)
    for rec, outcome in ((ok, "stored:CEDAR_PERMIT_RECORDED"), (no, "stored:CEDAR_DENY_RECORDED")):
        mine = [what for what, idp_id in order if idp_id == rec["idp_id"]]
        assert mine[0] == "stored:IDP_SUBMITTED" and mine[1] == "cedar", mine
        assert mine.index(outcome) > mine.index("cedar")


async def test_chain_verifies_and_tamper_is_detected(setup: Any, nc: Any, capsys: Any) -> None:
    """`pgw log verify` passes an intact log and reports the first tampered event (bad signature) by sequence."""
    cfg, _issuer, so, token, jti = setup
    js = nc.jetstream()
    async with running_gateway(cfg, nc):
        for step in (1, 2, 3):
            await request(nc, AGENT, {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=step, action="CloseBooking")})
    args = argparse.Namespace(stream="PGW_EVENTLOG", subject=None, pubkey=[])
    assert await verify_command(args, cfg) == 0
    assert '"ok": true' in capsys.readouterr().out
    # Tamper: republish the first IDP_SUBMITTED with a changed confidence but its old signature.
    _seq, ev = (await read_log(js, "IDP_SUBMITTED"))[0]
    ev.body["idp"]["confidence_level"] = 0.99
    ack = await js.publish("pgw.log.IDP_SUBMITTED", ev.canonical_bytes())
    assert await verify_command(args, cfg) == 1
    out = capsys.readouterr().out
    assert '"ok": false' in out and f'"seq": {ack.seq}' in out and "bad signature" in out
    sub_args = argparse.Namespace(stream="PGW_EVENTLOG", subject="pgw.log.IDP_SUBMITTED", pubkey=[])
    assert await verify_command(sub_args, cfg) == 1


async def test_chain_break_and_foreign_key_detected(setup: Any, nc: Any) -> None:
    """An event signed by an unknown key is reported, and a genuine event replayed out of place breaks the chain."""
    cfg, _issuer, so, token, jti = setup
    js = nc.jetstream()
    async with running_gateway(cfg, nc):
        await request(nc, AGENT, {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")})
    keys = keys_of(cfg)
    rogue_priv = Ed25519PrivateKey.generate()
    rogue = EventLog(nc, cfg.subjects, SigningKey("kernel", kid_of(rogue_priv.public_key()), rogue_priv))
    forged = await rogue.append("CEDAR_PERMIT_RECORDED", {"idp_id": "forged"}, msg_id="forged-1")
    res = await verify_stream(js, cfg.subjects, keys)
    assert not res.ok and res.first_break["seq"] == forged.seq and "unknown kid" in res.first_break["problem"]
    _seq, first = (await read_log(js, "IDP_SUBMITTED"))[0]
    replay = await js.publish("pgw.log.IDP_SUBMITTED", first.canonical_bytes())
    res = await verify_stream(js, cfg.subjects, keys, subject="pgw.log.IDP_SUBMITTED")
    assert not res.ok and res.first_break["seq"] == replay.seq and "prev_seq" in res.first_break["problem"]


async def test_two_writers_keep_one_chain(setup: Any, nc: Any, nats_server: Any) -> None:
    """Two kernel instances appending concurrently never fork the chain (expected-last-sequence), and verify passes."""
    cfg, *_ = setup
    key = load_or_create(cfg.data_path, "kernel")
    nc2 = await connect(nats_server.client_url)
    try:
        a = EventLog(nc, cfg.subjects, key)
        b = EventLog(nc2, cfg.subjects, key)

        async def burst(log: EventLog, name: str) -> None:
            for i in range(25):
                await log.append("CEDAR_PERMIT_RECORDED", {"writer": name, "i": i}, msg_id=f"{name}-{i}")

        await asyncio.gather(burst(a, "a"), burst(b, "b"))
        res = await verify_stream(nc.jetstream(), cfg.subjects, keys_of(cfg))
    finally:
        await nc2.close()
    assert res.ok and res.checked == 50, res.first_break


async def test_duplicate_refused_after_restart_and_bucket_loss(setup: Any, nc: Any) -> None:
    """An idp_id committed before a gateway restart is still IDP_DUPLICATE, even after the KV index was lost (rebuilt from the log, spec 003 §8.4)."""
    cfg, _issuer, so, token, jti = setup
    first = idp(so_id=so, mandate_id=jti, step=5, action="CloseBooking")
    async with running_gateway(cfg, nc):
        assert isinstance(await request(nc, AGENT, {"mandate": token, "idp": first}), Permit)
    async with running_gateway(cfg, nc):
        r = await request(nc, AGENT, {"mandate": token, "idp": {**first, "step_sequence": 6}})
    assert isinstance(r, Reject) and r.error_code == "IDP_DUPLICATE"
    await nc.jetstream().delete_key_value("PGW_KERNEL")
    async with running_gateway(cfg, nc):
        r = await request(nc, AGENT, {"mandate": token, "idp": {**first, "step_sequence": 7}})
        assert isinstance(r, Reject) and r.error_code == "IDP_DUPLICATE"
        r = await request(nc, AGENT, {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=5, action="CloseBooking")})
        assert isinstance(r, Reject) and r.error_code == "IDP_STEP_SEQUENCE"


async def test_two_gateways_share_the_index(setup: Any, nc: Any, nats_server: Any) -> None:
    """The same IDP sent to two gateway instances at once is committed once; the other is refused."""
    cfg, _issuer, so, token, jti = setup
    nc2 = await connect(nats_server.client_url)
    try:
        async with running_gateway(cfg, nc) as g1, running_gateway(cfg, nc2) as g2:
            rec = idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")
            k1, k2 = kernel_of(g1), kernel_of(g2)
            data = msgspec.json.encode({"mandate": token, "idp": rec})
            r1, r2 = await asyncio.gather(k1.handle_request(AGENT, data), k2.handle_request(AGENT, data))
    finally:
        await nc2.close()
    kinds = sorted(type(r).__name__ for r in (r1, r2))
    assert kinds == ["Permit", "Reject"], (r1, r2)
    assert len(await read_log(nc.jetstream(), "IDP_SUBMITTED")) == 1


async def test_the_same_idp_racing_itself_is_permitted_once(setup: Any, nc: Any, nats_server: Any) -> None:
    """Round after round, one IDP sent to two instances at once: one PERMIT, one refusal, one IDP_SUBMITTED,
    whichever instance wins the step reservation and whichever wins the log append."""
    cfg, _issuer, so, token, jti = setup
    nc2 = await connect(nats_server.client_url)
    try:
        async with running_gateway(cfg, nc) as g1, running_gateway(cfg, nc2) as g2:
            k1, k2 = kernel_of(g1), kernel_of(g2)
            for step in range(1, 21):
                data = msgspec.json.encode({"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=step, action="CloseBooking")})
                pair = (k1, k2) if step % 2 else (k2, k1)
                r1, r2 = await asyncio.gather(*(k.handle_request(AGENT, data) for k in pair))
                kinds = sorted(type(r).__name__ for r in (r1, r2))
                assert kinds == ["Permit", "Reject"], (step, r1, r2)
                refused = r1 if isinstance(r1, Reject) else r2
                assert refused.error_code in ("IDP_DUPLICATE", "IDP_STEP_SEQUENCE"), refused
    finally:
        await nc2.close()
    assert len(await read_log(nc.jetstream(), "IDP_SUBMITTED")) == 20
    assert await read_log(nc.jetstream(), "IDP_SUBMISSION_VOIDED") == []


async def test_the_same_idp_permitted_through_the_instance_that_lost_the_reservation(setup: Any, nc: Any, nats_server: Any) -> None:
    """The crossed order: instance 1 stores the IDP_SUBMITTED, instance 2 takes the step. The step is held for this
    very IDP, so instance 1 goes on to PERMIT and instance 2 (whose append was the duplicate) answers IDP_DUPLICATE."""
    cfg, _issuer, so, token, jti = setup
    nc2 = await connect(nats_server.client_url)
    try:
        async with running_gateway(cfg, nc) as g1, running_gateway(cfg, nc2) as g2:
            k1, k2 = kernel_of(g1), kernel_of(g2)
            validated = {k1: asyncio.Event(), k2: asyncio.Event()}
            k1_appended, k2_reserved = asyncio.Event(), asyncio.Event()

            def gate(k: KernelService, other: KernelService) -> None:
                reserve, append, put_tr = k._reserve_step, k.eventlog.append, k.state.put_tr

                async def reserve_(*a: Any) -> Any:
                    validated[k].set()
                    await validated[other].wait()
                    if k is k1:
                        await k2_reserved.wait()
                    got = await reserve(*a)
                    if k is k2:
                        k2_reserved.set()
                    return got

                async def append_(event_type: str, body: Any, **kw: Any) -> Any:
                    if event_type == "IDP_SUBMITTED":
                        await validated[other].wait()
                        if k is k2:
                            await k1_appended.wait()
                    got = await append(event_type, body, **kw)
                    if event_type == "IDP_SUBMITTED" and k is k1:
                        k1_appended.set()
                    return got

                async def put_tr_(*a: Any) -> Any:
                    await validated[other].wait()
                    return await put_tr(*a)

                k._reserve_step, k.eventlog.append, k.state.put_tr = reserve_, append_, put_tr_  # type: ignore[method-assign]

            gate(k1, k2)
            gate(k2, k1)
            data = msgspec.json.encode({"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")})
            r1, r2 = await asyncio.wait_for(asyncio.gather(k1.handle_request(AGENT, data), k2.handle_request(AGENT, data)), 20)
    finally:
        await nc2.close()
    assert isinstance(r1, Permit), r1
    assert isinstance(r2, Reject) and r2.error_code == "IDP_DUPLICATE", r2
    assert len(await read_log(nc.jetstream(), "IDP_SUBMITTED")) == 1
    assert await read_log(nc.jetstream(), "IDP_SUBMISSION_VOIDED") == []


def stale_session_read(
    kernel: KernelService, agent: str, session_id: str, read: tuple[Any, int], hold: tuple[Any, int] | None = None
) -> None:
    """The kernel's next validation read of this session returns ``read`` (and of the governed object's hold,
    ``hold``, when given): what they held before a concurrent write."""
    real = kernel.state.validation_reads

    async def reads(a: str, so: str, idp_id: str, s: str | None) -> Any:
        if (a, s) == (agent, session_id):
            kernel.state.validation_reads = real  # type: ignore[method-assign]
            known, reported, _, fresh_hold = await real(a, so, idp_id, None)
            return known, reported, read, hold if hold is not None else fresh_hold
        return await real(a, so, idp_id, s)

    kernel.state.validation_reads = reads  # type: ignore[method-assign]


async def test_a_step_taken_meanwhile_voids_the_logged_submission(setup: Any, nc: Any) -> None:
    """Two IDPs for one step: the one whose reservation loses (validated against the session as it was) is refused
    IDP_STEP_SEQUENCE; its IDP_SUBMITTED stays in the log, followed by IDP_SUBMISSION_VOIDED, and a report for it is refused.
    The index rebuilt from the log agrees."""
    cfg, _issuer, so, token, jti = setup
    js = nc.jetstream()
    winner = idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")
    loser = idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")
    async with running_gateway(cfg, nc) as gw:
        kernel = kernel_of(gw)
        before = await kernel.state.session(AGENT, "s-1")
        assert isinstance(await request(nc, AGENT, {"mandate": token, "idp": winner}), Permit)
        stale_session_read(kernel, AGENT, "s-1", before)
        r = await kernel.handle_request(AGENT, msgspec.json.encode({"mandate": token, "idp": loser}))
        assert isinstance(r, Reject) and r.error_code == "IDP_STEP_SEQUENCE", r
        submitted = {ev.body["idp_id"]: seq for seq, ev in await read_log(js, "IDP_SUBMITTED")}
        assert set(submitted) == {winner["idp_id"], loser["idp_id"]}
        voided = await read_log(js, "IDP_SUBMISSION_VOIDED")
        assert [(ev.body["idp_id"], ev.body["code"], ev.body["idp_submitted_seq"]) for _, ev in voided] == [
            (loser["idp_id"], "IDP_STEP_SEQUENCE", submitted[loser["idp_id"]])
        ]
        assert voided[0][0] > submitted[loser["idp_id"]]
        entry, _ = await kernel.state.idp(so, loser["idp_id"])
        assert entry.status == "denied"
        report = msgspec.json.encode({"idp_id": loser["idp_id"], "executed_action": "CloseBooking",
                                      "effect": {"type": "booking.close", "status": "dispatched"}})
        assert (await kernel.handle_transition(AGENT, report, 998)).startswith("refused:")
        sess, _ = await kernel.state.session(AGENT, "s-1")
        assert (sess.last_step, sess.last_idp) == (1, winner["idp_id"])
    res = await verify_stream(js, cfg.subjects, keys_of(cfg))
    assert res.ok, res.first_break
    await js.delete_key_value("PGW_KERNEL")
    async with running_gateway(cfg, nc) as gw:
        kernel = kernel_of(gw)
        entry, _ = await kernel.state.idp(so, loser["idp_id"])
        assert entry.status == "denied"
        r = await request(nc, AGENT, {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking")})
        assert isinstance(r, Reject) and r.error_code == "IDP_STEP_SEQUENCE"
        assert isinstance(await request(nc, AGENT, {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=2, action="CloseBooking")}), Permit)


async def test_a_session_escalated_meanwhile_voids_the_logged_submission(setup: Any, nc: Any) -> None:
    """An IDP validated while the session was ACTIVE, whose reservation finds it HEM_PENDING, is denied HEM_PENDING;
    its IDP_SUBMITTED is followed by IDP_SUBMISSION_VOIDED, and its step counts as committed, live as after a rebuild."""
    cfg, _issuer, so, token, jti = setup
    js = nc.jetstream()
    async with running_gateway(cfg, nc) as gw:
        kernel = kernel_of(gw)
        before = await kernel.state.session(AGENT, "s-1")
        before_hold = await kernel.state.hold(AGENT, so)
        hem = idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking", hem_urgency="REQUIRED")
        assert type(await request(nc, AGENT, {"mandate": token, "idp": hem})).__name__ == "HemPending"
        stale_session_read(kernel, AGENT, "s-1", before, before_hold)
        late = idp(so_id=so, mandate_id=jti, step=2, action="CloseBooking")
        r = await kernel.handle_request(AGENT, msgspec.json.encode({"mandate": token, "idp": late}))
        assert isinstance(r, EnrichedDeny) and r.deny_code == "HEM_PENDING", r
        voided = await read_log(js, "IDP_SUBMISSION_VOIDED")
        assert [(ev.body["idp_id"], ev.body["code"]) for _, ev in voided] == [(late["idp_id"], "HEM_PENDING")]
        sess, _ = await kernel.state.session(AGENT, "s-1")
        assert (sess.state, sess.last_step) == ("HEM_PENDING", 2)
    await js.delete_key_value("PGW_KERNEL")
    async with running_gateway(cfg, nc) as gw:
        sess, _ = await kernel_of(gw).state.session(AGENT, "s-1")
        assert (sess.state, sess.last_step) == ("HEM_PENDING", 2)
        entry, _ = await kernel_of(gw).state.idp(so, late["idp_id"])
        assert entry.status == "denied"


@settings(max_examples=200, deadline=None)
@given(body=st.dictionaries(_KEYS, _JSON, max_size=6), event_id=_TRICKY, prev_seq=st.integers(0, 2**53 - 1))
def test_wire_form_splice_is_the_canonical_form(body: dict[str, Any], event_id: str, prev_seq: int) -> None:
    """The event bytes the log writes (signature spliced into the signed JCS) equal the JCS of the whole event, whatever the body holds."""
    key = Ed25519PrivateKey.generate()
    ev = LogEvent(event_id=event_id, event_type="IDP_SUBMITTED", ts=now_rfc3339(), prev_seq=prev_seq,
                  prev_digest="0" * 64, kid="k", body=body)
    try:
        signing = ev.signing_bytes()
    except rfc8785.CanonicalizationError:
        return  # no JCS form at all: nothing is appended
    ev.sig = b64url(key.sign(signing))
    assert with_signature(signing, ev.sig) == ev.canonical_bytes()


async def test_signed_bytes_are_the_events_signing_bytes(setup: Any, nc: Any, tmp_path: Path) -> None:
    """What the log signs is exactly LogEvent.signing_bytes(), and what it writes is canonical_bytes(), so verifiers agree."""
    cfg = setup[0]
    log = EventLog(nc, cfg.subjects, load_or_create(tmp_path, "kernel"))
    body = {"idp": idp(so_id=str(uuid.uuid4()), mandate_id="m", step=1, action="CloseBooking"), "confidence": 0.9,
            "note": "caf\u00e9 \U0001f600", "\U0001f600key": 1, "\ue000": [2**53 - 1, 1.5e-7]}
    ev = LogEvent(event_id="e", event_type="IDP_SUBMITTED", ts=now_rfc3339(), prev_seq=3, prev_digest="0" * 64,
                  kid="", body=body)
    data = log._sign(ev)
    assert log.key.public.verify(ev.signature, ev.signing_bytes()) is None
    assert data == ev.canonical_bytes()


async def test_a_permits_writes_leave_in_their_order(setup: Any, nc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PERMIT's durable writes leave in the order they left before they ran in the request's own task: the session CAS
    first (so the bucket stores the report key after it), then the report key and IDP_SUBMITTED, then the index entry, then
    CEDAR_PERMIT_RECORDED."""
    cfg, _issuer, so, token, jti = setup
    async with running_gateway(cfg, nc) as gw:
        kernel = kernel_of(gw)
        sent: list[str] = []
        real = kernel.nc._send_command

        async def send(cmd: bytes, priority: bool = False) -> None:
            for line in bytes(cmd).split(b"\r\n"):
                if line.startswith((b"PUB ", b"HPUB ")):
                    subject = line.split(b" ")[1].decode()
                    if subject.startswith(("$KV.PGW_KERNEL.", "pgw.log.")):
                        sent.append(subject.split(".")[2] if subject.startswith("$KV") else subject)
            await real(cmd, priority)

        monkeypatch.setattr(kernel.nc, "_send_command", send)
        for step in (1, 2):  # the first step of a session, then one whose session is cached
            sent.clear()
            data = msgspec.json.encode({"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=step, action="CloseBooking")})
            assert isinstance(await kernel.handle_request(AGENT, data), Permit)
            # The report key and IDP_SUBMITTED run beside each other (their order is not fixed), after the session CAS.
            assert sent[0] == "sess" and sorted(sent[1:3]) == ["pgw.log.IDP_SUBMITTED", "tr"], sent
            assert sent[3:] == ["idp", "pgw.log.CEDAR_PERMIT_RECORDED"], sent


async def test_an_ops_user_verifies_the_log_without_a_consumer(tmp_path: Path, capsys: Any) -> None:
    """On a server enforcing per-party permissions (as `pgw up` starts it), `pgw log verify` with an ops user's
    credentials walks the log and its checkpoints by message get: ops may read every stream but create no
    consumer (DESIGN §7), and the walk by an ordered consumer timed out for them."""
    from gateway.security import Party, embedded_auth
    from pgwcore.config import load_config
    from pgwcore.server import EmbeddedServer

    issuer = Issuer(tmp_path / "issuer")
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent=AGENT, so_id=so)
    settings = {"data_dir": str(tmp_path / "data"), "agents": {AGENT: {"principals": ["alice"]}},
                "security": {"ops": ["oncall"]},
                "kernel": {"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(policy_dir(tmp_path))}}
    auth = embedded_auth(load_config(None, **settings))
    async with EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=None, websocket_port=None,
                              authorization=auth.server_block) as server:
        cfg = load_config(None, nats_url=server.client_url, **settings)
        gw_nc = await connect(server.client_url, creds=str(auth.service_creds), name="gateway")
        agent_nc = await connect(server.client_url, creds=str(auth.creds_for(Party("agent", AGENT))), name="agent")
        try:
            async with running_gateway(cfg, gw_nc):
                for step in (1, 2):
                    body = {"mandate": token, "idp": idp(so_id=so, mandate_id=jti, step=step, action="CloseBooking")}
                    assert isinstance(await request(agent_nc, AGENT, body), Permit)
        finally:
            await agent_nc.close()
            await gw_nc.drain()
        ops = load_config(None, nats_url=server.client_url, creds=str(auth.creds_for(Party("ops", "oncall"))),
                          **settings)
        args = argparse.Namespace(stream="PGW_EVENTLOG", subject=None, pubkey=[])
        assert await asyncio.wait_for(verify_command(args, ops), 30) == 0
        out = capsys.readouterr().out
        assert '"ok": true' in out and '"checked": 4' in out
        sub_args = argparse.Namespace(stream="PGW_EVENTLOG", subject="pgw.log.IDP_SUBMITTED", pubkey=[])
        assert await asyncio.wait_for(verify_command(sub_args, ops), 30) == 0
        assert '"checked": 2' in capsys.readouterr().out
