"""The old import path of the connection helper, kept working.

The README showed ``await gateway.connect.connect(url, creds=...)`` before the
platform moved to :mod:`pgwcore` (docs/architecture.md); scripts written
against it keep working through this re-export.
"""

from pgwcore.connect import connect

__all__ = ["connect"]
