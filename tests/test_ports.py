"""Free ports for the tests' own servers (tests/ports.py) and the peers that retry a port taken before their bind."""

from __future__ import annotations

import socket
from pathlib import Path

from tests import notify_peers
from tests.chaos import harness
from tests.ports import free_port, held_port


def test_free_ports_are_drawn_below_the_kernels_ephemeral_range() -> None:
    """free_port gives bindable loopback ports from 20000-32000, below where the kernel hands out port-0
    listeners and outgoing connections, and the chaos harness hands out the same function."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(20000 <= p <= 32000 < low for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    assert harness.free_port is free_port


def test_the_smtp_peer_starts_on_a_new_port_when_its_port_was_taken(tmp_path, monkeypatch) -> None:
    """When another process binds the port the SMTP peer drew before the peer binds it, the peer starts on a
    new port and answers there, rather than failing the test that wanted it."""
    monkeypatch.setenv("AIOSMTPD_CONTROLLER_TIMEOUT", "2.0")  # aiosmtpd waits this long before it reports the bind
    with held_port() as taken:
        draws = iter([taken])
        monkeypatch.setattr(notify_peers, "free_port", lambda: next(draws, None) or free_port())
        with notify_peers.smtp_server(tmp_path) as relay:
            assert relay.port != taken
            with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as c:
                assert c.recv(1024).startswith(b"220 ")

