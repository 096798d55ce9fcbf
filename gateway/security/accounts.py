"""Operator mode: NATS JWT accounts and users minted from the permission builders.

Operations teams run nats-server in *operator mode* (decentralized JWT
authentication): the server trusts one operator key; accounts are signed by the
operator, users by their account, and a user JWT carries that user's
permissions. Nothing about a user is configured on the server, so adding an
agent or a principal is minting one user JWT: no server reload.

This module mints, from one operator seed and one account seed per tenant:

- the operator JWT and a system account (nats-server wants one for its own
  ``$SYS`` traffic);
- one account JWT per tenant (one NATS account per organization is the tenancy
  model: subjects, streams and buckets of two accounts never meet), with
  JetStream enabled and no limits;
- one user ``.creds`` file per party, whose JWT carries exactly
  :func:`gateway.security.permissions.permissions_for` (the same lists the
  nkey ``authorization`` block grants), and whose ``name`` is the party label
  ``role:name``. The file also carries the ``# inbox-prefix:`` header, so a
  pgw process reads its own reply inbox from it; a JWT minted elsewhere (``nsc
  add user --name agent-planner``) gets the same prefix from its name
  (``pgwcore.identity.inbox_prefix_of_jwt``). The per-party inbox prefix is
  what keeps replies confined to their requester (DESIGN §7); a JWT user
  without it would need ``_INBOX.>`` and could read every party's replies.

The server side is a config block (``operator``, ``system_account``, a
``resolver: MEMORY`` with every account preloaded), written next to the
seeds. A cluster takes the same block on every node.

The JWT encoding is NATS JWT v2 (``github.com/nats-io/jwt/v2``): a JSON header
``{"typ":"JWT","alg":"ed25519-nkey"}``, JSON claims with ``jti`` (base32 of
SHA-512/256 over the claims with an empty ``jti``), ``iat``, ``iss`` (the
signer's public nkey), ``sub``, ``name`` and the ``nats`` object; both parts
base64url without padding, signed with the issuer's Ed25519 nkey.

Seeds are kept in ``{data}/accounts/`` (0600 files in a 0700 folder) and never
logged. The ``nsc`` equivalent is documented in docs/operations.md.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nkeys

from gateway.security.permissions import Permissions, permissions_for
from pgwcore.identity import CredentialsError, Party, public_of, write_private
from subjects.names import check_token

if TYPE_CHECKING:
    from pgwcore.config import Config

SERVER_BLOCK_FILE = "operator.conf"
SYSTEM_ACCOUNT = "SYS"

_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_UNLIMITED = -1


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=False).encode()


def new_seed(prefix: int) -> str:
    """A fresh nkey seed of the given kind (``nkeys.PREFIX_BYTE_OPERATOR`` / ``_ACCOUNT`` / ``_USER``)."""
    return nkeys.encode_seed(os.urandom(32), prefix).decode()


def encode_jwt(claims: dict[str, Any], issuer_seed: str) -> str:
    """Sign ``claims`` (``jti``, ``iat`` and ``iss`` filled in here) as a NATS JWT v2."""
    body = dict(claims)
    body["iat"] = int(body.get("iat") or time.time())
    body["iss"] = public_of(issuer_seed)
    body["jti"] = ""
    # nats-io/jwt v2 ClaimsData.hash: SHA-512/256 over the claims with an empty jti, base32 unpadded.
    digest = hashlib.new("sha512_256", _json(body)).digest()
    body["jti"] = base64.b32encode(digest).decode().rstrip("=")
    signing_input = f"{_b64(_json(_HEADER))}.{_b64(_json(body))}"
    kp = nkeys.from_seed(bytearray(issuer_seed.encode()))
    try:
        sig = kp.sign(signing_input.encode())
    finally:
        kp.wipe()
    return f"{signing_input}.{_b64(sig)}"


def decode_jwt_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT, unverified (the server verifies; we read the name and the permissions)."""
    try:
        payload = token.split(".")[1]
        return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError) as e:
        raise ValueError(f"not a JWT: {type(e).__name__}") from None


def operator_jwt(operator_seed: str, system_account: str, name: str = "pgw") -> str:
    pub = public_of(operator_seed)
    return encode_jwt(
        {"name": name, "sub": pub, "nats": {"system_account": system_account, "type": "operator", "version": 2}},
        operator_seed,
    )


def account_jwt(operator_seed: str, account_public: str, name: str, *, jetstream: bool = True) -> str:
    limits: dict[str, Any] = {
        "subs": _UNLIMITED, "data": _UNLIMITED, "payload": _UNLIMITED, "imports": _UNLIMITED,
        "exports": _UNLIMITED, "wildcards": True, "conn": _UNLIMITED, "leaf": _UNLIMITED,
    }
    if jetstream:  # JetStream is on for an account whose storage limits are non-zero
        limits |= {"mem_storage": _UNLIMITED, "disk_storage": _UNLIMITED, "streams": _UNLIMITED,
                   "consumer": _UNLIMITED}
    return encode_jwt(
        {"name": name, "sub": account_public,
         "nats": {"limits": limits, "default_permissions": {"pub": {}, "sub": {}}, "type": "account", "version": 2}},
        operator_seed,
    )


def user_claims_nats(perms: Permissions) -> dict[str, Any]:
    """The ``nats`` object of a user JWT granting exactly ``perms``."""

    def lists(allow: tuple[str, ...], deny: tuple[str, ...]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        if allow:
            out["allow"] = list(allow)
        if deny:
            out["deny"] = list(deny)
        return out

    body: dict[str, Any] = {
        "pub": lists(perms.pub_allow, perms.pub_deny),
        "sub": lists(perms.sub_allow, perms.sub_deny),
        "subs": _UNLIMITED, "data": _UNLIMITED, "payload": _UNLIMITED,
        "type": "user", "version": 2,
    }
    if perms.allow_responses:
        # The nkey block's `allow_responses: true`: one reply per request received (nats-server defaults).
        body["resp"] = {"max": 1, "ttl": 0}
    return body


def user_jwt(account_seed: str, user_public: str, party: Party, perms: Permissions) -> str:
    return encode_jwt({"name": party.label, "sub": user_public, "nats": user_claims_nats(perms)}, account_seed)


def render_user_creds(party: Party, token: str, user_seed: str) -> str:
    """A standard NATS ``.creds`` file, with pgw's party and inbox headers (nats-py and the nats CLI read it as is)."""
    return "\n".join(
        [
            f"# Principal Gateway NATS credentials (operator mode) for {party.role} {party.name!r}.",
            f"# Secret: keep it mode 0600. nats CLI: nats --creds THIS_FILE --inbox-prefix {party.inbox_prefix}",
            f"# pgw-party: {party.role} {party.name}",
            f"# inbox-prefix: {party.inbox_prefix}",
            "-----BEGIN NATS USER JWT-----",
            token,
            "------END NATS USER JWT------",
            "",
            "************************* IMPORTANT *************************",
            "NKEY Seed printed below can be used to sign and prove identity.",
            "NKEYs are sensitive and should be treated as secrets.",
            "",
            "-----BEGIN USER NKEY SEED-----",
            user_seed,
            "------END USER NKEY SEED------",
            "",
            "*************************************************************",
            "",
        ]
    )


def _load_or_create_seed(path: Path, prefix: int, *, create: bool) -> str:
    if path.exists():
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise CredentialsError(path, f"has mode {mode:o}; it must be 0600 (chmod 600 {path})")
        seed = path.read_text().strip()
        try:
            public_of(seed)
        except Exception as e:
            raise CredentialsError(path, "holds no valid nkey seed") from e
        return seed
    if not create:
        raise CredentialsError(path, "is missing (pass create=True, or `pgw accounts init`, to make it)")
    seed = new_seed(prefix)
    write_private(path, seed + "\n")
    return seed


@dataclass(frozen=True)
class OperatorAuth:
    """What a server and its parties need in operator mode; the same shape as ``EmbeddedAuth``."""

    server_block: str
    service_creds: Path
    party_creds_dir: Path
    block_path: Path
    parties: tuple[Party, ...]
    tenant: str
    account_public: str

    def creds_for(self, party: Party) -> Path:
        return self.party_creds_dir / party.filename


class Operator:
    """The operator, the system account and the tenants' accounts kept under one folder.

    Layout: ``{root}/operator.seed``, ``{root}/account-SYS.seed``,
    ``{root}/account-{tenant}.seed``, ``{root}/{tenant}/creds/{role}-{name}.creds``
    and the server block ``{root}/operator.conf``. Seeds are created on first use
    (``create=True``, the development default) or must exist.
    """

    def __init__(self, root: Path, *, create: bool = True) -> None:
        self.root = Path(root)
        self.create = create
        self.seed = _load_or_create_seed(self.root / "operator.seed", nkeys.PREFIX_BYTE_OPERATOR, create=create)
        self.public = public_of(self.seed)
        self.system_seed = self.account_seed(SYSTEM_ACCOUNT)

    def account_seed(self, tenant: str) -> str:
        check_token(tenant, "tenant")
        return _load_or_create_seed(self.root / f"account-{tenant}.seed", nkeys.PREFIX_BYTE_ACCOUNT,
                                    create=self.create)

    def account_public(self, tenant: str) -> str:
        return public_of(self.account_seed(tenant))

    def tenants(self) -> list[str]:
        return sorted(p.name[len("account-"):-len(".seed")] for p in self.root.glob("account-*.seed")
                      if p.name != f"account-{SYSTEM_ACCOUNT}.seed")

    def server_block(self) -> str:
        """The nats-server config block trusting this operator, every account preloaded (resolver MEMORY)."""
        system_public = public_of(self.system_seed)
        preload = {system_public: account_jwt(self.seed, system_public, SYSTEM_ACCOUNT, jetstream=False)}
        names = {system_public: SYSTEM_ACCOUNT}
        for t in self.tenants():
            pub = public_of(self.account_seed(t))
            preload[pub] = account_jwt(self.seed, pub, t)
            names[pub] = t
        lines = [
            "# Generated by `pgw accounts` (docs/operations.md): operator mode. Users are not listed here;",
            "# each carries a user JWT signed by its account, so adding one needs no reload.",
            f"operator: {json.dumps(operator_jwt(self.seed, system_public))}",
            f"system_account: {json.dumps(system_public)}",
            "resolver: MEMORY",
            "resolver_preload: {",
            *(f"  # account {names[k]}\n  {json.dumps(k)}: {json.dumps(v)}" for k, v in preload.items()),
            "}",
        ]
        return "\n".join(lines) + "\n"

    def mint_user(self, tenant: str, prefix: str, party: Party, path: Path, perms: Permissions | None = None) -> Path:
        """Write ``party``'s creds file for ``tenant`` with the permissions of ``permissions_for``
        (or ``perms``, for a user outside the contract's roles, e.g. a test's probe).

        A user seed already in the file is kept (its JWT is re-signed with today's permissions).
        """
        user_seed = ""
        if path.exists():
            text = path.read_text(errors="replace")
            for line in text.splitlines():
                if line.strip().startswith("SU"):
                    user_seed = line.strip()
        if not user_seed:
            user_seed = new_seed(nkeys.PREFIX_BYTE_USER)
        token = user_jwt(self.account_seed(tenant), public_of(user_seed), party,
                         perms if perms is not None else permissions_for(prefix, party))
        write_private(path, render_user_creds(party, token, user_seed))
        return path

    def provision(self, tenant: str, prefix: str, parties: list[Party], *, service: str = "services") -> OperatorAuth:
        """The tenant's account, one creds file per party, and the server block (all written 0600)."""
        self.account_seed(tenant)
        creds = self.root / tenant / "creds"
        for p in parties:
            self.mint_user(tenant, prefix, p, creds / p.filename)
        block = self.server_block()
        block_path = self.root / SERVER_BLOCK_FILE
        write_private(block_path, block)
        return OperatorAuth(block, creds / Party("service", service).filename, creds, block_path, tuple(parties),
                            tenant, public_of(self.account_seed(tenant)))


def operator_auth(config: Config, *, tenant: str = "pgw", root: Path | None = None,
                  service: str = "services", create: bool = True) -> OperatorAuth:
    """Operator-mode counterpart of ``embedded_auth``: the configuration's parties as JWT users of ``tenant``."""
    from gateway.security import parties

    op = Operator(root or config.data_path / "accounts", create=create)
    return op.provision(tenant, config.prefix, parties(config), service=service)
