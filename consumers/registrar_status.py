"""Registration progress: metrics the registrar keeps, and the counts ``pgw capsules status`` prints.

- waiting: capsules in ``capsule.register`` (``PGW_REGISTRATION``, a work
  queue) not yet registered, including those being retried;
- retrying: of those, delivered more than once (the TS was down, slow or
  refused them so far), from the durable consumer's redelivery count;
- registered: Transparent Statements with a verified receipt (``PGW_CAPSULES``);
- failed: statements given up on after ``registrar.max_failures`` permanent
  refusals (``PGW_REGISTRATION_DLQ``). A TS that is down never puts anything here.
"""

from __future__ import annotations

from typing import Any

import msgspec
from nats.js.errors import NotFoundError
from prometheus_client import Counter, Gauge

from pgwcore.metrics import REGISTRY

REGISTRATION_STREAM = "PGW_REGISTRATION"
CAPSULES_STREAM = "PGW_CAPSULES"
DLQ_STREAM = "PGW_REGISTRATION_DLQ"

REGISTRATIONS = Counter(
    "pgw_registrar_statements_total",
    "Statements handled by the registrar, by result: registered (fresh receipt), already_registered "
    "(the TS held it; its receipt fetched), retry (transient failure, will retry), refused (permanent "
    "refusal, counted toward dead-lettering), dead_lettered",
    ["result"],
    registry=REGISTRY,
)
RECEIPT_LEAVES = Counter(
    "pgw_registrar_receipt_leaf_total",
    "Verified receipts by the Merkle leaf construction that verified (statement or payload)",
    ["leaf"],
    registry=REGISTRY,
)
WAITING = Gauge("pgw_registrar_waiting", "Capsules in capsule.register not yet registered", registry=REGISTRY)
TS_UP = Gauge("pgw_registrar_ts_reachable",
              "1 while the Transparency Service answers, 0 after a transient failure until it answers again",
              registry=REGISTRY)


class Progress(msgspec.Struct):
    waiting: int
    retrying: int
    registered: int
    failed: int
    consumer: str | None = None


async def _messages(js: Any, stream: str) -> int:
    try:
        return (await js.stream_info(stream)).state.messages
    except NotFoundError:
        return 0


async def progress(js: Any, durable: str) -> Progress:
    """The counts from the streams themselves (valid with the registrar stopped, crashed or running)."""
    retrying = 0
    consumer = None
    try:
        info = await js.consumer_info(REGISTRATION_STREAM, durable)
        consumer = durable
        retrying = info.num_redelivered or 0
    except NotFoundError:
        pass
    return Progress(waiting=await _messages(js, REGISTRATION_STREAM), retrying=retrying,
                    registered=await _messages(js, CAPSULES_STREAM), failed=await _messages(js, DLQ_STREAM),
                    consumer=consumer)
