"""The signer consumer against a real nats-server (spec 004, DESIGN §6)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

from consumers.cose import TrustedKey, decode_sign1
from consumers.ledger_check import check_ledger
from consumers.signer import LEDGER_STREAM, Signer
from consumers.verifier import payload_of, verify_many
from pgwcore.config import Config
from pgwcore.keys import public_keys
from pgwcore.publish import Publisher
from subjects.wire import Verdict
from tests.polling import until, until_drained
from tests.stored import stored_msgs
from tests.test_capsule_model import design_rows, verdict, vid

REPO = Path(__file__).resolve().parent.parent


async def stream_items(js: Any, stream: str) -> list[tuple[str, bytes, dict[str, str]]]:
    return [(f"{stream}#{m.seq}", m.data, m.headers or {}) for m in await stored_msgs(js, stream)]


async def wait_count(js: Any, stream: str, n: int, timeout: float = 30.0) -> int:
    """Wait until ``stream`` holds at least ``n`` messages (polls the server, bounded)."""
    async def enough() -> int:
        c = (await js.stream_info(stream)).state.messages
        return c if c >= n else 0

    return await until(enough, timeout=timeout, what=f"{stream} holding {n} messages")


def signer_keys(config: Config) -> dict[str, TrustedKey]:
    return {k.kid: TrustedKey(k.kid, k.public) for k in public_keys(config.data_path, "signer")}


async def test_every_design_row_gets_one_verified_capsule(nc: Any, make_config: Any) -> None:
    """Each DESIGN §6 verdict yields exactly one capsule that passes Class 1 verification, chains resolved."""
    config = make_config(signer={"capsule_format": "2"})  # the format-2 profile (spec 004 draft -01)
    js = nc.jetstream()
    pub = Publisher(js, config.subjects)
    rows = design_rows()
    for v in rows:
        await pub.verdict(v)
    async with Signer(config, nc):
        await wait_count(js, "PGW_REGISTRATION", len(rows))
    items = await stream_items(js, "PGW_REGISTRATION")
    assert len(items) == len(rows)
    payloads = {payload_of(d)["pgw"]["verdict_id"]: payload_of(d) for _, d, _ in items}
    assert set(payloads) == {v.verdict_id for v in rows}
    for _, d, h in items:
        assert h["Nats-Msg-Id"] == payload_of(d)["capsule_id"]
    results = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(config))
    assert all(r.ok for r in results), [(r.source, r.findings) for r in results if not r.ok]
    # §5.3: chained exactly where the capsule carries its chain block; the signer's hash chain is store-level
    assert all(r.assurance["ledger_mode"] == ("chained" if "chain" in payload_of(d) else "standalone")
               for r, (_, d, _) in zip(results, items, strict=True))
    assert not any("ledger" in payload_of(d) for _, d, _ in items)
    ledger = check_ledger([m.data for m in await stored_msgs(js, LEDGER_STREAM)])
    assert ledger.ok and sorted(ledger.capsule_ids) == sorted(payload_of(d)["capsule_id"] for _, d, _ in items)
    # chains: resolution -> dispatch, expiry -> dispatch, execution -> HEM resolution.
    for child, parent in (("resolved", "dispatch"), ("expired", "dispatch2"), ("executed", "hem")):
        assert payloads[vid(child)]["chain"] == {"parent_capsule_id": payloads[vid(parent)]["capsule_id"],
                                                 "relation": "supersedes"}
    blocked = payloads[vid("blocked")]
    assert blocked["disposition"]["verdict_class"] == "blocked"  # refusal capsules exist
    # the key is a 0600 file in the data folder
    pem = next((config.data_path / "keys" / "signer").glob("*.pem"))
    assert pem.stat().st_mode & 0o777 == 0o600
    assert (config.data_path / "signer" / "tenant_salt").stat().st_mode & 0o777 == 0o600


async def test_redelivered_verdict_yields_same_capsule_once(nc: Any, make_config: Any) -> None:
    """Re-signing a verdict (as after a crash) gives byte-identical statements and no second capsule."""
    config = make_config()
    js = nc.jetstream()
    v = design_rows()[0]
    await Publisher(js, config.subjects).verdict(v)
    async with Signer(config, nc) as signer:
        await wait_count(js, "PGW_REGISTRATION", 1)
        first = (await stream_items(js, "PGW_REGISTRATION"))[0][1]
        again, _cid, status = await signer.sign_verdict(v)
        assert again == first and status == "replayed"
        # the same verdict reaching the stream again under another message id is still one capsule
        await js.publish(config.subjects.verdict(v.verdict_class), msgspec.json.encode(v),
                         headers={"Nats-Msg-Id": "replay-" + v.verdict_id})
        other = verdict("other", "denied")
        await Publisher(js, config.subjects).verdict(other)
        await signer.wait_signed(3, timeout=10)  # first, its second copy (deduplicated), other
    items = await stream_items(js, "PGW_REGISTRATION")
    assert Counter(payload_of(d)["pgw"]["verdict_id"] for _, d, _ in items) == {v.verdict_id: 1, other.verdict_id: 1}
    assert (await js.stream_info(LEDGER_STREAM)).state.messages == 2


async def test_resolution_waits_for_its_dispatch(nc: Any, make_config: Any) -> None:
    """A resolution seen before its dispatch capsule exists is retried, then chained to it."""
    config = make_config()
    js = nc.jetstream()
    rows = design_rows()
    dispatch, resolution = rows[2], rows[3]
    pub = Publisher(js, config.subjects)
    await pub.verdict(resolution)  # out of order on purpose
    async with Signer(config, nc) as signer:
        async def resolution_tried() -> bool:  # the signer fetched the lone resolution and nak'ed it
            return (await js.consumer_info("PGW_VERDICTS", config.signer.durable)).delivered.stream_seq >= 1

        await until(resolution_tried, timeout=10, interval=0.02, what="the lone resolution fetched")
        assert signer.signed == 0
        await pub.verdict(dispatch)
        await wait_count(js, "PGW_REGISTRATION", 2)
        await signer.wait_signed(2, timeout=10)  # counted after the acks, which follow the stored capsules
        assert signer.signed == 2
    items = {payload_of(d)["pgw"]["verdict_id"]: payload_of(d) for _, d, _ in await stream_items(js, "PGW_REGISTRATION")}
    assert items[resolution.verdict_id]["chain"]["parent_capsule_id"] == items[dispatch.verdict_id]["capsule_id"]


async def test_resolution_waits_for_its_dispatch_past_the_warning(nc: Any, make_config: Any) -> None:
    """A resolution whose dispatch comes after more redeliveries than parent_wait_deliveries still gets its chain."""
    config = make_config(signer={"parent_wait_deliveries": 2})
    js = nc.jetstream()
    rows = design_rows("late-")
    dispatch, resolution = rows[2], rows[3]
    pub = Publisher(js, config.subjects)
    await pub.verdict(resolution)
    async with Signer(config, nc) as signer:
        async def tried_past_the_limit() -> bool:
            info = await js.consumer_info("PGW_VERDICTS", config.signer.durable)
            return info.delivered.consumer_seq >= 4  # delivered four times, twice past the limit

        await until(tried_past_the_limit, timeout=20, interval=0.05, what="the lone resolution redelivered")
        assert signer.signed == 0  # never signed without its parent
        await pub.verdict(dispatch)
        await signer.wait_signed(2, timeout=20)
    items = {payload_of(d)["pgw"]["verdict_id"]: payload_of(d) for _, d, _ in await stream_items(js, "PGW_REGISTRATION")}
    assert items[resolution.verdict_id]["chain"]["parent_capsule_id"] == items[dispatch.verdict_id]["capsule_id"]


def _spawn_signer(config: Config, toml: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "pgwcli.commands.capsules", "--config", str(toml), "--server", config.nats_url,
         "--data-dir", config.data_dir, "--log-format", "json", "--log-level", "WARNING", "signer"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL,
        stderr=(toml.parent / "signer.log").open("ab"),  # a file: a full pipe would stall the child
    )


async def kill9_signer_run(nc: Any, config: Any, fmt: str, tag: str, n: int = 300) -> tuple[list[Any], list[Any], int]:
    """Publish ``n`` verdicts to a `pgw signer` in format ``fmt``, SIGKILL it mid-batch, restart it and wait
    until its consumer drained: (verdicts, PGW_REGISTRATION items, statements stored before the kill)."""
    toml = Path(config.data_dir).parent / "signer.toml"
    # redeliver the in-flight batch quickly
    toml.write_text(f'[signer]\nack_wait_s = 2.0\nbatch = 16\ncapsule_format = "{fmt}"\n')
    js = nc.jetstream()
    pub = Publisher(js, config.subjects)
    verdicts = [verdict(f"{tag}{i}", "blocked" if i % 3 else "denied") for i in range(n)]
    proc = _spawn_signer(config, toml)
    try:
        for v in verdicts:
            await pub.verdict(v)
        await wait_count(js, "PGW_REGISTRATION", 20, timeout=60)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed_at = (await js.stream_info("PGW_REGISTRATION")).state.messages
        assert killed_at < n, "the signer finished before the kill; nothing was tested"
        proc = _spawn_signer(config, toml)
        await wait_count(js, "PGW_REGISTRATION", n, timeout=120)

        await until_drained(js, "PGW_VERDICTS", config.signer.durable, timeout=60, interval=0.1,
                            what="the signer's consumer drained")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return verdicts, await stream_items(js, "PGW_REGISTRATION"), killed_at


@pytest.mark.slow
async def test_kill9_mid_batch_every_verdict_exactly_one_capsule(nc: Any, make_config: Any) -> None:
    """SIGKILL of `pgw signer` mid-batch, then restart: every verdict has exactly one capsule, chain intact."""
    config = make_config(signer={"capsule_format": "2"})  # the format-2 profile (spec 004 draft -01)
    n = 300
    verdicts, items, killed_at = await kill9_signer_run(nc, config, "2", "k", n)
    by_verdict = Counter(payload_of(d)["pgw"]["verdict_id"] for _, d, _ in items)
    assert len(items) == n
    assert set(by_verdict) == {v.verdict_id for v in verdicts}
    assert set(by_verdict.values()) == {1}
    assert len({payload_of(d)["capsule_id"] for _, d, _ in items}) == n
    # the hash chain survived the crash: every capsule verifies chained against the whole set
    results = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(config))
    assert all(r.ok for r in results)
    ledger = check_ledger([m.data for m in await stored_msgs(nc, LEDGER_STREAM)])
    assert ledger.ok and ledger.links == n
    assert sorted(ledger.capsule_ids) == sorted(payload_of(d)["capsule_id"] for _, d, _ in items)
    assert killed_at >= 20 and decode_sign1(items[0][1]).kid


async def test_gateway_blocked_envelope_yields_blocked_capsule(nc: Any, make_config: Any) -> None:
    """A malformed envelope through the real gateway ends as a verified `blocked` capsule."""
    try:
        from gateway.app import Gateway
    except ImportError as e:  # pragma: no cover - the gateway is another engineer's module
        pytest.fail(f"gateway.app not importable: {e}")
    config = make_config()
    js = nc.jetstream()
    async with Gateway(config, nc), Signer(config, nc):
        await js.publish(config.subjects.envelope("bot"), b'{"type": "error", "nonsense": 1}',
                         headers={"Nats-Msg-Id": "bot:bad-1"})
        await wait_count(js, "PGW_REGISTRATION", 1)
    items = await stream_items(js, "PGW_REGISTRATION")
    payloads = [payload_of(d) for _, d, _ in items]
    assert any(p["disposition"].get("verdict_class") == "blocked" and p["disposition"]["decision"] == "reject"
               and p["disposition"]["human_disposed"] is False for p in payloads), payloads
    assert all(r.ok for r in verify_many([(s, d) for s, d, _ in items], keys=signer_keys(config)))


async def test_unparseable_verdict_time_uses_stream_time(nc: Any, make_config: Any) -> None:
    """A verdict whose ts is not RFC 3339 still gets its capsule, timed by the stream, the same on redelivery."""
    config = make_config()
    js = nc.jetstream()
    v = verdict("badts", "engine_failure", ts="yesterday-ish", action_id="")
    await Publisher(js, config.subjects).verdict(v)
    async with Signer(config, nc) as signer:
        await signer.wait_signed(1, timeout=10)
        (_, data, _), = await stream_items(js, "PGW_REGISTRATION")
        assert (await signer.sign_verdict(v))[0] == data  # a redelivery re-signs the recorded payload
    p = payload_of(data)
    assert p["timestamp"].endswith("Z") and p["timestamp"].startswith("20")
    assert p["action_id"] == f"verdict:{v.verdict_id}"
    assert "verdict_ts_unparseable" in p["pgw"]["notes"]
    assert all(r.ok for r in verify_many([("x", data)], keys=signer_keys(config)))


def test_verdict_wire_roundtrip() -> None:
    """The verdicts the tests publish decode with the gateway's own decoder (no test-only shape)."""
    for v in design_rows():
        assert msgspec.json.decode(msgspec.json.encode(v), type=Verdict) == v


async def test_a_narrower_existing_durable_is_widened_and_atomic_is_enabled(nc: Any, make_config: Any) -> None:
    """A durable made with a smaller signer.batch is widened; streams made before atomic batches get the flag."""
    config = make_config(signer={"batch": 32})
    js = nc.jetstream()
    async with Signer(make_config(signer={"batch": 8}), nc):  # the old deployment: window 32
        pass
    assert (await js.consumer_info("PGW_VERDICTS", config.signer.durable)).config.max_ack_pending == 32
    info = await js.stream_info("PGW_REGISTRATION")
    info.config.allow_atomic = False  # as a stream created by an older release
    await js.update_stream(info.config)
    assert not (await js.stream_info("PGW_REGISTRATION")).config.allow_atomic
    async with Signer(config, nc) as signer:
        assert (await js.consumer_info("PGW_VERDICTS", config.signer.durable)).config.max_ack_pending == 128
        assert (await js.stream_info("PGW_REGISTRATION")).config.allow_atomic is True
        rows = design_rows("wide-")
        pub = Publisher(js, config.subjects)
        for v in rows:
            await pub.verdict(v)
        await signer.wait_signed(len(rows), timeout=30)
    assert len(await stream_items(js, "PGW_REGISTRATION")) == len(rows)


async def test_a_child_whose_parent_run_is_still_being_stored_waits_for_it(
        nc: Any, make_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resolution fetched while its dispatch's ledger run is still being stored is built after that run, chained to
    the dispatch and never handed back for redelivery."""
    import consumers.signer_ledger as ledger_mod

    config = make_config(signer={"batch": 1})
    js = nc.jetstream()
    rows = design_rows("fly-")
    dispatch, resolution = rows[2], rows[3]
    held, release, child_staged = asyncio.Event(), asyncio.Event(), asyncio.Event()
    real_publish, real_stage = ledger_mod.publish_atomic, Signer._stage_batch

    async def publish_held(nc_: Any, items: Any, **kw: Any) -> Any:
        if any(dispatch.verdict_id in subject for subject, _, _ in items):  # the dispatch's run, held in flight
            held.set()
            await release.wait()
        return await real_publish(nc_, items, **kw)

    async def stage(self: Signer, msgs: Any, before: Any) -> Any:
        if any(resolution.verdict_id.encode() in m.data for m in msgs):
            child_staged.set()
        return await real_stage(self, msgs, before)

    monkeypatch.setattr(ledger_mod, "publish_atomic", publish_held)
    monkeypatch.setattr(Signer, "_stage_batch", stage)
    pub = Publisher(js, config.subjects)
    await pub.verdict(dispatch)
    await pub.verdict(resolution)
    async with Signer(config, nc) as signer:
        await asyncio.wait_for(held.wait(), 10)
        await asyncio.wait_for(child_staged.wait(), 10)  # the resolution's batch is being built meanwhile
        release.set()
        await signer.wait_signed(2, timeout=10)
        info = await js.consumer_info("PGW_VERDICTS", config.signer.durable)
    assert info.num_redelivered == 0 and info.delivered.consumer_seq == 2  # each fetched once
    items = {payload_of(d)["pgw"]["verdict_id"]: payload_of(d) for _, d, _ in await stream_items(js, "PGW_REGISTRATION")}
    assert items[resolution.verdict_id]["chain"]["parent_capsule_id"] == items[dispatch.verdict_id]["capsule_id"]
    assert check_ledger([m.data for m in await stored_msgs(js, LEDGER_STREAM)]).ok


async def test_a_batch_of_transitions_with_outcomes_fits_the_atomic_batch_limit(nc: Any, make_config: Any) -> None:
    """With signer.batch above half the server's atomic batch limit, verdicts that each yield a capsule and an
    outcome statement are signed at the first delivery (a fetched batch's statements go in one atomic batch of at
    most 1000; a batch over it was refused whole and handed back)."""
    config = make_config(signer={"batch": 600})
    js = nc.jetstream()
    pub = Publisher(js, config.subjects)
    n = 600
    transitions = [Verdict(verdict_id=vid(f"tr-{i}"), ts="2026-03-01T12:00:00.000Z", agent="a", action_type="envelope",
                           action_id=f"tr:{i}", verdict_class="executed", decision="accept", approver="policy",
                           human_disposed=False,
                           details={"match_result": "match", "requested_action": "Close", "executed_action": "Close"})
                   for i in range(n)]
    for i in range(0, n, 100):
        await asyncio.gather(*(pub.verdict(v) for v in transitions[i:i + 100]))
    async with Signer(config, nc) as signer:
        await signer.wait_signed(2 * n, timeout=60)  # each: its capsule and its outcome
        info = await js.consumer_info("PGW_VERDICTS", config.signer.durable)
    assert (await js.stream_info("PGW_REGISTRATION")).state.messages == 2 * n
    assert info.delivered.consumer_seq == n  # each verdict fetched once


async def test_a_failed_ledger_lookup_hands_the_batch_back_and_the_signer_goes_on(
        nc: Any, make_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ledger lookup that times out while a batch is built (a node failing over) hands the batch back for
    redelivery, and the signer goes on to sign every verdict once: its loop does not end on it."""
    from nats.errors import TimeoutError as NatsTimeoutError

    config = make_config(signer={"batch": 4})
    js = nc.jetstream()
    real_recall, failed = Signer._recall, asyncio.Event()

    async def recall(self: Signer, jobs: Any) -> None:
        if not failed.is_set():
            failed.set()
            raise NatsTimeoutError  # what a get_last_msg meets while the stream's leader is elected
        await real_recall(self, jobs)

    monkeypatch.setattr(Signer, "_recall", recall)
    rows = design_rows("lookup-")[:3]
    pub = Publisher(js, config.subjects)
    for v in rows:
        await pub.verdict(v)
    async with Signer(config, nc) as signer:
        await asyncio.wait_for(failed.wait(), 10)
        await signer.wait_signed(len(rows), timeout=20)
    items = await stream_items(js, "PGW_REGISTRATION")
    assert Counter(payload_of(d)["pgw"]["verdict_id"] for _, d, _ in items) == {v.verdict_id: 1 for v in rows}
