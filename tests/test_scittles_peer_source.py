"""Where the suite finds scittles' source (tests/scittles_peer.py), also from a clone made elsewhere."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests import scittles_peer


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_a_clone_of_a_local_checkout_finds_the_peer_beside_its_origin(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    main = tmp_path / "work" / "main"
    peer = tmp_path / "work" / "shared" / "peers" / "scittles"
    peer.mkdir(parents=True)
    (peer / "pyproject.toml").write_text("[project]\nname = 'scittles'\n")
    main.mkdir()
    _git("init", "-q", cwd=main)
    (main / "README.md").write_text("x\n")
    _git("add", "README.md", cwd=main)
    _git("-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", "x", cwd=main)
    fresh = tmp_path / "elsewhere" / "fresh"
    fresh.parent.mkdir()
    _git("clone", "-q", str(main), str(fresh), cwd=tmp_path)

    monkeypatch.delenv("PGW_SCITTLES_SRC", raising=False)
    found = scittles_peer.source_candidates(fresh)
    assert found == [tmp_path / "elsewhere" / "shared" / "peers" / "scittles", peer.resolve()]
    # The checkout itself has no origin: only its own ../shared.
    assert scittles_peer.source_candidates(main) == [peer]

    monkeypatch.setenv("PGW_SCITTLES_SRC", str(tmp_path / "mine"))
    assert scittles_peer.source_candidates(fresh)[0] == tmp_path / "mine"


def test_no_source_anywhere_names_every_place_looked_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGW_SCITTLES_SRC", str(tmp_path / "nowhere"))
    monkeypatch.setattr(scittles_peer, "REPO", tmp_path / "repo")
    with pytest.raises(scittles_peer.PeerUnavailable, match="PGW_SCITTLES_SRC") as e:
        scittles_peer.find_source()
    assert str(tmp_path / "nowhere") in str(e.value) and str(tmp_path / "shared" / "peers" / "scittles") in str(e.value)
