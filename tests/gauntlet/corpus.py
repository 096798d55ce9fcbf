"""The hostile-input corpus (issue 7 "Hostile input gauntlet").

Each :class:`Case` is a raw message body. ``generic_cases`` are run through
every inbound subject (envelope, idp, transition, resolve, moment); the other
functions build subject-specific cases that put hostile values into every
slot of that subject's message.

Categories follow the JSONTestSuite ``n_`` files (bodies a parser must
reject) plus the resource attacks of DESIGN §3.2/§7.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tests.moments import GOOD_MOMENT


@dataclass(frozen=True)
class Case:
    name: str
    category: str
    body: bytes

    def __repr__(self) -> str:  # keep pytest ids and failure output short
        return f"Case({self.name!r}, {len(self.body)} bytes)"


MB = 1024 * 1024

# JSONTestSuite n_ categories: documents every conforming parser must reject.
JSON_MUST_REJECT: dict[str, bytes] = {
    "trailing comma in object": b'{"type": "x", "payload": {},}',
    "trailing comma in array": b'[{"type": "x"},]',
    "double comma": b'[1,,2]',
    "missing colon": b'{"type" "x"}',
    "single quotes": b"{'type': 'x'}",
    "unquoted key": b'{type: "x"}',
    "comment": b'{"type": "x" /* c */}',
    "invalid escape \\x": b'{"type": "\\x41"}',
    "invalid escape \\u short": b'{"type": "\\u12"}',
    "invalid escape \\U": b'{"type": "\\U0001F600"}',
    "bare control char in string": b'{"type": "a\x01b"}',
    "bare newline in string": b'{"type": "a\nb"}',
    "bare tab in string": b'{"type": "a\tb"}',
    "NUL byte in string": b'{"type": "a\x00b"}',
    "truncated object": b'{"type": "x", "payload": {"a": ',
    "truncated string": b'{"type": "x',
    "truncated array": b"[1, 2",
    "truncated literal": b"tru",
    "leading zero": b'{"n": 01}',
    "plus sign": b'{"n": +1}',
    "bare decimal point": b'{"n": .5}',
    "trailing decimal point": b'{"n": 1.}',
    "hex number": b'{"n": 0x1F}',
    "empty body": b"",
    "whitespace only": b" \t\r\n ",
    "word joiner only": "\u2060".encode(),
    "two documents": b'{"a": 1}{"b": 2}',
    "UTF-8 BOM": b"\xef\xbb\xbf{}",
    "lone surrogate escape": b'{"type": "\\ud800", "payload": {}}',
    "reversed surrogate pair": b'{"type": "\\udc00\\ud800"}',
}

INVALID_UTF8: dict[str, bytes] = {
    "invalid byte 0xff": b'{"type": "\xff"}',
    "overlong encoding of /": b'{"type": "\xc0\xaf"}',
    "UTF-8 encoded surrogate": b'{"type": "\xed\xa0\x80"}',
    "truncated multibyte": b'{"type": "\xe2\x82"}',
    "latin-1 body": '{"type": "café"}'.encode("latin-1"),
}


def nested(depth: int, open_: str = "[", close: str = "]", leaf: str = "1") -> bytes:
    return (open_ * depth + leaf + close * depth).encode()


RESOURCE: dict[str, bytes] = {
    "nesting 10,000 deep (arrays)": nested(10_000),
    "nesting 10,000 deep (objects)": ('{"a":' * 10_000 + "1" + "}" * 10_000).encode(),
    "10 MB body": b'{"type": "x", "payload": "' + b"A" * (10 * MB) + b'"}',
    "100k-element array": b"[" + b",".join(b"0" for _ in range(100_000)) + b"]",
    "100k-key object": b"{" + b",".join(f'"k{i}":0'.encode() for i in range(100_000)) + b"}",
    "duplicate keys": b'{"type": "a", "type": "b", "payload": {}}',
    "NaN": b'{"type": "x", "payload": NaN}',
    "Infinity": b'{"type": "x", "payload": Infinity}',
    "-Infinity": b'{"type": "x", "payload": -Infinity}',
    "5,000-digit integer": b'{"type": "x", "payload": ' + b"9" * 5000 + b"}",
    "5,000-digit float": b'{"type": "x", "payload": 0.' + b"1" * 5000 + b"}",
    "exponent overflow": b'{"type": "x", "payload": 1e999999}',
    "scalar document": b"42",
    "null document": b"null",
    "string document": b'"envelope"',
    "empty array": b"[]",
    "empty object": b"{}",
}


def generic_cases() -> list[Case]:
    out = [Case(n, "JSON n_ (must reject)", b) for n, b in JSON_MUST_REJECT.items()]
    out += [Case(n, "invalid UTF-8", b) for n, b in INVALID_UTF8.items()]
    out += [Case(n, "resource / number attacks", b) for n, b in RESOURCE.items()]
    return out


# A curated slice of the Big List of Naughty Strings (minimaxir/big-list-of-naughty-strings).
NAUGHTY: list[str] = [
    "undefined", "null", "NULL", "None", "NaN", "Infinity", "-1", "0x0", "1E+02", "$1.00",
    "' OR 1=1 --", "'; DROP TABLE moments; --", "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>", "javascript:alert(1)", "{{7*7}}", "${jndi:ldap://x/a}",
    "%s%s%s%n", "{0}{1}", "../../../../etc/passwd", "\\\\server\\share", "$(reboot)", "`rm -rf /`",
    "\u202eevil\u202c", "\u2066isolate\u2069", "\u200b\u200c\u200d\ufeff", "\U000e0041\U000e0042",
    "Ṱ̺̺̕o͞ ̷i̲̬͇̪͙n̝̗͕v̟̜̘̦͟o̶̙̰̠kè͚̮̺̪̹̱̤ ̖t̝͕̳̣̻̪͞h̼͓̲̦̳̘̲e͇̣̰̦̬͎ ̢̼̻̱̘h͚͎͙̜̣̲ͅi̦̲̣̰̤v̻͍e̺̭̳̪̰-m̢iͅn̖̺̞̲̯̰d̵̼̟͙̩̼̘̳",
    "田中さんにあげて下さい", "사회과학원 어학연구소", "𠜎𠜱𠝹𠱓", "👨‍👩‍👧‍👦🏳️‍🌈", "🇺🇸🇷🇺🇸",
    "ثم نفس سقطت وبالتحديد", "בְּרֵאשִׁית", "\x00", "\x1b[31mred\x1b[0m", "\r\n\r\nX-Injected: 1",
    "ﷺ" * 50, "Ω≈ç√∫˜µ≤≥÷", "ｔｅｓｔ", "secret:swordfish", " ", "",
]

OVERLONG = "L" * 100_000  # over every string limit, under the 1 MB body limit


def _moment_env(agent: str, principal: str, eid: str) -> dict[str, Any]:
    return {
        "type": "vendor.pgw.binding_moment",
        "envelopeId": eid,
        "correlationId": eid,
        "meta": {"source": "ai-generation", "ts": "2026-01-01T00:00:00Z", "label": "gauntlet"},
        "payload": {"principal": principal, "binding_moment": copy.deepcopy(GOOD_MOMENT),
                    "conventional": {"text": "fallback"}},
    }


# Every string slot of a binding-moment envelope, as a path into the dict.
ENVELOPE_SLOTS: list[tuple[str | int, ...]] = [
    ("type",), ("envelopeId",), ("correlationId",), ("meta", "label"), ("meta", "traceparent"), ("meta", "ts"),
    ("payload", "principal"), ("payload", "conventional", "text"),
    ("payload", "binding_moment", "synopsis"), ("payload", "binding_moment", "findings", 0),
    ("payload", "binding_moment", "recommendations", 0), ("payload", "binding_moment", "offer"),
    ("payload", "binding_moment", "question", "stem"),
    ("payload", "binding_moment", "question", "options", 0, "label"),
    ("payload", "binding_moment", "question", "options", 1, "reasoning"),
    ("payload", "binding_moment", "meta", "decision_class"),
]
# Text a human reads in the decision (meta.label is for ops dashboards only).
LABEL_SLOTS = [s for s in ENVELOPE_SLOTS if s[0] == "payload" and s[-1] in ("label", "stem", "synopsis")]


def _set(d: Any, path: tuple[str | int, ...], value: Any) -> None:
    for p in path[:-1]:
        d = d[p]
    d[path[-1]] = value


def _slot(path: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in path)


def envelope_cases(agent: str, principal: str) -> Iterator[tuple[Case, str]]:
    """(case, envelopeId) pairs: hostile values in every slot of a valid binding-moment envelope."""
    n = 0

    def make(name: str, category: str, mutate: Any) -> tuple[Case, str]:
        nonlocal n
        n += 1
        eid = f"gauntlet-{n}"
        env = _moment_env(agent, principal, eid)
        mutate(env)
        ident = env.get("envelopeId") if isinstance(env.get("envelopeId"), str) else eid
        return Case(name, category, json.dumps(env, ensure_ascii=False).encode("utf-8", "surrogatepass")), ident

    for slot in ENVELOPE_SLOTS:
        yield make(f"overlong string in {_slot(slot)}", "overlong strings", lambda e, s=slot: _set(e, s, OVERLONG))
    for slot in LABEL_SLOTS:
        for tag, text in (("bidi override", "Approve \u202eyned\u202c"), ("tag characters", "Approve\U000e0020\U000e0064\U000e0065\U000e006e\U000e0079"),
                          ("bidi isolate", "\u2067Deny\u2069 Approve")):
            yield make(f"{tag} in {_slot(slot)}", "Unicode bidi / tag characters", lambda e, s=slot, t=text: _set(e, s, t))
    for i, s in enumerate(NAUGHTY):
        slot = ENVELOPE_SLOTS[i % len(ENVELOPE_SLOTS)]
        yield make(f"naughty #{i} in {_slot(slot)}", "naughty strings", lambda e, sl=slot, v=s: _set(e, sl, v))
    floats = {
        "float recommended_idx": ("payload", "binding_moment", "question", "recommended_idx"),
        "float expires_in_s": ("payload", "expires_in_s"),
        "float schemaVersion": ("schemaVersion",),
    }
    for name, slot in floats.items():
        yield make(name, "floats for integers / decimal strings", lambda e, s=slot: _set(e, s, 0.5))
    yield make("number as meta.ts", "floats for integers / decimal strings", lambda e: _set(e, ("meta", "ts"), 1.7e9))
    yield make("100k options", "resource / number attacks",
               lambda e: _set(e, ("payload", "binding_moment", "question", "options"),
                              [{"label": "x", "reasoning": "y"}] * 100_000))


def resolve_cases(moment_id: str) -> list[Case]:
    """Hostile resolutions of a real, pending moment."""
    def body(res: Any, mid: Any = moment_id) -> bytes:
        return json.dumps({"moment_id": mid, "resolution": res}, ensure_ascii=False).encode("utf-8", "surrogatepass")

    out = [
        Case("float option index", "floats for integers / decimal strings", body({"kind": "option", "index": 0.0})),
        Case("negative index", "out of range", body({"kind": "option", "index": -1})),
        Case("huge index", "out of range", body({"kind": "option", "index": 10**30})),
        Case("overlong free text", "overlong strings", body({"kind": "free_text", "text": OVERLONG})),
        Case("overlong moment_id", "overlong strings", body({"kind": "option", "index": 0}, OVERLONG)),
        Case("unknown kind", "schema", body({"kind": "approve_all"})),
        Case("extra member", "schema", body({"kind": "option", "index": 0, "as": "admin"})),
        Case("moment_id wildcard", "naughty strings", body({"kind": "option", "index": 0}, "*")),
    ]
    for i, s in enumerate(NAUGHTY):
        out.append(Case(f"naughty #{i} as moment_id", "naughty strings", body({"kind": "option", "index": 0}, s)))
    return out


def moment_query_cases(moment_id: str) -> list[Case]:
    """Hostile moment queries (agent.{agent}.moment) about a real moment: every one is malformed."""
    def body(mid: Any = moment_id, **extra: Any) -> bytes:
        return json.dumps({"moment_id": mid, **extra}, ensure_ascii=False).encode("utf-8", "surrogatepass")

    out = [
        Case("overlong moment_id", "overlong strings", body(OVERLONG)),
        Case("overlong principal", "overlong strings", body(principal=OVERLONG)),
        Case("numeric moment_id", "schema", body(10**30)),
        Case("extra member", "schema", body(agent="someone-else")),
        Case("moment_id wildcard", "naughty strings", body("*")),
        Case("moment_id full wildcard", "naughty strings", body(">")),
        Case("principal wildcard", "naughty strings", body(principal="*")),
        Case("principal with a dot", "naughty strings", body(principal="alice.>")),
    ]
    for i, s in enumerate(NAUGHTY):
        out.append(Case(f"naughty #{i} as moment_id", "naughty strings", body(s)))
    return out + moment_list_cases(moment_id)


def moment_list_cases(moment_id: str) -> list[Case]:
    """Hostile list queries (the list form of agent.{agent}.moment): every one is malformed."""
    def body(**members: Any) -> bytes:
        return json.dumps(members, ensure_ascii=False).encode("utf-8", "surrogatepass")

    out = [
        Case("list and moment_id together", "schema", body(list="open", moment_id=moment_id)),
        Case("neither list nor moment_id", "schema", body()),
        Case("limit without list", "schema", body(moment_id=moment_id, limit=5)),
        Case("unknown list kind", "schema", body(list="pending")),
        Case("list as an array", "schema", body(list=["open"])),
        Case("list as null with limit", "schema", body(list=None, limit=5)),
        Case("limit 0", "out of range", body(list="open", limit=0)),
        Case("limit above 50", "out of range", body(list="all", limit=51)),
        Case("limit 2**63", "out of range", body(list="all", limit=2**63)),
        Case("negative limit", "out of range", body(list="all", limit=-1)),
        Case("float limit", "floats for integers / decimal strings", body(list="all", limit=5.5)),
        Case("decimal-string limit", "floats for integers / decimal strings", body(list="all", limit="5")),
        Case("overlong list", "overlong strings", body(list=OVERLONG)),
        Case("list principal wildcard", "naughty strings", body(list="all", principal=">")),
        Case("extra member with list", "schema", body(list="all", agent="someone-else")),
    ]
    for i, s in enumerate(NAUGHTY):
        out.append(Case(f"naughty #{i} as list", "naughty strings", body(list=s)))
    return out


def idp_cases() -> list[Case]:
    """Hostile transition requests: naughty and overlong values in every field."""
    base = {"mandate": "x.y.z", "action": "CloseBooking", "resource": {"id": "r1"}, "idp": {"idp_id": "i1"}}
    out: list[Case] = []
    for field in ("mandate", "action"):
        for i, s in enumerate([OVERLONG, *NAUGHTY[:12]]):
            b = copy.deepcopy(base)
            b[field] = s
            out.append(Case(f"naughty #{i} in {field}", "naughty strings", json.dumps(b, ensure_ascii=False).encode()))
    b = copy.deepcopy(base)
    b["idp"] = {"idp_id": OVERLONG, "goal": OVERLONG, "reasoning": OVERLONG}
    out.append(Case("overlong idp fields", "overlong strings", json.dumps(b).encode()))
    return out


def transition_cases() -> list[Case]:
    base = {"idp_id": "i1", "executed_action": "CloseBooking", "effect": {"type": "t", "status": "dispatched"}}
    out: list[Case] = []
    for field in ("idp_id", "executed_action"):
        for i, s in enumerate([OVERLONG, *NAUGHTY[:8]]):
            b = copy.deepcopy(base)
            b[field] = s
            out.append(Case(f"naughty #{i} in {field}", "naughty strings", json.dumps(b, ensure_ascii=False).encode()))
    b = copy.deepcopy(base)
    b["effect"]["status"] = 0.5
    out.append(Case("float effect.status", "floats for integers / decimal strings", json.dumps(b).encode()))
    return out
