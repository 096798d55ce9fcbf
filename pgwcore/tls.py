"""TLS for every NATS connection, and a local CA for a development setup.

A deployed NATS usually requires TLS, often with client certificates (mutual
TLS). Every pgw process takes the same three settings, from the ``[tls]``
section of the configuration or, at the command-line edge, ``--tls-ca``,
``--tls-cert``, ``--tls-key`` and the nats CLI's own variables ``NATS_CA``,
``NATS_CERT``, ``NATS_KEY``:

- ``ca``: the CA bundle that signed the server's certificate (a private CA
  works without ``SSL_CERT_FILE``); absent, the system's trust store;
- ``cert`` and ``key``: this process's client certificate, for a server that
  verifies clients (``verify: true``); both or neither.

``make_dev_ca`` writes a CA, a server certificate for the loopback names and
a client certificate, all 0600, so ``pgw up --tls`` runs the embedded server
with mutual TLS on the client and WebSocket ports. A development CA is not a
production PKI: its key sits beside the certificates.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pgwcore.identity import write_private
from subjects.errors import PgwError


class TlsError(PgwError):
    """A TLS file is missing or unreadable, or only half of a client certificate pair is given."""


@dataclass(frozen=True)
class TlsFiles:
    """The CA bundle and the client certificate and key (paths; empty strings mean not given)."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def __bool__(self) -> bool:
        return bool(self.ca or self.cert or self.key)

    def check(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise TlsError("tls.cert and tls.key go together: give both (a client certificate and its key) or neither")
        for what, path in (("tls.ca", self.ca), ("tls.cert", self.cert), ("tls.key", self.key)):
            if path and not Path(path).expanduser().is_file():
                raise TlsError(f"{what}: no such file {path}")

    def client_context(self) -> ssl.SSLContext:
        """The client side: verify the server against ``ca`` (or the system store), present ``cert`` if given."""
        self.check()
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                         cafile=str(Path(self.ca).expanduser()) if self.ca else None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert:
            try:
                ctx.load_cert_chain(str(Path(self.cert).expanduser()), str(Path(self.key).expanduser()))
            except (OSError, ssl.SSLError) as e:
                raise TlsError(f"tls.cert / tls.key: cannot load the client certificate ({e})") from e
        return ctx


def server_tls_block(cert: str, key: str, ca: str = "", *, verify: bool = True, indent: str = "") -> str:
    """A nats-server ``tls { }`` block; ``verify`` requires a client certificate signed by ``ca``."""
    lines = [f"{indent}tls {{", f'{indent}  cert_file: "{cert}"', f'{indent}  key_file: "{key}"']
    if ca:
        lines.append(f'{indent}  ca_file: "{ca}"')
    if verify:
        lines.append(f"{indent}  verify: true")
    lines.append(f"{indent}}}")
    return "\n".join(lines)


@dataclass(frozen=True)
class DevCa:
    """Where ``make_dev_ca`` wrote its files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_files(self) -> TlsFiles:
        return TlsFiles(str(self.ca), str(self.client_cert), str(self.client_key))


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None,
          issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool, server: bool, days: int) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    b = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False,
                                          encipher_only=False, decipher_only=False), critical=True)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if server:
            b = b.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1")),
            ]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_dev_ca(folder: Path, *, client: str = "pgw", days: int = 365) -> DevCa:
    """A development CA with a loopback server certificate and one client certificate (reused once made)."""
    folder = Path(folder)
    out = DevCa(folder / "ca.pem", folder / "server.pem", folder / "server-key.pem",
                folder / "client.pem", folder / "client-key.pem")
    if all(p.exists() for p in (out.ca, out.server_cert, out.server_key, out.client_cert, out.client_key)):
        return out
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _cert("Principal Gateway development CA", ca_key, None, ca_key, ca=True, server=False, days=days)
    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv = _cert("localhost", srv_key, ca_cert, ca_key, ca=False, server=True, days=days)
    cli_key = ec.generate_private_key(ec.SECP256R1())
    cli = _cert(client, cli_key, ca_cert, ca_key, ca=False, server=False, days=days)
    write_private(folder / "ca-key.pem", _key_pem(ca_key))
    write_private(out.ca, ca_cert.public_bytes(serialization.Encoding.PEM).decode())
    write_private(out.server_cert, srv.public_bytes(serialization.Encoding.PEM).decode())
    write_private(out.server_key, _key_pem(srv_key))
    write_private(out.client_cert, cli.public_bytes(serialization.Encoding.PEM).decode())
    write_private(out.client_key, _key_pem(cli_key))
    return out
