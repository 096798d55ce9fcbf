"""A counting spy for the tests that prove work is done once (or not at all)."""

from __future__ import annotations

from typing import Any

import pytest


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[tuple[Any, ...]]:
    """Replace ``owner.name`` with a spy that calls it as before; the list of each call's arguments, in order."""
    calls: list[tuple[Any, ...]] = []
    real = getattr(owner, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls
