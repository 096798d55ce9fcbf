"""A command given something wrong says what, in one line, and exits non-zero: never a traceback.

Each case is what a person types by mistake: a path that is not there, a key file that is not a
key, a stream or subject that does not exist, a server that is not running."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from nats.js.api import StreamConfig

from consumers.notify.store import DLQ_STREAM
from gateway.security import EmbeddedAuth, Party, embedded_auth
from pgwcore.config import load_config
from pgwcore.connect import connect
from pgwcore.server import EmbeddedServer
from pgwcore.streams import ensure_streams

PGW = str(Path(sys.executable).parent / "pgw")


async def _pgw(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(PGW, "--log-format", "json", *args, env={**os.environ, **(env or {})},
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[tuple[str, EmbeddedAuth]]:
    """A server enforcing per-party permissions, as `pgw up` starts it (agent a1 -> p1, ops user oncall),
    its streams made and one envelope stored; (its URL, the parties' credentials)."""
    config = load_config(None, data_dir=str(tmp_path / "d"), agents={"a1": {"principals": ["p1"]}},
                         security={"ops": ["oncall"]})
    auth = embedded_auth(config)
    async with EmbeddedServer(tmp_path / "nats", port=-1, monitor_port=None, websocket_port=None,
                              authorization=auth.server_block) as server:
        service = await connect(server.client_url, creds=str(auth.service_creds))
        try:
            await ensure_streams(service.jetstream(), config.subjects)
            await service.jetstream().publish("pgw.agent.a1.envelope", b"{}", headers={"Nats-Msg-Id": "a1:x"})
        finally:
            await service.close()
        yield server.client_url, auth


def _creds(auth: EmbeddedAuth, role: str, name: str) -> str:
    return str(auth.creds_for(Party(role, name)))


async def test_each_mistake_is_one_clear_line(nats_server, nc, tmp_path: Path) -> None:
    url = nats_server.client_url
    data = str(tmp_path / "data")
    not_a_key = tmp_path / "notes.txt"
    not_a_key.write_text("not a key\n")
    ec_key = tmp_path / "p256.pem"  # a real PEM public key, but P-256: the capsule and log keys are Ed25519
    ec_key.write_bytes(ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    cases = {
        "verify a file that is not there": (
            ("verify", str(tmp_path / "missing.cose")), "cannot read", "missing.cose"),
        "verify with a key file that is not there": (
            ("verify", "--key", str(tmp_path / "k.pem"), str(not_a_key)), "not a readable PEM public key", "k.pem"),
        "verify with a key of another kind": (
            ("verify", "--key", str(ec_key), str(not_a_key)), "is not an Ed25519 public key", "p256.pem"),
        "verify a stream that does not exist": (
            ("--server", url, "--data-dir", data, "verify", "--stream", "NOPE"), "stream 'NOPE' does not exist", "pgw streams"),
        "log verify a stream that does not exist": (
            ("--server", url, "--data-dir", data, "log", "verify", "--stream", "NOPE"), "stream 'NOPE' does not exist", "pgw streams"),
        "log verify with a key that is not a key": (
            ("--server", url, "--data-dir", data, "log", "verify", "--pubkey", str(not_a_key)), "not a readable PEM public key",
            "notes.txt"),
        "log verify with a key of another kind": (
            ("--server", url, "--data-dir", data, "log", "verify", "--pubkey", str(ec_key)), "is not an Ed25519 public key",
            "p256.pem"),
        "tail something that is not a subject": (
            ("--server", url, "tail", "pgw verdict", "--count", "1"), "is not a NATS subject", "'pgw verdict'"),
        "tail the history of a subject no stream stores": (
            ("--server", url, "tail", "nostream.x", "--all", "--count", "1"), "no stream stores 'nostream.x'", "watched live"),
        "tail the history of a subject several streams store": (
            ("--server", url, "tail", "pgw.>", "--all", "--count", "1"), "'pgw.>' is stored by", "PGW_VERDICTS"),
        "tail with no server running": (
            ("--server", "nats://127.0.0.1:1", "tail", "pgw.>", "--count", "1"), "cannot connect to nats://127.0.0.1:1", ""),
        "replay a subject no stream stores": (
            ("--server", url, "replay", "--subject", "no.such", "--dry-run"), "no stream holds subject 'no.such'", ""),
        "a mandate for a governed object that is not a UUID v4": (
            ("--data-dir", data, "mandate", "issue", "--agent", "bot", "--so-id", "booking-17", "--principal", "alice",
             "--action", "CloseBooking"), "is not a UUID v4", "spec 003"),
        "a mandate for an agent name no subject can carry": (
            ("--data-dir", data, "mandate", "issue", "--agent", "bad agent", "--so-id", "0a4c661a-4172-40d7-9aab-b1073e9c1bcb",
             "--principal", "alice", "--action", "CloseBooking"), "invalid agent token 'bad agent'", ""),
    }
    results = await asyncio.gather(*(_pgw(*args) for args, _, _ in cases.values()))
    for (what, (_, said, also)), (rc, _out, err) in zip(cases.items(), results, strict=True):
        assert rc != 0, what
        assert "Traceback" not in err, (what, err)
        assert said in err and also in err, (what, err)


async def test_dead_letters_of_an_empty_stream_are_none(nats_server, nc) -> None:
    """The dead-letter stream exists (the notifier made it) and is empty: `pgw notifications --dead`
    lists none (an empty stream's first and last sequence are 0, which a message get refuses)."""
    await nc.jetstream().add_stream(StreamConfig(name=DLQ_STREAM, subjects=["pgw.notify.deadletter"]))
    rc, out, err = await _pgw("--server", nats_server.client_url, "notifications", "--dead")
    assert rc == 0, err
    assert "0 dead letter(s)" in out


async def test_what_the_credentials_may_not_do_is_said(secured: tuple[str, EmbeddedAuth]) -> None:
    """On a server enforcing per-party permissions the server drops what a user may not publish and tells
    nobody: an agent's `pgw streams`, and an ops user's replay that would publish, end with a line saying
    so (they were nats TimeoutError tracebacks)."""
    url, auth = secured
    agent, ops = _creds(auth, "agent", "a1"), _creds(auth, "ops", "oncall")
    (rc1, _, err1), (rc2, _, err2) = await asyncio.gather(
        _pgw("--server", url, "--creds", agent, "streams"),
        _pgw("--server", url, "--creds", ops, "replay", "--stream", "PGW_INBOUND", "--from-seq", "1"))
    assert rc1 == 1 and "Traceback" not in err1
    assert "did not answer a request in time (asked at " in err1, err1  # which request, in this project's code
    assert ".py:" in err1.split("(asked at ", 1)[1].split(")", 1)[0], err1
    assert "these credentials may not be allowed it" in err1
    assert rc2 != 0 and "Traceback" not in err2
    assert "these credentials may not publish it" in err2 and "--dry-run" in err2


async def test_a_revocation_with_no_gateway_running_says_so(nats_server, tmp_path: Path) -> None:
    """`pgw mandate revoke` with nobody to answer: a clear error and exit 1, never a traceback."""
    rc, _, err = await _pgw("--server", nats_server.client_url, "--data-dir", str(tmp_path / "d"),
                            "mandate", "revoke", "jti-1", "--reason", "test")
    assert rc == 1
    assert "no gateway answers on pgw.kernel.revoke" in err and "pgw up" in err
    assert "Traceback" not in err


async def test_a_kernel_request_these_credentials_may_not_send_names_who_may(
        secured: tuple[str, EmbeddedAuth], tmp_path: Path) -> None:
    """An agent's credentials cannot publish `kernel.revoke`: the server drops the publish, the request times
    out, and the error says who may send it. Asking as auditor carol with the agent's file is refused before
    connecting, in one line naming whose file it is and carol's own."""
    url, auth = secured
    common = ("--server", url, "--data-dir", str(tmp_path / "d"), "--creds", _creds(auth, "agent", "a1"))
    (rc1, _, err1), (rc2, _, err2) = await asyncio.gather(
        _pgw(*common, "mandate", "revoke", "jti-1", "--timeout", "1"),
        _pgw(*common, "audit", "session", "s-1", "--agent", "a1", "--auditor", "carol", "--timeout", "1"))
    assert rc1 == 1 and "Traceback" not in err1
    assert "no answer on pgw.kernel.revoke within 1 s" in err1 and "ops users may send revocations" in err1
    assert rc2 == 2 and "Traceback" not in err2 and err2.count("\n") == 1, err2
    assert "agent:a1's credentials, not audit:carol's" in err2 and "audit-carol.creds" in err2


async def test_a_surface_on_a_taken_port_or_for_a_stranger_says_so(nats_server, tmp_path: Path) -> None:
    """`pgw surface-web` on a port another process holds exits with one line (it was an OSError traceback);
    for a principal `pgw up` made no credentials for, it first warns that the page will be refused."""
    import socket

    data = tmp_path / "data"
    (data / "creds").mkdir(parents=True)  # as `pgw up` leaves it, with no file for ~zed
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        rc, _, err = await _pgw("--server", nats_server.client_url, "--data-dir", str(data),
                                "surface-web", "--principal", "zed", "--port", port)
    assert rc == 1 and "Traceback" not in err
    assert "address already in use" in err and "another process" in err
    assert "no credentials for ~zed" in err


async def test_a_bad_log_level_or_metrics_port_is_said_before_anything_runs(tmp_path: Path) -> None:
    """From the command line or the environment: a usage error naming the setting (a KeyError or ValueError
    traceback before)."""
    cases = [
        ({}, ("--log-level", "loud", "schema"), "'loud' is not a log level"),
        ({"PGW_LOG_LEVEL": "loud"}, ("schema",), "'loud' is not a log level"),
        ({}, ("--metrics-port", "99999", "schema"), "'99999' is not a TCP port"),
        ({"PGW_METRICS_PORT": "abc"}, ("schema",), "PGW_METRICS_PORT: 'abc' is not a TCP port"),
    ]
    results = await asyncio.gather(*(_pgw(*args, env=env) for env, args, _ in cases))
    for (_, args, said), (rc, _, err) in zip(cases, results, strict=True):
        assert rc == 2 and "Traceback" not in err, (args, err)
        assert said in err, (args, err)
    rc, _, err = await _pgw("--data-dir", str(tmp_path), "schema", "Verdict", env={"PGW_LOG_LEVEL": "warning"})
    assert rc == 0, err
