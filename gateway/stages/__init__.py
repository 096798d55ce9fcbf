"""The envelope pipeline, one module per stage, in spec 002 "Production flow" order.

shape -> kind -> payload -> contract -> limits -> redaction -> trust -> dedup -> route

Each stage is ``async def run(ctx: Ctx) -> None`` and refuses by raising
:class:`gateway.stages.base.Refuse`. ``STAGES`` in ``gateway.pipeline`` lists
them in order; a new rule from a spec lands in the one stage it belongs to.
"""
