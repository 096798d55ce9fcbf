"""Free loopback ports for the servers tests start themselves (peers, stand-ins, services).

Standard library only, so a peer module can import it without the chaos
harness's imports. ``tests.chaos.harness`` re-exports ``free_port``.
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator


def free_port() -> int:
    """A loopback port nothing listens on now. Drawn at random below Linux's ephemeral range
    (32768-60999), where the kernel hands out port-0 listeners (every test's embedded nats-server)
    and outgoing connections: one taken from there can be given to another process before its user
    binds it. Port 0's answer only if none of 200 draws is free.

    Nothing holds the port once this returns: another test worker may still draw it before the
    caller binds. A caller that starts a server on it retries on a new port when the bind fails
    with "address already in use" (``tests.scittles_peer.start``, ``tests.notify_peers.smtp_server``,
    ``start_cluster`` in tests/chaos/test_chaos_cluster.py, ``start_listening`` in
    tests/test_surface_slack_kill9.py)."""
    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A loopback port another process listens on while the block runs (as a test worker that drew it
    first would): for the tests of a server's retry on a taken port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        yield s.getsockname()[1]
