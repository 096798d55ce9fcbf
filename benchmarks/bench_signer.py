"""Signer throughput: capsules/s through the real signer vs raw JCS + Ed25519 + COSE encode.

Both sides sign the same capsules in the same run, so the ratio is what the
signer's machinery (verdict decode, capsule construction rules, ledger
append, JetStream publish with fsync, ack) costs on top of the bare crypto
and encoding. Run alone: ``.venv/bin/python -m benchmarks.bench_signer``.

Two raw baselines, both a loop over capsules already in memory doing JCS of
the identity form + SHA-256, JCS of the payload, the Ed25519 signature and the
COSE_Sign1 encode (cbor2), nothing else:

- **raw, rfc8785**: JCS by the reference implementation (issue 8's "raw
  JCS"), a pure-Python JCS the signer does not use;
- **raw, msgspec**: JCS by msgspec's sorted encoder, the fast path the
  signer itself uses where it is exact (``consumers.capsule.canonical_bytes``),
  without even the checking walk: the cheapest possible canonical JSON, so
  this ratio is what the signer's own machinery costs;
- **raw, subjects.jcs**: JCS by the project's own exact implementation (the
  checking walk, then msgspec), i.e. the raw loop written with the JCS the
  signer itself uses: **the target row** (>= 0.7, issue 18).

The signer signs in a worker process beside it by default on two cores or
more (``signer.workers``, consumers/signer_pool.py); the row "signing in
process (signer.workers = 0)" runs the same signer without it, and the CPU
row adds the signer's process and its workers' CPU per capsule (less moved by
a shared machine's load than capsules/s, not immune: on one quiet host the
workers' CPU for the same signatures read 88 to 120 us per capsule in runs
31-33, benchmarks/performance-log.md). The decision on the
target (>= 0.7 of the raw format-4 loop) is the row "end to end, vs a raw
format-4 loop".
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cbor2
import msgspec
import rfc8785
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from benchmarks import harness
from benchmarks.harness import bench_server, cpu_s
from consumers import capsule as capm
from consumers import capsule_map, capsule_v4, profiles
from consumers.signer import Signer, _Head, _Job, claims_for, sign_payload
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.keys import SigningKey, kid_of
from pgwcore.publish import Publisher
from pgwcore.service import freeze_startup_heap
from pgwcore.streams import ensure_streams
from subjects import jcs
from subjects.util import stable_id
from subjects.wire import Refusal, ReportedEffect, Verdict

N = int(os.environ.get("PGW_BENCH_SIGNER_N", "10000"))  # about 2 s through the signer: 3,000 (0.5 s) moved by +-5 % run to run
SALT = "00" * 32


def _verdicts(n: int) -> list[Verdict]:
    out = []
    for i in range(n):
        kw: dict[str, object] = {
            "verdict_id": stable_id("bench", str(i)), "ts": "2026-03-01T12:00:00.000Z", "agent": "bench",
            "action_type": "envelope", "action_id": f"bench:{i}", "approver": "policy", "human_disposed": False,
        }
        if i % 2:
            kw.update(verdict_class="blocked", decision="reject", reason=Refusal("invalid_envelope_shape", "x"))
        else:
            kw.update(verdict_class="executed", decision="accept",
                      effect=ReportedEffect(type="write_order", status="confirmed", request={"n": str(i)},
                                            response={"ok": True, "id": str(i)}))
        out.append(Verdict(**kw))  # type: ignore[arg-type]
    return out


def _raw_baseline(payloads: list[dict], key: Ed25519PrivateKey, kid: str,
                  jcs: Callable[[Any], bytes] = rfc8785.dumps) -> float:
    """capsules/s for JCS + SHA-256 id + Ed25519 + COSE_Sign1 encode, nothing else."""
    t0 = time.perf_counter()
    for p in payloads:
        hashlib.sha256(jcs({k: v for k, v in p.items() if k not in ("capsule_id", "chain", "ledger")}))
        body = jcs(p)
        prot = cbor2.dumps({1: -8, 4: kid.encode(), 3: capm.MEDIA_TYPE, 15: claims_for(p)})
        sig = key.sign(cbor2.dumps(["Signature1", prot, b"", body]))
        cbor2.dumps(cbor2.CBORTag(18, [prot, {}, body, sig]))
    return len(payloads) / (time.perf_counter() - t0)


def _raw_format4(payloads: list[dict], key: Ed25519PrivateKey, kid: str) -> float:
    """capsules/s for format 4's bare work: JCS + SHA-256 id, JCS payload, the Producer Envelope
    and the registration statement (two Ed25519 signatures, two COSE_Sign1 encodes), nothing else."""
    pub = capsule_v4.raw_public(key.public_key())
    t0 = time.perf_counter()
    for p in payloads:
        raw_id = hashlib.sha256(jcs.dumps({k: v for k, v in p.items() if k != "capsule_id"})).digest()
        body = jcs.dumps(p)
        eprot = cbor2.dumps({1: -8, 3: capsule_v4.ID_MEDIA_TYPE, 4: pub})
        env = cbor2.dumps(cbor2.CBORTag(18, [eprot, {}, raw_id, key.sign(cbor2.dumps(["Signature1", eprot, b"",
                                                                                     raw_id]))]))
        prot = cbor2.dumps({1: -8, 4: kid.encode(), 3: capsule_v4.ID_MEDIA_TYPE, 15: capsule_v4.claims_for(p)})
        sig = key.sign(cbor2.dumps(["Signature1", prot, b"", raw_id]))
        cbor2.dumps(cbor2.CBORTag(18, [prot, {capsule_v4.CAPSULE_LABEL: body, capsule_v4.ENVELOPE_LABEL: env},
                                       raw_id, sig]))
    return len(payloads) / (time.perf_counter() - t0)


def _inprocess4(verdicts: list[Verdict], key: SigningKey) -> float:
    """capsules/s for what the signer does in process with its default profile (format 4)."""
    prof = profiles.profile("4")
    t0 = time.perf_counter()
    head = _Head(0, capm.GENESIS_HASH, None)
    for v in verdicts:
        built = prof.build(v, operator="bench", salt=SALT, default_developer="principal-gateway",
                           authority=None, parent_capsule_id=None, fallback_ts=None)
        job = _Job(None, v, built=built)
        job.profile = prof
        entry, head = Signer._link(head, job, {})
        sign_payload(entry.payload.encode(), key, built.body)
    return len(verdicts) / (time.perf_counter() - t0)


def _inprocess(verdicts: list[Verdict], key: SigningKey) -> float:
    """capsules/s for what the signer does in process: build (all rules), chain, sign; no NATS."""
    t0 = time.perf_counter()
    head = _Head(0, capm.GENESIS_HASH, None)
    for v in verdicts:
        built = capsule_map.capsule_from_verdict_checked(v, operator="bench", salt=SALT)
        entry, head = Signer._link(head, _Job(None, v, built=built), {})
        sign_payload(entry.payload.encode(), key, built.body)
    return len(verdicts) / (time.perf_counter() - t0)


def _cpu_of(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far; 0 for one that is gone."""
    return sum(cpu_s(pid) for pid in pids)


async def _through_signer(verdicts: list[Verdict], tmp: Path, workers: int | str = "auto",
                          cpu: dict[str, float] | None = None) -> float:
    """capsules/s through a real signer (``signer.workers`` = ``workers``); ``cpu`` gets the CPU
    seconds per capsule of the signer's process and of its signing workers over the same window."""
    async with bench_server(tmp / "nats", websocket_port=-1) as srv:
        nc = await connect(srv.client_url, name="bench")
        try:
            js = nc.jetstream()
            config = load_config(None, data_dir=str(tmp / "data"), nats_url=srv.client_url,
                                 log_format="json", signer={"workers": workers})
            await ensure_streams(js, config.subjects)
            pub = Publisher(js, config.subjects)
            await asyncio.gather(*(pub.verdict(v) for v in verdicts))
            async with Signer(config, nc) as signer:
                # As every service process once it has started (pgwcore.service.run_services): the
                # start-up heap frozen, the collector's larger steps.
                freeze_startup_heap()
                # From the moment the signer is up (key, salt, streams, consumer: one-off costs) to
                # the last capsule stored: the steady-state rate.
                pids = signer.pool.worker_pids() if signer.pool is not None else []
                c0, w0 = time.process_time(), _cpu_of(pids)
                t0 = time.perf_counter()
                await signer.wait_signed(len(verdicts), timeout=600)
                elapsed = time.perf_counter() - t0
                if cpu is not None:
                    cpu["signer"] = (time.process_time() - c0) / len(verdicts)
                    cpu["workers"] = (_cpu_of(pids) - w0) / len(verdicts)
            return len(verdicts) / elapsed
        finally:
            await nc.close()


def run() -> list[dict]:
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    verdicts = _verdicts(N)
    priv = Ed25519PrivateKey.generate()
    key = SigningKey("signer", kid_of(priv.public_key()), priv)
    payloads = []
    for v in verdicts:  # as the signer emits them: the ledger linkage stays in PGW_SIGNER_LEDGER
        payloads.append(capsule_map.capsule_from_verdict(v, operator="bench", salt=SALT).to_dict())
    # Every loop below runs with the collector as every service process sets it once started
    # (pgwcore.service.freeze_startup_heap; the signers freeze their own start-up again).
    freeze_startup_heap()
    ref = _raw_baseline(payloads, priv, key.kid)
    fast_jcs = msgspec.json.Encoder(order="sorted").encode
    fast = _raw_baseline(payloads, priv, key.kid, fast_jcs)
    own = _raw_baseline(payloads, priv, key.kid, jcs.dumps)
    inproc = _inprocess(verdicts, key)
    inproc4 = _inprocess4(verdicts, key)
    payloads4 = [capsule_v4.from_verdict(v, operator="bench", salt=SALT).body for v in verdicts]
    c0 = time.process_time()
    raw4 = _raw_format4(payloads4, priv, key.kid)
    raw4_cpu = (time.process_time() - c0) / len(payloads4)
    cpu: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        signer = harness.run(_through_signer(verdicts, Path(d), cpu=cpu))
    with tempfile.TemporaryDirectory() as d:  # the same, signing in the signer's own process
        signer0 = harness.run(_through_signer(verdicts, Path(d), workers=0))
    raw4b = _raw_format4(payloads4, priv, key.kid)  # again after both: the load may have changed

    def row(name: str, value: float, baseline: float, note: str) -> dict:
        return {"name": name, "value": round(value, 1), "baseline": round(baseline, 1),
                "ratio": round(value / baseline, 3), "unit": f"capsules/s ({note})"}

    return [
        row("signer: capsules/s end to end (NATS, ledger, fsync), vs raw with the signer's own JCS", signer, own,
            "ratio vs raw with subjects.jcs, target >= 0.7"),
        row("signer: capsules/s end to end, vs raw with rfc8785 JCS", signer, ref, "ratio vs raw with rfc8785"),
        row("signer: capsules/s end to end, vs raw with msgspec JCS", signer, fast, "ratio vs the fastest raw"),
        row("signer: build + chain + sign, in process, vs raw with the signer's own JCS", inproc, own,
            "ratio vs raw with subjects.jcs"),
        row("signer: build + chain + sign, in process, vs raw with msgspec JCS", inproc, fast,
            "ratio vs the fastest raw"),
        row("signer: build + chain + sign, in process, format 4 (the default: two signatures), vs raw with "
            "the signer's own JCS", inproc4, own, "ratio vs raw with subjects.jcs (one signature)"),
        row("signer: capsules/s end to end, vs a raw format-4 loop (two signatures, the signer's own JCS)",
            signer, raw4, "ratio vs raw format 4"),
        # signer.workers = 0: the same signer signing in its own process (before the signing workers).
        row("signer: capsules/s end to end, signing in process (signer.workers = 0), vs a raw format-4 loop",
            signer0, raw4b, "ratio vs raw format 4, measured after both signer runs"),
        # CPU is robust to the load of a shared machine where capsules/s is not: the signer's process
        # and its signing workers together, per capsule, against the raw format-4 loop's CPU.
        {"name": "signer: CPU us per capsule, signer process + signing workers, vs the raw format-4 loop's",
         "value": round((cpu["signer"] + cpu["workers"]) * 1e6, 1), "baseline": round(raw4_cpu * 1e6, 1),
         "ratio": round((cpu["signer"] + cpu["workers"]) / raw4_cpu, 3),
         "unit": f"us CPU per capsule (signer process {cpu['signer'] * 1e6:.0f}, workers "
                 f"{cpu['workers'] * 1e6:.0f}; each worker from its CPU-time clock, 0 where one is gone)"},
        # The floor of the target row: a format-4 signer with nothing but draft -05's two signatures
        # ({#envelope}, {#registration}) and no NATS at all, on one core, reaches this ratio at most.
        row("raw format-4 loop (the draft's two signatures, no NATS) vs raw with the signer's own JCS",
            raw4, own, "ratio: the most a format-4 signer on one core can reach in the target row"),
    ]


if __name__ == "__main__":
    for row in run():
        print(f"{row['name']}: {row['value']} vs raw {row['baseline']}: ratio {row['ratio']}, {row['unit']}")
