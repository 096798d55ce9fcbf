"""`pgw up` supervises its embedded nats-server: restarted when it dies, or one clear line and a non-zero exit."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.harness import started_at
from tests.procs import NO_PDEATHSIG, PDEATHSIG
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


def _gone(pid: int, born: int | None, timeout: float = 30) -> bool:
    """Whether the process ``pid`` that started at ``born`` is gone within ``timeout`` (a reused pid is not it).
    Polled: no event tells of the end of a process that is not this one's child."""
    deadline = time.monotonic() + timeout
    while started_at(pid) == born and born is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return started_at(pid) != born or born is None


def _kill_if_running(pid: int | None, born: int | None) -> None:
    if pid is not None and born is not None and started_at(pid) == born:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(not PDEATHSIG, reason=NO_PDEATHSIG)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_a_pgw_up_killed_outright_leaves_no_server_running(tmp_path: Path, sig: signal.Signals) -> None:
    """`pgw up` killed with no stop of its own (SIGKILL; SIGHUP, a closed terminal's, which it does not catch):
    its embedded server, in a session of its own, ran on holding its store. It is started bound to `pgw up`
    (EmbeddedServer.stop_with_parent), so the kernel stops it; `pgw up` then starts again on the same folder."""
    if sig == signal.SIGHUP and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        pytest.skip("SIGHUP is ignored here (nohup), and `pgw up` would inherit that")
    server = born = again = None
    proc, data, _url = _start(tmp_path)
    try:
        server = _server_pid(data)
        born = started_at(server)
        assert born is not None
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == -sig
        assert _gone(server, born), f"the embedded nats-server {server} ran on after `pgw up` was killed"
        again, _, _ = _start(tmp_path)  # the same config and data folder
        again.send_signal(signal.SIGINT)
        again.communicate(timeout=60)
        assert again.returncode == 0
    finally:
        for p in (proc, again):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        _kill_if_running(server, born)


@pytest.mark.slow
@pytest.mark.skipif(not PDEATHSIG, reason=NO_PDEATHSIG)
def test_a_pgw_demo_killed_outright_leaves_no_server_running(tmp_path: Path) -> None:
    """`pgw demo` with nothing listening starts an embedded server "(it goes when the demo ends)"; killed, the
    demo runs no stop of its own, and its server ran on for good. Bound to the demo, it is stopped."""
    from benchmarks.harness import children

    proc = subprocess.Popen([PGW, "--data-dir", str(tmp_path / "d"), "demo", "--server", "nats://127.0.0.1:1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    server = born = None
    try:
        read_until(proc, r"started an embedded server at nats://")
        servers = [k for k in children(proc.pid) if b"nats-server" in Path(f"/proc/{k}/cmdline").read_bytes()]
        assert len(servers) == 1, servers
        server, born = servers[0], started_at(servers[0])
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL  # killed mid-demo, not ended on its own
        assert _gone(server, born), f"the demo's nats-server {server} ran on after the demo was killed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_if_running(server, born)


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
