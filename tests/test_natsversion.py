"""pgw imports only with the nats-py series whose internals pgwcore reads (pgwcore/natsversion.py)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from pgwcore import natsversion

ROOT = Path(__file__).resolve().parent.parent


def _nats_requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found = [r for r in map(Requirement, deps) if r.name == "nats-py"]
    assert len(found) == 1
    return found[0]


def test_pyproject_admits_exactly_the_checked_series() -> None:
    spec = _nats_requirement().specifier
    major, minor = natsversion.SERIES
    assert f"{major}.{minor}.0" in spec and f"{major}.{minor}.9" in spec
    assert f"{major}.{minor - 1}.99" not in spec  # an older series lacks names pgwcore imports
    assert f"{major}.{minor + 1}.0" not in spec  # a newer one is not checked yet


def test_the_installed_nats_py_is_of_the_series() -> None:
    from nats.aio.client import __version__

    natsversion.check(__version__)
    assert __version__ in _nats_requirement().specifier


@pytest.mark.parametrize("version", ["2.15.0", "2.9.1", "2.17.0", "2.161.0", "2.1rc6", "3.0.0"])
def test_another_series_is_refused_by_name(version: str) -> None:
    with pytest.raises(natsversion.NatsVersionError, match=rf"needs nats-py 2\.16\.x and found {version}"):
        natsversion.check(version)


@pytest.mark.parametrize("version", ["2.16.0", "2.16.3", "2.16.1rc1", "2.16rc1"])
def test_a_release_of_the_series_passes(version: str) -> None:
    natsversion.check(version)


def test_an_unreadable_version_is_refused() -> None:
    with pytest.raises(natsversion.NatsVersionError, match="unreadable"):
        natsversion.check("dev")


def test_importing_pgwcore_with_another_series_fails_with_the_clear_error(tmp_path: Path) -> None:
    """An environment holding nats-py 2.15 (say) fails at ``import pgwcore`` with the message, not with
    an ImportError from deep in pubbatch: a stand-in ``nats`` package reporting 2.15.0 is put first."""
    fake = tmp_path / "nats" / "aio"
    fake.mkdir(parents=True)
    (tmp_path / "nats" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "client.py").write_text('__version__ = "2.15.0"\n')
    code = "import pgwcore"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}, check=False)
    assert got.returncode != 0
    assert "NatsVersionError: pgw needs nats-py 2.16.x and found 2.15.0" in got.stderr
