"""Print pip constraints pinning each runtime dependency of pyproject.toml to its lower bound.

``make test-lowest`` installs the project with these constraints into ``.venv-lowest`` and runs the
suite there: the lower bounds pyproject.toml declares are then ones the code was tested with (a
bound the code has outgrown shows up as failing tests, not as a user's ImportError). Not part of
``make test``, which installs the newest releases the bounds admit.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version


def lowest(pyproject: Path) -> list[str]:
    out = []
    for spec in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        req = Requirement(spec)
        floors = [s.version for s in req.specifier if s.operator in (">=", "==", "~=") and "*" not in s.version]
        if not floors:
            continue  # no lower bound (or a wildcard pin such as pycose==1.1.*): the resolver's choice
        marker = f"; {req.marker}" if req.marker else ""
        out.append(f"{req.name}=={max(floors, key=Version)}{marker}")
    return out


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    print("\n".join(lowest(Path(sys.argv[1]) if len(sys.argv) > 1 else root / "pyproject.toml")))
