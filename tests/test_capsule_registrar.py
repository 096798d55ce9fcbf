"""The registrar under injected faults (spec 004 §3.2), against the project's fault-injection TS.

Interop with a real Transparency Service is in tests/test_capsule_scittles.py
(scittles); this file keeps what only a TS built to misbehave can show: 503s
and a TS that is down, permanent refusals, forged receipts, and the 202/303
polling paths scittles never takes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
from typing import Any

import pytest
import structlog

from consumers import capsule_v4
from consumers.cose import TrustedKey, decode_sign1, statement_leaf
from consumers.registrar import DLQ_STREAM, Registrar
from consumers.registrar_status import progress
from consumers.signer import Signer
from consumers.ts_keys import pinned_ts_keys_path
from consumers.verifier import payload_of, verify_many
from pgwcli.commands import capsules as cli
from pgwcore.config import Config
from pgwcore.metrics import REGISTRY
from pgwcore.publish import Publisher
from tests.polling import until
from tests.scitt_ts import ScittTS
from tests.test_capsule_model import design_rows
from tests.test_capsule_signer import signer_keys, stream_items, wait_count


async def counted(reg: Any, n: int) -> None:
    """Wait until the registrar has counted ``n`` statements: its counters move after the statement's
    publish and its ack, so the stream can hold it a moment before they do."""
    async def done() -> bool:
        return reg.registered >= n

    await until(done, timeout=30, what=f"the registrar counting {n} statements")


def _config(make_config: Any, ts: ScittTS | None, **registrar: object) -> Config:
    reg: dict[str, object] = {"backoff_base_s": 0.05, "backoff_max_s": 0.2, "poll_timeout_s": 5.0}
    if ts is not None:
        reg["ts_url"] = ts.url
    reg.update(registrar)
    return make_config(registrar=reg)


async def _signed(nc: Any, config: Config, rows: list[Any]) -> None:
    js = nc.jetstream()
    pub = Publisher(js, config.subjects)
    for v in rows:
        await pub.verdict(v)
    async with Signer(config, nc):
        await wait_count(js, "PGW_REGISTRATION", len(rows))


@pytest.mark.parametrize("mode", ["accepted", "see_other"])
async def test_registration_anchors_with_verified_receipts(nc: Any, make_config: Any, mode: str) -> None:
    """202-then-poll and 303-then-poll end with verified Transparent Statements on capsule.registered."""
    rows = design_rows()[:4]
    async with ScittTS(mode=mode, polls_before_ready=2) as ts:  # type: ignore[arg-type]
        config = _config(make_config, ts, ts_public_key=ts.public_hex)
        await _signed(nc, config, rows)
        js = nc.jetstream()
        async with Registrar(config, nc) as reg:
            await wait_count(js, "PGW_CAPSULES", len(rows))
            await counted(reg, len(rows))
            assert reg.registered == len(rows)
        assert len(ts.leaves) == len(rows)  # the TS log really holds each statement once
        # draft -05 {#registration}, {#privacy}: the TS holds the capsule's identifier, not the capsule
        for body in ts.statements:
            sent = decode_sign1(body)
            assert len(sent.payload) == 32 and not set(sent.unprotected) - {394}
        items = await stream_items(js, "PGW_CAPSULES")
        assert (await js.stream_info("PGW_REGISTRATION")).state.messages == 0  # work queue drained
        ts_keys = {ts.kid: TrustedKey(ts.kid, ts.key.public_key())}
        results = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(config), ts_keys=ts_keys)
        assert all(r.ok and r.assurance["attestation_mode"] == "anchored" for r in results), results
        for _, d, h in items:
            msg = decode_sign1(d)
            assert len(msg.receipts()) == 1
            assert h["Nats-Msg-Id"] == payload_of(d)["capsule_id"]
            assert statement_leaf(capsule_v4.registration_statement(d)) in ts.leaves
        # without the TS key the same statements are only self-attested
        plain = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(config))
        assert {r.assurance["attestation_mode"] for r in plain} == {"self_attested"}


async def test_transient_failures_are_retried(nc: Any, make_config: Any) -> None:
    """Two 503s are retried with backoff and the statement is then registered."""
    async with ScittTS(fail_first=2) as ts:
        config = _config(make_config, ts, ts_public_key=ts.public_hex, max_failures=5)
        await _signed(nc, config, design_rows()[:1])
        async with Registrar(config, nc) as reg:
            await wait_count(nc.jetstream(), "PGW_CAPSULES", 1)
            assert reg.dead_lettered == 0
        assert ts.posts == 3


async def test_ts_down_loses_nothing_and_drains_when_back(nc: Any, make_config: Any) -> None:
    """A TS answering 503 to everything never dead-letters: the capsules wait (progress says so), the
    registrar probes at its back-off pace instead of once per capsule, and the queue drains once it is back."""
    rows = design_rows()[:3]
    async with ScittTS(fail_first=-1) as ts:
        config = _config(make_config, ts, ts_public_key=ts.public_hex, max_failures=2)
        await _signed(nc, config, rows)
        js = nc.jetstream()
        async def probed() -> bool:
            return ts.posts >= 6

        with structlog.testing.capture_logs() as logs:
            async with Registrar(config, nc) as reg:
                await until(probed, timeout=20, what="six probes of the TS")
                assert reg.dead_lettered == 0
                p = await progress(js, config.registrar.durable)
                assert (p.waiting, p.registered, p.failed) == (3, 0, 0)
                assert p.retrying >= 1
                assert REGISTRY.get_sample_value("pgw_registrar_ts_reachable") == 0
                assert REGISTRY.get_sample_value("pgw_registrar_waiting") == 3
                ts.fail_first = 0  # the TS is back
                await wait_count(js, "PGW_CAPSULES", len(rows))
                assert REGISTRY.get_sample_value("pgw_registrar_ts_reachable") == 1
        failed = [e for e in logs if e["event"].startswith("registration failed (transient)")]
        pauses = [e for e in logs if e["event"].startswith("Transparency Service unavailable")]
        assert len(failed) >= 6 and len(pauses) == len(failed)  # one probe per pause, not one per capsule
        assert [e["retry_in_s"] for e in pauses[:3]] == [0.05, 0.1, 0.2]  # exponential, capped at backoff_max_s
        assert any(e["event"].startswith("Transparency Service answers again") for e in logs)

        p = await progress(js, config.registrar.durable)
        assert (p.waiting, p.registered, p.failed) == (0, 3, 0)
        assert len(ts.leaves) == len(rows)


async def test_ts_unreachable_then_back_on_the_same_address(nc: Any, make_config: Any) -> None:
    """Connection refused (the TS process is gone) is transient: nothing dead-lettered, and once a TS
    answers on the same address again with the same key, every waiting capsule is anchored."""
    rows = design_rows()[:3]
    ts = await ScittTS().start()
    key, port = ts.key, ts.port
    await ts.stop()
    config = _config(make_config, ts, ts_public_key=ts.public_hex, max_failures=1)
    await _signed(nc, config, rows)
    js = nc.jetstream()
    with structlog.testing.capture_logs() as logs:
        async with Registrar(config, nc) as reg:
            async def refused_twice() -> bool:
                return sum(e["event"].startswith("registration failed (transient)") for e in logs) >= 2

            await until(refused_twice, timeout=20, what="two refused connections")
            assert reg.dead_lettered == 0
            async with ScittTS(key=key, port=port) as back:
                await wait_count(js, "PGW_CAPSULES", len(rows))
                assert len(back.leaves) == len(rows)
    assert any("ClientConnectorError" in e.get("error", "") for e in logs)
    assert (await progress(js, config.registrar.durable)).failed == 0


async def test_slow_answer_times_out_then_409_finishes(nc: Any, make_config: Any) -> None:
    """A TS slower than http_timeout_s: the POST times out (transient), the TS registers it anyway, and the
    retry's 409 + Location leads to the existing entry's receipt: anchored once, never dead-lettered."""
    rows = design_rows()[:1]
    async with ScittTS(hold=asyncio.Event()) as ts:
        config = _config(make_config, ts, ts_public_key=ts.public_hex, http_timeout_s=0.3, max_failures=1)
        await _signed(nc, config, rows)
        js = nc.jetstream()
        with structlog.testing.capture_logs() as logs:
            async with Registrar(config, nc) as reg:
                async def timed_out() -> bool:
                    return any(e["event"].startswith("registration failed (transient)") for e in logs)

                await until(timed_out, timeout=20, what="a timed-out POST")
                assert ts.hold is not None
                ts.hold.set()  # the held handler finishes after the client gave up, as do all later POSTs

                async def logged() -> bool:
                    return len(ts.leaves) == 1

                await until(logged, timeout=20, what="the TS logging the statement")
                await wait_count(js, "PGW_CAPSULES", 1)
                await counted(reg, 1)
                assert (reg.already_registered, reg.dead_lettered) == (1, 0)
        assert len(ts.leaves) == 1  # in the TS's log once
        assert any("TimeoutError" in e.get("error", "") for e in logs)


async def test_unusable_published_key_waits_instead_of_dead_lettering(nc: Any, make_config: Any) -> None:
    """A TS publishing only an RSA key (and no key configured): the registrar says why it cannot verify and
    keeps the capsules waiting (a configuration problem, not the statements'); nothing pinned or anchored."""
    rsa_jwk = {"kty": "RSA", "n": "sXch", "e": "AQAB", "kid": "r1"}
    async with ScittTS(published_jwks={"keys": [rsa_jwk]}) as ts:
        config = _config(make_config, ts, max_failures=1)
        await _signed(nc, config, design_rows()[:2])
        js = nc.jetstream()
        with structlog.testing.capture_logs() as logs:
            async with Registrar(config, nc) as reg:
                async def refused_twice() -> bool:
                    return sum("UnsupportedTsKey" in e.get("error", "") for e in logs) >= 2

                await until(refused_twice, timeout=20, what="two refusals of the published key")
                assert reg.dead_lettered == 0
        p = await progress(js, config.registrar.durable)
        assert (p.waiting, p.registered, p.failed) == (2, 0, 0)
        assert ts.posts == 0  # nothing registered without a key to verify the receipt with
        assert not pinned_ts_keys_path(config.data_path).exists()
        why = next(e["error"] for e in logs if "UnsupportedTsKey" in e.get("error", ""))
        assert "kty 'RSA'" in why and "supported: EdDSA/Ed25519, ES256/P-256, ES384/P-384" in why


async def test_permanent_refusal_goes_to_dead_letter(nc: Any, make_config: Any) -> None:
    """After max_failures permanent refusals (400) the statement is dead-lettered with the error, not anchored."""
    async with ScittTS(reject=True) as ts:
        config = _config(make_config, ts, ts_public_key=ts.public_hex, max_failures=3)
        await _signed(nc, config, design_rows()[:2])
        js = nc.jetstream()
        async with Registrar(config, nc):
            await wait_count(js, DLQ_STREAM, 2)
        items = await stream_items(js, DLQ_STREAM)
        records = [json.loads(d) for _, d, _ in items]
        assert {r["attempts"] for r in records} == {3}
        assert all("400" in r["last_error"] and "refused" in r["last_error"] for r in records)
        cids = {payload_of(base64.b64decode(r["statement_b64"]))["capsule_id"] for r in records}
        assert cids == {r["capsule_id"] for r in records}
        assert (await js.stream_info("PGW_CAPSULES")).state.messages == 0
        assert (await js.stream_info("PGW_REGISTRATION")).state.messages == 0
        assert ts.posts == 6
        p = await progress(js, config.registrar.durable)
        assert (p.waiting, p.registered, p.failed) == (0, 0, 2)


async def test_forged_receipt_is_never_anchored(nc: Any, make_config: Any) -> None:
    """A receipt not signed by the trusted TS key is refused: nothing reaches capsule.registered."""
    async with ScittTS(bad_receipts=True) as ts:
        config = _config(make_config, ts, ts_public_key=ts.public_hex, max_failures=2)
        await _signed(nc, config, design_rows()[:1])
        js = nc.jetstream()
        async with Registrar(config, nc):
            await wait_count(js, DLQ_STREAM, 1)
        rec = json.loads((await stream_items(js, DLQ_STREAM))[0][1])
        assert "signature" in rec["last_error"]
        assert (await js.stream_info("PGW_CAPSULES")).state.messages == 0


async def test_no_ts_configured_capsules_wait(nc: Any, make_config: Any) -> None:
    """With no ts_url the registrar starts, consumes nothing and says how many capsules wait."""
    config = _config(make_config, None)
    await _signed(nc, config, design_rows()[:3])
    with structlog.testing.capture_logs() as logs:
        async with Registrar(config, nc) as reg:
            assert reg.waiting == 3
    js = nc.jetstream()
    assert (await js.stream_info("PGW_REGISTRATION")).state.messages == 3
    assert (await js.stream_info("PGW_CAPSULES")).state.messages == 0
    warning = next(e for e in logs if e["log_level"] == "warning")
    assert "no Transparency Service configured" in warning["event"] and "registrar.ts_url" in warning["event"]
    assert warning["waiting"] == 3


async def test_cli_verify_files_and_keys(tmp_path: Any, nc: Any, make_config: Any, capsys: Any) -> None:
    """`pgw verify DIR` fails a tampered statement file; `pgw keys` prints hex, PEM and kid of each key."""
    config = make_config()
    await _signed(nc, config, design_rows()[:2])
    d = tmp_path / "caps"
    d.mkdir()
    items = await stream_items(nc.jetstream(), "PGW_REGISTRATION")
    for i, (_, data, _) in enumerate(items):
        (d / f"{i}.cose").write_bytes(data)
    (d / "junk.cose").write_bytes(b"\x00garbage")
    capsys.readouterr()
    args = argparse.Namespace(paths=[str(d)], stream=[], key=[], ts_key=[], store=[], json=False)
    assert await cli.handle_verify(args, config) == 1
    out = capsys.readouterr().out
    assert out.count("OK  ") == 2 and "FAIL" in out and "junk.cose" in out and "cose_malformed" in out
    args = argparse.Namespace(paths=[str(d / "0.cose")], stream=[], key=[], ts_key=[], store=[], json=False)
    assert await cli.handle_verify(args, config) == 0
    # Its capsule as a bare JSON file passes on its content alone, and says so: its line read as a signed
    # statement's, and a docs-only attack's hand-made "approve by a human" printed a plain OK.
    bare = tmp_path / "bare.json"
    bare.write_bytes(json.dumps(payload_of(items[0][1])).encode())
    capsys.readouterr()
    args = argparse.Namespace(paths=[str(bare)], stream=[], key=[], ts_key=[], store=[], json=False)
    assert await cli.handle_verify(args, config) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK (UNSIGNED") and not out.startswith("OK  "), out
    args = argparse.Namespace(paths=[str(bare)], stream=[], key=[], ts_key=[], store=[], json=True)
    assert await cli.handle_verify(args, config) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["unsigned"] is True
    assert await cli.handle_keys(argparse.Namespace(rotate=None, role=None), config) == 0
    out = capsys.readouterr().out
    from pgwcore.keys import public_keys

    k = public_keys(config.data_path, "signer")[0]
    assert f"kid: {k.kid}" in out and k.raw_hex in out and "BEGIN PUBLIC KEY" in out and "status: active" in out
    assert await cli.handle_keys(argparse.Namespace(rotate="signer", role="signer"), config) == 0
    out = capsys.readouterr().out
    assert out.count("status: retired") == 1 and out.count("status: active") == 1
    # statements signed before the rotation still verify with the data folder's keys
    args = argparse.Namespace(paths=[str(d / "0.cose")], stream=[], key=[], ts_key=[], store=[], json=False)
    assert await cli.handle_verify(args, config) == 0


async def test_a_failure_the_registrar_does_not_settle_hands_the_statement_back(
        nc: Any, make_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A statement whose handling fails in a way the registrar does not settle itself (a bus write timing out during a
    node's failover) is handed back and registered on its redelivery: the registrar's loop goes on."""
    from nats.errors import TimeoutError as NatsTimeoutError

    real, failed = Registrar._handle, []

    async def handle(self: Registrar, msg: Any, hdrs: Any) -> bool:
        if not failed:
            failed.append(msg)
            raise NatsTimeoutError
        return await real(self, msg, hdrs)

    monkeypatch.setattr(Registrar, "_handle", handle)
    async with ScittTS() as ts:
        config = _config(make_config, ts, ts_public_key=ts.public_hex)
        await _signed(nc, config, design_rows()[:2])
        async with Registrar(config, nc) as reg:
            await wait_count(nc.jetstream(), "PGW_CAPSULES", 2)
            await counted(reg, 2)
            assert reg.registered == 2 and len(failed) == 1


async def test_an_empty_answer_of_the_servers_on_capsule_register_is_passed_over(nc: Any, make_config: Any) -> None:
    """A party's no-wait pull with ``capsule.register`` as its reply subject makes nats-server store its ``404 No
    Messages`` answer there as an empty record (found by a docs-only attack). It is no statement of the signer's:
    the registrar passes over it, neither sending it to the Transparency Service (where, while the service was
    down, it held the queue) nor dead-lettering it, and registers the statements around it."""
    from nats.js.api import StreamConfig

    async with ScittTS() as ts:
        config = _config(make_config, ts, ts_public_key=ts.public_hex)
        js = nc.jetstream()
        await _signed(nc, config, design_rows()[:1])
        await js.add_stream(StreamConfig(name="EMPTY_PULL", subjects=["empty.pull"]))
        await js.pull_subscribe("empty.pull", durable="nothing", stream="EMPTY_PULL")
        await nc.publish("$JS.API.CONSUMER.MSG.NEXT.EMPTY_PULL.nothing", b'{"batch": 1, "no_wait": true}',
                         reply=f"{config.prefix}.capsule.register")
        await wait_count(js, "PGW_REGISTRATION", 2)
        stored = (await js.get_msg("PGW_REGISTRATION", 2))
        assert not stored.data and not stored.headers, stored  # the server's answer, as it is stored
        async with Registrar(config, nc) as reg:
            await wait_count(js, "PGW_CAPSULES", 1)

            async def settled() -> bool:
                info = await js.consumer_info("PGW_REGISTRATION", config.registrar.durable)
                return info.num_pending == 0 and info.num_ack_pending == 0

            await until(settled, timeout=30, what="both records of capsule.register settled")
            assert reg.dead_lettered == 0
        assert ts.posts == 1, ts.posts
