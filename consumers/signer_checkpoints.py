"""The signer's second input: event-log checkpoints on their way to the Transparency Service.

A durable pull consumer (``{signer.durable}-checkpoints``) on
``PGW_CHECKPOINTS``: each checkpoint the kernel anchored is wrapped as a
checkpoint statement (:mod:`consumers.checkpoint_statement`) and stored in
``capsule.register`` with ``Nats-Msg-Id`` = its statement id, then acked; the
registrar registers it like a capsule. Checkpoints are not verdicts, so they
stay out of the signer's capsule ledger (their chain is the event log's own).
A message that is not a checkpoint is terminated and logged; one that cannot
be stored now is redelivered.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import msgspec
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from consumers import checkpoint_statement as cps
from pgwcore.logs import get_logger
from pgwcore.service import fetch_batch, hand_back, stop_pull_loop
from subjects.checkpoint import CHECKPOINT_STREAM as STREAM
from subjects.checkpoint import Checkpoint, checkpoint_subject

if TYPE_CHECKING:
    from nats.aio.msg import Msg

log = get_logger("pgw.signer.checkpoints")
_decoder = msgspec.json.Decoder(Checkpoint)


class CheckpointSigner:
    """Started and drained by :class:`consumers.signer.Signer`; ``signed`` counts stored statements."""

    def __init__(self, signer: Any) -> None:
        self.signer = signer
        self.js = signer.js
        self.subjects = signer.subjects
        self.durable = f"{signer.config.signer.durable}-checkpoints"
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.signed = 0

    async def start(self) -> None:
        subject = checkpoint_subject(self.subjects.prefix)
        try:
            self._sub = await self.js.pull_subscribe(
                subject, durable=self.durable, stream=STREAM,
                config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                                      ack_wait=self.signer.config.signer.ack_wait_s, max_deliver=-1,
                                      filter_subject=subject),
            )
        except NotFoundError:
            log.warning("no PGW_CHECKPOINTS stream (run `pgw streams`): event-log checkpoints are not "
                        "registered with the transparency service")
            return
        self._task = asyncio.create_task(self._run(), name="pgw-signer-checkpoints")

    async def drain(self) -> None:
        task, self._task = self._task, None
        sub, self._sub = self._sub, None
        await stop_pull_loop(self._stopping, [task], sub)

    async def _run(self) -> None:
        while not self._stopping.is_set():
            msgs = await fetch_batch(lambda: self._sub.fetch(16, timeout=0.5), self._stopping, self.signer.nc, log,
                                     what="fetching checkpoints")
            if msgs is None:
                return
            for m in msgs:
                await self.handle(m)

    async def handle(self, m: Msg) -> None:
        try:
            cp = _decoder.decode(m.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.error("not an event-log checkpoint; terminated", subject=m.subject, error=str(e))
            await m.term()
            return
        cfg = self.signer.config
        statement, sid = cps.sign(cp, self.signer.key, operator=cfg.operator, developer=cfg.signer.developer)
        try:
            ack = await self.js.publish(self.subjects.capsule_register, statement,
                                        headers={"Nats-Msg-Id": sid, "Pgw-Capsule-Id": sid})
        except Exception as e:  # noqa: BLE001 - stored later: the checkpoint is redelivered
            log.warning("checkpoint statement not stored; will retry", seq=cp.seq, error=repr(e))
            await hand_back([m])
            return
        await m.ack()
        self.signed += 1
        log.info("checkpoint statement signed", stream=cp.stream, seq=cp.seq, statement_id=sid,
                 duplicate=bool(ack.duplicate))
