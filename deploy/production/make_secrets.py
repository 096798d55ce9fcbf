"""The production recipe's TLS material and route credential (docs/operations.md, "The production recipe").

Run once on a trusted machine, beside `pgw accounts` (which makes the NATS accounts and users)::

    python deploy/production/make_secrets.py --dir deploy/production/secrets

It writes, every file 0600 in 0700 folders, and never over a file that exists:

- ``ca/client-ca-key.pem``, ``ca/route-ca-key.pem``: the two CAs' keys. Nothing mounts ``ca/``:
  move it offline once the certificates below are issued.
- ``tls/ca.pem``, ``tls/server.pem``, ``tls/server-key.pem``: the client CA, and the nodes'
  certificate for the client port (its names: every ``--node`` host and ``--server-name``).
- ``tls/route-ca.pem``, ``tls/route.pem``, ``tls/route-key.pem``: the route CA and the nodes' route
  certificate (server and client usage, the same names).
- ``clients/NAME.pem``, ``clients/NAME-key.pem``: a client certificate per ``--client`` (by default
  the four services; agents and surfaces get theirs the same way, from the client CA).
- ``cluster.conf``: the route credential, included inside every node's ``cluster { }``: an
  ``authorization { user, password }`` block and the routes carrying it (nats-server uses that
  block only for routes it discovers; explicit routes must carry the credential in their URL).

Why routes have a CA and a credential of their own: a route is trusted with every account's
traffic (it carries every message of every account and is not permission-checked), while a client
certificate is handed to every service, agent and surface. With routes trusting the client CA,
any client certificate was a route credential: a nats-server holding one agent's certificate joined
the cluster as a route and read and published every party's traffic in the account. The route CA
signs route certificates only, and the password is a second gate a certificate alone does not pass.

Only ``cryptography`` and the standard library: it runs where ``pgw`` is installed, or anywhere else.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NODES = ("nats-1", "nats-2", "nats-3")  # compose.yaml's services
SERVICES = ("gateway", "signer", "registrar", "notifier")
ROUTE_PORT = 6222
ROUTE_USER = "pgw-route"


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # O_EXCL: never over an existing file
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def _cert_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _issue(subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
           *, days: int, usages: tuple[x509.ObjectIdentifier, ...] = (), hosts: tuple[str, ...] = ()) -> x509.Certificate:
    """A CA certificate (``issuer`` None: self-signed) or a leaf with ``usages`` and ``hosts`` as names."""
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    ca = issuer is None
    issuer_cert, issuer_key = issuer if issuer else (None, key)
    b = (x509.CertificateBuilder()
         .subject_name(name)
         .issuer_name(issuer_cert.subject if issuer_cert else name)
         .public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=days))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False,
                                          encipher_only=False, decipher_only=False), critical=True)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        if hosts:
            b = b.add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _split_node(node: str) -> tuple[str, int]:
    host, sep, port = node.rpartition(":")
    if sep and port.isdigit() and not host.endswith(":"):  # an IPv6 literal without a port keeps its colons
        return host.strip("[]"), int(port)
    return node.strip("[]"), ROUTE_PORT


def cluster_conf(nodes: list[tuple[str, int]], password: str) -> str:
    """The block every node includes inside ``cluster { }``: the route authorization and the routes carrying it."""
    def url(host: str, port: int) -> str:
        return f"nats-route://{ROUTE_USER}:{password}@{f'[{host}]' if ':' in host else host}:{port}"
    routes = "\n".join(f'  "{url(h, p)}"' for h, p in nodes)
    return ("# Written by deploy/production/make_secrets.py: the route credential (keep it like the other\n"
            "# secrets). A server that dials a route without it is refused, whatever certificate it holds.\n"
            f'authorization {{\n  user: "{ROUTE_USER}"\n  password: "{password}"\n  timeout: 2\n}}\n'
            f"routes: [\n{routes}\n]\n")


def make_secrets(folder: Path, *, nodes: list[str], clients: list[str], server_names: Sequence[str] = (),
                 days: int = 825) -> list[Path]:
    """Write the recipe's CAs, certificates and ``cluster.conf`` under ``folder``; the paths written.
    The client port's certificate names every node and ``server_names`` (e.g. a Service's name)."""
    folder = Path(folder)
    hosts = tuple(dict.fromkeys(_split_node(n)[0] for n in nodes))
    plan = [folder / "ca" / "client-ca-key.pem", folder / "ca" / "route-ca-key.pem",
            *(folder / "tls" / n for n in ("ca.pem", "server.pem", "server-key.pem",
                                           "route-ca.pem", "route.pem", "route-key.pem")),
            *(folder / "clients" / f"{c}{s}.pem" for c in clients for s in ("", "-key")),
            folder / "cluster.conf"]
    if taken := [p for p in plan if p.exists()]:
        raise FileExistsError(f"{taken[0]} exists: this writes a new PKI and route credential only into an empty folder")
    written: list[Path] = []

    def put(path: Path, text: str) -> None:
        _write_private(path, text)
        written.append(path)

    client_key = ec.generate_private_key(ec.SECP256R1())
    client_ca = _issue("Principal Gateway client CA", client_key, None, days=days)
    route_key = ec.generate_private_key(ec.SECP256R1())
    route_ca = _issue("Principal Gateway route CA", route_key, None, days=days)
    put(folder / "ca" / "client-ca-key.pem", _key_pem(client_key))
    put(folder / "ca" / "route-ca-key.pem", _key_pem(route_key))
    put(folder / "tls" / "ca.pem", _cert_pem(client_ca))
    put(folder / "tls" / "route-ca.pem", _cert_pem(route_ca))

    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _issue("nats", server_key, (client_ca, client_key), days=days,
                    usages=(ExtendedKeyUsageOID.SERVER_AUTH,), hosts=tuple(dict.fromkeys([*hosts, *server_names])))
    put(folder / "tls" / "server.pem", _cert_pem(server))
    put(folder / "tls" / "server-key.pem", _key_pem(server_key))
    # A route connection is both: a node dials (client) and is dialled (server) with the same pair.
    node_key = ec.generate_private_key(ec.SECP256R1())
    node = _issue("nats route", node_key, (route_ca, route_key), days=days,
                  usages=(ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH), hosts=hosts)
    put(folder / "tls" / "route.pem", _cert_pem(node))
    put(folder / "tls" / "route-key.pem", _key_pem(node_key))
    for name in clients:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(name, key, (client_ca, client_key), days=days, usages=(ExtendedKeyUsageOID.CLIENT_AUTH,))
        put(folder / "clients" / f"{name}.pem", _cert_pem(cert))
        put(folder / "clients" / f"{name}-key.pem", _key_pem(key))
    put(folder / "cluster.conf", cluster_conf([_split_node(n) for n in nodes], os.urandom(32).hex()))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent / "secrets",
                   help="the recipe's secrets folder (default: deploy/production/secrets)")
    p.add_argument("--node", action="append", metavar="HOST[:PORT]",
                   help=f"a NATS node as the others reach it, route port {ROUTE_PORT} unless given "
                        f"(repeat; default: {' '.join(NODES)})")
    p.add_argument("--server-name", action="append", default=[], metavar="HOST",
                   help="one more name for the client port's certificate, e.g. a Kubernetes Service (repeat)")
    p.add_argument("--client", action="append", metavar="NAME",
                   help=f"a client certificate to issue (repeat; default: {' '.join(SERVICES)})")
    p.add_argument("--days", type=int, default=825, help="validity of every certificate (default: 825)")
    args = p.parse_args(argv)
    try:
        written = make_secrets(args.dir, nodes=args.node or list(NODES), clients=args.client or list(SERVICES),
                               server_names=args.server_name, days=args.days)
    except FileExistsError as e:
        print(f"make_secrets: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    print(f"move {args.dir / 'ca'} offline: no node or service needs the CA keys", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
