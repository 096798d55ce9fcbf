"""The capsule profile setting (signer.capsule_format) and its dispatch point (consumers/profiles.py)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from consumers import profiles
from consumers.signer import Signer
from pgwcore.config import load_config
from subjects.errors import ConfigError


def test_capsule_format_setting() -> None:
    """signer.capsule_format takes "2" or "4" (default "4") and names the field on a bad value."""
    assert load_config(None).signer.capsule_format == "4"
    assert load_config(None, signer={"capsule_format": "2"}).signer.capsule_format == "2"
    for bad in ("3", 2, "format-2"):
        with pytest.raises(ConfigError, match="capsule_format"):
            load_config(None, signer={"capsule_format": bad})


def test_profile_dispatch() -> None:
    """Each format resolves to its profile; a stored payload resolves by its own format_version."""
    p2 = profiles.profile("2")
    assert p2.format_version == "2" and "draft-mih-scitt-agent-action-capsule-01" in p2.label
    assert profiles.profile_of({"format_version": "2"}) is p2
    p4 = profiles.profile("4")
    assert p4.format_version == "4" and "draft-mih-scitt-agent-action-capsule-05" in p4.label
    assert profiles.profile_of({"format_version": "4"}) is p4 and p4.outcomes and p4.sign is not None
    with pytest.raises(profiles.ProfileError, match="unknown"):
        profiles.profile("7")
    with pytest.raises(profiles.ProfileError, match="no format_version"):
        profiles.profile_of({})


async def test_signer_refuses_to_start_on_a_format_it_cannot_build(nc: Any, make_config: Any) -> None:
    """capsule_format "4" without its profile module fails at start, naming the module; with it, the
    signer runs format 4."""
    config = make_config(signer={"capsule_format": "4"})
    if importlib.util.find_spec(profiles.MODULES["4"]) is None:
        with pytest.raises(profiles.ProfileError, match=profiles.MODULES["4"]):
            async with Signer(config, nc):
                pass
    else:
        async with Signer(config, nc) as signer:
            assert signer.profile.format_version == "4"
