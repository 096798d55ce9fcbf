"""``pgw accounts``: operator mode (NATS JWT accounts) for a NATS that operations teams run.

    pgw accounts                         the operator, the tenant's account, one user per party, the server block
    pgw accounts --tenant acme           the same for another organization (one NATS account each)
    pgw accounts --block                 print the server block (operator, system account, resolver preload)
    pgw accounts --user agent:NAME       mint one user JWT (no server reload); --out FILE to choose where
    pgw accounts --no-create             refuse to make a missing operator or account seed

Seeds live in ``--dir`` (default ``{data_dir}/accounts``), 0600; the creds files
in ``{dir}/{tenant}/creds/``. docs/operations.md has the ``nsc`` equivalent.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.security import parties
from gateway.security.accounts import SERVER_BLOCK_FILE, Operator
from pgwcore.config import Config
from pgwcore.identity import CredentialsError, Party


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("accounts", help="operator-mode NATS: account and user JWTs for every party (no server reload)")
    p.add_argument("--dir", help="where the operator and account seeds live (default: {data_dir}/accounts)")
    p.add_argument("--tenant", default="pgw", help="the organization's NATS account (default: pgw)")
    p.add_argument("--block", action="store_true", help="print the nats-server operator block to stdout")
    p.add_argument("--user", metavar="ROLE:NAME", help="mint this one user's creds file")
    p.add_argument("--out", help="with --user: the creds file to write (default: {dir}/{tenant}/creds/ROLE-NAME.creds)")
    p.add_argument("--no-create", action="store_true", help="refuse to create a missing operator or account seed")
    p.set_defaults(handler=handle)


async def handle(args: argparse.Namespace, config: Config) -> int:
    root = Path(args.dir) if args.dir else config.data_path / "accounts"
    try:
        op = Operator(root, create=not args.no_create)
        if args.user:
            party = Party.parse(args.user)
            out = Path(args.out) if args.out else root / args.tenant / "creds" / party.filename
            op.mint_user(args.tenant, config.prefix, party, out)
            print(f"{party.label}\n  credentials   {out}\n  inbox prefix  {party.inbox_prefix}\n"
                  f"  account       {args.tenant} ({op.account_public(args.tenant)})\n"
                  "  signed by the account key: no server reload needed")
            return 0
        auth = op.provision(args.tenant, config.prefix, parties(config))
    except (CredentialsError, ValueError) as e:
        print(f"pgw accounts: {e}", file=sys.stderr)
        return 2
    if args.block:
        sys.stdout.write(auth.server_block)
        return 0
    print(f"operator            {op.public}")
    print(f"account {args.tenant:<11} {auth.account_public}")
    print(f"server block        {root / SERVER_BLOCK_FILE}  (include it in nats-server.conf; every node of a cluster)")
    print(f"credentials folder  {auth.party_creds_dir}")
    print()
    print(f"{'party':<28} inbox prefix")
    for party in auth.parties:
        print(f"{party.label:<28} {party.inbox_prefix}")
    return 0
