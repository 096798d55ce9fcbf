"""The kernel's session cache (issue 18): the next step of a session skips its read, and a stale
entry never lets a step through that the stored session refuses (spec 003 §5.2(f), §6.2)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gateway.kernel.service import KernelService
from pgwcore.connect import connect
from subjects.idp import EnrichedDeny, Permit, Reject
from tests.kernel_support import Issuer, idp, kernel_config, policy_dir, read_log, running_gateway

AGENT = "bot"


def kernel_of(gw: Any) -> KernelService:
    return next(p for p in gw.parts if isinstance(p, KernelService))


@pytest.fixture
def setup(make_config: Any, tmp_path: Path) -> tuple[Any, str, str, str]:
    issuer = Issuer(tmp_path / "issuer")
    cfg = kernel_config(make_config, issuer, policy_dir(tmp_path))
    so = str(uuid.uuid4())
    token, jti = issuer.mandate(agent=AGENT, so_id=so)
    return cfg, so, token, jti


@contextlib.asynccontextmanager
async def two_kernels(cfg: Any, nc: Any, nats_server: Any) -> AsyncIterator[tuple[KernelService, KernelService]]:
    """Two gateway instances on one server, each on its own connection: their kernels (A, B)."""
    nc2 = await connect(nats_server.client_url)
    try:
        async with running_gateway(cfg, nc) as ga, running_gateway(cfg, nc2) as gb:
            yield kernel_of(ga), kernel_of(gb)
    finally:
        await nc2.close()


def body(token: str, rec: dict[str, Any]) -> bytes:
    return msgspec.json.encode({"mandate": token, "idp": rec})


def count_session_reads(kernel: KernelService) -> list[str]:
    reads: list[str] = []
    real = kernel.state.validation_reads

    async def validation_reads(a: str, so: str, idp_id: str, s: str | None) -> Any:
        if s is not None:
            reads.append(s)
        return await real(a, so, idp_id, s)

    kernel.state.validation_reads = validation_reads  # type: ignore[method-assign]
    return reads


async def test_the_next_step_skips_the_read(setup: Any, nc: Any) -> None:
    cfg, so, token, jti = setup
    async with running_gateway(cfg, nc) as gw:
        k = kernel_of(gw)
        reads = count_session_reads(k)
        for step in (1, 2, 3):
            r = await k.handle_request(AGENT, body(token, idp(so_id=so, mandate_id=jti, step=step, action="CloseBooking")))
            assert isinstance(r, Permit), r
        assert reads == ["s-1"]  # only the first step read the session
        # A step at or below the last one is refused on a fresh read, never on the cache.
        r = await k.handle_request(AGENT, body(token, idp(so_id=so, mandate_id=jti, step=3, action="CloseBooking")))
        assert isinstance(r, Reject) and r.error_code == "IDP_STEP_SEQUENCE", r
        assert reads == ["s-1", "s-1"]
    assert await read_log(nc.jetstream(), "IDP_SUBMISSION_VOIDED") == []


async def test_a_stale_entry_cannot_take_a_step_taken_elsewhere(setup: Any, nc: Any, nats_server: Any) -> None:
    """Instance A caches step 1; B takes step 2; A is then sent another step 2 (refused: the CAS
    on A's stale revision fails and the fresh session refuses), then step 3 (permitted)."""
    cfg, so, token, jti = setup
    async with two_kernels(cfg, nc, nats_server) as (a, b):
        assert isinstance(await a.handle_request(AGENT, body(token, idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking"))), Permit)
        assert isinstance(await b.handle_request(AGENT, body(token, idp(so_id=so, mandate_id=jti, step=2, action="CloseBooking"))), Permit)
        assert a.state.cached_session(AGENT, "s-1", 2) is not None  # A still holds step 1
        r = await a.handle_request(AGENT, body(token, idp(so_id=so, mandate_id=jti, step=2, action="CloseBooking")))
        assert isinstance(r, Reject) and r.error_code == "IDP_STEP_SEQUENCE", r
        r = await a.handle_request(AGENT, body(token, idp(so_id=so, mandate_id=jti, step=3, action="CloseBooking")))
        assert isinstance(r, Permit), r
        sess, _ = await b.state.session(AGENT, "s-1")
        assert sess.last_step == 3
    # The refused step 2 was logged, then voided (docs/kernel.md, "State across instances").
    assert len(await read_log(nc.jetstream(), "IDP_SUBMISSION_VOIDED")) == 1


async def test_a_stale_entry_cannot_pass_a_session_escalated_elsewhere(setup: Any, nc: Any, nats_server: Any) -> None:
    """B puts the session in HEM_PENDING while A caches it ACTIVE: A's next step is denied HEM_PENDING."""
    cfg, so, token, jti = setup
    async with two_kernels(cfg, nc, nats_server) as (a, b):
        assert isinstance(await a.handle_request(AGENT, body(token, idp(so_id=so, mandate_id=jti, step=1, action="CloseBooking"))), Permit)
        hem = idp(so_id=so, mandate_id=jti, step=2, action="CloseBooking", hem_urgency="REQUIRED")
        r = await b.handle_request(AGENT, body(token, hem))
        assert type(r).__name__ == "HemPending", r
        assert a.state.cached_session(AGENT, "s-1", 3) is not None  # A's entry is stale (ACTIVE)
        r = await a.handle_request(AGENT, body(token, idp(so_id=so, mandate_id=jti, step=3, action="CloseBooking")))
        assert isinstance(r, EnrichedDeny) and r.deny_code == "HEM_PENDING", r
