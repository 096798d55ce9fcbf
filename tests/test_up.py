"""`pgw up` in a subprocess: starts, serves the demo, refuses a second instance, stops cleanly on Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest

PGW = str(Path(sys.executable).parent / "pgw")


def read_until(proc: subprocess.Popen, pattern: str, timeout: float = 30.0, *,
               stream: IO[bytes] | None = None) -> tuple[str, re.Match]:
    """Read the child's stdout (or ``stream``, e.g. its stderr) until ``pattern`` matches (the banner is
    printed to stdout): each read waits for output (``select``), and the child closing it ends the wait."""
    buf = ""
    deadline = time.monotonic() + timeout
    out = stream if stream is not None else proc.stdout
    assert out is not None
    fd = out.fileno()
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([fd], [], [], left)[0]:
            break  # the time is up
        chunk = os.read(fd, 65536)
        if not chunk:
            break  # the child closed its stdout: it ended
        buf += chunk.decode(errors="replace")
        m = re.search(pattern, buf)
        if m:
            return buf, m
    raise AssertionError(f"pattern {pattern!r} not seen; output so far:\n{buf}")


@pytest.mark.slow
def test_up_starts_serves_and_stops_cleanly(tmp_path):
    """`pgw up` prints where to connect, the demo runs against it, a second `up` is refused, SIGINT stops it all."""
    cfg = tmp_path / "pgw.toml"
    cfg.write_text("open = true\n[server]\nport = -1\nmonitor_port = -1\nwebsocket_port = -1\n")
    data = tmp_path / "data"
    env = {**os.environ, "PGW_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [PGW, "--config", str(cfg), "--data-dir", str(data), "--log-format", "json", "up"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
    )
    try:
        _, m = read_until(proc, r"NATS\s+(nats://127\.0\.0\.1:\d+)")
        url = m.group(1)
        # The demo's pair from up's data folder; it ran against up's server, not a throw-away one of its own.
        demo = subprocess.run([PGW, "--data-dir", str(data), "demo", "--server", url], capture_output=True, text=True,
                              timeout=60, env=env)
        assert demo.returncode == 0, demo.stdout + demo.stderr
        assert f"connected to {url}" in demo.stdout and "embedded" not in demo.stdout
        assert "<- resolution on" in demo.stdout and "recommended" in demo.stdout

        second = subprocess.run(
            [PGW, "--config", str(cfg), "--data-dir", str(data), "up"], capture_output=True, text=True, timeout=30, env=env
        )
        assert second.returncode == 1
        assert "already running" in second.stderr

        server_pids = [int(p.stem.split("_")[-1]) for p in (data / "nats" / "run").glob("*.ports")]
        assert server_pids, "the embedded server wrote no ports file"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        for pid in server_pids:  # the embedded nats-server is gone too
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_refuses_open_mode_unless_asked(tmp_path):
    """`pgw up` with no agent bindings exits 2 with a loud OPEN MODE refusal naming `open = true` (spec 000 §8.4),
    before starting any server; `open = true` in the config lets it start, and OPEN MODE is then said once, in one
    wording (it was said three times: by `pgw up`, the gateway and its capabilities part)."""
    from pgwcore.config import OPEN_MODE_LINE

    cfg = tmp_path / "pgw.toml"
    cfg.write_text("[server]\nport = -1\nmonitor_port = -1\nwebsocket_port = -1\n")
    data = tmp_path / "data"
    env = {**os.environ, "PGW_LOG_LEVEL": "WARNING"}
    refused = subprocess.run([PGW, "--config", str(cfg), "--data-dir", str(data), "up"],
                             capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "OPEN MODE" in refused.stderr and "open = true" in refused.stderr
    assert not (data / "nats").exists(), "no server may start in refused open mode"
    cfg.write_text("open = true\n" + cfg.read_text())
    with (tmp_path / "up.err").open("wb") as err:
        proc = subprocess.Popen([PGW, "--config", str(cfg), "--data-dir", str(data), "--log-format", "json", "up"],
                                stdout=subprocess.PIPE, stderr=err, env=env)
    try:
        out, _ = read_until(proc, r"Ctrl-C drains")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = out + (tmp_path / "up.err").read_text()
    assert said.count("OPEN MODE") == 1, said
    logged = [json.loads(line) for line in said.splitlines() if line.startswith("{")]
    assert [e for e in logged if e.get("event") == OPEN_MODE_LINE and e.get("level") == "warning"], said


def test_quickstart_is_bound_not_open(tmp_path):
    """`pgw up --quickstart` (what `make run` runs) needs no `open = true`: it binds the quick start's agents to
    ~alice, so nothing is said about OPEN MODE; a configuration's own bindings and ops users are kept as they are."""
    from pgwcli.commands.up import quickstart
    from pgwcore.config import load_config

    bound = quickstart(load_config(None, data_dir=str(tmp_path)))
    assert {a: c.principals for a, c in bound.agents.items()} == {"planner": ["alice"], "demo-agent": ["alice"]}
    assert bound.security.ops == ["ops"]
    own = quickstart(load_config(None, data_dir=str(tmp_path), agents={"bot": {"principals": ["bob"]}},
                                 security={"ops": ["oncall"]}))
    assert list(own.agents) == ["bot"] and own.security.ops == ["oncall"]
