"""`pgw up` supervises its embedded nats-server: restarted when it dies, or one clear line and a non-zero exit."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.test_up import PGW, read_until


def _server_pid(data: Path) -> int:
    ports = sorted((data / "nats" / "run").glob("nats-server_*.ports"))
    assert ports, "no ports file of the embedded server"
    return int(ports[-1].name.split("_")[1].split(".")[0])


def _start(tmp_path: Path, extra: str = "") -> tuple[subprocess.Popen, Path, str]:
    cfg = tmp_path / "pgw.toml"
    cfg.write_text(f"[server]\nport = -1\nmonitor_port = -1\nwebsocket_port = -1\n{extra}\n")
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [PGW, "--config", str(cfg), "--data-dir", str(data), "--log-format", "json", "up", "--open"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PGW_LOG_LEVEL": "INFO"},
    )
    _, m = read_until(proc, r"NATS\s+(nats://127\.0\.0\.1:\d+)")
    return proc, data, m.group(1)


def _wait_for_restart(proc: subprocess.Popen, data: Path, old: int) -> tuple[int, str]:
    """Wait for `pgw up`'s log line that the server is back (stderr); (the new server's pid, stderr so far)."""
    seen, _ = read_until(proc, r"embedded nats-server restarted", stream=proc.stderr)
    ports = [p for p in (data / "nats" / "run").glob("nats-server_*.ports") if str(old) not in p.name]
    assert ports, "restarted, but no ports file of the new server"
    return int(ports[-1].name.split("_")[1].split(".")[0]), seen


@pytest.mark.slow
def test_killed_server_is_restarted_on_the_same_url(tmp_path: Path) -> None:
    """kill -9 of the embedded nats-server: `pgw up` starts it again at the same URL and the demo runs against it."""
    proc, data, url = _start(tmp_path)
    try:
        old = _server_pid(data)
        os.kill(old, signal.SIGKILL)
        new, seen = _wait_for_restart(proc, data, old)
        assert new != old
        demo = subprocess.run([PGW, "--data-dir", str(data), "demo", "--server", url], capture_output=True, text=True,
                              timeout=90)
        assert demo.returncode == 0, demo.stdout + demo.stderr
        assert f"connected to {url}" in demo.stdout, demo.stdout  # the restarted server, not one of the demo's own
        assert proc.poll() is None, "pgw up must still be running"
    finally:
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    err = seen.encode() + rest
    assert proc.returncode == 0
    at = err.find(b"Traceback")
    assert at < 0, err.decode()[max(0, at - 1500):at + 2500]
    assert b"embedded nats-server restarted" in err


@pytest.mark.slow
def test_gives_up_after_the_restart_limit_with_one_line(tmp_path: Path) -> None:
    """With server.restart_limit = 0 a dead server stops `pgw up` non-zero with one line, no traceback."""
    proc, data, _url = _start(tmp_path, "restart_limit = 0")
    os.kill(_server_pid(data), signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    text = err.decode()
    assert proc.returncode == 1, text[-2000:]
    at = text.find("Traceback")
    assert at < 0, text[max(0, at - 1500):at + 2500]
    lines = [ln for ln in text.splitlines() if ln.startswith("pgw up:")]
    assert len(lines) == 1 and "gave up after 0 restarts" in lines[0], text[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("setpriv") is None
    or subprocess.run(["setpriv", "--pdeathsig", "TERM", "--", "true"], check=False, capture_output=True).returncode,
    reason="no util-linux setpriv that takes --pdeathsig (2.33 or newer): the server is not bound to `pgw up`")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_a_pgw_up_killed_outright_leaves_no_server_running(tmp_path: Path, sig: signal.Signals) -> None:
    """`pgw up` killed with no stop of its own (SIGKILL; SIGHUP, a closed terminal's, which it does not catch):
    its embedded server, in a session of its own, ran on holding the ports and the store. It is started bound
    to `pgw up` (EmbeddedServer.stop_with_parent), so the kernel stops it; the next `pgw up` then starts."""
    proc, data, _url = _start(tmp_path)
    server = _server_pid(data)
    try:
        with open(f"/proc/{server}/stat") as f:
            born = f.read().rpartition(")")[2].split()[19]
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == -sig

        def alive() -> bool:
            try:
                with open(f"/proc/{server}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                return False
            return fields[19] == born and fields[0] not in ("Z", "X")

        deadline = time.monotonic() + 30
        while alive() and time.monotonic() < deadline:  # no event tells of a process that is not our child
            time.sleep(0.05)
        assert not alive(), f"the embedded nats-server {server} ran on after `pgw up` was killed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGKILL)
    again, data2, _ = _start(tmp_path)  # the same config and data folder, started again
    assert data2 == data
    again.send_signal(signal.SIGINT)
    again.communicate(timeout=60)
    assert again.returncode == 0


def test_connection_errors_are_logged_in_one_line(capsys) -> None:
    """A NATS connection error (or one it caused) is logged as an `error` field; any other exception keeps its traceback."""
    import json

    from nats.errors import TimeoutError as NatsTimeout

    from pgwcore.logs import configure_logging, get_logger

    configure_logging("json", "INFO")
    log = get_logger("t")
    try:
        try:
            raise NatsTimeout
        except NatsTimeout as e:
            raise RuntimeError("request failed") from e
    except RuntimeError:
        log.exception("while stopping")
    try:
        raise ValueError("a bug")
    except ValueError:
        log.exception("a real failure")
    lines = [json.loads(ln) for ln in capsys.readouterr().err.splitlines()]
    assert lines[0]["event"] == "while stopping" and "exception" not in lines[0]
    assert lines[0]["error"] == "RuntimeError: request failed"
    assert lines[1]["event"] == "a real failure" and "Traceback" in lines[1]["exception"]


@pytest.mark.slow
def test_up_tls_serves_mutual_tls_from_a_development_ca(tmp_path: Path) -> None:
    """`pgw up --dev-tls`: the server wants client certificates of its development CA; the printed demo command runs."""
    import re
    import shlex

    cfg = tmp_path / "pgw.toml"
    cfg.write_text("[server]\nport = -1\nmonitor_port = -1\nwebsocket_port = -1\n")
    proc = subprocess.Popen(
        [PGW, "--config", str(cfg), "--data-dir", str(tmp_path / "data"), "--log-format", "json", "up", "--open", "--dev-tls"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, "PGW_LOG_LEVEL": "WARNING"},
    )
    try:
        out, m = read_until(proc, r"(\.venv/bin/pgw demo --server (\S+) .*--tls-key \S+)")
        assert "TLS, client certificates required" in out
        demo = shlex.split(m.group(1))[1:]
        ok = subprocess.run([PGW, *demo], capture_output=True, text=True, timeout=90)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        url = m.group(2)
        bare = subprocess.run([PGW, "streams", "--server", url], capture_output=True, text=True, timeout=60)
        assert bare.returncode != 0 and re.search(r"cannot connect", bare.stderr), bare.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
