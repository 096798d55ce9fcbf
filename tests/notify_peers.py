"""Real receivers for the notifier's channels, on loopback (issue 17).

- :func:`smtp_server`: aiosmtpd, STARTTLS required (a self-signed certificate
  made here, the notifier trusts it through ``notifier.smtp.ca_file``) and
  AUTH required after it; keeps every accepted message.
- :func:`webhook_receiver`: an aiohttp server that checks every POST with
  ``consumers.notify.webhook_verify.verify`` (the function receivers copy),
  answering 401 to a bad signature or a stale timestamp and 409 to an id it
  already took (a replay, or the notifier's repeat after a crash).
- :func:`write_secret`: a 0600 file, as the notifier wants its secrets.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import errno
import ipaddress
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from email import message_from_bytes
from email.message import Message
from pathlib import Path
from typing import Any

from aiohttp import web
from aiosmtpd.controller import Controller
from aiosmtpd.smtp import AuthResult, LoginPassword
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from consumers.notify.webhook_verify import (
    ID_HEADER,
    SIGNATURE_HEADER,
    WebhookReplay,
    WebhookSignatureError,
    verify,
)
from tests.ports import free_port

SMTP_USER, SMTP_PASSWORD = "pgw-mailer", "correct horse battery staple"


def write_secret(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 / localhost and its key (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pgw test relay")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "relay.crt", folder / "relay.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@dataclass
class Mailbox:
    messages: list[Message] = field(default_factory=list)
    envelopes: list[Any] = field(default_factory=list)
    logins: list[str] = field(default_factory=list)
    tls: list[bool] = field(default_factory=list)

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802 - aiosmtpd's name
        self.envelopes.append(envelope)
        self.tls.append(session.ssl is not None)
        self.messages.append(message_from_bytes(envelope.original_content))
        return "250 Message accepted for delivery"


@dataclass
class Relay:
    host: str
    port: int
    ca_file: Path
    credentials_file: Path
    box: Mailbox


def _start_smtp(make: Callable[[int], Controller], tries: int = 3) -> Controller:
    """``make(port)`` started on a port from ``free_port`` (aiosmtpd's Controller cannot listen on port 0:
    it connects to the port it was given to check it serves). A port another process bound between the
    choice and the start (aiosmtpd raises the bind's OSError, EADDRINUSE) is retried on a new one."""
    for attempt in range(tries):
        controller = make(free_port())
        try:
            controller.start()
        except OSError as e:
            controller.loop.close()  # its thread ended at the failed bind; the loop it made is left open
            if e.errno != errno.EADDRINUSE or attempt == tries - 1:
                raise
            continue
        return controller
    raise AssertionError("unreachable")


@contextlib.contextmanager
def smtp_server(folder: Path) -> Iterator[Relay]:
    cert, key = self_signed(folder)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    box = Mailbox()

    def authenticator(server: Any, session: Any, envelope: Any, mechanism: str, auth_data: Any) -> AuthResult:
        ok = (isinstance(auth_data, LoginPassword) and auth_data.login == SMTP_USER.encode()
              and auth_data.password == SMTP_PASSWORD.encode())
        if ok:
            box.logins.append(auth_data.login.decode())
        return AuthResult(success=ok, handled=False)

    controller = _start_smtp(lambda port: Controller(
        box, hostname="127.0.0.1", port=port, tls_context=ctx, require_starttls=True,
        authenticator=authenticator, auth_required=True, auth_require_tls=True))
    port = controller.port
    creds = write_secret(folder / "smtp.creds", f"{SMTP_USER}\n{SMTP_PASSWORD}\n")
    try:
        yield Relay("127.0.0.1", port, cert, creds, box)
    finally:
        controller.stop()


@dataclass
class Hook:
    url: str
    secret: bytes
    secret_file: Path
    accepted: list[dict[str, Any]] = field(default_factory=list)
    raw: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    status: list[int] = field(default_factory=list)  # scripted answers, then 200
    seen: dict[str, float] = field(default_factory=dict)
    replays: list[str] = field(default_factory=list)  # ids refused as already received (409)
    # Past this many POSTs, each waits for ``released`` before it is answered (keeps sends in flight, for the
    # kill -9 test); None: every POST answered at once.
    hold_after: int | None = None
    released: asyncio.Event = field(default_factory=asyncio.Event)


@contextlib.asynccontextmanager
async def webhook_receiver(folder: Path, secret: str = "whsec-test-0123456789abcdef") -> AsyncIterator[Hook]:
    import json

    hook = Hook("", secret.encode(), write_secret(folder / "webhook.secret", secret + "\n"))

    async def receive(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {SIGNATURE_HEADER: request.headers.get(SIGNATURE_HEADER, ""),
                   ID_HEADER: request.headers.get(ID_HEADER, "")}
        hook.raw.append((headers, body))
        if hook.hold_after is not None and len(hook.raw) > hook.hold_after:
            await hook.released.wait()
        try:
            verify(hook.secret, headers[SIGNATURE_HEADER], body, notification_id=headers[ID_HEADER], seen=hook.seen)
        except WebhookReplay as e:
            hook.replays.append(headers[ID_HEADER])
            return web.Response(status=409, text=str(e))
        except WebhookSignatureError as e:
            hook.refused.append(str(e))
            return web.Response(status=401, text=str(e))
        if hook.status:
            code = hook.status.pop(0)
            hook.seen.pop(headers[ID_HEADER], None)  # not taken: a retry is no replay
            return web.Response(status=code)
        hook.accepted.append(json.loads(body))
        return web.Response(status=200, text="ok")

    app = web.Application()
    app.router.add_post("/hook", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    hook.url = f"http://127.0.0.1:{port}/hook"
    try:
        yield hook
    finally:
        hook.released.set()  # a held POST ends before the server does
        await runner.cleanup()
