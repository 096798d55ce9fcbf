"""/metrics and /healthz on every service (pgwcore/health.py, ``ops.metrics_port``), against a real nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from pgwcore.health import consumer_progress
from pgwcore.server import EmbeddedServer
from tests.chaos.harness import free_port
from tests.polling import until

REPO = Path(__file__).resolve().parent.parent


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


@pytest.mark.parametrize("role", ["gateway", "signer", "registrar", "notifier"])
async def test_every_service_serves_metrics_and_healthz(role: str, nats_server: EmbeddedServer, tmp_path: Path) -> None:
    """`pgw ROLE --metrics-port P` answers /metrics, and /healthz is 200 while connected and 503 once NATS is gone."""
    port = free_port()
    env = {**os.environ, "PGW_LOG_LEVEL": "WARNING"}
    cfg = tmp_path / "pgw.toml"  # a registrar with a TS runs its consumer (nothing is queued: no request is made)
    cfg.write_text('[registrar]\nts_url = "http://127.0.0.1:9"\n')
    # Its log goes to a file: a pipe nobody reads while NATS is gone fills with reconnect warnings
    # and then blocks the service's own writes (and its event loop with them).
    log = tmp_path / f"{role}.log"
    with open(log, "wb") as err:  # noqa: ASYNC230 - process start-up, not a hot path
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pgwcli", "--server", nats_server.client_url, "--data-dir", str(tmp_path / "d"),
            "--config", str(cfg), "--metrics-port", str(port), "--log-format", "json", role, cwd=str(REPO), env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=err,
        )
    base = f"http://127.0.0.1:{port}"
    last: list[tuple[int, bytes]] = [(0, b"")]  # the last answer seen: a timeout says what /healthz said

    def said() -> str:
        return f"(last /healthz: {last[0][0]} {last[0][1][:600]!r})"

    try:
        async def ready() -> dict | None:
            if proc.returncode is not None:
                raise AssertionError(f"pgw {role} exited: {log.read_text(errors='replace')[-2000:]}")
            last[0] = code, body = await asyncio.to_thread(_get, base + "/healthz")
            return json.loads(body) if code == 200 else None

        doc = await until(ready, timeout=60, interval=0.1, what=lambda: f"{role} /healthz 200 {said()}")
        assert doc["status"] == "ok" and doc["checks"][f"{role}:connected"] == "ok", doc
        assert doc["checks"][f"{role}:consumer"] == "ok", doc  # its durable consumer is watched
        code, body = await asyncio.to_thread(_get, base + "/metrics")
        assert code == 200 and b"# TYPE pgw_" in body
        nats_server.kill()

        async def unhealthy() -> dict | None:
            # 503 can come first from the consumer check (its request times out) while the
            # client has not yet noticed the lost connection: wait for the connection check.
            last[0] = code, body = await asyncio.to_thread(_get, base + "/healthz")
            doc = json.loads(body) if code == 503 else None
            return doc if doc and doc["checks"].get(f"{role}:connected") != "ok" else None

        doc = await until(unhealthy, timeout=30, interval=0.1, what=lambda: f"{role} /healthz 503 {said()}")
        assert doc["status"] == "unhealthy" and doc["checks"][f"{role}:connected"] != "ok", doc
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise AssertionError(f"pgw {role} did not stop within 30 s of SIGTERM: "
                                     f"{log.read_text(errors='replace')[-2000:]}") from None


async def test_a_consumer_with_waiting_work_and_no_acks_is_stalled(nc) -> None:
    """consumer_progress: healthy while the ack floor moves or nothing waits; stalled after stall_after_s without acks."""
    js = nc.jetstream()
    await js.add_stream(name="HEALTH_T", subjects=["health.t"])
    await js.add_consumer("HEALTH_T", ConsumerConfig(durable_name="w", ack_policy=AckPolicy.EXPLICIT))
    now = [0.0]
    check = consumer_progress(lambda: js.consumer_info("HEALTH_T", "w"), 60.0, clock=lambda: now[0])
    assert await check() is None  # nothing waits
    for i in range(3):
        await js.publish("health.t", str(i).encode())
    assert await check() is None  # work arrived: the clock starts now
    now[0] = 59.0
    assert await check() is None
    now[0] = 61.0
    reason = await check()
    assert reason is not None and reason.startswith("stalled: 3 message(s) waiting")
    sub = await js.pull_subscribe_bind("w", stream="HEALTH_T")
    for m in await sub.fetch(3, timeout=5):
        await m.ack_sync()
    assert await check() is None  # acknowledged: the floor moved and nothing waits


async def test_web_surface_healthz_follows_the_nats_websocket(tmp_path: Path) -> None:
    """The browser surface's /healthz is 200 while the NATS WebSocket it hands the page accepts connections, 503 after."""
    from consumers.surfaces.web import WebSurfaceServer

    server = await EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=None, websocket_port=-1).start()
    web = await WebSurfaceServer(principal="alice", ws_url=server.websocket_url, port=0).start()
    try:
        code, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{web.port}/healthz")
        assert code == 200 and json.loads(body)["checks"] == {"serving": "ok", "nats_websocket": "ok"}
        code, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{web.port}/metrics")
        assert code == 200
        await server.stop()
        code, body = await asyncio.to_thread(_get, f"http://127.0.0.1:{web.port}/healthz")
        assert code == 503 and json.loads(body)["checks"]["nats_websocket"].endswith("ConnectionRefusedError")
    finally:
        await web.drain()
        await server.stop()
