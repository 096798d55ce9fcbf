"""``pgw demo``: one binding moment end to end, every hop printed.

Against a running ``pgw up`` (``--server``), or, when none answers, against
its own embedded server and gateway in a temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import textwrap
from pathlib import Path

import msgspec

from pgwcore.config import Config
from pgwcore.connect import connect
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
    """Plain-text rendering that keeps spec 000 §9.1's invariants."""
    bm = item.binding_moment
    q = bm.question
    wrap = lambda s, ind="    ": textwrap.fill(s, width, initial_indent=ind, subsequent_indent=ind)  # noqa: E731
    lines = [f"  From agent {item.agent}" + ("   [UNTRUSTED CONTENT]" if item.untrusted else "")]
    lines += ["", "  SYNOPSIS", wrap(bm.synopsis), "", "  FINDINGS"]
    bullet = lambda s: textwrap.fill(s, width, initial_indent="    - ", subsequent_indent="      ")  # noqa: E731
    lines += [bullet(f) for f in bm.findings]
    lines += ["", "  RECOMMENDATIONS"] + [bullet(r) for r in bm.recommendations]
    lines += ["", "  " + bm.offer, "", "  QUESTION", wrap(q.stem), ""]
    for i, opt in enumerate(q.options):
        mark = "*" if i == q.recommended_idx else " "
        tag = "  (recommended)" if i == q.recommended_idx else ""
        lines.append(f"   {mark} [{i}] {opt.label}{tag}")
        lines.append(wrap(opt.reasoning, "         "))
    if q.hatches.free_text:
        lines.append("     [w] Answer in my own words")
    if q.hatches.dialogue:
        lines.append("     [x] Reject the question")
    return "\n".join(lines)


async def _silent(e: Exception) -> None:
    """No server is a normal case for the demo: it starts its own."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="send one realistic binding moment and answer it, printing each hop")
    p.add_argument("--agent", default="demo-agent")
    p.add_argument("--principal", default="alice")
    p.add_argument("--embedded", action="store_true", help="always use a private embedded server")
    p.set_defaults(handler=handle)


async def handle(args: argparse.Namespace, config: Config) -> int:
    async with contextlib.AsyncExitStack() as stack:
        nc = snc = None  # snc: the surface's own connection on a server enforcing per-party creds
        if not args.embedded:
            from gateway.security import (  # issue 7: `pgw up` is secure by default
                Party,
                party_creds,
            )

            acreds = pcreds = None
            if not config.creds:
                acreds = party_creds(config, Party("agent", args.agent))
                pcreds = party_creds(config, Party("principal", args.principal))
            with contextlib.suppress(Exception):
                opts = {"max_reconnect_attempts": 1, "allow_reconnect": False, "connect_timeout": 2, "error_cb": _silent}
                nc = await asyncio.wait_for(
                    connect(config.nats_url, creds=acreds or config.creds, tls=config.tls.files(), name="pgw-demo", **opts), timeout=3)
                if acreds and pcreds:
                    snc = await asyncio.wait_for(connect(config.nats_url, creds=pcreds, tls=config.tls.files(), name="pgw-demo-surface", **opts), timeout=3)
                    stack.push_async_callback(snc.drain)
        if nc is None:
            from gateway.app import Gateway

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pgw-demo-")))
            server = await stack.enter_async_context(
                EmbeddedServer(tmp / "nats", port=-1, monitor_port=-1, websocket_port=None)
            )
            print(f"[demo] no server at {config.nats_url}; started an embedded one at {server.client_url}")
            nc = await connect(server.client_url, name="pgw-demo")
            await ensure_streams(nc.jetstream(), config.subjects)
            cfg = msgspec.structs.replace(config, nats_url=server.client_url, data_dir=str(tmp / "data"))
            gw_nc = await connect(server.client_url, name="pgw-demo-gateway")
            stack.push_async_callback(gw_nc.drain)
            await stack.enter_async_context(Gateway(cfg, gw_nc))
        else:
            print(f"[demo] connected to {config.nats_url}")
        stack.push_async_callback(nc.drain)
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
                print(f"\n[surface {args.principal}] -> resolve: option {choice} ({label!r}) on {config.subjects.resolve(args.principal)}")
                reply = await surface.resolve(item.moment_id, OptionChoice(index=choice))
                print(f"[gateway] -> surface reply: {reply.status}" + (f" ({reply.code}: {reply.reason})" if reply.code else ""))
                return

        surface_task = asyncio.create_task(run_surface())
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
