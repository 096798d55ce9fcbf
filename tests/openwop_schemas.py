"""The official OpenWOP schemas (tests/data/openwop, issue 15) as test-side checks.

``check_envelope``: the top level against ``ai-envelope.schema.json`` and, for
a kind the official repository publishes a payload schema for, the payload
against ``envelopes/{type}.schema.json``. A turn (a JSON array) is checked
envelope by envelope. Tests that send a deliberately non-official envelope
say so (``Recorder.send(..., official=False)``, ``deliberately_unofficial``).

``check_outcome``: the official schemas publish no document for an outcome
(spec 002 gives ``EnvelopeOutcome`` only as a TypeScript union), so an
outcome is checked against that union's closed values: ``status`` one of
accepted / gated / invalid / breached, ``cap_kind`` one of the spec's
``capKind`` values, and a ``breached`` outcome names its ``cap_kind``.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import msgspec

DATA = Path(__file__).parent / "data" / "openwop" / "schemas"
OUTCOME_STATUSES = {"accepted", "gated", "invalid", "breached"}  # spec 002 EnvelopeOutcome
CAP_KINDS = {"envelopes", "schema", "clarification"}  # spec 002 EnvelopeOutcome.capKind


class NotOfficial(AssertionError):
    """An envelope or outcome that the official OpenWOP schemas refuse."""


@cache
def _validator(name: str) -> jsonschema.protocols.Validator | None:
    path = DATA / name
    if not path.exists():
        return None
    schema = json.loads(path.read_text("utf-8"))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def payload_schema_exists(kind: str) -> bool:
    return _validator(f"envelopes/{kind}.schema.json") is not None


def official_errors(value: Any) -> list[str]:
    """Why ``value`` (one envelope or a turn) is not an official AI Envelope; [] when it is."""
    if isinstance(value, list):
        return [f"[{i}] {e}" for i, v in enumerate(value) for e in official_errors(v)]
    top = _validator("ai-envelope.schema.json")
    assert top is not None, "tests/data/openwop/schemas/ai-envelope.schema.json is missing"
    errs = [f"{'/'.join(map(str, e.absolute_path)) or '$'}: {e.message}" for e in top.iter_errors(value)]
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        per_kind = _validator(f"envelopes/{value['type']}.schema.json")
        if per_kind is not None:
            errs += [f"payload/{'/'.join(map(str, e.absolute_path))}: {e.message}"
                     for e in per_kind.iter_errors(value.get("payload"))]
    return errs


def check_envelope(value: Any) -> None:
    errs = official_errors(value)
    if errs:
        raise NotOfficial("envelope disagrees with the official OpenWOP schemas (mark it official=False if "
                          "that is the point of the test): " + "; ".join(errs[:5]))


def checked_envelope(value: Any) -> Any:
    check_envelope(value)
    return value


def check_outcome(data: bytes | dict[str, Any]) -> None:
    o = msgspec.json.decode(data) if isinstance(data, bytes | bytearray) else data
    if not isinstance(o, dict) or o.get("outcome") != "envelope_outcome":
        return  # resolutions, HEM decisions, schema answers: this host's own messages
    status, cap = o.get("status"), o.get("cap_kind")
    if status not in OUTCOME_STATUSES:
        raise NotOfficial(f"outcome status {status!r} is not a spec 002 EnvelopeOutcome status")
    if cap is not None and cap not in CAP_KINDS:
        raise NotOfficial(f"outcome cap_kind {cap!r} is not a spec 002 capKind")
    if status == "breached" and cap is None:
        raise NotOfficial("a breached outcome must name its capKind (spec 002 EnvelopeOutcome)")


def checked_outcome(data: bytes) -> bytes:
    check_outcome(data)
    return data
