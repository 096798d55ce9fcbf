"""The "Writing your own surface" example of docs/surfaces.md runs as written (STYLE.md: examples are tests)."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pgwcore.server import EmbeddedServer
from subjects.client import Agent
from subjects.wire import OptionChoice, ResolutionOutcome

sys.path.insert(0, str(Path(__file__).parent / "web"))
from surface_kit import REPO, moment, planner_agent, running_gateway

SECTION = "## Writing your own surface"
WAIT = 20.0


def surface_example() -> tuple[Path, str]:
    """The first python block of the section in docs/surfaces.md."""
    for path in (REPO / "docs" / "surfaces.md",):
        if not path.exists():
            continue
        text = path.read_text()
        if SECTION not in text:
            continue
        section = text.split(SECTION, 1)[1]
        m = re.search(r"```python\n(.*?)```", section, re.S)
        assert m, f"{path}: the section has no python example"
        return path, m.group(1)
    raise AssertionError("docs/surfaces.md has no 'Writing your own surface' section")


@pytest.fixture
async def agent(nats_server: EmbeddedServer, tmp_path: Path) -> AsyncIterator[Agent]:
    async with running_gateway(nats_server, tmp_path / "gw"), planner_agent(nats_server) as a:
        yield a


async def test_documented_surface_renders_and_answers_a_moment(
    nats_server: EmbeddedServer, agent: Agent, tmp_path: Path
) -> None:
    """The documented example shows the briefing and recommended option, answers '2', and the agent receives option index 1."""
    where, code = surface_example()
    script = tmp_path / "my_surface.py"
    script.write_text(code)
    eid = await agent.send_moment("alice", moment())
    out = await agent.outcome_for(eid, timeout=WAIT)
    assert out.moment_id
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), "alice", env=dict(os.environ, NATS_URL=nats_server.client_url),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(b"2\n"), WAIT)
    text = stdout.decode()
    assert proc.returncode == 0, (where, text, stderr.decode()[-2000:])
    bm = moment()
    for slot in [bm["synopsis"], bm["offer"], *bm["findings"], *bm["recommendations"]]:
        assert slot in text, (where, slot)
    assert "2. Send the summary only   <- recommended" in text
    assert "f. answer in my own words" in text and "d. reject the question" in text
    assert "'status': 'accepted'" in text
    res = await agent.final_outcome(out.moment_id, timeout=WAIT)
    assert isinstance(res, ResolutionOutcome) and res.resolution == OptionChoice(index=1)


def test_documented_subjects_and_schemas_exist() -> None:
    """Every subject and `pgw schema` name the section cites is one of the contract's."""
    from subjects import wire
    from subjects.names import Subjects

    where, _ = surface_example()
    section = where.read_text().split(SECTION, 1)[1]
    s = Subjects("pgw")
    for subject in (s.surface("alice"), s.pending("alice"), s.resolve("alice")):
        assert f"`{subject}`" in section, subject
    for name in set(re.findall(r"`pgw schema ([A-Z][a-z]\w*)`", section)) | {
        "BindingMomentItem", "ClarificationItem", "AuthorizationItem", "NoticeItem", "WithdrawnItem"
    }:
        assert hasattr(wire, name), name
        assert f"`{name}`" in section or f"pgw schema {name}" in section, name
