"""``pgw creds``: per-party NATS credentials and the nats-server authorization block (DESIGN §7).

    pgw creds                      create missing credentials, list every party
    pgw creds --block              print the authorization block (for a deployed server)
    pgw creds --out DIR            write credentials and the block into DIR instead
    pgw creds --rotate agent:NAME  replace one party's nkey (restart/reload the server after)
    pgw creds --show principal:P   print one party's credentials file path and inbox prefix
    pgw creds --quickstart         also the parties `pgw up --quickstart` (`make run`) binds

Seeds are never printed; the files are 0600 in a 0700 folder.
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from gateway.security import Party, embedded_auth, read_creds, rotate_creds
from pgwcore.config import Config


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("creds", help="generate per-party NATS credentials and the server authorization block")
    p.add_argument("--out", help="credentials folder (default: security.creds_dir or {data_dir}/creds)")
    p.add_argument("--block", action="store_true", help="print the nats-server authorization block to stdout")
    p.add_argument("--rotate", metavar="ROLE:NAME", action="append", default=[],
                   help="replace this party's nkey (repeatable); the old key stops working once the server reloads")
    p.add_argument("--show", metavar="ROLE:NAME", help="print where this party's credentials are and its inbox prefix")
    p.add_argument("--quickstart", action="store_true",
                   help="the parties of `pgw up --quickstart` (what `make run` runs) where the configuration names none")
    p.set_defaults(handler=handle)


async def handle(args: argparse.Namespace, config: Config) -> int:
    if args.out:
        config = msgspec.structs.replace(config, security=msgspec.structs.replace(config.security, creds_dir=args.out))
    if args.quickstart:
        from pgwcli.commands.up import quickstart

        config = quickstart(config)
    try:
        rotate = [Party.parse(r) for r in args.rotate]
        show = Party.parse(args.show) if args.show else None
    except ValueError as e:
        print(f"pgw creds: {e}", file=sys.stderr)
        return 2
    auth = embedded_auth(config)
    for party in rotate:
        if party not in auth.parties:
            print(f"pgw creds: {party.label} is not a party of this configuration", file=sys.stderr)
            return 2
        rotate_creds(auth.party_creds_dir, party)
    if rotate:
        auth = embedded_auth(config)  # re-render the block with the new keys
    if args.block:
        sys.stdout.write(auth.server_block)
        return 0
    if show:
        if show not in auth.parties:
            print(f"pgw creds: {show.label} is not a party of this configuration", file=sys.stderr)
            return 2
        path = auth.creds_for(show)
        print(f"{show.label}\n  credentials   {path}\n  inbox prefix  {show.inbox_prefix}\n"
              f"  public nkey   {read_creds(path).public_nkey}")
        return 0
    print(f"credentials folder  {auth.party_creds_dir}")
    print(f"server block        {auth.block_path}")
    print()
    print(f"{'party':<28} {'inbox prefix':<36} public nkey")
    for party in auth.parties:
        pub = read_creds(auth.creds_for(party)).public_nkey
        print(f"{party.label:<28} {party.inbox_prefix:<36} {pub}")
    others = sorted(f.name for f in auth.party_creds_dir.glob("*.creds")
                    if f.name not in {p.filename for p in auth.parties})
    if others:
        # A `pgw up --quickstart` binds parties no configuration file names; the block just written lacks them.
        print(f"\nalso in the folder, not parties of this configuration: {', '.join(others)}"
              + ("" if args.quickstart else " (`pgw creds --quickstart` counts the quick start's)"))
    for party in rotate:
        print(f"\nrotated {party.label}: reload the server (`nats-server --signal reload` or restart `pgw up`)")
    return 0
