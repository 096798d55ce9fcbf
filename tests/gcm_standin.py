"""A loopback stand-in for Google's GCM/FCM, so that headless Chromium can make and receive Web Push.

TEST STAND-IN, not a peer: Chromium's push service is Google's (GCM/FCM) and
this machine has no internet, so there is no other way to let Chromium's own
``pushManager.subscribe()`` complete offline. Chromium is pointed here with
its own command-line switches (``--gcm-checkin-url``,
``--gcm-registration-url``, ``--gcm-mcs-endpoint``; see :meth:`GcmStandin.chromium_args`).

What stays real: Chromium's GCM client (check-in, registration, the MCS
connection), the subscription's keys (p256dh/auth are generated inside
Chromium; the private key never leaves it), the decryption of the push
message (Chromium's GCMEncryptionProvider, RFC 8291/8188 ``aes128gcm``) and
the service worker's push event. What is stood in: Google's three services,
each as small as Chromium needs, written from Chromium's protocol files
(google_apis/gcm/protocol/checkin.proto and mcs.proto):

- check-in: ``POST /checkin`` (protobuf AndroidCheckinRequest) answered with an
  AndroidCheckinResponse carrying ``stats_ok``, ``android_id``, ``security_token``;
- registration: ``POST /c2dm/register3`` (form) answered ``token=...``; for a
  Web Push subscription the form's ``sender`` is the page's
  applicationServerKey and ``X-subtype`` Chromium's app id for it;
- MCS: TLS, version byte 41, tagged length-prefixed protobufs; a push arrives
  as a DataMessageStanza (tag 8) with ``raw_data`` the encrypted body and
  ``content-encoding: aes128gcm`` in its app data; a message Chromium has not
  acknowledged (SelectiveAck, or listed in its next LoginRequest) is sent again
  on its next login (Chromium drops its first MCS connection right after the
  login and opens another, as observed here; a repeat carries the same
  notification tag);
- the push resource: ``POST /fcm/send/<token>`` over TLS (RFC 8030 §5), which
  checks the VAPID header as FCM does (RFC 8292 §2-3: ES256 JWT signed by the
  key the subscription was made with, ``aud`` the endpoint's origin).

The endpoint Chromium 156 built from the token in every run here is
``https://jmt17.google.com/fcm/send/<token>`` (a host compiled into it beside
``https://fcm.googleapis.com/fcm/send/``; why it picks that one with these
switches was not investigated, so both names are handled). The notifier reaches it through :meth:`GcmStandin.client_session`,
whose resolver sends the Google host names to this loopback server (test
wiring, like an /etc/hosts line) and which trusts this server's certificate.
Chromium accepts the same certificate for the MCS connection only through
``--ignore-certificate-errors-spki-list`` with this key's hash.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import hashlib
import ipaddress
import json
import ssl
import struct
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from cryptography.x509.oid import NameOID

GOOGLE_HOSTS = ("jmt17.google.com", "fcm.googleapis.com")
MCS_VERSION = 41  # google_apis/gcm/base/mcs_util: kMCSVersion
LOGIN_REQUEST, LOGIN_RESPONSE, IQ_STANZA, DATA_MESSAGE = 2, 3, 7, 8  # mcs.proto tags
HEARTBEAT_PING, HEARTBEAT_ACK = 0, 1
SELECTIVE_ACK = 12  # mcs.proto: Extension id of an IqStanza carrying a SelectiveAck


# --- protobuf, by hand (only varint, fixed64 and length-delimited fields are needed) ---

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def _field(num: int, value: bytes | str) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return _varint(num << 3 | 2) + _varint(len(data)) + data


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def _parse(buf: bytes) -> list[tuple[int, Any]]:
    out: list[tuple[int, Any]] = []
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        elif wire == 2:
            size, i = _read_varint(buf, i)
            value, i = buf[i:i + size], i + size
        else:
            raise ValueError(f"protobuf wire type {wire} not expected from Chromium")
        out.append((num, value))
    return out


def _b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _certificate(folder: Path) -> tuple[Path, Path, str]:
    """Self-signed certificate for the Google host names and 127.0.0.1; returns cert, key, SPKI SHA-256 (base64)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pgw test GCM stand-in")])
    now = dt.datetime.now(dt.UTC)
    sans = [x509.DNSName(h) for h in GOOGLE_HOSTS] + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "gcm.crt", folder / "gcm.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return cert_path, key_path, base64.b64encode(hashlib.sha256(spki).digest()).decode()


def check_vapid(authorization: str, sender: str, origin: str) -> str | None:
    """None if ``authorization`` is a valid ``vapid t=..., k=...`` for ``sender`` and ``origin``, else why not."""
    scheme, _, params = authorization.partition(" ")
    if scheme.lower() != "vapid":
        return f"authorization scheme {scheme!r} is not vapid"
    parts = dict(p.strip().split("=", 1) for p in params.split(",") if "=" in p)
    if parts.get("k") != sender:
        return "k is not the applicationServerKey the subscription was made with"
    try:
        head, body, sig = parts["t"].split(".")
        public = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), _b64url_decode(parts["k"]))
        raw = _b64url_decode(sig)
        der = encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
        public.verify(der, f"{head}.{body}".encode(), ec.ECDSA(hashes.SHA256()))
        header, claims = json.loads(_b64url_decode(head)), json.loads(_b64url_decode(body))
    except (KeyError, ValueError, InvalidSignature) as e:
        return f"bad VAPID JWT: {type(e).__name__}"
    if header.get("alg") != "ES256":
        return f"JWT alg {header.get('alg')!r} is not ES256"
    if claims.get("aud") != origin:
        return f"JWT aud {claims.get('aud')!r} is not {origin!r}"
    if not time.time() < claims.get("exp", 0) <= time.time() + 24 * 3600:
        return "JWT exp is not within 24 hours"
    return None


@dataclass
class Registration:
    token: str
    app_id: str  # Chromium's X-subtype: the push registration's app id
    sender: str  # the applicationServerKey (base64url), as Chromium sent it


@dataclass
class Push:
    token: str
    persistent_id: str
    vapid_error: str | None
    body_size: int
    acked: bool = False


class _Resolver(AbstractResolver):
    """The Google host names resolve to the stand-in's TLS port on 127.0.0.1 (test wiring)."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def resolve(self, host: str, port: int = 0, family: int = 0) -> list[dict[str, Any]]:
        if host not in GOOGLE_HOSTS:
            raise OSError(f"the GCM stand-in resolves only {GOOGLE_HOSTS}, not {host!r}")
        return [{"hostname": host, "host": "127.0.0.1", "port": self.port, "family": 2, "proto": 0, "flags": 0}]

    async def close(self) -> None:
        return None


@dataclass
class GcmStandin:
    folder: Path
    registrations: dict[str, Registration] = field(default_factory=dict)
    pushes: list[Push] = field(default_factory=list)
    checkins: int = 0
    logins: int = 0
    _queue: dict[str, bytes] = field(default_factory=dict)  # persistent_id -> DataMessageStanza, until acked
    _writer: asyncio.StreamWriter | None = None

    async def start(self) -> None:
        self.cert, self.key, self.spki = _certificate(self.folder)
        self.tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.tls.load_cert_chain(self.cert, self.key)
        app = web.Application()
        app.router.add_post("/checkin", self._checkin)
        app.router.add_post("/c2dm/register3", self._register)
        app.router.add_post("/fcm/send/{token}", self._send)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        plain = web.TCPSite(self.runner, "127.0.0.1", 0)
        secure = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.tls)
        await plain.start()
        await secure.start()
        self.http_port = plain._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.https_port = secure._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.mcs = await asyncio.start_server(self._mcs, "127.0.0.1", 0, ssl=self.tls)
        self.mcs_port = self.mcs.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.mcs.close()
        if self._writer:
            self._writer.close()
        await self.runner.cleanup()

    def chromium_args(self) -> list[str]:
        base = f"http://127.0.0.1:{self.http_port}"
        return [f"--gcm-checkin-url={base}/checkin", f"--gcm-registration-url={base}/c2dm/register3",
                f"--gcm-mcs-endpoint=https://127.0.0.1:{self.mcs_port}",
                f"--ignore-certificate-errors-spki-list={self.spki}"]

    def client_session(self) -> aiohttp.ClientSession:
        """An HTTP client for the notifier: Google's push hosts reach this stand-in, whose certificate it trusts."""
        trust = ssl.create_default_context(cafile=str(self.cert))
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=_Resolver(self.https_port), ssl=trust))

    # --- check-in and registration (HTTP) ---

    async def _checkin(self, request: web.Request) -> web.Response:
        if request.content_type != "application/x-protobuf":
            return web.Response(status=400, text="check-in is application/x-protobuf")
        _parse(await request.read())  # well-formed, or ValueError fails the request
        self.checkins += 1
        # AndroidCheckinResponse: stats_ok=1 (field 1), android_id (7, fixed64), security_token (8, fixed64).
        body = _varint(1 << 3) + _varint(1) + b"\x39" + struct.pack("<Q", 4242424242) + b"\x41" + struct.pack("<Q", 77)
        return web.Response(body=body, content_type="application/x-protobuf")

    async def _register(self, request: web.Request) -> web.Response:
        if not request.headers.get("Authorization", "").startswith("AidLogin 4242424242:77"):
            return web.Response(status=401, text="Error=AUTHENTICATION_FAILED")
        form = dict(urllib.parse.parse_qsl((await request.read()).decode()))
        token = f"standin{len(self.registrations) + 1}:{hashlib.sha256(json.dumps(form).encode()).hexdigest()[:32]}"
        self.registrations[token] = Registration(token, form.get("X-subtype", form.get("app", "")), form.get("sender", ""))
        return web.Response(text=f"token={token}")

    def web_push_registrations(self) -> list[Registration]:
        return [r for r in self.registrations.values() if r.app_id.startswith("wp:")]

    # --- the push resource (HTTPS, RFC 8030 §5) ---

    async def _send(self, request: web.Request) -> web.Response:
        reg = self.registrations.get(request.match_info["token"])
        if reg is None:
            return web.Response(status=404, text="no such subscription")
        if request.headers.get("Content-Encoding") != "aes128gcm" or "TTL" not in request.headers:
            return web.Response(status=400, text="Content-Encoding aes128gcm and TTL are required")
        body = await request.read()
        origin = f"https://{request.host.split(':')[0]}"
        error = check_vapid(request.headers.get("Authorization", ""), reg.sender, origin)
        pid = f"0:{time.time_ns()}%{len(self.pushes)}"
        self.pushes.append(Push(reg.token, pid, error, len(body)))
        if error:
            return web.Response(status=403, text=error)
        app_data = (_field(7, _field(1, "subtype") + _field(2, reg.app_id))
                    + _field(7, _field(1, "content-encoding") + _field(2, "aes128gcm")))
        # DataMessageStanza: id (2), from (3), category (5), app_data (7), persistent_id (9), raw_data (21).
        self._queue[pid] = (_field(2, pid) + _field(3, reg.sender) + _field(5, "org.chromium.linux") + app_data
                            + _field(9, pid) + _field(21, body))
        await self._flush()
        return web.Response(status=201, headers={"Location": f"/fcm/message/{pid}"})

    # --- MCS (TLS) ---

    async def _flush(self) -> None:
        if self._writer is None:
            return
        for stanza in list(self._queue.values()):
            self._writer.write(bytes([DATA_MESSAGE]) + _varint(len(stanza)) + stanza)
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()

    async def _mcs(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if (await reader.readexactly(1))[0] < MCS_VERSION:
                return
            tag, body = await _read_stanza(reader)
            if tag != LOGIN_REQUEST:
                return
            login = _parse(body)
            if dict(login).get(5) != b"77":  # auth_token: the security token of the check-in
                return
            for num, value in login:  # received_persistent_id: what Chromium already has
                if num == 10:
                    self._ack(value.decode())
            response = _field(1, "login") + _varint(6 << 3) + _varint(1)  # id, last_stream_id_received=1
            writer.write(bytes([MCS_VERSION, LOGIN_RESPONSE]) + _varint(len(response)) + response)
            await writer.drain()
            self.logins += 1
            self._writer = writer  # the newest login wins: Chromium reconnects at will
            await self._flush()
            while True:
                tag, body = await _read_stanza(reader)
                if tag == HEARTBEAT_PING:
                    writer.write(bytes([HEARTBEAT_ACK, 0]))
                    await writer.drain()
                elif tag == IQ_STANZA:
                    ext = dict(_parse(body)).get(7)
                    if ext and dict(_parse(ext)).get(1) == SELECTIVE_ACK:
                        for num, value in _parse(dict(_parse(ext))[2]):
                            if num == 1:
                                self._ack(value.decode())
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            if self._writer is writer:
                self._writer = None
            writer.close()

    def _ack(self, pid: str) -> None:
        self._queue.pop(pid, None)
        for p in self.pushes:
            if p.persistent_id == pid:
                p.acked = True


async def _read_stanza(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    tag = (await reader.readexactly(1))[0]
    size = shift = 0
    while True:
        b = (await reader.readexactly(1))[0]
        size |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    return tag, await reader.readexactly(size)


@contextlib.asynccontextmanager
async def gcm_standin() -> AsyncIterator[GcmStandin]:
    with tempfile.TemporaryDirectory(prefix="pgw-gcm-") as folder:
        standin = GcmStandin(Path(folder))
        await standin.start()
        try:
            yield standin
        finally:
            await standin.stop()
