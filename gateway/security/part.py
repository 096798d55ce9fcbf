"""The gateway part of DESIGN §7 (listed in ``gateway.app.GATEWAY_PARTS``).

* inserts the ``Nats-Msg-Id`` binding stage right after the shape stage;
* watches envelope publishes for one ``Nats-Msg-Id`` used by two agents and
  re-publishes the envelope the server may have dropped (``squat.SquatWatch``);
* pre-creates one durable pull consumer on ``PGW_SURFACE`` per configured
  principal, the only JetStream path a surface is allowed to read its items
  by (it may pull from it, never create or change consumers: nats-server
  #3202, #8274). Agents' outcome consumers are created by the gateway itself
  (``subjects.client.ensure_agent_consumer``) for configured agents; this
  part adds the other agent parties (the open-mode demo agent).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.security import msgid, parties
from gateway.security.permissions import SURFACE_STREAM, principal_durable
from gateway.security.squat import SquatWatch
from gateway.stages import shape
from pgwcore.logs import get_logger
from pgwcore.slack_config import ensure_slack_state
from subjects.client import ensure_agent_consumer, ensure_pull_durable

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from gateway.app import Gateway

log = get_logger("pgw.security")


async def ensure_principal_consumer(js: JetStreamContext, principal: str, *, prefix: str = "pgw") -> str:
    """Create (idempotently) the durable a principal's surface may pull its items from."""
    from subjects.names import Subjects

    durable = principal_durable(principal)
    await ensure_pull_durable(js, SURFACE_STREAM, durable, Subjects(prefix).surface(principal))
    return durable


class SecurityPart:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def __aenter__(self) -> SecurityPart:
        stages = self.gw.worker.pipeline.stages
        if msgid.run not in stages:
            at = stages.index(shape.run) + 1 if shape.run in stages else 0
            stages.insert(at, msgid.run)
        self.squat = SquatWatch(self.gw)  # DESIGN §7: no agent can get another's envelope dropped
        await self.squat.start()
        for party in parties(self.gw.config):
            if party.role == "principal":
                await ensure_principal_consumer(self.gw.js, party.name, prefix=self.gw.subjects.prefix)
            elif party.role == "slack":
                await ensure_slack_state(self.gw.js, party.name, prefix=self.gw.subjects.prefix)
            elif party.role == "agent" and party.name not in self.gw.config.agents:
                # e.g. the open-mode demo agent: it may not create its own consumer.
                await ensure_agent_consumer(self.gw.js, party.name, prefix=self.gw.subjects.prefix)
        return self

    async def drain(self) -> None:
        squat = getattr(self, "squat", None)
        if squat is not None:
            await squat.drain()

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()
