"""``pgw approvals``: a principal's standing approvals, listed and revoked (docs/gate.md "Standing approvals").

It speaks ``kernel.approvals.{P}`` with P's own credentials, as her surfaces
do (``--creds FILE``, else ``{creds_dir}/principal-{P}.creds`` when ``pgw
creds`` made one): the server lets only P ask it, and the kernel answers only
about P's own approvals.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

import msgspec

from subjects.names import principal_token

if TYPE_CHECKING:
    from pgwcore.config import Config

def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "approvals",
        help="a principal's standing approvals: list them, revoke one",
        description="List the principal's live standing approvals (what she allowed with 'Allow for this "
        "session' or 'Allow for an hour' on a gated call's card), or revoke one by its scope id: the next "
        "call it covered asks her again.",
    )
    p.add_argument("--principal", "-p", required=True, help="principal handle (alice or ~alice)")
    p.add_argument("--revoke", metavar="SCOPE_ID", help="revoke this standing approval (an id from the list)")
    p.add_argument("--json", action="store_true", help="print the kernel's reply (ApprovalsReply) as JSON")
    p.set_defaults(handler=run_approvals)


async def run_approvals(args: argparse.Namespace, config: Config) -> int:
    from consumers.surfaces.text import describe_standing as describe
    from pgwcore.connect import connect
    from subjects.client import Surface

    principal = principal_token(args.principal)
    nc = await connect(config.nats_url, creds=config.creds, tls=config.tls.files(), name=f"pgw-approvals-{principal}")
    try:
        reply = await Surface(nc, principal, prefix=config.prefix, presence=False).approvals(revoke=args.revoke)
    finally:
        await nc.drain()
    if args.json:
        print(msgspec.json.encode(reply).decode())
    elif not reply.ok:
        r = reply.refusal
        print(f"pgw approvals: {r.reason if r else 'refused'}" + (f" ({r.code})" if r else ""), file=sys.stderr)
    elif reply.revoked is not None:
        said = "was already revoked or had expired" if reply.already else "revoked"
        print(f"{reply.revoked.scope_id} {said}: {describe(reply.revoked)}")
        print("The next call it covered asks you again.")
    elif not reply.approvals:
        print(f"~{principal} has no standing approvals.")
    else:
        for a in reply.approvals:
            print(f"{a.scope_id}  {describe(a)}")
        print("Revoke one with: pgw approvals --principal " + principal + " --revoke SCOPE_ID")
    return 0 if reply.ok else 1
