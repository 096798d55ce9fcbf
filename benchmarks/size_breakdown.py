"""Where the gateway's CPU per envelope grows with the moment's size, step by step, in process:
``python -m benchmarks.size_breakdown`` (issue 18, "grows with moment size no faster than the
parse and the writes require"; benchmarks/performance-log.md).

Each step of the binding-moment path whose cost depends on the moment's bytes, called the way the
pipeline calls it, on the bench's moments of 1, 16 and 120 KB (``benchmarks.harness.moment_of_kb``, numbered),
best of seven rounds. No NATS: what the bench's gateway spends beyond these and beyond the contract
floor (``benchmarks/relay.py floor``) is messaging. The steps:

- ``decode_body``: UTF-8 check, msgspec decode, the duplicate-key tally, the text-level limit proofs
  (DESIGN §3.2 step 1, ``gateway/stages/shape.py``);
- ``digest``: sha256 of the body (the envelope's identity, ``Turn.digest``);
- ``envelope``: the closed AIEnvelope top level (``msgspec.convert``);
- ``grammar``: spec 000 §5's slot grammar and the fold of the texts the lints read (``check_and_fold``,
  the seen forms' cache emptied before each call);
- ``payload``: the typed payload (``msgspec.convert``);
- ``lints``: spec 000 §6's construction lints (``lints.check``) on the forms the grammar folded, the
  seen forms' cache emptied before each call, as for a new moment;
- ``redaction``: SR-1's pre-check on the envelope (``Redactor.plainly_clean``; a body that needs the
  full walk costs more, and is not the common case measured here);
- ``encode x2``: the moment record and the surface item, as written (msgspec).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import msgspec

from benchmarks.harness import PRINCIPAL, envelope, moment_of_kb
from gateway.security.seen import clear_caches
from gateway.stages import lints, shape
from gateway.stages.moment_grammar import check_and_fold
from gateway.stages.redaction import Redactor
from pgwcore.config import Config
from subjects.client import BINDING_MOMENT_KIND
from subjects.wire import AIEnvelope, BindingMomentItem, BindingMomentPayload

SIZES = (1, 16, 120)


def _best(fn: Callable[[], Any], rounds: int = 7) -> float:
    """Best per-call milliseconds over ``rounds`` rounds of enough calls to take about 20 ms each."""
    fn()
    t = time.perf_counter()
    fn()
    n = max(5, int(0.02 / max(time.perf_counter() - t, 1e-7)))
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1000


def steps(kb: int) -> dict[str, float]:
    limits = Config().limits
    body = json.dumps(envelope(BINDING_MOMENT_KIND, {"principal": PRINCIPAL, "binding_moment": moment_of_kb(kb, 1)},
                               envelope_id="size-1")).encode()
    (raw,) = shape.decode_body(body, limits)
    env = msgspec.convert(raw, AIEnvelope)
    payload = msgspec.convert(env.payload, BindingMomentPayload)
    bm = payload.binding_moment
    _, forms = check_and_fold(raw["payload"]["binding_moment"])
    item = BindingMomentItem(binding_moment=bm, agent="bench", principal=PRINCIPAL, created_at="2026-11-26T00:00:00Z",
                             moment_id="m", envelope_id="size-1", correlation_id="c")
    enc = msgspec.json.Encoder()
    red = Redactor()
    return {
        "bytes": float(len(body)),
        "decode_body": _best(lambda: shape.decode_body(body, limits)),
        "digest": _best(lambda: hashlib.sha256(body).hexdigest()),
        "envelope": _best(lambda: msgspec.convert(raw, AIEnvelope)),
        "grammar": _best(lambda: (clear_caches(), check_and_fold(raw["payload"]["binding_moment"]))),
        "payload": _best(lambda: msgspec.convert(env.payload, BindingMomentPayload)),
        "lints": _best(lambda: (clear_caches(), lints.check(bm, forms))),
        "redaction": _best(lambda: red.plainly_clean(env)),
        "encode x2": _best(lambda: (enc.encode(item), enc.encode(item))),
    }


def main() -> None:
    got = {kb: steps(kb) for kb in SIZES}
    names = [k for k in got[SIZES[0]] if k != "bytes"]
    print(f"{'step (ms per envelope)':<24}" + "".join(f"{kb:>10} KB" for kb in SIZES) + f"{'us per KB':>12}")
    span = (got[SIZES[-1]]["bytes"] - got[SIZES[0]]["bytes"]) / 1024
    total = dict.fromkeys(SIZES, 0.0)
    for name in names:
        for kb in SIZES:
            total[kb] += got[kb][name]
        per_kb = (got[SIZES[-1]][name] - got[SIZES[0]][name]) / span * 1000
        print(f"{name:<24}" + "".join(f"{got[kb][name]:>13.3f}" for kb in SIZES) + f"{per_kb:>12.2f}")
    per_kb = (total[SIZES[-1]] - total[SIZES[0]]) / span * 1000
    print(f"{'all of these':<24}" + "".join(f"{total[kb]:>13.3f}" for kb in SIZES) + f"{per_kb:>12.2f}")


if __name__ == "__main__":
    main()
