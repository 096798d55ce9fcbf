"""README examples run as tests, so the README cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

from subjects.wire import OptionChoice

README = Path(__file__).resolve().parent.parent / "README.md"


def python_block(after_heading: str) -> str:
    text = README.read_text()
    section = text.split(after_heading, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


async def test_agents_and_surfaces_example_runs(gateway, nc):
    """The README's agent + surface example, run against a real gateway, returns what the README says."""
    ns: dict = {}
    exec(compile(python_block("### Agents and surfaces in Python"), "README.md", "exec"), ns)
    assert await ns["main"](nc) == (OptionChoice(index=0), "accepted")


def test_quick_start_shows_the_two_commands():
    """The quick start shows exactly `make run` and `make test`."""
    block = re.search(r"## Quick start.*?```sh\n(.*?)```", README.read_text(), re.S).group(1)
    assert [line.split()[0:2] for line in block.strip().splitlines()] == [["make", "run"], ["make", "test"]]
