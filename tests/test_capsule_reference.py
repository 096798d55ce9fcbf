"""Capsules from a real run, checked by the spec authors' reference verifier (PyPI, issue 14).

The reference is the other side's own code (tests/refverifier.py installs it
from PyPI and runs its CLI); nothing of it is reimplemented here.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from consumers.signer import Signer
from consumers.verifier import payload_of, verify_many
from gateway.app import Gateway
from pgwcore.publish import Publisher
from tests import refverifier
from tests.test_capsule_model import design_rows
from tests.test_capsule_signer import signer_keys, stream_items, wait_count


async def real_run_capsules(nc: Any, config: Any) -> list[bytes]:
    """Signed statements of every verdict class, from the gateway and the signer against a real NATS.

    A malformed envelope goes through the real gateway (a ``blocked``
    verdict of its own); one verdict per DESIGN §6 row (every other class,
    supersedes chains included) goes through the signer's stream. Returned
    in ledger order, the order the reference reads a store in.
    """
    js = nc.jetstream()
    rows = design_rows("ref-")
    async with Gateway(config, nc), Signer(config, nc):
        await js.publish(config.subjects.envelope("bot"), b'{"type": "error", "nonsense": 1}',
                         headers={"Nats-Msg-Id": "bot:ref-bad-1"})
        await wait_count(js, "PGW_REGISTRATION", 1)
        pub = Publisher(js, config.subjects)
        for v in rows:
            await pub.verdict(v)
        await wait_count(js, "PGW_REGISTRATION", len(rows) + 1)
    items = await stream_items(js, "PGW_REGISTRATION")
    assert len(items) == len(rows) + 1
    # every capsule verifies under our own verifier too (signature, supersedes chains); chained exactly
    # where the capsule carries its chain block (§5.3), the signer's hash chain being store-level
    results = verify_many([(s, d) for s, d, _ in items], keys=signer_keys(config))
    assert all(r.ok and r.assurance["ledger_mode"] == ("chained" if "chain" in payload_of(d) else "standalone")
               for r, (_, d, _) in zip(results, items, strict=True)), \
        [(r.source, r.findings) for r in results if not r.ok]
    return [d for _, d, _ in items]  # stream order: the signer stores a parent before its child


async def test_reference_0_1_0_accepts_every_verdict_class(nc: Any, make_config: Any) -> None:
    """agent-action-capsule 0.1.0 (format "2") accepts every capsule of a real run, with no error finding."""
    config = make_config(signer={"capsule_format": "2"})  # 0.1.0 verifies format "2"
    statements = await real_run_capsules(nc, config)
    payloads = [refverifier.payload_of_statement(s) for s in statements]
    classes = Counter(p["disposition"].get("verdict_class", "executed") for p in payloads)
    assert set(classes) >= {"blocked", "denied", "hitl_dispatched", "resolved", "timeout", "executed",
                            "errored", "engine_failure"}, classes
    results = refverifier.run(statements, version="0.1.0")
    bad = [(r.capsule_id, [(f.code, f.detail) for f in r.errors]) for r in results if not r.ok or r.errors]
    assert not bad, json.dumps(bad, indent=1)
    # §5.3: each capsule claims only the ledger_mode its own bytes support, so not even an info overclaim
    over = [(r.capsule_id, f.code, f.detail) for r in results for f in r.findings if "overclaim" in f.code]
    assert not over, json.dumps(over, indent=1)
    # the reference recomputed each capsule_id itself and got the one the capsule carries (§5.1)
    assert all(r.recomputed == r.capsule_id for r in results)
    # supersedes chains were resolved inside the store the reference was given (§5.4.4, check 6)
    chained = [p for p in payloads if "chain" in p]
    assert len(chained) >= 3  # resolution, moment timeout and HEM execution, each over its dispatch
    print("reference 0.1.0:", refverifier.summary(results), dict(classes))  # counts for docs/capsules.md
