"""Stage 4, the Envelope Contract gate (spec 002 "Envelope Contract", DESIGN §3.2 step 4).

Each agent's contract comes from ``[pipeline.contracts.AGENT]``: ``accepts``
(kinds it may emit) and ``refusal_mode``. The four universal kinds are always
accepted. An agent without a contract is not gated (the kind stage already
limits it to what this host supports).

- ``fail-node`` (default): refused with ``envelope_contract_violation``,
  ``refusedType`` and ``acceptedTypes`` (status ``gated``, a ``denied`` verdict).
- ``discard-and-warn``: the envelope is discarded - never routed - and the
  agent's outcome says so as a warning (``discarded`` rule) with the same code
  and types; the turn's other envelopes go on (spec 002: "proceed to the next
  emission"). It is still a decision of the gateway, so it has a verdict.
"""

from __future__ import annotations

from gateway.stages.base import Ctx, Refuse
from gateway.stages.kind import UNIVERSAL_KINDS
from pgwcore.logs import get_logger
from subjects.wire import Detail

CODE = "envelope_contract_violation"
log = get_logger("pgw.contract")


def accepted_types(ctx: Ctx) -> list[str] | None:
    contract = ctx.gw.config.pipeline.contracts.get(ctx.agent)
    if contract is None:
        return None
    return sorted(set(contract.accepts) | set(UNIVERSAL_KINDS))


async def run(ctx: Ctx) -> None:
    assert ctx.env is not None
    contract = ctx.gw.config.pipeline.contracts.get(ctx.agent)
    if contract is None:
        return
    t = ctx.env.type
    if t in UNIVERSAL_KINDS or t in contract.accepts:
        return
    accepted = accepted_types(ctx) or []
    silent = contract.refusal_mode == "discard-and-warn"
    if silent:
        # spec 002: "discard ... after emitting a log.appended event of level warn".
        # The gate runs before redaction (spec 002 "Production flow"): no raw text in the log (SR-1).
        red = ctx.state.redactor
        log.warning("envelope discarded by the contract gate", agent=ctx.agent, type=red.text(t[:128]),
                    envelope_id=red.text(ctx.envelope_id) if ctx.envelope_id else None)
        ctx.warn(f"envelope of type {t[:128]!r} discarded (refusalMode discard-and-warn)", "discarded", "$.type")
    raise Refuse(
        CODE,
        f"this agent's Envelope Contract does not accept {t[:128]!r}"
        + ("; the envelope was discarded (refusalMode discard-and-warn)" if silent else ""),
        details=[Detail(
            message=f"accepted types: {', '.join(accepted)}",
            path="$.type",
            rule="discarded" if silent else "fail-node",
        )],
        status="gated",
        verdict_class="denied",
        refused_type=t,
        accepted_types=accepted,
        silent=silent,
    )
