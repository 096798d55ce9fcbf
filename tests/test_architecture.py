"""The shape of the house, read from the imports (STYLE.md "The shape of the house", issue 18).

The graph is built with ``ast`` over ``subjects/``, the shared platform package
``pgwcore/``, ``gateway/``, ``consumers/`` and ``integrations/``. Every ``import`` and
``from ... import`` statement counts wherever it stands: at module level, inside
a function (a lazy import is still a dependency, it only moves the failure to
run time) and under ``if TYPE_CHECKING:`` (the type checker follows it). An
import of a name from a package counts as an import of the submodule when one of
that name exists (``from pgwcore import metrics`` is ``pgwcore.metrics``), and as
an import of the package's ``__init__`` otherwise.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLATFORM = "pgwcore"
PACKAGES = ("subjects", PLATFORM, "gateway", "consumers", "integrations")
INTEGRATIONS = "integrations"


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _targets(
    module: str, is_package: bool, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]
) -> Iterator[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            origin = ".".join([*base, node.module] if node.module else base)
        else:
            origin = node.module or ""
        names = [
            f"{origin}.{a.name}" if f"{origin}.{a.name}" in mods else origin for a in node.names
        ]
    for name in names:
        target = name
        while (
            target and target not in mods
        ):  # `import gateway.stages.x` is gateway.stages.x; nats.* is outside
            target = target.rpartition(".")[0]
        if target and target != module:
            yield target


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (module-level, function-level and TYPE_CHECKING imports)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                graph[module].update(_targets(module, path.name == "__init__.py", node, mods))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _reaching(graph: dict[str, set[str]], source: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m.split(".")[0] == source
        for t in targets
        if t.split(".")[0] in forbidden
    )


def test_the_graph_sees_lazy_and_type_checking_imports():
    """A function-level import and a TYPE_CHECKING import are both edges (the checks below rely on it)."""
    tree = ast.parse(
        "def f():\n    from subjects import wire\nif TYPE_CHECKING:\n    import subjects.names\n"
    )
    mods = _modules()
    edges = {
        t
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for t in _targets("x", False, node, mods)
    }
    assert edges == {"subjects.wire", "subjects.names"}


def test_circles_are_found():
    """The circle finder reports a two-module circle and a longer one, and nothing for a chain."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"g"}, "g": set()}
    assert circles(graph) == [["a", "b"], ["c", "d", "e"]]


def test_no_import_circles():
    """No module of subjects/, the platform, gateway/ or consumers/ imports itself through others."""
    found = circles(import_graph())
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_subjects_imports_nothing_above_it():
    """subjects/ is the bus contract: it imports nothing from the platform, gateway/ or consumers/."""
    assert _reaching(import_graph(), "subjects", (PLATFORM, "gateway", "consumers", "integrations")) == []


def test_platform_imports_nothing_from_gateway_or_consumers():
    """The platform every process shares imports nothing from gateway/ or consumers/."""
    graph = import_graph()
    assert any(m.split(".")[0] == PLATFORM for m in graph), f"no {PLATFORM}/ package"
    assert _reaching(graph, PLATFORM, ("gateway", "consumers", "integrations")) == []


def test_consumers_import_nothing_from_gateway():
    """consumers/ is downstream of the gateway: it takes the plumbing from the platform and the wire types from subjects/."""
    assert _reaching(import_graph(), "consumers", ("gateway",)) == []


def test_integrations_speak_only_the_contract_and_the_platform():
    """integrations/ (MCP and the frameworks, issue 16) imports only subjects/ and the platform, like an agent would."""
    graph = import_graph()
    assert any(m.split(".")[0] == INTEGRATIONS for m in graph), "no integrations/ package"
    assert _reaching(graph, INTEGRATIONS, ("gateway", "consumers")) == []


def test_nothing_below_the_command_line_imports_integrations():
    """Only the command line (gateway/commands, gateway/cli.py) starts an integration; no service depends on one."""
    graph = import_graph()
    below = [
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m.split(".")[0] in ("subjects", PLATFORM, "consumers")
        or (m.startswith("gateway.") and not m.startswith("gateway.commands") and m != "gateway.cli")
        for t in targets
        if t.split(".")[0] == INTEGRATIONS
    ]
    assert below == []


def test_the_readmes_old_connect_path_still_works() -> None:
    """`gateway.connect.connect`, once shown in the README, is the platform's connect."""
    import gateway.connect
    import pgwcore.connect

    assert gateway.connect.connect is pgwcore.connect.connect
