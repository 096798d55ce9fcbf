"""The official reference MCP servers as test peers of the MCP gate (docs/gate.md, tests/test_mcp_gate*.py).

* ``@modelcontextprotocol/server-filesystem`` (npm): :func:`install_filesystem`
  puts it under ``~/.cache/pgw-peers/mcp-server-filesystem-VERSION``
  (``PGW_PEERS_CACHE`` overrides the root), built in a temporary folder beside
  it and renamed into place, so two pytest processes installing it at once
  cannot leave a half-installed copy; it runs unmodified under ``node``.
* ``mcp-server-git`` (PyPI, in the ``test`` extra): run as
  ``python -m mcp_server_git --repository PATH`` with this interpreter.
* The official TypeScript MCP client (``@modelcontextprotocol/sdk``, the client
  the MCP Inspector is built on), pinned with its lock file in
  ``tests/mcp_ts/package.json``: :func:`install_ts_client` runs ``npm ci`` for it
  under ``~/.cache/pgw-peers/mcp-ts-client-HASH`` (the lock file's hash: a new pin
  is a new folder), the same way, and puts ``tests/mcp_ts/client.mjs`` beside it.

``python -m tests.mcp_peers`` installs them (and the TypeScript client) ahead of a run (the Makefile's
``test`` target does).
"""

from __future__ import annotations

import hashlib
import os
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


TS_DIR = Path(__file__).with_name("mcp_ts")


def install_ts_client() -> Path:
    """The ``client.mjs`` of tests/mcp_ts, runnable with ``node``: its pinned SDK installed (``npm ci``) on first use."""
    lock = (TS_DIR / "package-lock.json").read_bytes()
    final = cache_root() / f"mcp-ts-client-{hashlib.sha256(lock).hexdigest()[:12]}"
    sdk = final / "node_modules" / "@modelcontextprotocol" / "sdk" / "package.json"
    if not sdk.is_file():
        final.parent.mkdir(parents=True, exist_ok=True)
        npm = shutil.which("npm")
        if npm is None:
            raise McpPeerError("npm is not installed (Debian: apt-get install npm)")
        tmp = Path(tempfile.mkdtemp(prefix=".mcp-ts-client-", dir=final.parent))
        tmp.chmod(0o755)
        try:
            for name in ("package.json", "package-lock.json"):
                shutil.copy(TS_DIR / name, tmp / name)
            proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error"],
                                  cwd=tmp, capture_output=True, text=True, timeout=600, check=False)
            if proc.returncode != 0:
                raise McpPeerError(f"npm ci in tests/mcp_ts failed ({proc.returncode}): {proc.stderr[-2000:]}")
            try:
                tmp.rename(final)
            except OSError:
                if not sdk.is_file():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    # Node resolves the SDK from the script's folder: the script goes beside node_modules (renamed into
    # place, so a concurrent run never reads half a file).
    script = final / "client.mjs"
    source = (TS_DIR / "client.mjs").read_bytes()
    if not script.is_file() or script.read_bytes() != source:
        fd, tmp_script = tempfile.mkstemp(dir=final, suffix=".mjs")
        with os.fdopen(fd, "wb") as f:
            f.write(source)
        Path(tmp_script).replace(script)
    return script


def filesystem_upstream(root: Path) -> dict[str, object]:
    """The gate's upstream entry for the filesystem server serving ``root``."""
    return {"command": NODE, "args": [str(install_filesystem()), str(root)]}


def git_upstream(repo: Path) -> dict[str, object]:
    """The gate's upstream entry for the git server on ``repo``."""
    return {"command": sys.executable, "args": ["-m", "mcp_server_git", "--repository", str(repo)]}


if __name__ == "__main__":  # install ahead of a run: python -m tests.mcp_peers
    print(install_filesystem())
    print(install_ts_client())
