"""pytest plugin for the security suite: collects matrix and gauntlet rows and
prints them as one table at the end of the run (``make security``).

Loaded from ``tests/conftest.py`` via ``pytest_plugins``. A test records a row
with the ``security_table`` fixture; the row's verdict is the observed
behaviour, and the test itself asserts it, so a red row is also a failed test.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import pytest


@dataclass(frozen=True)
class Row:
    table: str  # "isolation matrix" | "hostile-input gauntlet" | ...
    check: str
    actor: str
    target: str
    expected: str
    observed: str
    ok: bool


ROWS: list[Row] = []


class SecurityTable:
    def record(self, table: str, check: str, actor: str, target: str, expected: str, observed: str, ok: bool) -> None:
        ROWS.append(Row(table, check, actor, target, expected, observed, ok))


@pytest.fixture(scope="session")
def security_table() -> SecurityTable:
    """Where security tests record a row for the summary table."""
    return SecurityTable()


def _fmt(rows: list[Row]) -> list[str]:
    heads = ("check", "actor", "target", "expected", "observed", "")
    cells = [(r.check, r.actor, r.target, r.expected, r.observed, "PASS" if r.ok else "FAIL") for r in rows]
    widths = [min(48, max(len(h), *(len(c[i]) for c in cells))) for i, h in enumerate(heads)]

    def line(vals: tuple[str, ...]) -> str:
        return " | ".join(v[:w].ljust(w) for v, w in zip(vals, widths, strict=True))

    out = [line(heads), "-+-".join("-" * w for w in widths)]
    out += [line(c) for c in cells]
    return out


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist (``make test`` runs two workers) a worker hands its rows to the controller."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["pgw_security_rows"] = [list(astuple(r)) for r in ROWS]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """The controller gathers the rows of each worker as it finishes."""
    ROWS.extend(Row(*r) for r in getattr(node, "workeroutput", {}).get("pgw_security_rows", []))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not ROWS:
        return
    tables: dict[str, list[Row]] = {}
    for r in ROWS:
        tables.setdefault(r.table, []).append(r)
    # Full tables under `-m security` (make security) or when a row is red;
    # a one-line count per table otherwise, to keep `make test` output short.
    full = "security" in (config.option.markexpr or "") or any(not r.ok for r in ROWS)
    for name, rows in tables.items():
        bad = sum(not r.ok for r in rows)
        title = f"security: {name} ({len(rows) - bad}/{len(rows)} green)"
        if not full:
            terminalreporter.write_line(title)
            continue
        terminalreporter.section(title)
        for ln in _fmt(rows):
            terminalreporter.write_line(ln)
