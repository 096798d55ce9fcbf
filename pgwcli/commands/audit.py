"""``pgw mandate revoke`` and ``pgw audit``: requests to the kernel on the bus.

``pgw mandate revoke JTI`` signs a revocation (gateway/kernel/revocation.py)
with the dev issuer key of the data folder, or ``--key`` (a trusted issuer's
or a configured revoker's private key), and sends it to
``{prefix}.kernel.revoke``; it prints the reply and exits 0 when recorded.

``pgw audit session ID --agent A`` / ``pgw audit idp ID`` ask the kernel for
the Session Audit Record or one IDP's record (gateway/kernel/audit.py); they
run with the credentials of an audit principal, ``audit-{NAME}.creds`` for
``--auditor NAME`` (pgwcli/creds.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import msgspec
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from pgwcore.config import Config
from pgwcore.connect import connect


def register(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser("audit", help="Audit Principal queries to the kernel (spec 003 §4.2, §9)")
    asub = a.add_subparsers(dest="audit_command", metavar="WHAT")
    s = asub.add_parser("session", help="the Session Audit Record of one session")
    s.add_argument("id", help="session_id")
    s.add_argument("--agent", required=True, help="the agent whose session it is")
    i = asub.add_parser("idp", help="one IDP's record: its submission and every event that names it")
    i.add_argument("id", help="idp_id")
    for p in (s, i):
        p.add_argument("--auditor", default="auditor", help="the audit principal asking (its credentials' name; recorded in the event log)")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the kernel")
        p.add_argument("--from-seq", type=int, default=0,
                       help="start at this log sequence (a long record names next_from_seq)")
        p.set_defaults(handler=audit_command)


def _load_private(path: str) -> Any:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    return key


async def _ask(config: Config, name: str, subject: str, body: bytes, timeout: float, who_may: str) -> Any:
    """One request to the kernel on a connection of its own; no answer is a clear error naming the two likely
    causes, not a traceback.

    The server drops a publish these credentials may not make without telling the request, so a refused
    permission and a gateway that is not running both end in the timeout."""
    from nats.errors import NoRespondersError

    nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name=name, once=True)
    try:
        return await nc.request(subject, body, timeout=timeout)
    except NoRespondersError:
        raise SystemExit(f"pgw: no gateway answers on {subject} at {config.nats_url}: start `pgw up` "
                         "(or `pgw gateway`) with the kernel") from None
    except TimeoutError:  # nats' own TimeoutError is one
        raise SystemExit(f"pgw: no answer on {subject} within {timeout:g} s: no gateway is running at "
                         f"{config.nats_url}, or these credentials may not send it: {who_may}") from None
    finally:
        await nc.drain()


async def revoke_command(args: argparse.Namespace, config: Config) -> int:
    from gateway.kernel.mandate import DEV_ISSUER_ROLE
    from gateway.kernel.revocation import sign_revocation
    from pgwcore.keys import kid_of, load_or_create
    from subjects.kernelops import RevokeRequest, revoke_reply_decoder, revoke_subject

    if args.key:
        try:
            priv = _load_private(args.key)
        except (OSError, ValueError) as e:
            raise SystemExit(f"pgw: cannot read private key {args.key}: {e}") from None
        if args.kid:
            kid = args.kid
        elif isinstance(priv, ed25519.Ed25519PrivateKey):
            kid = kid_of(priv.public_key())
        else:
            raise SystemExit("pgw: --kid is required for a non-Ed25519 key")
    else:
        dev = load_or_create(config.data_path, DEV_ISSUER_ROLE, keys_dir=config.keys_path)
        priv, kid = dev.private, args.kid or dev.kid
    token = sign_revocation(priv, kid, args.jti, reason=args.reason)
    msg = await _ask(config, "pgw-mandate-revoke", revoke_subject(config.subjects.prefix), msgspec.json.encode(RevokeRequest(token)), args.timeout,
                     "ops users may send revocations (`[security] ops = [\"NAME\"]`, then `--as ops:NAME`)")
    reply = revoke_reply_decoder.decode(msg.data)
    print(json.dumps(msgspec.to_builtins(reply), indent=2))
    return 0 if reply.ok else 1


async def audit_command(args: argparse.Namespace, config: Config) -> int:
    from subjects.kernelops import AuditRequest, audit_reply_decoder, audit_subject

    if args.audit_command == "session":
        req = AuditRequest(kind="session", id=args.id, agent=args.agent, from_seq=args.from_seq)
    else:
        req = AuditRequest(kind="idp", id=args.id, from_seq=args.from_seq)
    msg = await _ask(config, "pgw-audit", audit_subject(config.subjects.prefix, args.auditor), msgspec.json.encode(req), args.timeout,
                     f"only the auditor {args.auditor!r} may ask (`[security] auditors`, audit-{args.auditor}.creds)")
    reply = audit_reply_decoder.decode(msg.data)
    print(json.dumps(msgspec.to_builtins(reply), indent=2))
    return 0 if reply.ok else 1
