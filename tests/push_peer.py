"""A push service that decrypts with the reference RFC 8188/8291 code (npm ``http_ece``), as a test peer.

Interop is proved against the other side's own code: ``tests/push_service.js``
runs under ``/usr/bin/node`` with Martin Thomson's ``http_ece`` (the reference
implementation of Encrypted Content-Encoding) and checks the VAPID JWT with
``node:crypto``. Nothing of the notifier is used on that side.

:func:`install` puts ``http_ece@VERSION`` under
``~/.cache/pgw-peers/http_ece-VERSION`` (``PGW_PEERS_CACHE`` overrides the
root), built in a temporary folder beside it and renamed into place, so two
pytest processes building it at once cannot leave a half-installed copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from tests.refverifier import cache_root

VERSION = "1.2.1"
NODE = shutil.which("node") or "/usr/bin/node"
SCRIPT = Path(__file__).with_name("push_service.js")


class PushPeerError(RuntimeError):
    """The peer could not be installed or started."""


def install(version: str = VERSION) -> Path:
    final = cache_root() / f"http_ece-{version}"
    if (final / "node_modules" / "http_ece" / "ece.js").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    npm = shutil.which("npm")
    if npm is None:
        raise PushPeerError("npm is not installed (Debian: apt-get install npm)")
    tmp = Path(tempfile.mkdtemp(prefix=f".http_ece-{version}-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        proc = subprocess.run(
            [npm, "install", "--prefix", str(tmp), "--no-audit", "--no-fund", "--no-save", "--silent",
             f"http_ece@{version}"],
            capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0 or not (tmp / "node_modules" / "http_ece" / "ece.js").is_file():
            raise PushPeerError(f"npm install http_ece@{version} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "node_modules" / "http_ece" / "ece.js").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


class PushService:
    """The running peer: make subscriptions, script answers, read what arrived."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.http = aiohttp.ClientSession()

    async def new_subscription(self) -> tuple[str, dict[str, Any]]:
        async with self.http.post(f"{self.base}/subs") as r:
            d = await r.json()
        return d["id"], d["subscription"]

    async def respond(self, sid: str, *statuses: int) -> None:
        async with self.http.post(f"{self.base}/respond/{sid}", json={"statuses": list(statuses)}) as r:
            assert r.status == 200

    async def received(self) -> list[dict[str, Any]]:
        async with self.http.get(f"{self.base}/received") as r:
            return await r.json()

    async def close(self) -> None:
        await self.http.close()
        if self.proc.returncode is None:
            self.proc.terminate()
            with contextlib.suppress(ProcessLookupError):
                await self.proc.wait()


@contextlib.asynccontextmanager
async def push_service() -> AsyncIterator[PushService]:
    folder = await asyncio.to_thread(install)
    proc = await asyncio.create_subprocess_exec(NODE, str(SCRIPT), str(folder), stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    except TimeoutError:
        proc.kill()
        raise PushPeerError("the push service did not start") from None
    if not line.startswith("LISTENING "):
        err = (await proc.stderr.read()).decode() if proc.stderr else ""
        raise PushPeerError(f"the push service did not start: {line!r} {err[-1000:]}")
    svc = PushService(proc, int(line.split()[1]))
    try:
        yield svc
    finally:
        await svc.close()


def payloads(received: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [json.loads(json.dumps(r["payload"])) for r in received if "payload" in r]
