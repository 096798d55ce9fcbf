"""The browser surface's page server: ``pgw surface-web``.

A small aiohttp server on loopback that serves the built page
(``consumers/web/static``: no npm at run time) and, behind a per-run token,
the page's connection settings: the NATS WebSocket URL, the principal, the
subject prefix and, when in use, the principal's credentials. The page then
talks to NATS directly (DESIGN §4); this server never sees a surface item or
an answer.

Why a token: the config carries the principal's credentials, and any local
process can reach a loopback port. The token is in the URL the command
prints; a request without it gets 403.

The page is also an installable Progressive Web App (issue 17): a web app
manifest at ``/manifest.webmanifest`` and a service worker at ``/sw.js``
(root scope: it may control every page of this origin). The installed app
starts at ``/`` without the token; the page keeps the token it was first
opened with in localStorage (docs/surfaces.md, "Installing the app").

The page shows times (a moment's deadline) in ``time_zone``, the principal's
IANA zone when one is configured (``[notifier.principals.P] timezone``), else
in the browser's own zone; either way the zone is named (docs/surfaces.md
"Accessibility").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from aiohttp import web

from pgwcore.config import ConfigError
from pgwcore.logs import get_logger
from subjects.names import principal_token

log = get_logger("pgw.surface-web")

STATIC_DIR = Path(__file__).resolve().parent.parent / "web" / "static"


def stored_token(path: Path, *, renew: bool = False) -> str:
    """The page token kept in ``path`` (mode 0600), made on first use or when ``renew``.

    An installed app keeps the token it was opened with; a token that changed
    with every run of ``pgw surface-web`` would lock it out after each restart.
    """
    if not renew:
        try:
            token = path.read_text().strip()
        except FileNotFoundError:
            token = ""
        if len(token) >= 24:
            return token
    token = secrets.token_urlsafe(24)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return token


def manifest(principal: str) -> dict[str, Any]:
    """The web app manifest (W3C Web Application Manifest) of the browser surface of ``principal``."""
    icons = "/static/icons"
    return {
        "id": "/",
        "name": f"Principal Gateway (~{principal})",
        "short_name": "Gateway",
        "description": "Decisions your agents need from you",
        "start_url": "/",
        "scope": "/",
        "display": "standalone",
        "orientation": "any",
        "theme_color": "#0f1b33",
        "background_color": "#f4f5f7",
        "icons": [
            {"src": f"{icons}/icon-192.png", "sizes": "192x192", "type": "image/png", "purpose": "any"},
            {"src": f"{icons}/icon-512.png", "sizes": "512x512", "type": "image/png", "purpose": "any"},
            {"src": f"{icons}/icon-maskable-512.png", "sizes": "512x512", "type": "image/png", "purpose": "maskable"},
        ],
    }


class WebSurfaceServer:
    """Serves the browser surface for one principal; an async context manager."""

    name = "surface-web"

    def __init__(
        self,
        *,
        principal: str,
        ws_url: str,
        prefix: str = "pgw",
        auth: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 8765,
        static_dir: Path = STATIC_DIR,
        token: str | None = None,
        notify_synopsis: bool = False,
        time_zone: str | None = None,
    ) -> None:
        self.principal = principal_token(principal)
        self.ws_url = ws_url
        self.prefix = prefix
        self.auth = auth
        self.host = host
        self.port = port
        self.static_dir = static_dir
        # A token kept across runs (``pgw surface-web`` stores one per principal) lets an
        # installed app keep working after a restart; None = a fresh one per run.
        self.token = token or secrets.token_urlsafe(18)
        # Desktop notifications show the synopsis only when the principal opted in (issue 17).
        self.notify_synopsis = notify_synopsis
        # None: the page shows times in the browser's zone.
        if time_zone is not None:
            try:
                ZoneInfo(time_zone)
            except (ZoneInfoNotFoundError, ValueError) as e:
                raise ConfigError("time_zone", f"{time_zone!r} is not an IANA time zone (e.g. \"Europe/Paris\")") from e
        self.time_zone = time_zone
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/?t={self.token}"

    def app(self) -> web.Application:
        if not (self.static_dir / "app.js").exists():
            raise FileNotFoundError(
                f"{self.static_dir / 'app.js'} is missing: build it with `npm ci && npm run build` in consumers/web"
            )
        app = web.Application(middlewares=[self._headers])
        app.router.add_get("/", self._index)
        app.router.add_get("/config.json", self._config)
        app.router.add_get("/manifest.webmanifest", self._manifest)
        app.router.add_get("/sw.js", self._service_worker)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_static("/static", self.static_dir, show_index=False, follow_symlinks=False)
        return app

    @web.middleware
    async def _headers(self, request: web.Request, handler: Any) -> web.StreamResponse:
        resp = await handler(request)
        # The page loads only its own code and talks only to this server and NATS.
        resp.headers["Content-Security-Policy"] = (
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "manifest-src 'self'; worker-src 'self'; "
            f"connect-src 'self' {' '.join(u.strip() for u in self.ws_url.split(','))}; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
        )
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Referrer-Policy"] = "no-referrer"
        resp.headers["Cache-Control"] = "no-store"
        return resp

    async def _healthz(self, request: web.Request) -> web.Response:
        """Ready when this server serves and the NATS WebSocket the page connects to accepts connections
        (the page holds its own NATS connection; docs/operations.md "Health and metrics")."""
        checks = {"serving": "ok", "nats_websocket": await _reachable(self.ws_url)}
        ok = all(v == "ok" for v in checks.values())
        return web.json_response({"status": "ok" if ok else "unhealthy", "checks": checks}, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from pgwcore.metrics import REGISTRY

        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(self.static_dir / "index.html")

    async def _manifest(self, request: web.Request) -> web.Response:
        return web.json_response(manifest(self.principal), content_type="application/manifest+json")

    async def _service_worker(self, request: web.Request) -> web.StreamResponse:
        # Served from the root so its scope is the whole origin (the default scope is the
        # script's own directory); Service-Worker-Allowed states that scope explicitly.
        return web.FileResponse(
            self.static_dir / "sw.js",
            headers={"Content-Type": "text/javascript; charset=utf-8", "Service-Worker-Allowed": "/"},
        )

    async def _config(self, request: web.Request) -> web.Response:
        if not secrets.compare_digest(request.query.get("t", ""), self.token):
            return web.json_response({"error": "open the URL that `pgw surface-web` printed"}, status=403)
        return web.json_response(
            {"principal": self.principal, "prefix": self.prefix, "ws_url": self.ws_url, "auth": self.auth,
             "notify_synopsis": self.notify_synopsis, "time_zone": self.time_zone}
        )

    async def start(self) -> WebSurfaceServer:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        log.info("browser surface serving", principal=self.principal, url=f"http://{self.host}:{self.port}/")
        return self

    async def drain(self) -> None:
        """Stop serving; idempotent (open pages keep their own NATS connection)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> WebSurfaceServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.drain()


async def _reachable(ws_urls: str, timeout: float = 2.0) -> str:
    """"ok" when one of the comma-separated WebSocket URLs accepts a TCP connection, else why not."""
    last = "no WebSocket URL configured"
    for url in (u.strip() for u in ws_urls.split(",") if u.strip()):
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "wss" else 80)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), timeout)
        except (OSError, TimeoutError) as e:
            last = f"{url}: {type(e).__name__}"
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return "ok"
    return last
