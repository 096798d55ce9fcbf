"""Services starting at the same time on a fresh server all get their streams and buckets.

Two gateway instances (or a gateway and the signer) started together both find
a bucket missing and both create it; the first may already have allowed atomic
batches on its stream, so the second's create has another configuration and
nats-server refuses it (err_code 10058). Found by the chaos suite's two-gateway
test on a fresh clone: the second gateway exited at start.
"""

from __future__ import annotations

from typing import Any

import pytest
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, NotFoundError

from pgwcore.config import Config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from pgwcore.streams import StreamConflict, ensure_kv, ensure_streams, stream_plans


class LateLook:
    """The real JetStream context whose first look at ``name`` finds nothing: the window in which
    another process creates it happens deterministically (timing injection; every other call
    goes to the real server)."""

    def __init__(self, js: JetStreamContext, name: str) -> None:
        self._js = js
        self._name = name
        self._looked = False

    def _first(self, name: str, exc: type[Exception]) -> None:
        if name == self._name and not self._looked:
            self._looked = True
            raise exc()

    async def key_value(self, bucket: str) -> Any:
        self._first(bucket, BucketNotFoundError)
        return await self._js.key_value(bucket)

    async def stream_info(self, name: str, *a: Any, **kw: Any) -> Any:
        self._first(name, NotFoundError)
        return await self._js.stream_info(name, *a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)


async def test_a_bucket_made_and_made_atomic_meanwhile_is_opened(nats_server: EmbeddedServer) -> None:
    nc = await connect(nats_server.client_url, name="other")
    try:
        js = nc.jetstream()
        await ensure_kv(js, "RACE_KV", atomic=True)  # the other process, all the way
        assert (await js.stream_info("KV_RACE_KV")).config.allow_atomic
        kv = await ensure_kv(LateLook(js, "RACE_KV"), "RACE_KV", atomic=True)  # type: ignore[arg-type]
        await kv.put("k", b"v")
        assert (await (await js.key_value("RACE_KV")).get("k")).value == b"v"
    finally:
        await nc.close()


async def test_a_bucket_create_refused_for_another_reason_still_fails(nats_server: EmbeddedServer) -> None:
    nc = await connect(nats_server.client_url, name="other")
    try:
        with pytest.raises(Exception, match="replicas"):  # one server cannot hold three replicas
            await ensure_kv(nc.jetstream(), "R3_ALONE", replicas=3)
    finally:
        await nc.close()


async def test_a_stream_made_meanwhile_is_checked_as_an_existing_one(nats_server: EmbeddedServer) -> None:
    nc = await connect(nats_server.client_url, name="other")
    try:
        js = nc.jetstream()
        subjects = Config().subjects
        plans = {p.name: p.config for p in stream_plans(subjects)}
        # Made meanwhile by a process from before atomic batches were planned: another configuration.
        plans["PGW_OUTBOUND"].allow_atomic = False
        await js.add_stream(plans["PGW_OUTBOUND"])
        result = await ensure_streams(LateLook(js, "PGW_OUTBOUND"), subjects)  # type: ignore[arg-type]
        assert result["PGW_OUTBOUND"] == "exists"
        assert (await js.stream_info("PGW_OUTBOUND")).config.allow_atomic  # made atomic as planned

        # Made meanwhile with subjects the contract does not have: the clear conflict, as for any stream.
        await js.delete_stream("PGW_SURFACE")
        plans["PGW_SURFACE"].subjects = ["elsewhere.>"]
        await js.add_stream(plans["PGW_SURFACE"])
        with pytest.raises(StreamConflict, match="PGW_SURFACE"):
            await ensure_streams(LateLook(js, "PGW_SURFACE"), subjects)  # type: ignore[arg-type]
    finally:
        await nc.close()


async def test_a_bucket_create_that_times_out_is_asked_again(nc) -> None:
    """A JetStream API timeout while a bucket is created (a busy or electing R3 cluster) is retried, not fatal."""
    from nats.errors import TimeoutError as NatsTimeoutError

    from pgwcore.streams import ensure_kv

    real = nc.jetstream()

    class SlowFirstCreate:
        """Fault injection the real server cannot do on demand: the first create times out (as a busy
        cluster's does); everything else is the real JetStream context."""

        calls = 0

        def __getattr__(self, name: str):
            return getattr(real, name)

        async def create_key_value(self, config):
            SlowFirstCreate.calls += 1
            if SlowFirstCreate.calls == 1:
                raise NatsTimeoutError
            return await real.create_key_value(config)

    kv = await ensure_kv(SlowFirstCreate(), "PGW_RETRY_T", retry_for=10)
    assert SlowFirstCreate.calls == 2 and kv is not None
    await kv.put("k", b"v")
    assert (await (await real.key_value("PGW_RETRY_T")).get("k")).value == b"v"
