"""A SCRAPI Transparency Service of the project's own, kept ONLY for fault injection.

Interop is proved against the real peer, scittles (``tests/scittles_peer.py``,
``tests/test_capsule_scittles.py``). This stand-in exists for what the real
peer cannot be made to do on demand: answer 503 (``fail_first=N``: the first N
POSTs; ``-1``: every POST, a TS that is down), refuse every statement with a
permanent 400 (``reject``), publish a key of another kind (``published_jwks``), sign receipts with a key nobody trusts
(``bad_receipts``), answer late (each POST held until the ``hold`` event is set),
come back on the same port after a stop (``port``), and take the asynchronous paths scittles never takes:
``accepted`` answers 202 + Location of an operation that turns into a 303 to
the entry after ``polls_before_ready`` polls, ``see_other`` answers 303 +
Location of the entry. Its log is a real RFC 9162 tree over the ``statement``
leaf construction (SHA-256 of the whole Signed Statement), the other one the
registrar supports, with Ed25519 receipts. A statement POSTed again is answered
``409`` with the ``Location`` of its entry (SCRAPI), as after a client timeout.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from dataclasses import dataclass, field
from typing import Literal

import cbor2
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from consumers.cose import (
    CoseError,
    decode_sign1,
    inclusion_path,
    merkle_root,
    raw_public,
    sign_receipt,
    statement_leaf,
)
from pgwcore.keys import kid_of


@dataclass
class ScittTS:
    mode: Literal["sync", "accepted", "see_other"] = "sync"
    fail_first: int = 0
    polls_before_ready: int = 1
    bad_receipts: bool = False
    reject: bool = False
    hold: asyncio.Event | None = None  # set: POSTs are handled; unset: each waits for it
    published_jwks: dict | None = None  # what the configuration document publishes instead of its key
    port: int = 0
    key: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)
    leaves: list[bytes] = field(default_factory=list)
    statements: list[bytes] = field(default_factory=list)
    operations: dict[str, list[int]] = field(default_factory=dict)  # op -> [entry index, polls]
    posts: int = 0
    url: str = ""
    _runner: web.AppRunner | None = None

    @property
    def kid(self) -> str:
        return kid_of(self.key.public_key())

    @property
    def public_hex(self) -> str:
        return raw_public(self.key.public_key()).hex()

    # -- HTTP ---------------------------------------------------------------
    async def start(self) -> ScittTS:
        app = web.Application()
        app.router.add_get("/.well-known/transparency-configuration", self._configuration)
        app.router.add_post("/entries", self._post_entry)
        app.router.add_get("/entries/{eid}", self._get_entry)
        app.router.add_get("/operations/{op}", self._get_operation)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        port = self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ScittTS:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _configuration(self, _req: web.Request) -> web.Response:
        x = base64.urlsafe_b64encode(raw_public(self.key.public_key())).rstrip(b"=").decode()
        doc = {
            "issuer": self.url,
            "registration_endpoint": f"{self.url}/entries",
            "jwks": self.published_jwks or {"keys": [{"kty": "OKP", "crv": "Ed25519", "x": x, "kid": self.kid}]},
        }
        return web.Response(body=cbor2.dumps(doc), content_type="application/cbor")

    async def _post_entry(self, req: web.Request) -> web.Response:
        self.posts += 1
        if req.content_type != "application/cose":
            return web.Response(status=415, text="expected application/cose")
        if self.fail_first < 0 or self.fail_first >= self.posts:
            return web.Response(status=503, text="service unavailable (test)", headers={"Retry-After": "0"})
        body = await req.read()
        if self.hold is not None:
            await self.hold.wait()  # a slow TS: the client gives up while the POST is still being handled
        if body in self.statements:
            return web.Response(status=409, text="already registered",
                                headers={"Location": f"/entries/{self.statements.index(body)}"})
        if self.reject:
            return web.Response(status=400, text="statement refused by registration policy (test)")
        try:
            decode_sign1(body)
            leaf = statement_leaf(body)
        except CoseError as e:
            return web.Response(status=400, text=f"not a COSE_Sign1: {e}")
        index = len(self.leaves)
        self.leaves.append(leaf)  # append-only: nothing ever removes or rewrites a leaf
        self.statements.append(body)
        if self.mode == "sync":
            return web.Response(status=201, body=self._receipt(index), content_type="application/cose",
                                headers={"Location": f"/entries/{index}"})
        if self.mode == "see_other":
            return web.Response(status=303, headers={"Location": f"/entries/{index}", "Retry-After": "0"})
        op = secrets.token_hex(8)
        self.operations[op] = [index, 0]
        return web.Response(status=202, body=cbor2.dumps({"operationID": op, "status": "running"}),
                            content_type="application/cbor",
                            headers={"Location": f"/operations/{op}", "Retry-After": "0"})

    async def _get_operation(self, req: web.Request) -> web.Response:
        op = self.operations.get(req.match_info["op"])
        if op is None:
            return web.Response(status=404)
        op[1] += 1
        if op[1] <= self.polls_before_ready:
            return web.Response(status=202, body=cbor2.dumps({"status": "running"}),
                                content_type="application/cbor", headers={"Retry-After": "0"})
        return web.Response(status=303, headers={"Location": f"{self.url}/entries/{op[0]}"})

    async def _get_entry(self, req: web.Request) -> web.Response:
        try:
            index = int(req.match_info["eid"])
        except ValueError:
            return web.Response(status=404)
        if not 0 <= index < len(self.leaves):
            return web.Response(status=404)
        return web.Response(status=200, body=self._receipt(index), content_type="application/cose")

    def _receipt(self, index: int) -> bytes:
        leaves = list(self.leaves)
        key = Ed25519PrivateKey.generate() if self.bad_receipts else self.key
        kid = self.kid  # a forged receipt still claims the real kid
        return sign_receipt(key, kid, len(leaves), index, inclusion_path(index, leaves), merkle_root(leaves))
