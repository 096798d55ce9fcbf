"""A Jepsen-style checker for the gateway's delivery promises (issue 8 "Faults").

After a run with faults, the history is read back from the streams (the
system of record) and every envelope the harness sent *and had acknowledged
by JetStream* is classified:

- ``delivered_once``: exactly one outcome for it (and, for binding moments,
  exactly one surface item and one ``hitl_dispatched`` verdict);
- ``lost``: no outcome (or a binding moment without its item / verdict);
- ``duplicated``: two or more outcomes, surface items or verdicts for it.

Anything on the output streams that no acknowledged send explains is
``unexpected``. Every verdict is classified ``capsuled_once`` / ``not_capsuled``
/ ``capsuled_twice`` when a signer ran (capsules are matched on the capsule's
``capsule_decision_id`` / verdict id, see ``capsule_verdict_id``).

The checker reads with an ephemeral ordered consumer that acknowledges
nothing, so it can be run against a live system too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy


async def read_stream(js: JetStreamContext, stream: str, subject: str | None = None,
                      *, batch: int = 1000, timeout: float = 120.0) -> list[Msg]:
    """Every message currently in ``stream`` (optionally filtered), in order.

    Right after a node of an R3 cluster comes back, a read can stall, time out
    or lose its consumer (503): the read then resumes from the next sequence
    on a fresh consumer, and never ends early. Stopping at the first quiet
    fetch would count everything not yet read as lost.
    """
    info = await js.stream_info(stream, subjects_filter=subject)
    if info.state.messages == 0 or (subject is not None and not sum((info.state.subjects or {}).values())):
        return []
    last = info.state.last_seq
    out: list[Msg] = []
    next_seq = 1
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        psub = None
        try:
            psub = await js.pull_subscribe(
                subject or ">", durable=None, stream=stream,
                config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                      opt_start_seq=next_seq, mem_storage=True, inactive_threshold=30.0,
                                      filter_subject=subject),
            )
            while True:
                msgs = await psub.fetch(batch, timeout=2.0)
                out.extend(msgs)
                md = msgs[-1].metadata
                next_seq = md.sequence.stream + 1
                if md.sequence.stream >= last:
                    return out
                # A filtered read may never reach the stream's last sequence: it ends when the
                # consumer has nothing pending. An unfiltered one reads on to ``last``: a consumer
                # made on a replica that is still catching up can say nothing is pending early.
                if subject is not None and md.num_pending == 0:
                    return out
        except (NatsTimeoutError, NatsError) as e:  # stalled, or the consumer went away
            if loop.time() > deadline:
                raise AssertionError(f"{stream}: read stalled at seq {next_seq} of {last}: {e!r}") from e
        finally:
            if psub is not None:
                with contextlib.suppress(Exception):
                    await psub.unsubscribe()


def _json(msg: Msg) -> dict[str, Any]:
    try:
        v = json.loads(msg.data)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


@dataclass
class Report:
    """The classification of one run."""

    sent: int
    acked: int
    delivered_once: int = 0
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    verdicts: int = 0
    verdicts_duplicated: list[str] = field(default_factory=list)
    capsuled_once: int | None = None
    not_capsuled: list[str] = field(default_factory=list)
    capsuled_twice: list[str] = field(default_factory=list)
    surface_items: int = 0
    outcomes: int = 0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.unexpected or self.verdicts_duplicated
                    or self.not_capsuled or self.capsuled_twice)

    def summary(self) -> str:
        cap = ("" if self.capsuled_once is None else
               f", capsuled-once {self.capsuled_once}, not-capsuled {len(self.not_capsuled)}, "
               f"capsuled-twice {len(self.capsuled_twice)}")
        return (f"sent {self.sent}, acked {self.acked}: delivered-once {self.delivered_once}, "
                f"lost {len(self.lost)}, duplicated {len(self.duplicated)}, "
                f"unexpected {len(self.unexpected)}; outcomes {self.outcomes}, "
                f"surface items {self.surface_items}, verdicts {self.verdicts} "
                f"(duplicated {len(self.verdicts_duplicated)}){cap}")


def classify(
    acked: dict[str, str],
    outcomes: Iterable[dict[str, Any]],
    items: Iterable[dict[str, Any]],
    verdicts: Iterable[dict[str, Any]],
    *,
    sent: int,
    moment_kind: Callable[[str], bool] = lambda kind: kind == "moment",
    capsule_verdict_ids: Iterable[str] | None = None,
) -> Report:
    """Classify every acknowledged envelope and every verdict.

    ``acked``: envelope id -> what it was ("moment" expects an outcome, a
    surface item and a hitl_dispatched verdict; anything else an outcome and
    at most one verdict).
    """
    rep = Report(sent=sent, acked=len(acked))
    out_count = Counter()
    for o in outcomes:
        rep.outcomes += 1
        eid = o.get("envelope_id")
        if eid in acked:
            out_count[eid] += 1
        else:
            rep.unexpected.append(f"outcome for {eid!r}")
    item_count = Counter()
    for it in items:
        if it.get("item") == "withdrawn":
            continue
        rep.surface_items += 1
        eid = it.get("envelope_id")
        if eid in acked:
            item_count[eid] += 1
        else:
            rep.unexpected.append(f"surface item for {eid!r}")
    verdict_ids = Counter()
    verdict_by_env = Counter()
    all_verdicts: list[str] = []
    for v in verdicts:
        rep.verdicts += 1
        vid = v.get("verdict_id")
        verdict_ids[vid] += 1
        all_verdicts.append(vid)
        eid = v.get("envelope_id")
        if eid in acked:
            verdict_by_env[eid] += 1
        else:
            rep.unexpected.append(f"verdict for {eid!r}")
    rep.verdicts_duplicated = [vid for vid, n in verdict_ids.items() if n > 1]
    for eid, kind in acked.items():
        n_out, n_item, n_ver = out_count[eid], item_count[eid], verdict_by_env[eid]
        if moment_kind(kind):
            if n_out > 1 or n_item > 1 or n_ver > 1:
                rep.duplicated.append(eid)
            elif n_out == 1 and n_item == 1 and n_ver == 1:
                rep.delivered_once += 1
            else:
                rep.lost.append(eid)
        elif n_out > 1 or n_ver > 1:
            rep.duplicated.append(eid)
        elif n_out == 1:
            rep.delivered_once += 1
        else:
            rep.lost.append(eid)
    if capsule_verdict_ids is not None:
        caps = Counter(capsule_verdict_ids)
        rep.capsuled_once = sum(1 for vid in set(all_verdicts) if caps[vid] == 1)
        rep.not_capsuled = [vid for vid in set(all_verdicts) if caps[vid] == 0]
        rep.capsuled_twice = [vid for vid in set(all_verdicts) if caps[vid] > 1]
        rep.unexpected += [f"capsule for verdict {vid!r}" for vid in caps if vid not in verdict_ids]
    return rep


async def check_streams(js: JetStreamContext, acked: dict[str, str], *, sent: int, prefix: str = "pgw",
                        agents: Iterable[str] | None = None,
                        capsules: Iterable[str] | None = None) -> Report:
    """Read outcomes, surface items, verdicts (and capsules) back and classify them."""
    outs_msgs, items_msgs, verdict_msgs = await asyncio.gather(
        read_stream(js, "PGW_OUTBOUND"), read_stream(js, "PGW_SURFACE"), read_stream(js, "PGW_VERDICTS"))
    agent_set = set(agents) if agents is not None else None

    def mine(d: dict[str, Any]) -> bool:
        return agent_set is None or d.get("agent") in agent_set

    outcomes = [d for d in map(_json, outs_msgs) if mine(d) and d.get("outcome") == "envelope_outcome"]
    items = [d for d in map(_json, items_msgs) if mine(d)]
    verdicts = [d for d in map(_json, verdict_msgs) if mine(d)]
    return classify(acked, outcomes, items, verdicts, sent=sent, capsule_verdict_ids=capsules)


async def capsule_verdict_ids(js: JetStreamContext, prefix: str = "pgw") -> tuple[list[str], dict[str, int]]:
    """Verdict ids of every capsule that exists, once per stored copy, plus ledger counts.

    A capsule is in ``PGW_REGISTRATION`` (signed, waiting for the registrar; header
    ``Pgw-Verdict-Id``) or in ``PGW_CAPSULES`` (registered; header ``Pgw-Capsule-Id``,
    mapped back to its verdict through the signer's ledger). The second value counts
    ledger entries per verdict id: more than one would be a verdict signed twice.
    """
    ledger = await read_stream(js, "PGW_SIGNER_LEDGER")
    ledger_count: Counter[str] = Counter()
    by_capsule: dict[str, str] = {}
    outcome_ids: set[str] = set()  # spec 004 §3.3 outcome statements: beside a capsule, not capsules
    for m in ledger:
        entry = _json(m)
        if '"statement_type":"outcome"' in (entry.get("payload") or ""):
            outcome_ids.add(entry.get("capsule_id"))
            continue
        vid = entry.get("verdict_id")
        ledger_count[vid] += 1
        by_capsule[entry.get("capsule_id")] = vid
    out: list[str] = []
    for m in await read_stream(js, "PGW_REGISTRATION"):
        if (m.headers or {}).get("Pgw-Capsule-Id") in outcome_ids:
            continue
        out.append((m.headers or {}).get("Pgw-Verdict-Id") or "?")
    for m in await read_stream(js, "PGW_CAPSULES"):
        cid = (m.headers or {}).get("Pgw-Capsule-Id")
        if cid in outcome_ids:
            continue
        out.append(by_capsule.get(cid, f"unknown-capsule:{cid}"))
    return out, dict(ledger_count)
