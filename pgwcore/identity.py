"""Parties of the bus and their NATS credentials (DESIGN §7).

A *party* is one NATS user: an agent, a principal, a service (gateway,
signer, registrar, notifier, or ``services`` = all of them in one ``pgw up`` process) or
an ops user. Each party authenticates with its own nkey (Ed25519) and uses its
own inbox prefix ``_INBOX_{role}_{name}``, so the server can confine replies
to their requester (DESIGN §7 "each user gets its own inbox prefix").

The credentials file is a *decorated nkey seed*: the seed between the usual
``BEGIN USER NKEY SEED`` markers plus ``#`` header lines naming the party and
its inbox prefix. ``nats --nkey FILE`` reads it as is (the Go nkeys parser
picks the ``SU...`` line), and ``pgwcore.connect.connect`` reads the inbox
prefix from the header. Its patterns live in ``subjects/creds.py``, where an
agent's own client reads the file too. Files are created 0600 in a 0700 folder and their
content is never logged.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import nkeys

from subjects.creds import HEADER_RE, SEED_RE
from subjects.errors import CredentialsError
from subjects.names import check_token
from subjects.replies import ROLES as REPLY_ROLES

# "slack": the Slack surface of one principal (name = the principal; docs/surfaces.md).
# "executor": executor:{kind}, the service that carries out one kind of gated action (docs/gate.md).
# "responder": responder:{service}, the connection a service takes requests on and answers them from
# (name = the service's; pgwcore/respond.py, docs/security.md "Replies").
Role = Literal["agent", "principal", "service", "ops", "audit", "slack", "executor", "responder"]
ROLES = cast("tuple[Role, ...]", REPLY_ROLES)  # one list: the reply rule names the same roles (subjects/replies.py)
SERVICE_NAMES = ("gateway", "signer", "registrar", "notifier", "services")

_SEED_BEGIN = "-----BEGIN USER NKEY SEED-----"
_SEED_END = "------END USER NKEY SEED------"


@dataclass(frozen=True, slots=True)
class Party:
    """One NATS user of the bus: a role and a subject-token name."""

    role: Role
    name: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown party role {self.role!r}")
        check_token(self.name, f"{self.role} name")

    @property
    def inbox_prefix(self) -> str:
        # One token, so `_INBOX_agent_a.>` never overlaps `_INBOX_agent_a_b.>`.
        return f"_INBOX_{self.role}_{self.name}"

    @property
    def label(self) -> str:
        return f"{self.role}:{self.name}"

    @property
    def filename(self) -> str:
        return f"{self.role}-{self.name}.creds"

    @classmethod
    def parse(cls, label: str) -> Party:
        """``agent:A`` / ``principal:P`` / ``service:gateway`` / ``ops:NAME``."""
        role, sep, name = label.partition(":")
        if not sep:
            raise ValueError(f"party {label!r} must be written ROLE:NAME (e.g. agent:planner)")
        return cls(role, name)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Credentials:
    """A party's credentials as read from its file (the seed stays in memory only)."""

    party: Party | None
    public_nkey: str
    seed: str
    inbox_prefix: str | None
    path: Path

    def __repr__(self) -> str:  # never print the seed
        return f"Credentials(party={self.party!r}, public_nkey={self.public_nkey!r}, path={str(self.path)!r})"


def new_seed() -> str:
    """A fresh user nkey seed (``SU...``)."""
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()


def public_of(seed: str) -> str:
    kp = nkeys.from_seed(bytearray(seed.encode()))
    try:
        return kp.public_key.decode()
    finally:
        kp.wipe()


def render_creds(party: Party, seed: str) -> str:
    return "\n".join(
        [
            f"# Principal Gateway NATS credentials for {party.role} {party.name!r} (docs/security.md).",
            "# Secret: keep it mode 0600. nats CLI: nats --nkey THIS_FILE --inbox-prefix PREFIX",
            f"# pgw-party: {party.role} {party.name}",
            f"# inbox-prefix: {party.inbox_prefix}",
            f"# public-nkey: {public_of(seed)}",
            _SEED_BEGIN,
            seed,
            _SEED_END,
            "",
        ]
    )


def write_private(path: Path, text: str, *, private_dir: bool = True) -> None:
    """Write ``text`` to ``path`` atomically, readable by its owner alone from the first byte: a new file
    made 0600 beside it (``mkstemp``), then renamed over it, and removed if the write fails. Its folder is
    made 0700 too, unless ``private_dir`` is False (a folder the user named, ``pgw mcp-gate init --out``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if private_dir:
        os.chmod(path.parent, 0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_creds(path: str | os.PathLike[str]) -> Credentials:
    """Parse a decorated nkey seed file (or a bare seed); refuse group/world-readable files."""
    p = Path(path)
    try:
        mode = p.stat().st_mode & 0o777
        text = p.read_bytes().decode("utf-8", "replace")  # a seed is ASCII; junk must not raise
    except OSError as e:
        raise CredentialsError(p, f"cannot read ({e.strerror})") from e
    if mode & 0o077:
        raise CredentialsError(p, f"has mode {mode:o}; it must be 0600 (chmod 600 {p})")
    m = SEED_RE.search(text)
    if not m:
        raise CredentialsError(p, "holds no user nkey seed (SU...)")
    seed = m.group(1)
    try:
        public = public_of(seed)
    except Exception as e:
        raise CredentialsError(p, "the nkey seed is invalid") from e
    headers = {k: v for k, v in HEADER_RE.findall(text)}
    party: Party | None = None
    if "pgw-party" in headers:
        role, _, name = headers["pgw-party"].partition(" ")
        try:
            party = Party(role, name)  # type: ignore[arg-type]
        except ValueError as e:
            raise CredentialsError(p, f"bad pgw-party header: {e}") from e
    return Credentials(party, public, seed, headers.get("inbox-prefix"), p)


def load_or_create_creds(creds_dir: Path, party: Party) -> Credentials:
    """The party's credentials, created (0600) on first use and reused afterwards."""
    path = Path(creds_dir) / party.filename
    if not path.exists():
        write_private(path, render_creds(party, new_seed()))
    creds = read_creds(path)
    if creds.party != party:
        raise CredentialsError(path, f"belongs to {creds.party!r}, expected {party!r}")
    return creds


def rotate_creds(creds_dir: Path, party: Party) -> Credentials:
    """Replace the party's nkey: the old one stops working once the server reloads the block."""
    path = Path(creds_dir) / party.filename
    write_private(path, render_creds(party, new_seed()))
    return read_creds(path)


def creds_connect_options(path: str | os.PathLike[str]) -> dict[str, object]:
    """nats-py ``connect`` options for a credentials file of either format.

    A standard JWT ``.creds`` file (operator mode) is passed through as
    ``user_credentials`` with the party's own ``inbox_prefix`` from its header or
    its JWT's name (:func:`jwt_creds_inbox_prefix`); a pgw decorated nkey seed
    gives ``nkeys_seed_str`` and the party's own ``inbox_prefix`` (DESIGN §7).
    """
    p = Path(path)
    try:
        head = p.read_text(errors="replace")
    except OSError as e:
        raise CredentialsError(p, f"cannot read ({e.strerror})") from e
    if "BEGIN NATS USER JWT" in head:
        opts: dict[str, object] = {"user_credentials": str(p)}
        prefix = jwt_creds_inbox_prefix(head)
        if prefix:
            opts["inbox_prefix"] = prefix
        return opts
    creds = read_creds(p)
    opts = {"nkeys_seed_str": creds.seed}
    if creds.inbox_prefix:
        opts["inbox_prefix"] = creds.inbox_prefix
    return opts


_JWT_RE = re.compile(r"-----BEGIN NATS USER JWT-----\s*([A-Za-z0-9_\-.]+)\s*------END NATS USER JWT------")


def party_of_jwt_name(name: str) -> Party | None:
    """The party a user JWT's ``name`` claim names: ``role:name`` or ``role-name`` (nsc's naming), else None."""
    for sep in (":", "-"):
        role, found, rest = name.partition(sep)
        if found and role in ROLES:
            try:
                return Party(role, rest)  # type: ignore[arg-type]
            except ValueError:
                return None
    return None


def jwt_creds_inbox_prefix(text: str) -> str | None:
    """The reply-inbox prefix of a JWT ``.creds`` file (operator mode, DESIGN §7).

    The ``# inbox-prefix:`` header (``pgw accounts`` writes it) wins; otherwise the
    prefix follows from the user JWT's ``name`` claim when it names a party
    (``agent:planner`` or ``agent-planner`` as ``nsc add user --name`` allows), so a
    user minted with nsc gets the same confined inbox as one minted by pgw. None
    when neither says: the connection then uses nats-py's shared ``_INBOX``, which
    the generated permissions do not grant.
    """
    headers = {k: v for k, v in HEADER_RE.findall(text)}
    if "inbox-prefix" in headers:
        return headers["inbox-prefix"]
    m = _JWT_RE.search(text)
    if not m:
        return None
    try:
        payload = m.group(1).split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return None
    party = party_of_jwt_name(str(claims.get("name") or ""))
    return party.inbox_prefix if party else None
