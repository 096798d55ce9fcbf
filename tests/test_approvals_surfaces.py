"""A principal's standing approvals, seen and revoked where she is (docs/gate.md "Standing approvals").

Through the bus: a real gateway with the IDP kernel grants alice a standing approval ("Allow for this
session", answered on her surface); the command line (``pgw approvals``, a subprocess) and the terminal
surface (the ``s`` key, ``r`` to revoke) list it and revoke it over ``kernel.approvals.alice``, and the next
call it covered asks her again.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE
from typing import Any

from consumers.surfaces.feed import SurfaceFeed
from consumers.surfaces.terminal import TerminalSurface
from subjects.approvals import ApprovalsRequest
from tests.test_gate_scopes import SESSION, Env, env  # noqa: F401 - the fixture

FOLDER = "/home/alice/notes"


async def pgw(nats_url: str, data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``pgw`` in a subprocess, the event loop (and the gateway in it) running meanwhile."""
    argv = [sys.executable, "-m", "pgwcli", "--server", nats_url, "--data-dir", str(data), *args]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=PIPE, stderr=PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    return subprocess.CompletedProcess(argv, proc.returncode or 0, out.decode(), err.decode())


async def test_pgw_approvals_lists_and_revokes_hers(env: Env, nats_server: Any, tmp_path: Path) -> None:  # noqa: F811
    """`pgw approvals --principal alice` lists the standing approval she granted in her words, `--revoke ID`
    revokes it (the kernel's list is then empty and the next write asks again), and a second revoke fails."""
    assert (await env.call(f"{FOLDER}/a.txt", answer=SESSION))[0] == "asked"
    (granted,) = (await env.approvals(ApprovalsRequest(op="list"))).approvals
    out = await pgw(nats_server.client_url, tmp_path, "approvals", "--principal", "alice")
    assert out.returncode == 0, out.stderr
    assert granted.scope_id in out.stdout
    assert f'Allow for this session: write_file by agent bot on files directly in "{FOLDER}"' in out.stdout
    assert (await env.call(f"{FOLDER}/b.txt"))[0] == "ran", "still standing"
    out = await pgw(nats_server.client_url, tmp_path, "approvals", "-p", "alice", "--revoke", granted.scope_id)
    assert out.returncode == 0 and f"{granted.scope_id} revoked" in out.stdout, out.stderr
    assert (await env.approvals(ApprovalsRequest(op="list"))).approvals == []
    assert (await env.call(f"{FOLDER}/c.txt"))[0] == "asked", "revoked: the next write asks again"
    out = await pgw(nats_server.client_url, tmp_path, "approvals", "-p", "alice", "--revoke", granted.scope_id)
    assert out.returncode == 1 and "scope_not_found" in out.stderr
    out = await pgw(nats_server.client_url, tmp_path, "approvals", "-p", "alice")
    assert out.returncode == 0 and "~alice has no standing approvals." in out.stdout


async def test_the_terminal_lists_and_revokes_with_a_key(env: Env) -> None:  # noqa: F811
    """On the terminal surface `s` lists her standing approvals (asked of the kernel), `r` revokes the chosen one
    and the list is read again; the help line names the key."""
    assert (await env.call(f"{FOLDER}/a.txt", answer=SESSION))[0] == "asked"
    (granted,) = (await env.approvals(ApprovalsRequest(op="list"))).approvals
    ui = TerminalSurface(SurfaceFeed(env.nc, "alice"), out=io.StringIO(), color=False)
    assert "s standing approvals" in ui.frame()
    await ui.handle("char:s")
    screen = ui.frame()
    assert "Standing approvals" in screen and granted.scope_id in screen
    assert "Allow for this session: write_file by agent bot" in screen and "r revoke" in screen
    await ui.handle("char:r")
    assert ui.status.startswith("Revoked: Allow for this session") and ui.standing == []
    assert "You have no standing approvals." in ui.frame()
    assert (await env.approvals(ApprovalsRequest(op="list"))).approvals == []
    await ui.handle("esc")
    assert ui.standing is None and "Standing approvals" not in ui.frame()
