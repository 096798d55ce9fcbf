"""README and docs examples run as tests, so the documents cannot rot (STYLE.md "Documents").

The README is for the newcomer: what it is for, one picture, the quick start
(run as written by tests/test_quickstart.py), then links into docs/. This module
keeps it that way and runs the Python example of docs/bus.md; the other pages'
examples are run by the tests named in docs/development.md.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from subjects.wire import OptionChoice

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"


def python_block(after_heading: str, page: Path = DOCS / "bus.md") -> str:
    """The first ```python block after ``after_heading`` on ``page``."""
    text = page.read_text()
    section = text.split(after_heading, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


async def test_agents_and_surfaces_example_runs(gateway, nc):
    """docs/bus.md's agent + surface example, run against a real gateway, returns what the page says."""
    ns: dict = {}
    exec(compile(python_block("## Agents and surfaces in Python"), "docs/bus.md", "exec"), ns)
    assert await ns["main"](nc) == (OptionChoice(index=0), "accepted")


def test_the_readme_is_what_a_newcomer_reads_in_five_minutes():
    """The README has its parts in order (what it is for, one picture, the quick start, links), starts with `make run`
    alone, keeps reference out (no `nats` CLI, no link outside the repository) and links its terms to the glossary."""
    text = README.read_text()
    assert [h for h in re.findall(r"(?m)^## (.+)$", text)] == ["One binding moment", "Quick start", "Where next"]
    assert len(text.splitlines()) < 200
    block = re.search(r"## Quick start.*?```sh\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]
    assert block.strip() == "make run"
    assert not re.search(r"(?m)^\s*nats\s", "\n".join(re.findall(r"```sh\n(.*?)```", text, re.S)))
    assert "../shared" not in text and "DESIGN" not in text
    assert not re.search(r"\]\((?:https?:|\.\./)", text), "the README links only inside the repository"
    for term in ("binding moment", "gate", "capsule", "transparency service"):
        assert f"[{term}](docs/README.md#glossary)" in text.split("## ", 1)[0], term


def test_the_first_agent_example_is_the_ten_lines_docs_integrations_runs():
    """The README's first Python block is at most ten lines and is the example tests/test_agent_approve.py runs
    (docs/integrations.md, "Ten lines to a first approval")."""
    readme = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)  # type: ignore[union-attr]
    doc = python_block("## Ten lines to a first approval", DOCS / "integrations.md")
    assert len(readme.strip().splitlines()) <= 10
    assert readme == doc


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"`", "", heading.strip().lower())
    h = "".join(c for c in h if c in " -_" or unicodedata.category(c)[0] in "LN")
    return h.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for h in re.findall(r"(?m)^#{1,6} (.+?)\s*$", text):
        s = _slug(h)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_every_link_of_the_readme_and_the_pages_it_leads_to_exists():
    """Each relative link of README.md, docs/README.md and the pages that took the README's reference (cli,
    configuration, bus, development) names a file of the repository and, with #anchor, a heading of it."""
    pages = [README, *(DOCS / n for n in ("README.md", "cli.md", "configuration.md", "bus.md", "development.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.name}: {target} (no heading)")
    assert broken == []


def test_the_readme_shows_the_two_set_up_commands():
    """`make run` starts everything and `make test` passes the suite: the README shows both, each in a block of its own."""
    blocks = [b.strip() for b in re.findall(r"```sh\n(.*?)```", README.read_text(), re.S)]
    assert blocks[0] == "make run" and "make test" in blocks
