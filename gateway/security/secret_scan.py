"""Secrets in the arguments of a gated action, found by a maintained detector (docs/gate.md).

SR-1 (spec 002 "Redaction", ``pipeline.secrets``) redacts the values an operator
configured; a principal who approves a tool call also must not be shown a key the
agent put in its arguments that nobody configured (``api_key=sk-live-...``). This
module runs the plugins of Yelp's ``detect-secrets`` (AWS, GitHub, GitLab, Slack,
Stripe, OpenAI, npm, PyPI, JWT, private keys, basic-auth URLs, keyword assignments
such as ``api_key=...`` or ``password: ...``, and high-entropy strings) over each
line of each string, and writes each finding as ``[REDACTED]``.

Only what the principal *reads* is redacted: the executor still receives the
arguments as sent (the kernel's open dispatch keeps them). The plugins' own
entropy limits and keyword rules decide; a file name of type YAML is given so that
the keyword plugin takes unquoted ``key = value`` and ``key: value`` assignments.
A plugin that reports only a prefix of a token (GitHub's ``ghp``) has the whole
token redacted: a match grows to the nearest quote, space, ``=``, ``:``, ``,``,
``;``, ``@``, ``/`` or bracket.
"""

from __future__ import annotations

import functools
import re
from typing import Any

REDACTED = "[REDACTED]"
_FILENAME = "arguments.yaml"  # the keyword plugin's loosest (config-file) rules
_BOUNDARY = set(" \t\r\n\"'`=:,;@/()[]{}<>")
_MAX_LINE = 4000  # a longer line is scanned in windows of this size (the plugins' regexes are linear)


@functools.cache
def _plugins() -> tuple[Any, ...]:
    from detect_secrets.settings import default_settings, get_plugins

    with default_settings():
        return tuple(get_plugins())


def _windows(line: str) -> list[tuple[int, str]]:
    if len(line) <= _MAX_LINE:
        return [(0, line)]
    step = _MAX_LINE // 2  # overlapping: a secret across a window edge is whole in the next one
    return [(i, line[i:i + _MAX_LINE]) for i in range(0, len(line), step)]


def _spans(line: str) -> list[tuple[int, int, str]]:
    out: list[tuple[int, int, str]] = []
    for base, part in _windows(line):
        for plugin in _plugins():
            try:
                found = plugin.analyze_line(filename=_FILENAME, line=part, line_number=0)
            except Exception:  # noqa: BLE001 - a plugin that fails on odd input finds nothing there
                continue
            for s in found:
                value = s.secret_value
                if not value:
                    continue
                for m in re.finditer(re.escape(value), part):
                    a, b = m.start(), m.end()
                    while a > 0 and part[a - 1] not in _BOUNDARY:
                        a -= 1
                    while b < len(part) and part[b] not in _BOUNDARY:
                        b += 1
                    out.append((base + a, base + b, s.type))
    return out


def redact_text(text: str) -> tuple[str, list[str]]:
    """``text`` with each secret the detector finds written ``[REDACTED]``, and the kinds found."""
    if len(text) < 8:
        return text, []
    kinds: list[str] = []
    lines = text.split("\n")
    for n, line in enumerate(lines):
        spans = sorted(_spans(line))
        if not spans:
            continue
        merged: list[list[int]] = []
        for a, b, kind in spans:
            if kind not in kinds:
                kinds.append(kind)
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out = line
        for a, b in reversed(merged):
            out = out[:a] + REDACTED + out[b:]
        lines[n] = out
    return "\n".join(lines), kinds


def redact_graph(value: Any, kinds: list[str] | None = None) -> Any:
    """``value`` (JSON data) with every string redacted by :func:`redact_text`; ``kinds`` collects what was found."""
    if isinstance(value, str):
        text, found = redact_text(value)
        if kinds is not None:
            kinds += [k for k in found if k not in kinds]
        return text
    if isinstance(value, dict):
        return {k: redact_graph(v, kinds) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_graph(v, kinds) for v in value]
    return value
