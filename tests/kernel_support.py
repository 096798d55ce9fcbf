"""Helpers for the kernel tests (tests/test_kernel_*.py): keys, mandates, IDPs, a running gateway."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gateway.kernel.mandate import issue_mandate
from pgwcore.keys import kid_of
from subjects.idp import KernelResult, kernel_result_decoder
from subjects.util import now_rfc3339

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_POLICIES = REPO / "policies"


class Issuer:
    """A mandate issuer: an Ed25519 key whose public half the kernel trusts."""

    def __init__(self, folder: Path) -> None:
        self.key = Ed25519PrivateKey.generate()
        self.kid = kid_of(self.key.public_key())
        folder.mkdir(parents=True, exist_ok=True)
        self.pem_path = folder / f"issuer-{self.kid}.pem"
        self.pem_path.write_bytes(
            self.key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

    def mandate(self, *, agent: str, so_id: str, principal: str = "alice", actions: list[str] | None = None, **kw: Any) -> tuple[str, str]:
        jti = kw.pop("jti", None) or str(uuid.uuid4())
        token = issue_mandate(
            self.key, self.kid, agent=agent, so_id=so_id, principal=principal,
            actions=actions if actions is not None else ["ReadBooking", "CloseBooking", "ProcessPayment"],
            jti=jti, **kw,
        )
        return token, jti


def idp(*, so_id: str, mandate_id: str, step: int, action: str, session: str = "s-1", **over: Any) -> dict[str, Any]:
    """A valid IDP_STANDARD record; ``over`` replaces or (with None) removes fields."""
    rec: dict[str, Any] = {
        "idp_id": str(uuid.uuid4()),
        "session_id": session,
        "so_id": so_id,
        "mandate_id": mandate_id,
        "step_sequence": step,
        "requested_action": action,
        "declared_goal": {"goal_id": str(uuid.uuid4()), "description": "Close the guest's booking after checkout"},
        "reasoning_basis": {"type": "RULE_BASED", "description": "Checkout was recorded, so the booking closes"},
        "confidence_level": 0.9,
        "hem_urgency": "NONE",
        "timestamp": now_rfc3339(),
    }
    for k, v in over.items():
        if v is None:
            rec.pop(k, None)
        else:
            rec[k] = v
    return rec


def thin(full: dict[str, Any]) -> dict[str, Any]:
    keep = ("idp_id", "session_id", "so_id", "mandate_id", "step_sequence", "requested_action", "timestamp")
    return {**{k: full[k] for k in keep}, "profile": "IDP_THIN"}


async def request(nc: Any, agent: str, body: dict[str, Any] | bytes, *, prefix: str = "pgw", timeout: float = 10.0) -> KernelResult:
    data = body if isinstance(body, bytes) else msgspec.json.encode(body)
    msg = await nc.request(f"{prefix}.agent.{agent}.idp", data, timeout=timeout)
    return kernel_result_decoder.decode(msg.data)


def policy_dir(tmp: Path, text: str | None = None) -> Path:
    d = tmp / "policies"
    if text is None:
        shutil.copytree(EXAMPLE_POLICIES, d)
    else:
        d.mkdir(parents=True, exist_ok=True)
        (d / "test.cedar").write_text(text)
    return d


def kernel_config(make_config: Any, issuer: Issuer, pdir: Path, **kernel: Any) -> Any:
    section = {"issuers": {issuer.kid: str(issuer.pem_path)}, "policy_dir": str(pdir), **kernel}
    return make_config(kernel=section)


@contextlib.asynccontextmanager
async def running_gateway(config: Any, nc: Any) -> AsyncIterator[Any]:
    from gateway.app import Gateway

    async with Gateway(config, nc) as gw:
        yield gw


async def read_log(js: Any, event_type: str | None = None) -> list[tuple[int, Any]]:
    """Every event of the kernel log (or of one type) as (seq, LogEvent), in order."""
    from gateway.kernel.eventlog import _iter_stream
    from subjects.idp import log_event_decoder

    subject = f"pgw.log.{event_type}" if event_type else "pgw.log.>"
    return [(seq, log_event_decoder.decode(data)) async for seq, _s, data in _iter_stream(js, "PGW_EVENTLOG", subject)]


async def read_verdicts(js: Any, verdict_class: str = "*") -> list[Any]:
    from gateway.kernel.eventlog import _iter_stream
    from subjects.wire import verdict_decoder

    return [verdict_decoder.decode(d) async for _seq, _s, d in _iter_stream(js, "PGW_VERDICTS", f"pgw.verdict.{verdict_class}")]


async def stored_verdicts(js: Any, verdict_class: str, match: Any = None, timeout: float = 10) -> list[Any]:
    """The stored verdicts of a class (those ``match`` accepts), once there is at least one.

    A core subscriber (the watcher) sees a verdict as it is published, which
    can be before its stream has stored it (a group-committed batch is stored
    at its commit), so a test reading the stream right after waits for it.
    """
    from tests.polling import until

    async def probe() -> list[Any]:
        return [v for v in await read_verdicts(js, verdict_class) if match is None or match(v)]

    return await until(probe, timeout=timeout, what=f"a stored {verdict_class} verdict")
