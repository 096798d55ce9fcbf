"""The project's error hierarchy: one root, a small flat set of subclasses.

Each subclass carries typed attributes and builds its message in ``__init__``,
so callers never parse exception strings (STYLE.md "Errors").
"""

from __future__ import annotations

import os
from pathlib import Path


class PgwError(Exception):
    """Root of every error raised by Principal Gateway."""


class SubjectError(PgwError, ValueError):
    """A subject or subject token is not valid under the bus contract (DESIGN §2)."""

    def __init__(self, value: str, what: str, why: str) -> None:
        self.value = value
        self.what = what
        self.why = why
        super().__init__(f"invalid {what} {value!r}: {why}")


class WireError(PgwError, ValueError):
    """A message body does not decode to the expected wire type."""

    def __init__(self, type_name: str, why: str) -> None:
        self.type_name = type_name
        self.why = why
        super().__init__(f"not a valid {type_name}: {why}")


class ConfigError(PgwError):
    """The configuration is invalid; ``field`` names the offending setting."""

    def __init__(self, field: str, why: str) -> None:
        self.field = field
        self.why = why
        super().__init__(f"configuration error at {field}: {why}")


class CredentialsError(PgwError):
    """A credentials file is missing, unreadable, malformed, not private, or another party's."""

    def __init__(self, path: str | os.PathLike[str], why: str) -> None:
        self.path = Path(path)
        self.why = why
        super().__init__(f"credentials file {path}: {why}")


class NoConnectionError(PgwError):
    """A client of the bus could not connect: no server at the URL, or it refused the credentials."""

    def __init__(self, url: str, why: str, *, auth: bool) -> None:
        self.url = url
        self.why = why
        self.auth = auth
        super().__init__(f"cannot connect to {url}: {why}")


class RefusedError(PgwError):
    """A request-reply answer said no (resolution refused, kernel rejected...)."""

    def __init__(self, code: str, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"{code}: {reason}")
