"""``pgw demo``: one binding moment end to end, every hop printed.

Against a running ``pgw up`` (``--server``), as its own pair of parties: the
agent ``--agent`` (``demo-agent``) with ``--creds`` or its file in the
credentials folder, and the principal ``--principal`` (``alice``) with hers
(pgwcli/creds.py). Only when nothing listens at the URL does it run against its
own embedded server and gateway in a temporary folder, and it says so; a
server that refuses the pair's credentials, or anything else that fails, is
said in one line and the demo exits 1 (a throw-away server would hide it).

The moment is printed as the terminal surface draws it (consumers/surfaces/text.py), with
the keys every surface uses: options by number from 1, ``[f]`` answer in my own words,
``[d]`` reject the question (docs/surfaces.md "One set of answer keys").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from consumers.surfaces.model import plan_item
from consumers.surfaces.text import render_plan
from gateway.security import Party, creds_dir, creds_party
from pgwcli.creds import CredsError, Need, mismatch, refusal
from pgwcore.config import Config
from pgwcore.connect import ConnectError, connect
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams
from subjects.client import Agent, Surface
from subjects.wire import BindingMomentItem, OptionChoice

DEMO_MOMENT = {
    "synopsis": "Renew the team's design-tool plan on the annual tier; it saves 18% over monthly.",
    "findings": [
        "The monthly plan renews on 1 December at 12 seats.",
        "Seat usage has been 11 or 12 every month this year.",
        "The annual tier is billed once and locks the per-seat price for 12 months.",
    ],
    "recommendations": [
        "Switch to the annual tier at 12 seats before 1 December.",
        "Set a reminder to review the seat count in June.",
    ],
    "offer": "Ask for detail on any item.",
    "question": {
        "stem": "How should the design-tool plan renew on 1 December?",
        "options": [
            {"label": "Renew annually at 12 seats", "reasoning": "Lowest cost if the team stays at its current size."},
            {"label": "Renew monthly at 12 seats", "reasoning": "Keeps the option to cut seats at any month's end."},
            {"label": "Let it lapse", "reasoning": "Only if the team is moving to another tool."},
        ],
        "recommended_idx": 0,
        "hatches": {"free_text": True, "dialogue": True},
    },
    "meta": {"decision_class": "purchase"},
}


def render(item: BindingMomentItem, width: int = 78) -> str:
    """The moment as the terminal surface shows it (spec 000 §9.1's invariants kept by the shared render
    model), so the demo teaches the keys of every surface; no colour, since it may go to a file."""
    return "\n".join(("  " + line).rstrip() for line in render_plan(plan_item(item), width=width - 2))


async def nothing_listens(url: str) -> bool:
    """True when no process accepts a TCP connection at the first server of ``url``: the one case in
    which the demo runs its own server (a server that is there but refuses is an error to show)."""
    first = urlsplit(url.split(",", maxsplit=1)[0].strip())
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(first.hostname or "127.0.0.1", first.port or 4222), 3)
    except (OSError, TimeoutError):
        return True
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


async def _settle(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` if it still runs and take its outcome: its own error (the reader of stdout
    gone) is then not logged as "never retrieved" after the command has ended on it."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def pair_creds(args: argparse.Namespace, config: Config) -> tuple[Need, Need, str | None, str | None]:
    """The demo's two parties and their files: the agent's (``--creds`` or its own), the principal's."""
    folder = creds_dir(config).resolve()
    agent, principal = Party("agent", args.agent), Party("principal", args.principal)
    need_a = Need(f"pgw demo --agent {agent.name}", (agent,), f"agent {agent.name}'s ({agent.filename})",
                  exact=agent, choose="--creds FILE (the agent's)")
    need_p = Need(f"pgw demo --principal {principal.name}", (principal,), f"~{principal.name}'s ({principal.filename})",
                  exact=principal, choose="--principal NAME")
    acreds = config.creds or (str(folder / agent.filename) if (folder / agent.filename).exists() else None)
    if config.creds and (party := creds_party(config.creds)) is not None and party != agent:
        raise CredsError(mismatch(need_a, config.creds, party, folder))
    pcreds = str(folder / principal.filename) if (folder / principal.filename).exists() else None
    return need_a, need_p, acreds, pcreds


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="send one realistic binding moment and answer it, printing each hop")
    p.add_argument("--agent", default="demo-agent")
    p.add_argument("--principal", default="alice")
    p.add_argument("--embedded", action="store_true", help="always use a private embedded server")
    p.set_defaults(handler=handle)


async def handle(args: argparse.Namespace, config: Config) -> int:
    async with contextlib.AsyncExitStack() as stack:
        nc = snc = None  # snc: the surface's own connection on a server enforcing per-party creds
        url = config.nats_url
        if not args.embedded:
            from pgwcli.creds import Chosen

            need_a, need_p, acreds, pcreds = pair_creds(args, config)
            folder = creds_dir(config).resolve()
            try:
                nc = await connect(url, creds=acreds, tls=config.tls.files(), name="pgw-demo", once=True, connect_timeout=3)
            except ConnectError as e:
                if e.auth:
                    raise CredsError(refusal(Chosen(need_a, acreds, creds_party(acreds) if acreds else None, folder), url, e.why)) from None
                if not await nothing_listens(url):
                    raise  # something is there and the connection failed all the same: said as it is
            if nc is not None:
                stack.push_async_callback(nc.drain)
                if acreds and not pcreds:
                    raise CredsError(f"pgw demo: no credentials for ~{args.principal} in {folder} "
                                     f"({Party('principal', args.principal).filename}); the surface cannot read her moments")
                if pcreds:
                    try:
                        snc = await connect(url, creds=pcreds, tls=config.tls.files(), name="pgw-demo-surface", once=True, connect_timeout=3)
                    except ConnectError as e:
                        if not e.auth:
                            raise
                        raise CredsError(refusal(Chosen(need_p, pcreds, Party("principal", args.principal), folder), url, e.why)) from None
                    stack.push_async_callback(snc.drain)
        if nc is None:
            from gateway.app import Gateway

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pgw-demo-")))
            server = await stack.enter_async_context(
                # Bound to the demo: killed outright, it runs no stop of its own (EmbeddedServer.stop_with_parent).
                EmbeddedServer(tmp / "nats", port=-1, monitor_port=-1, websocket_port=None, stop_with_parent=True)
            )
            reason = "" if args.embedded else f"nothing listens at {url}; "
            print(f"[demo] {reason}started an embedded server at {server.client_url} (it goes when the demo ends)")
            nc = await connect(server.client_url, name="pgw-demo")
            stack.push_async_callback(nc.drain)
            await ensure_streams(nc.jetstream(), config.subjects)
            cfg = msgspec.structs.replace(config, nats_url=server.client_url, data_dir=str(tmp / "data"))
            gw_nc = await connect(server.client_url, name="pgw-demo-gateway")
            stack.push_async_callback(gw_nc.drain)
            await stack.enter_async_context(Gateway(cfg, gw_nc))
        else:
            print(f"[demo] connected to {url}" + (f" as agent {args.agent} and ~{args.principal}" if acreds else ""))
        prefix = config.subjects.prefix
        agent = Agent(nc, args.agent, prefix=prefix)
        stack.push_async_callback(agent.close)
        surface = Surface(snc or nc, args.principal, prefix=prefix)

        async def run_surface() -> None:
            async for item in surface.items():
                if not isinstance(item, BindingMomentItem) or item.agent != args.agent:
                    continue
                print(f"\n[surface {args.principal}] <- binding_moment {item.moment_id} on {config.subjects.surface(args.principal)}")
                print(render(item))
                choice = item.binding_moment.question.recommended_idx
                label = item.binding_moment.question.options[choice].label
                print(f"\n[surface {args.principal}] -> resolve: option {choice + 1}. {label!r} (its index {choice} "
                      f"on the wire) on {config.subjects.resolve(args.principal)}")
                reply = await surface.resolve(item.moment_id, OptionChoice(index=choice))
                print(f"[gateway] -> surface reply: {reply.status}" + (f" ({reply.code}: {reply.reason})" if reply.code else ""))
                return

        surface_task = asyncio.create_task(run_surface())
        stack.push_async_callback(_settle, surface_task)
        await asyncio.sleep(0)  # let the surface subscribe before the moment is sent
        print(f"[agent {args.agent}] -> binding moment for ~{args.principal} on {config.subjects.envelope(args.agent)}")
        try:
            eid = await agent.send_moment(args.principal, DEMO_MOMENT)
            out = await agent.outcome_for(eid, timeout=30)
            print(f"[agent {args.agent}] <- envelope outcome on {config.subjects.outcome(args.agent)}: "
                  f"{out.status}" + (f", moment {out.moment_id}" if out.moment_id else f" ({out.code}: {out.reason})"))
            if out.status != "accepted" or not out.moment_id:
                surface_task.cancel()
                return 1
            res = await agent.resolution_for(out.moment_id, timeout=30)
        except TimeoutError:
            print("[demo] no answer within 30 s: is a gateway running on that server? (pgw up runs one)")
            surface_task.cancel()
            return 1
        await surface_task
        r = res.resolution
        what = msgspec.json.encode(r).decode()
        if isinstance(r, OptionChoice):
            what += f" = {DEMO_MOMENT['question']['options'][r.index]['label']!r}"  # type: ignore[index]
        print(f"\n[agent {args.agent}] <- resolution on {config.subjects.outcome(args.agent)}: {what}")
    return 0
