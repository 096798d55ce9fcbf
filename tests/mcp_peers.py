"""The official reference MCP servers as test peers of the MCP gate (docs/gate.md, tests/test_mcp_gate*.py).

* ``@modelcontextprotocol/server-filesystem`` (npm): :func:`install_filesystem`
  puts it under ``~/.cache/pgw-peers/mcp-server-filesystem-VERSION``
  (``PGW_PEERS_CACHE`` overrides the root), built in a temporary folder beside
  it and renamed into place, so two pytest processes installing it at once
  cannot leave a half-installed copy; it runs unmodified under ``node``.
* ``mcp-server-git`` (PyPI, in the ``test`` extra): run as
  ``python -m mcp_server_git --repository PATH`` with this interpreter.

``python -m tests.mcp_peers`` installs them ahead of a run (the Makefile's
``test`` target does).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.refverifier import cache_root

FILESYSTEM_PACKAGE = "@modelcontextprotocol/server-filesystem"
FILESYSTEM_VERSION = "2026.8.31"
NODE = shutil.which("node") or "/usr/bin/node"


class McpPeerError(RuntimeError):
    """A reference MCP server could not be installed; the message says why."""


def _entry(folder: Path) -> Path:
    return folder / "node_modules" / "@modelcontextprotocol" / "server-filesystem" / "dist" / "index.js"


def install_filesystem(version: str = FILESYSTEM_VERSION) -> Path:
    """The ``dist/index.js`` of the cached filesystem server (installed with npm on first use)."""
    final = cache_root() / f"mcp-server-filesystem-{version}"
    if _entry(final).is_file():
        return _entry(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    npm = shutil.which("npm")
    if npm is None:
        raise McpPeerError("npm is not installed (Debian: apt-get install npm)")
    tmp = Path(tempfile.mkdtemp(prefix=f".mcp-server-filesystem-{version}-", dir=final.parent))
    tmp.chmod(0o755)
    try:
        proc = subprocess.run(
            [npm, "install", "--prefix", str(tmp), "--no-audit", "--no-fund", "--no-save", "--silent",
             f"{FILESYSTEM_PACKAGE}@{version}"],
            capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0 or not _entry(tmp).is_file():
            raise McpPeerError(f"npm install {FILESYSTEM_PACKAGE}@{version} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        try:
            tmp.rename(final)
        except OSError:
            if not _entry(final).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return _entry(final)


def filesystem_upstream(root: Path) -> dict[str, object]:
    """The gate's upstream entry for the filesystem server serving ``root``."""
    return {"command": NODE, "args": [str(install_filesystem()), str(root)]}


def git_upstream(repo: Path) -> dict[str, object]:
    """The gate's upstream entry for the git server on ``repo``."""
    return {"command": sys.executable, "args": ["-m", "mcp_server_git", "--repository", str(repo)]}


if __name__ == "__main__":  # install ahead of a run: python -m tests.mcp_peers
    print(install_filesystem())
