"""Stage 7, trust normalisation (spec 002 "Trust boundary").

``meta.contentTrust = "untrusted"`` propagates to every message the envelope
causes (surface item, outcome, verdict). Whether an untrusted moment may gate
an approval is enforced where it is answered (gateway.moments).
"""

from __future__ import annotations

from gateway.stages.base import Ctx


async def run(ctx: Ctx) -> None:
    assert ctx.env is not None and ctx.env.meta is not None
    ctx.untrusted = ctx.env.meta.contentTrust == "untrusted"
