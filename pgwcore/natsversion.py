"""The nats-py release pgw is built for, checked when ``pgwcore`` is imported.

Several platform modules read nats-py internals to save CPU on the hot paths
(issue 32): :mod:`pgwcore.pubbatch` (the command bytes, the flusher's queue),
:mod:`pgwcore.pull` (a pull subscription's fields), :mod:`pgwcore.delivery`
(a subscription's pending queue and task), :mod:`pgwcore.atomic` and
:mod:`pgwcore.headerparse`. Those names are private and change between
minor releases (nats-py 2.15 lacks names ``pubbatch`` imports), so
pyproject.toml admits only the minor series below, and an environment that
holds another one (``pip install --no-deps``, a pinned older copy) fails at
import with this error instead of an ``ImportError`` or ``AttributeError``
somewhere on the hot path. To move to a new series: run the tests that hold
those modules to nats-py's own behaviour (``tests/test_pubbatch.py``,
``test_pull.py``, ``test_delivery.py``, ``test_atomic.py``,
``test_headerparse.py``, ``test_kvread.py``) against it, then change
:data:`SERIES` and pyproject.toml together (``tests/test_natsversion.py``
checks that they agree).
"""

from __future__ import annotations

import re

SERIES = (2, 16)  # major, minor


class NatsVersionError(ImportError):
    """The installed nats-py is not the series pgw reads the internals of."""


def parse(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``2.16.0``, ``2.16.1rc1`` or ``2.17rc1``."""
    got = re.match(r"(\d+)\.(\d+)", version)
    if got is None:
        raise NatsVersionError(f"unreadable nats-py version {version!r}")
    return int(got[1]), int(got[2])


def check(version: str | None = None) -> None:
    """Raise :class:`NatsVersionError` unless ``version`` (default: the installed nats-py's) is of
    :data:`SERIES`."""
    if version is None:
        from nats.aio.client import __version__ as version
    if parse(version) != SERIES:
        want = ".".join(map(str, SERIES))
        raise NatsVersionError(
            f"pgw needs nats-py {want}.x and found {version}: pgwcore reads nats-py internals that differ "
            f"between minor releases (pgwcore/natsversion.py); install it with: pip install 'nats-py~={want}.0'")
