"""A principal's standing approvals, seen and revoked where she is (docs/gate.md "Standing approvals").

Through the bus: a real gateway with the IDP kernel grants alice a standing approval ("Allow for this
session", answered on her surface); the command line (``pgw approvals``, a subprocess) and the terminal
surface (the ``s`` key, ``r`` to revoke) and the browser surface (the "Standing approvals" disclosure, in
headless Chromium with axe-core) list it and revoke it over ``kernel.approvals.alice``, and the next call it
covered asks her again.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE
from typing import Any

import pytest

from consumers.surfaces.feed import SurfaceFeed
from consumers.surfaces.terminal import TerminalSurface
from consumers.surfaces.web import WebSurfaceServer
from subjects.approvals import ApprovalsRequest
from tests.test_gate_scopes import SESSION, Env, env  # noqa: F401 - the fixture

sys.path.insert(0, str(Path(__file__).parent / "web"))
from a11y_kit import assert_no_violations, axe_ready, live_text
from surface_kit import CHROMIUM, CHROMIUM_ARGS, browser_ready

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


_NO_BROWSER = browser_ready() or axe_ready()


@pytest.mark.skipif(_NO_BROWSER is not None, reason=_NO_BROWSER or "")
async def test_the_web_page_lists_and_revokes_with_a_button(env: Env, nats_server: Any) -> None:  # noqa: F811
    """On the browser surface the "Standing approvals" disclosure (aria-expanded) lists hers, asked of the kernel;
    its Revoke button revokes it, the list is asked again and says she has none, a polite status says what was
    revoked, and the kernel's list is empty; axe-core finds nothing with the panel open, listed or empty."""
    from playwright.async_api import async_playwright

    assert (await env.call(f"{FOLDER}/a.txt", answer=SESSION))[0] == "asked"
    (granted,) = (await env.approvals(ApprovalsRequest(op="list"))).approvals
    async with (WebSurfaceServer(principal="alice", ws_url=nats_server.websocket_url, port=0) as web,
                async_playwright() as pw):
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await (await browser.new_context(bypass_csp=True)).new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            await page.goto(web.url)
            await page.wait_for_selector("body[data-ready=true]", timeout=20000)
            toggle = page.get_by_role("button", name="Standing approvals")
            assert await toggle.get_attribute("aria-expanded") == "false"
            assert not await page.locator("#standing-panel").is_visible()
            await toggle.click()
            assert await toggle.get_attribute("aria-expanded") == "true"
            item = page.locator(f"li[data-scope-id='{granted.scope_id}']")
            await item.wait_for(timeout=20000)
            text = await item.inner_text()
            assert f"Allow for this session: write_file by agent bot on files directly in “{FOLDER}”" in text, text
            assert granted.scope_id in text
            await assert_no_violations(page, "standing approvals listed")
            revoke = item.get_by_role("button", name="Revoke")
            await revoke.click()
            await page.get_by_text("You have no standing approvals.").wait_for(timeout=20000)
            assert await item.count() == 0
            said = " | ".join(await live_text(page))
            assert "Revoked: Allow for this session" in said and "asks you again" in said, said
            assert await page.evaluate("document.activeElement.id") == "standing-toggle", "focus is not dropped"
            await assert_no_violations(page, "standing approvals empty after a revoke")
            await toggle.click()
            assert await toggle.get_attribute("aria-expanded") == "false"
            assert errors == []
        finally:
            await browser.close()
    assert (await env.approvals(ApprovalsRequest(op="list"))).approvals == []
    assert (await env.call(f"{FOLDER}/c.txt"))[0] == "asked", "revoked: the next write asks again"
