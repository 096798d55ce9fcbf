"""The real scittles SCRAPI Transparency Service as a test peer (issue 14).

scittles is outside software (``../shared/peers/scittles``, a snapshot of
github.com/vcon-dev/scittles; found as :func:`source_candidates` says); the suite installs it, unmodified, into a venv
of its own and runs it as a subprocess on a free loopback port, so that the
registrar is proved against the other side's own code.

- The venv is cached under ``~/.cache/pgw-peers/scittles-<hash>`` where the
  hash covers the peer's source tree and the Python that builds it: built once,
  reused by later runs, rebuilt when either changes. It is built in a temporary folder next to it and
  renamed into place, so two pytest processes building at once cannot leave a
  half-built cache (the loser of the rename race discards its copy).
- The source is copied first (``shared/`` is read-only) and installed
  editable: scittles reads ``src/storage/schema.sql`` from its source tree.
  ``cbor2<6``: cbor2 6 breaks pycose 1.1's decoder.
- One instance per test session (``scittles`` fixture in conftest), its own
  data folder and key file. Its receipts are ES256 over a P-256 key published
  at ``jwks_uri``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("PGW_PEERS_CACHE", Path.home() / ".cache" / "pgw-peers"))


class PeerUnavailable(RuntimeError):
    """The peer could not be installed or started; the message says why."""


def source_candidates(repo: Path | None = None) -> list[Path]:
    """Where the scittles source may be, in order: ``$PGW_SCITTLES_SRC``; ``../shared/peers/scittles``
    beside this checkout; and, for a clone of a local checkout (``git clone . /tmp/fresh``), the same
    beside the checkout it was cloned from (its ``origin`` is a local path)."""
    repo = repo or REPO
    out = [Path(os.environ["PGW_SCITTLES_SRC"])] if os.environ.get("PGW_SCITTLES_SRC") else []
    out.append(repo.parent / "shared" / "peers" / "scittles")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        origin = subprocess.run(["git", "-C", str(repo), "config", "--get", "remote.origin.url"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        origin = origin.removeprefix("file://")
        if origin and "://" not in origin and Path(origin).is_dir():
            out.append(Path(origin).resolve().parent / "shared" / "peers" / "scittles")
    return out


def find_source() -> Path:
    """The first candidate holding scittles' source; PeerUnavailable naming every place looked at."""
    tried = source_candidates()
    for src in tried:
        if (src / "pyproject.toml").exists():
            return src
    raise PeerUnavailable("scittles source not found; looked at " + ", ".join(map(str, tried))
                          + " (set PGW_SCITTLES_SRC to the folder of github.com/vcon-dev/scittles)")


def source_hash(src: Path) -> str:
    """A short hash of the peer's source tree (paths and contents) and of the Python that runs it."""
    h = hashlib.sha256(f"{getattr(sys, '_base_executable', sys.executable)} {sys.version}".encode())
    for p in sorted(src.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(src)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def ensure_venv(src: Path | None = None) -> Path:
    """The cached venv folder with scittles installed (built when missing); ``src``: default find_source()."""
    src = src or find_source()
    if not (src / "pyproject.toml").exists():
        raise PeerUnavailable(f"scittles source not found at {src}")
    final = CACHE / f"scittles-{source_hash(src)}"
    if (final / "ok").exists():
        return final
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="scittles-build-", dir=CACHE))
    try:
        # Built under tmp, then renamed: the venv's console scripts and the editable install keep
        # the build path, so start() runs ``venv/bin/python -m src.main`` with the copied source
        # first on PYTHONPATH, which is valid wherever the folder ends up.
        work = tmp / "peer"
        shutil.copytree(src, work / "scittles-src", ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True, capture_output=True)
        pip = [str(work / "venv" / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        r = subprocess.run([*pip, "-e", str(work / "scittles-src"), "cbor2<6"], capture_output=True, text=True)
        if r.returncode != 0:
            raise PeerUnavailable(f"pip install scittles failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        (work / "ok").write_text("built\n")
        try:
            work.rename(final)  # atomic; fails if another process got there first
        except OSError:
            if not (final / "ok").exists():
                raise
        return final if (final / "ok").exists() else work
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_in_peer(code: str, *, venv: Path | None = None, timeout: float = 120.0) -> str:
    """Run Python ``code`` with scittles' own modules importable (``src.*``); its stdout."""
    venv = venv or ensure_venv()
    env = {**os.environ, "PYTHONPATH": str(venv / "scittles-src"), "SCITT_OTEL_ENABLED": "false"}
    with tempfile.TemporaryDirectory() as cwd:  # scittles' settings read a .env from the working folder
        r = subprocess.run([str(venv / "venv" / "bin" / "python"), "-c", code], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise PeerUnavailable(f"scittles code failed:\n{r.stderr[-3000:]}")
    return r.stdout


@dataclass
class Scittles:
    """A running scittles: ``url``, its data folder, the process."""

    url: str
    data: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, n: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


READY_LINE = b"Uvicorn running on "  # uvicorn's own line once it listens (printed at any SCITT_LOG_LEVEL)


def _copy_until_ready(proc: subprocess.Popen[bytes], log: Path, ready: threading.Event) -> None:
    """Copy the process's output to ``log`` line by line for as long as it runs; set ``ready`` at the
    line that says it listens, or at the end of its output (it exited: the caller reads why)."""
    assert proc.stdout is not None
    with open(log, "wb") as out:
        for line in proc.stdout:
            out.write(line)
            out.flush()
            if READY_LINE in line:
                ready.set()
    ready.set()


def start(data: Path, *, venv: Path | None = None, timeout: float = 60.0) -> Scittles:
    """Start scittles on a free loopback port with its own database and key; return once it says it
    listens (its output is read as it comes) and answers its configuration."""
    venv = venv or ensure_venv()
    data.mkdir(parents=True, exist_ok=True)
    for _ in range(3):  # the port is free when picked; retry if someone takes it before uvicorn binds
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "SCITT_HOST": "127.0.0.1", "SCITT_PORT": str(port), "SCITT_SERVICE_URL": url,
               "SCITT_SERVICE_ID": url, "SCITT_DB_PATH": str(data / "ts.db"),
               "SCITT_KEY_FILE": str(data / "ts-key.pem"), "SCITT_OTEL_ENABLED": "false",
               "SCITT_LOG_LEVEL": "WARNING"}
        log = data / f"scittles-{port}.log"
        proc = subprocess.Popen([str(venv / "venv" / "bin" / "python"), "-m", "src.main"], cwd=data,
                                env={**env, "PYTHONPATH": str(venv / "scittles-src")},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        peer = Scittles(url, data, proc, log)
        ready = threading.Event()
        copier = threading.Thread(target=_copy_until_ready, args=(proc, log, ready), name=f"scittles-{port}-log",
                                  daemon=True)
        copier.start()
        if ready.wait(timeout) and proc.poll() is None:
            with contextlib.suppress(urllib.error.URLError, OSError), urllib.request.urlopen(
                    f"{url}/.well-known/transparency-configuration", timeout=10) as r:
                if r.status == 200:
                    return peer
        peer.stop()
        copier.join(10)  # its last lines in the log before they are read
        if "address already in use" not in peer.log_tail().lower():
            raise PeerUnavailable(f"scittles did not start:\n{peer.log_tail()}")
    raise PeerUnavailable("scittles: no free port after 3 tries")


if __name__ == "__main__":  # build the cache ahead of a run: python -m tests.scittles_peer
    print(ensure_venv())


# -- the pytest plugin (tests/conftest.py lists this module in pytest_plugins) ---------------

try:
    import pytest
except ImportError:  # used as a script: python -m tests.scittles_peer
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(scope="session")
    def scittles(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
        """One real scittles for the session (venv built once and cached), on a free loopback port."""
        peer = start(tmp_path_factory.mktemp("scittles"))
        try:
            yield peer
        finally:
            peer.stop()
