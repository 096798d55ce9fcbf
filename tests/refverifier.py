"""The spec authors' reference verifier (PyPI ``agent-action-capsule``) as a test peer.

Interop is proved against the other side's own code: this module installs the
published reference verifier into a folder of its own and runs its CLI over
capsule payloads, returning its structured results. Nothing of the
reference is reimplemented here.

- :func:`install` puts ``agent-action-capsule==VERSION`` under
  ``~/.cache/pgw-peers/aac-VERSION`` with ``pip install --target`` (versions
  side by side: 0.1.0 verifies format "2", 0.3.0 and later format "4"). It is
  built once and reused; on a clean machine it is built in a temporary folder
  next to the cache entry and renamed into place, so two pytest processes
  building it at once cannot leave a half-installed copy (the loser of the
  rename throws its copy away).
- :func:`run` writes the payloads as one JSON array (the store, in the order
  given: ledger order) and runs ``python -m agent_action_capsule.cli verify
  --store FILE --json`` with the installed copy first on ``PYTHONPATH``; both
  0.1.0 and 0.12.0 answer with one result object per capsule.

``PGW_PEERS_CACHE`` overrides the cache root (default ``~/.cache/pgw-peers``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbor2

PACKAGE = "agent-action-capsule"
MODULE = "agent_action_capsule"
FORMAT_2_VERSION = "0.1.0"  # the last release that verifies format "2" (spec 004 as in ../shared/specs)


class RefVerifierError(RuntimeError):
    """The reference verifier could not be installed or could not run (not: it ran and said no)."""


def cache_root() -> Path:
    return Path(os.environ.get("PGW_PEERS_CACHE") or Path.home() / ".cache" / "pgw-peers")


def install(version: str = FORMAT_2_VERSION, *, extras: Iterable[str] = ()) -> Path:
    """The folder holding ``agent-action-capsule==version`` (installed on first use)."""
    extras = sorted(extras)
    name = f"aac-{version}" + ("".join(f"+{e}" for e in extras))
    final = cache_root() / name
    if (final / MODULE / "__init__.py").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    spec = f"{PACKAGE}{'[' + ','.join(extras) + ']' if extras else ''}=={version}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the installed copy is readable like any cache entry
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--no-input", "--target", str(tmp), spec],
            capture_output=True, text=True, timeout=600, check=False,
        )
        if proc.returncode != 0:
            raise RefVerifierError(f"pip install {spec} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        if not (tmp / MODULE / "__init__.py").is_file():
            raise RefVerifierError(f"pip install {spec} left no {MODULE} package in {tmp}")
        try:
            tmp.rename(final)
        except OSError:
            # Another process renamed its copy first (the target exists and is not empty).
            if not (final / MODULE / "__init__.py").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@dataclass
class RefFinding:
    code: str
    severity: str
    detail: str
    check: int | None = None


@dataclass
class RefResult:
    """One capsule's result from the reference verifier, as it reported it."""

    ok: bool
    capsule_id: str | None  # the capsule_id the capsule carries
    recomputed: str | None  # the reference's own recomputation
    derived: dict[str, Any] = field(default_factory=dict)
    findings: list[RefFinding] = field(default_factory=list)

    @property
    def errors(self) -> list[RefFinding]:
        return [f for f in self.findings if f.severity == "error"]


def payload_of_statement(statement: bytes) -> dict[str, Any]:
    """The capsule JSON carried by a COSE_Sign1 (tagged or not), decoded without our own code."""
    obj = cbor2.loads(statement)
    if isinstance(obj, cbor2.CBORTag):
        obj = obj.value
    payload = obj[2]
    return json.loads(payload)


def _as_payload(item: bytes | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(item, (bytes, bytearray)):
        return payload_of_statement(bytes(item))
    return dict(item)


def run(capsules: Iterable[bytes | Mapping[str, Any]], *, version: str = FORMAT_2_VERSION,
        workdir: Path | None = None) -> list[RefResult]:
    """Run the reference verifier's store verification over ``capsules`` (statements or payloads).

    The results come back in the order given; the store is the whole set.
    Raises :class:`RefVerifierError` when the verifier could not run.
    """
    payloads = [_as_payload(c) for c in capsules]
    home = install(version)
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pgw-aac-")))
        store = workdir / f"store-{version}.json"
        store.write_text(json.dumps(payloads))
        env = dict(os.environ)
        env["PYTHONPATH"] = str(home)
        env.pop("PYTHONHOME", None)
        proc = subprocess.run(
            [sys.executable, "-s", "-m", f"{MODULE}.cli", "verify", "--store", str(store),
             "--json"],
            capture_output=True, text=True, env=env, timeout=300, check=False, cwd=workdir,
        )
    if proc.returncode not in (0, 1):
        raise RefVerifierError(f"{PACKAGE} {version} could not run ({proc.returncode}): {proc.stderr[-2000:]}")
    try:
        raw = json.loads(proc.stdout)
    except ValueError as e:
        raise RefVerifierError(f"{PACKAGE} {version} answered no JSON: {proc.stdout[:500]!r}") from e
    if not isinstance(raw, list) or len(raw) != len(payloads):
        raise RefVerifierError(f"{PACKAGE} {version} answered {len(raw)} results for {len(payloads)} capsules")
    out = []
    for p, r in zip(payloads, raw, strict=True):
        out.append(RefResult(
            ok=bool(r.get("ok")),
            capsule_id=p.get("capsule_id"),
            recomputed=r.get("capsule_id_recomputed"),
            derived=r.get("derived") or {},
            findings=[RefFinding(f.get("code", ""), f.get("severity", ""), f.get("detail", ""), f.get("check"))
                      for f in r.get("findings") or []],
        ))
    return out


def summary(results: list[RefResult]) -> dict[str, Any]:
    """Counts for docs/capsules.md's table of outside checks."""
    codes: dict[str, int] = {}
    for r in results:
        for f in r.errors:
            codes[f.code] = codes.get(f.code, 0) + 1
    return {"capsules": len(results), "accepted": sum(r.ok for r in results), "error_codes": codes}
