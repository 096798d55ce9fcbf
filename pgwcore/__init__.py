"""The platform every pgw process shares (issue 18, docs/architecture.md).

Connection and credentials, the embedded nats-server, acked and atomic
publishing, the JetStream streams and KV buckets, signing keys, logging, the
event loop, metrics, the services API, the service life cycle and the one
configuration file. ``gateway/`` and ``consumers/`` both import it; it imports
nothing from either (tests/test_architecture.py).
"""

from pgwcore import natsversion as _natsversion

_natsversion.check()  # before any module that reads nats-py internals is imported
