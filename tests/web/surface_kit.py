"""Helpers shared by the surface tests (tests/test_surface_*.py).

A running gateway on a real nats-server, a well-formed binding moment, and a
corpus of surface items (good, malformed, every authorization variant) that
both render models (Python and the browser's plan.js) must agree on.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from gateway.app import Gateway
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from subjects.client import Agent

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("PGW_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]


def not_in_ci(reason: str | None) -> str | None:
    """``reason`` to skip by, outside CI; in CI (``CI`` set, as `.ci/run` runs) a missing peer is an
    error: CI's set-up installs it, so a skip there would be a check that cannot fail."""
    if reason is not None and os.environ.get("CI"):
        raise RuntimeError(f"{reason} (CI is set: the set-up must provide it)")
    return reason


def browser_ready() -> str | None:
    """None if the browser tests can run, else the LOUD reason they cannot (an error in CI).

    Runs tests/web/setup.sh (installs Debian's chromium when missing and root).
    """
    return not_in_ci(_browser_ready())


def _browser_ready() -> str | None:
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        return "BROWSER TESTS NOT RUN: the 'playwright' package is missing (pip install -e '.[test]')"
    if not os.access(CHROMIUM, os.X_OK):
        setup = REPO / "tests" / "web" / "setup.sh"
        done = subprocess.run(["sh", str(setup)], capture_output=True, text=True, check=False)
        if done.returncode != 0 or not os.access(CHROMIUM, os.X_OK):
            return f"BROWSER TESTS NOT RUN: {CHROMIUM} missing and tests/web/setup.sh could not install it: {done.stderr.strip()}"
    return None


def js_plans(items: list[Any]) -> list[dict[str, Any]]:
    """plan.js's plans for ``items``, computed by Node: the browser's render model without a browser."""
    import json
    import shutil

    node = shutil.which("node")
    if node is None:
        import pytest

        pytest.skip("NODE TESTS NOT RUN: no `node` on PATH to run consumers/web/src/plan.js")
    plan_js = (REPO / "consumers" / "web" / "src" / "plan.js").as_uri()
    script = (
        f"import {{ planItem }} from {json.dumps(plan_js)}; let s = '';"
        " process.stdin.on('data', (d) => { s += d; });"
        " process.stdin.on('end', () => { console.log(JSON.stringify(JSON.parse(s).map((i) => planItem(i)))); });"
    )
    done = subprocess.run([node, "--input-type=module", "-e", script], input=json.dumps(items),
                          capture_output=True, text=True, check=True, timeout=60)
    return json.loads(done.stdout)


def moment(**question: Any) -> dict[str, Any]:
    """A well-formed eight-slot binding moment (spec 000 §5); ``question`` overrides slots 5-8."""
    q: dict[str, Any] = {
        "stem": "Should the Q3 revenue report go to Acme's auditors this week?",
        "options": [
            {"label": "Send the full report", "reasoning": "Auditors asked for it and the NDA covers it."},
            {"label": "Send the summary only", "reasoning": "Keeps customer-level figures in house."},
            {"label": "Hold until the board meets", "reasoning": "Lets the board see it first."},
        ],
        "recommended_idx": 1,
        "hatches": {"free_text": True, "dialogue": True},
    }
    q.update(question)
    return {
        "synopsis": "Send Acme's auditors the summary, not the full Q3 report.",
        "findings": [
            "The audit request names revenue totals, not customer detail.",
            "The NDA with Acme's auditors expired on 30 September.",
            "The summary was reviewed by finance on Monday.",
        ],
        "recommendations": ["Send the reviewed summary today.", "Renew the NDA before sharing detail."],
        "offer": "Ask for detail on any finding.",
        "question": q,
        "meta": {"decision_class": "data-release"},
    }


def gateway_config(server: EmbeddedServer, data_dir: Path, **kw: Any):
    return load_config(None, nats_url=server.client_url, data_dir=str(data_dir), **kw)


@contextlib.asynccontextmanager
async def running_gateway(server: EmbeddedServer, data_dir: Path) -> AsyncIterator[Gateway]:
    """The lead's gateway (envelope pipeline, resolution and pending services) on ``server``."""
    config = gateway_config(server, data_dir)
    nc = await connect(server.client_url, name="test-gateway")
    try:
        async with Gateway(config, nc) as gw:
            yield gw
    finally:
        await nc.drain()


@contextlib.asynccontextmanager
async def planner_agent(server: EmbeddedServer) -> AsyncIterator[Agent]:
    """The agent ``planner`` on a connection of its own, closed in order afterwards."""
    nc = await connect(server.client_url, name="test-agent")
    a = Agent(nc, "planner")
    try:
        yield a
    finally:
        await a.close()
        await nc.drain()


async def accepted_moment(agent: Agent, m: dict[str, Any] | None = None, *, principal: str = "alice", **kw: Any) -> str:
    """Send a moment (the standard one by default) and return its moment_id once accepted."""
    eid = await agent.send_moment(principal, m or moment(), **kw)
    out = await agent.outcome_for(eid, timeout=20.0)
    assert out.status == "accepted" and out.moment_id, out
    return out.moment_id


class Relay:
    """A TCP relay to the server that can be cut (all links closed, new ones refused) and restored."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.open = True
        self.links: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> Relay:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.close()
            return
        up_r, up_w = await asyncio.open_connection(*self.target)
        self.links |= {writer, up_w}

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            w.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    def cut(self) -> None:
        self.open = False
        for w in self.links:
            w.close()
        self.links.clear()

    async def close(self) -> None:
        self.cut()
        if self.server:
            self.server.close()


def _base(kind: str, **kw: Any) -> dict[str, Any]:
    return {"item": kind, "agent": "planner", "principal": "alice", "created_at": "2026-11-21T20:00:00.000Z", **kw}


def corpus() -> list[tuple[str, Any]]:
    """(name, item) pairs covering every plan kind and the fallbacks."""
    good = _base(
        "binding_moment", moment_id="a1" * 16, envelope_id="env-1", correlation_id="c-1",
        binding_moment=moment(), expires_at="2026-11-22T20:00:00.000Z",
    )
    untrusted = copy.deepcopy(good) | {"untrusted": True, "moment_id": "a2" * 16}
    one_hatch = copy.deepcopy(good)
    one_hatch["moment_id"] = "a3" * 16
    one_hatch["binding_moment"]["question"]["hatches"] = {"free_text": False, "dialogue": True}
    out_of_range = copy.deepcopy(good)
    out_of_range["moment_id"] = "a4" * 16
    out_of_range["binding_moment"]["question"]["recommended_idx"] = 3
    one_option = copy.deepcopy(good)
    one_option["moment_id"] = "a5" * 16
    one_option["binding_moment"]["question"]["options"] = one_option["binding_moment"]["question"]["options"][:1]
    one_option["binding_moment"]["question"]["recommended_idx"] = 0
    no_findings = copy.deepcopy(good)
    no_findings["moment_id"] = "a6" * 16
    del no_findings["binding_moment"]["findings"]
    extra_member = copy.deepcopy(good)
    extra_member["moment_id"] = "a7" * 16
    extra_member["binding_moment"]["question"]["options"][0]["score"] = 0.9
    prov = {"oracle_records": [{"oracle_id": "o1"}], "generated_at": "2026-11-21T19:00:00Z", "envelope_id": "ae-1"}

    def auth(n: int, env: dict[str, Any]) -> dict[str, Any]:
        return _base("authorization", item_id=f"b{n}" * 8, envelope_id=f"env-a{n}", workflow_id="wf-billing", envelope=env)

    return [
        ("good", good),
        ("untrusted", untrusted),
        ("one_hatch", one_hatch),
        ("out_of_range", out_of_range),
        ("one_option", one_option),
        ("no_findings", no_findings),
        ("extra_member", extra_member),
        ("clarification", _base(
            "clarification", moment_id="c1" * 16, envelope_id="env-c", correlation_id="c-c",
            questions=[{"id": "q1", "question": "Which account should be billed?"}],
        )),
        ("notice", _base(
            "notice", item_id="d1" * 8, envelope_id="env-n",
            diagnostic="binding moment refused: synopsis hedges (spec 000 §6.1)",
            conventional={"files": ["q3.pdf"], "action": "share"},
        )),
        ("withdrawn", _base("withdrawn", moment_id="a1" * 16, reason="resolved")),
        ("auth_measurement", auth(1, {"kind": "measurement", "value": 42.5, "provenance": prov})),
        ("auth_classification", auth(2, {"kind": "classification", "label": "low-risk", "provenance": prov})),
        ("auth_action", auth(3, {"kind": "action", "action": "refund", "params": {"amount": 10}, "provenance": prov})),
        ("auth_action_no_provenance", auth(4, {"kind": "action", "action": "refund"})),
        ("auth_narrative", auth(5, {"kind": "narrative", "text": "Usage rose this month.",
                                    "policy": {"grammar_mode": "attributive", "forbidden_markers": [],
                                               "max_specificity": "general", "scrub_measurements": True}})),
        ("auth_refusal", auth(6, {"kind": "refusal", "reason": {"code": "POLICY_VIOLATION",
                                  "user_message": "This request is not allowed.", "audit_id": "aud-1"}})),
        ("auth_dispute", auth(7, {"kind": "dispute_summary", "sources": [{"axis": "price", "oracles": [
            {"oracle_id": "o1", "tier": "primary", "value": 10, "verified_at": "x"},
            {"oracle_id": "o2", "tier": "secondary", "value": 12, "verified_at": "x"}],
            "resolution_attempted": True, "escalation_required": True}]})),
        ("auth_unknown_kind", auth(8, {"kind": "telepathy", "text": "trust me"})),
        ("auth_refusal_unknown_code", auth(10, {"kind": "refusal", "reason": {"code": "APPROVED",
                                       "user_message": "trust me, it is fine", "audit_id": "aud-2"}})),
        ("auth_no_kind", auth(9, {"text": "no kind at all"})),
        ("unknown_item_type", _base("hologram", moment_id="e1" * 16)),
        ("not_an_object", [1, 2, 3]),
    ]
