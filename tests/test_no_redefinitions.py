"""No module or class of the project defines one function name twice.

The second definition silently replaces the first. The moment desk's task done callback
``_forget(task)`` was replaced so by the coroutine ``_forget(key, rec, rev)`` further down the
class, and ruff's F811 did not report it there; every follow and re-drive task then failed its
done callback. Property setters and deleters, ``typing.overload`` and ``singledispatch``
registrations redefine a name on purpose and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("benchmarks", "consumers", "gateway", "integrations", "pgwcli", "pgwcore", "subjects", "tests")
ON_PURPOSE = (".setter", ".deleter", "overload", ".register")


def redefinitions(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if not isinstance(node, ast.Module | ast.ClassDef):
            continue
        seen: dict[str, int] = {}
        for stmt in node.body:
            if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if any(mark in ast.unparse(d) for d in stmt.decorator_list for mark in ON_PURPOSE):
                continue
            if stmt.name in seen:
                scope = getattr(node, "name", "<module>")
                found.append(f"{name}:{stmt.lineno}: {scope}.{stmt.name} replaces line {seen[stmt.name]}")
            seen[stmt.name] = stmt.lineno
    return found


def test_the_check_finds_a_method_defined_twice() -> None:
    source = "class Desk:\n    def f(self, t):\n        pass\n\n    async def f(self, a, b):\n        pass\n"
    assert redefinitions(source, "x.py") == ["x.py:5: Desk.f replaces line 2"]
    setter = "class A:\n    @property\n    def v(self):\n        pass\n\n    @v.setter\n    def v(self, x):\n        pass\n"
    assert redefinitions(setter, "y.py") == []


def test_no_function_is_defined_twice_in_one_scope() -> None:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 100
    found = [hit for p in files for hit in redefinitions(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []
