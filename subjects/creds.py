"""A party's credentials file, read to connect as that party (docs/security.md, docs/contract.md §1).

``pgw up`` and ``pgw creds`` write one file per party, ``{data}/creds/{role}-{name}.creds``:
a *decorated nkey seed*, the seed between ``BEGIN USER NKEY SEED`` markers with ``#``
header lines naming the party (``pgw-party``) and its inbox prefix. Operator mode
(``pgw accounts``, nsc) gives a standard JWT ``.creds`` file instead. Either way a
party replies on its own inbox prefix (``subjects.replies.inbox_prefix``), the only one
the server lets it subscribe to; nats-py's default ``_INBOX`` is refused.

The platform (``pgwcore.identity``) writes and checks these files with the same
patterns; an agent or a surface needs only :func:`connect_options`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from subjects.errors import CredentialsError
from subjects.replies import inbox_prefix

SEED_RE = re.compile(r"^\s*(SU[A-Z2-7]{50,})\s*$", re.MULTILINE)
HEADER_RE = re.compile(r"^#\s*(pgw-party|inbox-prefix|public-nkey):\s*(\S+(?:\s\S+)?)\s*$", re.MULTILINE)
JWT_MARK = "BEGIN NATS USER JWT"


def connect_options(path: str | os.PathLike[str], role: str, name: str) -> dict[str, object]:
    """nats-py ``connect`` options to connect as party ``role:name`` with its credentials file ``path``.

    A file that names another party (its ``pgw-party`` header) is refused here, in one
    line, rather than by the server later as a permissions violation.
    """
    p = Path(path)
    try:
        text = p.read_text(errors="replace")
    except OSError as e:
        raise CredentialsError(p, f"cannot read ({e.strerror})") from None
    opts: dict[str, object] = {"inbox_prefix": inbox_prefix(role, name)}
    if JWT_MARK in text:
        return {**opts, "user_credentials": str(p)}
    seed = SEED_RE.search(text)
    if not seed:
        raise CredentialsError(p, "holds no user nkey seed (SU...)")
    headers = dict(HEADER_RE.findall(text))
    owner = headers.get("pgw-party")
    if owner is not None and owner.split() != [role, name]:
        raise CredentialsError(p, f"is the credentials of {owner.replace(' ', ':', 1)}, not of {role}:{name}")
    return {**opts, "nkeys_seed_str": seed.group(1)}
