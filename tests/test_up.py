"""`pgw up` in a subprocess: starts, serves the demo, refuses a second instance, stops cleanly on Ctrl-C."""

from __future__ import annotations

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
        demo = subprocess.run([PGW, "demo", "--server", url], capture_output=True, text=True, timeout=60, env=env)
        assert demo.returncode == 0, demo.stdout + demo.stderr
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
    before starting any server; `open = true` in the config lets it start."""
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
    proc = subprocess.Popen([PGW, "--config", str(cfg), "--data-dir", str(data), "--log-format", "json", "up"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        read_until(proc, r"NATS\s+nats://127\.0\.0\.1:\d+")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
