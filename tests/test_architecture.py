"""The shape of the house, read from the imports (STYLE.md "The shape of the house", issue 18).

The graph is built with ``ast`` over ``subjects/``, the shared platform package
``pgwcore/``, ``gateway/``, ``consumers/``, ``integrations/`` and the command line
``pgwcli/``. Every ``import`` and ``from ... import`` statement counts wherever it
stands: at module level, inside a function (a lazy import is still a dependency,
it only moves the failure to run time) and under ``if TYPE_CHECKING:`` (the type
checker follows it). An import of a name from a package counts as an import of
the submodule when one of that name exists (``from pgwcore import metrics`` is
``pgwcore.metrics``), and as an import of the package's ``__init__`` otherwise.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLATFORM = "pgwcore"
CLI = "pgwcli"
PACKAGES = ("subjects", PLATFORM, "gateway", "consumers", "integrations", CLI)

# package -> the packages it may import, from the ground up (STYLE.md "The shape of the house").
# gateway/, consumers/ and integrations/ sit side by side and share only what is below them;
# the command line wires them together and nothing imports it.
LAYERS: dict[str, tuple[str, ...]] = {
    "subjects": (),
    PLATFORM: ("subjects",),
    "gateway": ("subjects", PLATFORM),
    "consumers": ("subjects", PLATFORM),
    "integrations": ("subjects", PLATFORM),
    CLI: ("subjects", PLATFORM, "gateway", "consumers", "integrations"),
}


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


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every edge ``module -> target`` whose target's package is not a layer the module's package may import."""
    return sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        for t in targets
        if (src := m.split(".")[0]) != (dst := t.split(".")[0]) and dst not in LAYERS[src]
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
    """No module of the house imports itself through others."""
    found = circles(import_graph())
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_a_step_up_is_a_violation():
    """An import of consumers/ from gateway/, of the command line from a consumer, and of gateway/ from the platform are each reported; imports down the layers and inside a package are not."""
    graph = {
        "gateway.app": {"pgwcore.service", "subjects.wire", "gateway.pipeline", "consumers.signer"},
        "consumers.signer": {"pgwcore.keys", "pgwcli.main"},
        "pgwcore.streams": {"gateway.app"},
        "pgwcli.main": {"gateway.app", "consumers.signer", "integrations.mcp"},
    }
    assert violations(graph) == ["consumers.signer -> pgwcli.main", "gateway.app -> consumers.signer", "pgwcore.streams -> gateway.app"]


def test_each_package_imports_only_the_layers_below_it():
    """subjects/ imports nothing of the project; the platform only subjects/; gateway/, consumers/ and integrations/ only the platform and subjects/ (not each other); the command line anything."""
    graph = import_graph()
    assert {m.split(".")[0] for m in graph} == set(PACKAGES), "a package of the house has no modules"
    assert violations(graph) == []


def test_no_service_imports_the_command_line():
    """Nothing outside pgwcli/ imports it: the services run without the command line (a lazy import counts too)."""
    graph = import_graph()
    assert sorted(f"{m} -> {t}" for m, targets in graph.items() if m.split(".")[0] != CLI
                  for t in targets if t.split(".")[0] == CLI) == []


def test_the_command_line_is_its_own_package():
    """`pgw` and its subcommands live in pgwcli/ at the top, and gateway/ holds the gateway service only."""
    graph = import_graph()
    assert {"pgwcli.main", "pgwcli.commands.up"} <= set(graph)
    assert [m for m in graph if m == "gateway.cli" or m.startswith("gateway.commands")] == []


def test_the_readmes_old_connect_path_still_works() -> None:
    """`gateway.connect.connect`, once shown in the README, is the platform's connect."""
    import gateway.connect
    import pgwcore.connect

    assert gateway.connect.connect is pgwcore.connect.connect
