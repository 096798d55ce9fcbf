"""Every `pgw` command finds the credentials its role needs (docs/operations.md "Credentials").

Against `pgw up --quickstart` (what `make run` runs) in a subprocess, with each command started
from another folder, the way an MCP host starts `pgw`: the data folder is found from the
configuration or $PGW_DATA_DIR, never from the current folder."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from pgwcore.connect import connect
from tests.test_up import read_until

PGW = str(Path(sys.executable).parent / "pgw")


@dataclass(frozen=True)
class Up:
    url: str
    config: Path
    data: Path
    elsewhere: Path  # a folder with nothing of pgw's in it, where the commands start

    def run(self, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([PGW, "--log-format", "json", *args], capture_output=True, text=True, timeout=timeout,
                              cwd=self.elsewhere, env={**os.environ, "PGW_LOG_LEVEL": "WARNING", **(env or {})},
                              stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """`pgw up --quickstart` on free ports, started in one folder with a configuration in another whose
    `data_dir = "data"` is relative to the file."""
    root = tmp_path_factory.mktemp("quickstart")
    (root / "conf").mkdir()
    (root / "start").mkdir()
    (root / "elsewhere").mkdir()
    cfg = root / "conf" / "pgw.toml"
    cfg.write_text('data_dir = "data"\n[server]\nport = -1\nmonitor_port = -1\nwebsocket_port = -1\n')
    env = {k: v for k, v in os.environ.items() if k not in ("PGW_DATA_DIR", "PGW_CONFIG", "NATS_CREDS", "NATS_URL")}
    with (root / "up.err").open("wb") as err:
        proc = subprocess.Popen([PGW, "--config", str(cfg), "--log-format", "json", "up", "--quickstart"],
                                cwd=root / "start", stdout=subprocess.PIPE, stderr=err,
                                env={**env, "PGW_LOG_LEVEL": "WARNING"})
    try:
        _, m = read_until(proc, r"NATS\s+(nats://127\.0\.0\.1:\d+)[\s\S]*Ctrl-C drains")
        yield Up(m.group(1), cfg, root / "conf" / "data", root / "elsewhere")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_quickstart_binds_planner_and_an_ops_user_and_writes_their_credentials(quickstart: Up) -> None:
    """`pgw up --quickstart` puts its data folder beside the configuration that names it (not in the folder it
    started in) and writes credentials for agent planner and the demo's pair, both bound to ~alice, and the ops
    user ops."""
    creds = quickstart.data / "creds"
    for name in ("agent-planner", "agent-demo-agent", "principal-alice", "ops-ops", "service-services"):
        assert (creds / f"{name}.creds").exists(), name
    assert not (quickstart.config.parent.parent / "start" / ".pgw").exists()
    block = (creds / "authorization.conf").read_text()
    assert "agent:planner" in block and "ops:ops" in block


def test_ops_commands_find_the_ops_users_credentials_from_another_folder(quickstart: Up) -> None:
    """`pgw streams`, `pgw log verify` and `pgw capsules` started elsewhere, told only $PGW_CONFIG or
    $PGW_DATA_DIR, connect as the ops user and succeed (without credentials the server refuses them)."""
    by_config = {"PGW_CONFIG": str(quickstart.config)}
    by_env = {"PGW_DATA_DIR": str(quickstart.data)}
    streams = quickstart.run("--server", quickstart.url, "streams", env=by_config)
    assert streams.returncode == 0, streams.stderr
    assert "PGW_INBOUND" in streams.stdout and "exists" in streams.stdout
    assert "service-services" not in streams.stderr
    log = quickstart.run("--server", quickstart.url, "log", "verify", env=by_env)
    assert log.returncode == 0, log.stderr
    capsules = quickstart.run("--server", quickstart.url, "capsules", env=by_env)
    assert capsules.returncode == 0, capsules.stderr


def test_a_refusal_names_the_file_that_would_serve(quickstart: Up, tmp_path: Path) -> None:
    """With no credentials to be found the server's refusal is one line naming the ops user's file and the
    folder looked in; `--as` a party with no file names the file it looked for."""
    empty = tmp_path / "empty"
    r = quickstart.run("--server", quickstart.url, "--data-dir", str(empty), "streams")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "requires credentials" in r.stderr and "ops-NAME.creds" in r.stderr and str(empty / "creds") in r.stderr
    r = quickstart.run("--server", quickstart.url, "--as", "ops:nobody", "streams", env={"PGW_DATA_DIR": str(quickstart.data)})
    assert r.returncode == 2 and "ops-nobody.creds" in r.stderr and "Traceback" not in r.stderr


def test_mcp_for_an_agent_the_credentials_are_not_is_one_line(quickstart: Up) -> None:
    """`pgw mcp --agent x` with planner's credentials says whose they are, in one line (it was a 40-line
    TimeoutError traceback); for an agent with no credentials the refusal names agent-nobody.creds."""
    env = {"PGW_DATA_DIR": str(quickstart.data)}
    r = quickstart.run("--server", quickstart.url, "mcp", "--agent", "x", "--as", "agent:planner", env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "agent:planner's credentials, not agent:x's" in r.stderr, r.stderr
    r = quickstart.run("--server", quickstart.url, "--creds", str(quickstart.data / "creds" / "agent-planner.creds"),
                       "mcp", "--agent", "x", env=env)
    assert r.returncode == 2 and "not agent:x's" in r.stderr, r.stderr
    r = quickstart.run("--server", quickstart.url, "mcp", "--agent", "nobody", env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "agent-nobody.creds" in r.stderr, r.stderr
    # planner's own, found by $PGW_DATA_DIR: it serves until the host closes its stdin, then ends cleanly.
    r = quickstart.run("--server", quickstart.url, "mcp", "--agent", "planner", env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_demo_runs_against_it_and_tail_shows_each_messages_own_time(quickstart: Up) -> None:
    """`pgw demo` (its own pair, found by $PGW_DATA_DIR) answers a moment on the running server; a `pgw tail`
    of the history stamps the envelope with the time the stream stored it (the server's own stamp, read back
    with a JetStream message get as the ops user), not the time it was read: a later command's start alone
    puts a read time hundreds of milliseconds after it."""
    env = {"PGW_DATA_DIR": str(quickstart.data)}
    demo = quickstart.run("demo", "--server", quickstart.url, env=env)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert f"connected to {quickstart.url}" in demo.stdout and "embedded" not in demo.stdout
    assert "<- resolution on" in demo.stdout
    before_tail = datetime.now().astimezone()
    tail = quickstart.run("--server", quickstart.url, "tail", "pgw.agent.demo-agent.envelope", "--last", "1",
                          "--count", "1", "--json", env=env)
    assert tail.returncode == 0, tail.stderr
    shown = json.loads(tail.stdout.splitlines()[0])
    received = datetime.fromisoformat(shown["received"])
    assert received < before_tail, (shown["received"], before_tail)

    async def stored_time() -> datetime:
        nc = await connect(quickstart.url, creds=str(quickstart.data / "creds" / "ops-ops.creds"), once=True)
        try:
            js = nc.jetstream()
            stream = await js.find_stream_name_by_subject("pgw.agent.demo-agent.envelope")
            raw = await js.get_msg(stream, shown["seq"])
            assert raw.subject == "pgw.agent.demo-agent.envelope" and raw.time is not None
            return raw.time
        finally:
            await nc.close()

    stored = asyncio.run(stored_time())
    assert abs((received - stored).total_seconds()) < 0.001, (shown["received"], stored.isoformat())


def test_demo_refused_by_the_server_says_so_and_runs_nothing_else(quickstart: Up, tmp_path: Path) -> None:
    """`pgw demo --server URL` against a server that refuses the demo's credentials says which file was refused
    and exits 1: it does not start a throw-away server of its own (it used to, saying there was none)."""
    other = tmp_path / "other"
    made = quickstart.run("--data-dir", str(other), "--config", str(quickstart.config), "creds")  # another folder's keys
    assert made.returncode == 0, made.stderr
    r = quickstart.run("--data-dir", str(other), "demo", "--server", quickstart.url)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "embedded" not in r.stdout and "Traceback" not in r.stderr
    assert "refused agent:demo-agent's credentials" in r.stderr and "agent-demo-agent.creds" in r.stderr
    r = quickstart.run("--data-dir", str(tmp_path / "none"), "demo", "--server", quickstart.url)
    assert r.returncode == 1 and "embedded" not in r.stdout
    assert "requires credentials" in r.stderr and "agent-demo-agent.creds" in r.stderr


def test_demo_with_nothing_listening_says_it_starts_its_own(tmp_path: Path) -> None:
    """Only when nothing listens at the URL does `pgw demo` run against an embedded server, and it says so."""
    r = subprocess.run([PGW, "--data-dir", str(tmp_path / "d"), "demo", "--server", "nats://127.0.0.1:1"],
                       capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nothing listens at nats://127.0.0.1:1; started an embedded server" in r.stdout


def test_a_closed_pipe_ends_a_command_without_a_traceback(tmp_path: Path) -> None:
    """`pgw schema | head` whose reader has gone: no BrokenPipeError traceback, nothing on stderr, and the exit
    status of a command ended by SIGPIPE (141)."""
    proc = subprocess.Popen([PGW, "--data-dir", str(tmp_path), "schema", "BindingMomentItem"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes before pgw has written a byte (it is still importing)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert err == "", err


def test_each_command_takes_the_file_its_role_needs(tmp_path: Path) -> None:
    """In a folder holding every party's file, the ops commands take the ops user's (never the services' own),
    `pgw mcp` and `pgw surface` the agent's and principal's they name, a service its own, `pgw log quarantine`
    the gateway's; `--as` takes the party it names. With no ops user's file the ops commands fall back to the
    services' own and say so (an ops user's file the folder's server block no longer lists is passed over)."""
    from gateway.security import Party, embedded_auth
    from pgwcli.creds import SERVICES, choose, need_for
    from pgwcli.main import build_parser
    from pgwcore.config import load_config
    from pgwcore.identity import load_or_create_creds

    config = load_config(None, data_dir=str(tmp_path), agents={"planner": {"principals": ["alice"]}},
                         security={"ops": ["ops"], "auditors": ["carol"]})
    embedded_auth(config)
    parser = build_parser()

    def chosen(*argv: str) -> Party | None:
        args = parser.parse_args(list(argv))
        need = need_for(args)
        assert need is not None, argv
        return choose(args, config, need).party

    ops = Party("ops", "ops")
    for argv in (["streams"], ["tail", "pgw.>"], ["replay", "--subject", "x", "--dry-run"], ["capsules"],
                 ["notifications"], ["verify", "--stream", "PGW_CAPSULES"], ["log", "verify"],
                 ["mandate", "revoke", "jti-1"], ["keys", "--rotate", "signer"], ["capsules", "list"]):
        assert chosen(*argv) == ops, argv
    assert chosen("mcp", "--agent", "planner") == Party("agent", "planner")
    assert chosen("surface", "--principal", "~alice") == Party("principal", "alice")
    assert chosen("surface-web", "-p", "alice") == Party("principal", "alice")
    assert chosen("audit", "session", "s-1", "--agent", "planner", "--auditor", "carol") == Party("audit", "carol")
    assert chosen("log", "quarantine", "3", "--reason", "found") == Party("service", "gateway")
    assert chosen("signer") == Party("service", "signer")
    assert chosen("--as", "agent:planner", "streams") == Party("agent", "planner")
    assert need_for(parser.parse_args(["verify", "capsule.cose"])) is None  # a file: no server
    (tmp_path / "creds" / "ops-ops.creds").unlink()
    load_or_create_creds(tmp_path / "creds", Party("ops", "left"))  # an earlier run's, not in the server block
    args = parser.parse_args(["streams"])
    fallback = choose(args, config, need_for(args))  # type: ignore[arg-type]
    assert fallback.party == SERVICES and fallback.note and "service-services.creds" in fallback.note


def test_creds_lists_the_quickstart_parties_it_was_not_told_of(tmp_path: Path) -> None:
    """`pgw creds --quickstart` makes and lists the parties `make run` binds; a plain `pgw creds` on that folder
    says which files are not parties of its configuration, instead of silently leaving them out."""
    env = {**os.environ, "PGW_LOG_LEVEL": "WARNING"}
    made = subprocess.run([PGW, "--data-dir", str(tmp_path / "d"), "creds", "--quickstart"], capture_output=True,
                          text=True, timeout=60, env=env, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert "agent:planner" in made.stdout and "ops:ops" in made.stdout and "principal:alice" in made.stdout
    plain = subprocess.run([PGW, "--data-dir", str(tmp_path / "d"), "creds"], capture_output=True, text=True,
                           timeout=60, env=env, cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert "not parties of this configuration: agent-planner.creds, ops-ops.creds" in plain.stdout


def test_the_data_folder_is_found_without_the_current_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A configuration file's relative data_dir, creds_dir and keys.dir are relative to the file; with nothing
    naming the data folder, the `.pgw` beside the Python environment `pgw` runs from serves when the current
    folder has none (a checkout where `make run` made both, seen from an MCP host's folder)."""
    from pgwcore.config import DEFAULT_DATA_DIR, default_data_dir, load_config

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "pgw.toml").write_text('data_dir = "state"\n[security]\ncreds_dir = "../creds"\n[keys]\ndir = "/abs/keys"\n')
    monkeypatch.chdir(tmp_path)
    config = load_config(conf / "pgw.toml")
    assert config.data_path == conf / "state"
    assert Path(config.security.creds_dir) == conf / "../creds" and config.keys.dir == "/abs/keys"
    checkout = tmp_path / "checkout"
    (checkout / ".pgw").mkdir(parents=True)
    monkeypatch.setattr(sys, "prefix", str(checkout / ".venv"))
    assert default_data_dir() == str(checkout / ".pgw")
    (tmp_path / ".pgw").mkdir()
    assert default_data_dir() == DEFAULT_DATA_DIR  # one here wins
