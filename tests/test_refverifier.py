"""The reference-verifier fixture (tests/refverifier.py) runs the real PyPI package."""

from __future__ import annotations

from consumers import capsule_map
from tests import refverifier
from tests.test_capsule_model import SALT, design_rows


def test_reference_verifier_runs_and_can_say_no() -> None:
    """0.1.0 accepts a standalone capsule of ours and reports capsule_id_mismatch for an altered one."""
    built = capsule_map.capsule_from_verdict(design_rows()[1], operator="acme", salt=SALT, chained=False)
    good = built.to_dict()
    bad = dict(good, operator="someone-else")
    res = refverifier.run([good, bad])
    assert res[0].ok and not res[0].errors, res[0].findings
    assert res[0].recomputed == good["capsule_id"]
    assert not res[1].ok
    assert [f.code for f in res[1].errors] == ["capsule_id_mismatch"]
    assert (refverifier.cache_root() / f"aac-{refverifier.FORMAT_2_VERSION}").is_dir()
