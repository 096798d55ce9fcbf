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
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from aiohttp import web

from pgwcore.logs import get_logger
from subjects.names import principal_token

log = get_logger("pgw.surface-web")

STATIC_DIR = Path(__file__).resolve().parent.parent / "web" / "static"


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
    ) -> None:
        self.principal = principal_token(principal)
        self.ws_url = ws_url
        self.prefix = prefix
        self.auth = auth
        self.host = host
        self.port = port
        self.static_dir = static_dir
        self.token = secrets.token_urlsafe(18)
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
        app.router.add_static("/static", self.static_dir, show_index=False, follow_symlinks=False)
        return app

    @web.middleware
    async def _headers(self, request: web.Request, handler: Any) -> web.StreamResponse:
        resp = await handler(request)
        # The page loads only its own code and talks only to this server and NATS.
        resp.headers["Content-Security-Policy"] = (
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            f"connect-src 'self' {' '.join(u.strip() for u in self.ws_url.split(','))}; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
        )
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Referrer-Policy"] = "no-referrer"
        resp.headers["Cache-Control"] = "no-store"
        return resp

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(self.static_dir / "index.html")

    async def _config(self, request: web.Request) -> web.Response:
        if not secrets.compare_digest(request.query.get("t", ""), self.token):
            return web.json_response({"error": "open the URL that `pgw surface-web` printed"}, status=403)
        return web.json_response(
            {"principal": self.principal, "prefix": self.prefix, "ws_url": self.ws_url, "auth": self.auth}
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
