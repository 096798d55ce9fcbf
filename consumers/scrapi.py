"""The SCRAPI calls the registrar makes (draft-ietf-scitt-scrapi), over one aiohttp session.

- ``GET /.well-known/transparency-configuration`` (§2.1.1), CBOR or JSON;
  its ``jwks`` or ``jwks_uri`` gives the receipt keys (``GET`` of the URI);
- ``POST /entries`` (§2.1.2) with ``Content-Type: application/cose``: ``201``
  carries the receipt; ``202``/``303`` name a ``Location`` polled until it
  yields one (``Retry-After`` honoured, capped);
- a statement the TS already holds (``409``, or ``400`` whose problem details
  say "already registered", as scittles answers) raises :class:`AlreadyRegistered`
  with whatever location it named, and :meth:`ScrapiClient.receipt_at` fetches
  the receipt of the existing entry (§2.1.4 "Resolve Receipt").

Errors say whether retrying can help: :class:`RegistrationError` ``transient``
is true for 5xx, 429, timeouts and connection failures (the TS is down or
busy), false for an answer that will not change (another 4xx).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import cbor2

from subjects.errors import PgwError

COSE = "application/cose"


class RegistrationError(PgwError):
    """The TS did not register the statement; ``status`` if it answered, ``transient`` if worth retrying."""

    def __init__(self, why: str, status: int | None = None, *, transient: bool | None = None) -> None:
        self.why = why
        self.status = status
        self.transient = (status is None or status >= 500 or status == 429) if transient is None else transient
        super().__init__(f"registration failed: {why}")


class AlreadyRegistered(PgwError):
    """The TS holds this statement already (409, or 400 "Already Registered"); ``location`` if named."""

    def __init__(self, status: int, detail: str, location: str | None) -> None:
        self.status = status
        self.detail = detail
        self.location = location
        super().__init__(f"already registered ({status}: {detail})")


def problem_text(body: bytes, content_type: str) -> str:
    """Title and detail of RFC 9290 concise problem details (CBOR) or RFC 9457 JSON, else the text."""
    try:
        if "cbor" in content_type:
            doc = cbor2.loads(body)
            if isinstance(doc, dict):
                return " ".join(str(doc[k]) for k in (-1, -2) if k in doc) or str(doc)
        if "json" in content_type:
            doc = json.loads(body)
            if isinstance(doc, dict):
                return " ".join(str(doc[k]) for k in ("title", "detail") if k in doc) or str(doc)
    except Exception:  # noqa: BLE001 - a malformed error body is still reported, as text
        pass
    return body[:200].decode("utf-8", "replace")


def _retry_after(r: aiohttp.ClientResponse) -> float:
    try:
        return max(0.0, float(r.headers.get("Retry-After", "0.2")))
    except ValueError:
        return 0.2


class ScrapiClient:
    """One TS at ``base_url``; an idempotent ``close()``."""

    def __init__(self, base_url: str, *, timeout_s: float, poll_timeout_s: float) -> None:
        self.base = base_url.rstrip("/")
        self.poll_timeout_s = poll_timeout_s
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))

    async def close(self) -> None:
        await self.session.close()

    def absolute(self, loc: str) -> str:
        return loc if loc.startswith(("http://", "https://")) else f"{self.base}/{loc.lstrip('/')}"

    async def configuration(self) -> dict[str, Any]:
        async with self.session.get(f"{self.base}/.well-known/transparency-configuration",
                                    headers={"Accept": "application/cbor, application/json"}) as r:
            body = await r.read()
            if r.status != 200:
                raise RegistrationError(f"transparency-configuration answered {r.status}", r.status)
            doc = json.loads(body) if "json" in r.headers.get("Content-Type", "") else cbor2.loads(body)
        if not isinstance(doc, dict):
            raise RegistrationError("transparency-configuration is not a map", transient=False)
        return doc

    async def jwks(self, uri: str) -> Any:
        async with self.session.get(self.absolute(uri), headers={"Accept": "application/json"}) as r:
            body = await r.read()
            if r.status != 200:
                raise RegistrationError(f"jwks_uri {uri} answered {r.status}", r.status)
        try:
            return json.loads(body)
        except ValueError:
            raise RegistrationError(f"jwks_uri {uri} is not JSON", transient=False) from None

    async def register(self, statement: bytes) -> bytes:
        """POST /entries; the receipt bytes (following 202/303 by polling), or AlreadyRegistered."""
        async with self.session.post(f"{self.base}/entries", data=statement,
                                     headers={"Content-Type": COSE, "Accept": COSE},
                                     allow_redirects=False) as r:
            body = await r.read()
            if r.status == 201 and body:
                return body
            if r.status in (201, 202, 303) and r.headers.get("Location"):
                return await self._poll(self.absolute(r.headers["Location"]), _retry_after(r))
            detail = problem_text(body, r.headers.get("Content-Type", ""))
            if r.status == 409 or (r.status == 400 and "already registered" in detail.lower()):
                loc = r.headers.get("Location")
                raise AlreadyRegistered(r.status, detail, self.absolute(loc) if loc else None)
            raise RegistrationError(f"POST /entries answered {r.status}: {detail}", r.status)

    async def receipt_at(self, url: str) -> bytes | None:
        """GET a receipt; None if the TS does not know that entry (404)."""
        async with self.session.get(url, headers={"Accept": COSE}, allow_redirects=True) as r:
            body = await r.read()
            if r.status == 200 and body:
                return body
            if r.status == 404 or (r.status == 400 and "entry" in problem_text(body, "").lower()):
                return None
            raise RegistrationError(f"GET {url} answered {r.status}: "
                                    f"{problem_text(body, r.headers.get('Content-Type', ''))}", r.status)

    async def _poll(self, url: str, wait: float) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.poll_timeout_s
        while True:
            await asyncio.sleep(min(wait, 5.0))
            if loop.time() > deadline:
                raise RegistrationError(f"no receipt from {url} within {self.poll_timeout_s}s")
            async with self.session.get(url, headers={"Accept": COSE}, allow_redirects=False) as r:
                body = await r.read()
                if r.status in (200, 201) and r.headers.get("Content-Type", "").startswith(COSE) and body:
                    return body
                if r.status in (301, 302, 303, 307) and r.headers.get("Location"):
                    url, wait = self.absolute(r.headers["Location"]), 0.0
                    continue
                if r.status in (200, 202, 404):  # still running (404: entry not yet visible)
                    wait = _retry_after(r)
                    continue
                raise RegistrationError(f"polling {url} answered {r.status}: "
                                        f"{problem_text(body, r.headers.get('Content-Type', ''))}", r.status)
