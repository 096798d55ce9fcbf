"""Helpers for the pipeline tests (tests/test_pipeline_*.py): a gateway with a
given configuration, and a recorder of everything the gateway publishes."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from gateway.app import Gateway
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from subjects.client import envelope
from subjects.util import now_rfc3339
from subjects.wire import outcome_decoder, surface_item_decoder, verdict_decoder
from tests.openwop_schemas import check_envelope, check_outcome
from tests.stored import stored_msgs

BM = "vendor.pgw.binding_moment"
_enc = msgspec.json.Encoder()


@contextlib.asynccontextmanager
async def running_gateway(server: EmbeddedServer, data_dir: str, **overrides: Any) -> AsyncIterator[Gateway]:
    config = load_config(None, data_dir=data_dir, nats_url=server.client_url, **overrides)
    nc = await connect(server.client_url, name="gateway")
    gw = Gateway(config, nc)
    try:
        async with gw:
            yield gw
    finally:
        await nc.drain()


def env(type_: str, payload: Any, **kw: Any) -> dict[str, Any]:
    kw.setdefault("envelope_id", uuid.uuid4().hex)
    e = envelope(type_, payload, **kw)
    return e


def moment_env(principal: str, moment: dict[str, Any], **kw: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {"principal": principal, "binding_moment": moment}
    for k in ("conventional", "expires_in_s", "reasoning"):
        if k in kw:
            payload[k] = kw.pop(k)
    return env(BM, payload, **kw)


class Recorder:
    """Every outcome, surface item and verdict the gateway publishes, as it happens (core NATS)."""

    def __init__(self, nc: Any, prefix: str = "pgw") -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.prefix = prefix
        self.outcomes: list[Any] = []
        self.items: list[Any] = []
        self.verdicts: list[Any] = []
        self.raw: list[bytes] = []
        self._changed = asyncio.Event()
        self._subs: list[Any] = []

    async def __aenter__(self) -> Recorder:
        p = self.prefix

        def cb(decode: Callable[[bytes], Any], into: list[Any]) -> Callable[[Any], Any]:
            async def _cb(msg: Any) -> None:
                if into is self.outcomes:
                    check_outcome(msg.data)  # spec 002 EnvelopeOutcome values (tests/openwop_schemas.py)
                self.raw.append(msg.data)
                into.append(decode(msg.data))
                self._changed.set()
            return _cb

        self._subs = [
            await self.nc.subscribe(f"{p}.agent.*.outcome", cb=cb(outcome_decoder.decode, self.outcomes)),
            await self.nc.subscribe(f"{p}.principal.*.surface", cb=cb(surface_item_decoder.decode, self.items)),
            await self.nc.subscribe(f"{p}.verdict.>", cb=cb(verdict_decoder.decode, self.verdicts)),
        ]
        await self.nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for s in self._subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()

    async def send(
        self, agent: str, body: Any, *, msg_id: str | None = None, raw: bytes | None = None,
        headers: dict[str, str] | None = None, official: bool = True,
    ) -> None:
        """Publish a turn. Every body is checked against the official OpenWOP schemas first
        (issue 15); ``official=False`` marks one a test sends non-official on purpose."""
        if official and raw is None:
            check_envelope(body)
        data = raw if raw is not None else _enc.encode(body)
        if msg_id is None:
            first = body[0] if isinstance(body, list) else body
            msg_id = f"{agent}:{first.get('envelopeId') if isinstance(first, dict) else uuid.uuid4().hex}"
        await self.js.publish(f"{self.prefix}.agent.{agent}.envelope", data, headers={"Nats-Msg-Id": msg_id, **(headers or {})})

    async def until(self, pred: Callable[[], Any], timeout: float = 10.0) -> Any:
        async def loop() -> Any:
            while True:
                v = pred()
                if v:
                    return v
                self._changed.clear()
                await self._changed.wait()
        return await asyncio.wait_for(loop(), timeout)

    async def outcome(self, envelope_id: str, timeout: float = 10.0) -> Any:
        return await self.until(lambda: next((o for o in self.outcomes if getattr(o, "envelope_id", None) == envelope_id), None), timeout)

    async def item(self, pred: Callable[[Any], bool], timeout: float = 10.0) -> Any:
        return await self.until(lambda: next((i for i in self.items if pred(i)), None), timeout)

    async def verdict(self, pred: Callable[[Any], bool], timeout: float = 10.0) -> Any:
        return await self.until(lambda: next((v for v in self.verdicts if pred(v)), None), timeout)

    async def roundtrip(self, agent: str, body: dict[str, Any], timeout: float = 10.0, **kw: Any) -> Any:
        await self.send(agent, body, **kw)
        return await self.outcome(body["envelopeId"], timeout)


async def stream_bytes(nc: Any, stream: str) -> list[bytes]:
    """Every message body stored in ``stream``."""
    return [m.data or b"" for m in await stored_msgs(nc, stream)]


async def stream_count(nc: Any, stream: str) -> int:
    return (await nc.jetstream().stream_info(stream)).state.messages


def now() -> str:
    return now_rfc3339()
