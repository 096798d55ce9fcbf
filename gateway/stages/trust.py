"""Stage 7, trust normalisation (spec 002 "Trust boundary").

``meta.contentTrust = "untrusted"`` propagates to every message the envelope
causes (surface item, outcome, verdict). What untrusted content may not do
("Hosts MUST NOT advance HITL approval gates ... on the basis of an envelope
whose meta.contentTrust = 'untrusted'") is refused by the handler that would
open the gate: an untrusted binding moment (``route.untrusted_moment``) and
an authoritative authorization variant (``authorization.enforce``), both with
``untrusted_content_blocks_approval``; a kernel HEM moment, the gateway's own,
is refused at its answer when marked untrusted (gateway.moments).
"""

from __future__ import annotations

from gateway.stages.base import Ctx


async def run(ctx: Ctx) -> None:
    assert ctx.env is not None and ctx.env.meta is not None
    ctx.untrusted = ctx.env.meta.contentTrust == "untrusted"
