"""SR-1 redaction (spec 002 "Redaction"): no planted secret reaches any downstream byte."""

from __future__ import annotations

import json
import unicodedata

import msgspec
import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.stages.redaction import MARK, Redactor, skeleton
from subjects.wire import BindingMomentItem, ClarificationItem, NoticeItem
from tests.moments import good_moment
from tests.pipeline_helpers import Recorder, env, moment_env, running_gateway
from tests.stored import stored_msgs

SECRET = "sk-live-7Hq2Zp9WvX4r"
ENV_SECRET = "ghp_EnvTokenAbc123xyz"
FILE_SECRET = "db-pass-Qw3rty!9Lm"
ZW = "\u200b"
TAG = "\U000e0041"


def _zw(s: str) -> str:
    return ZW.join(s)


def _tags(s: str) -> str:
    return "".join(c + TAG for c in s)


def _fullwidth(s: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in s)


def _needles() -> list[bytes]:
    """Byte forms a leak could take in JSON output."""
    out = []
    for s in (SECRET, ENV_SECRET, FILE_SECRET, "tok-abc-DEF-987"):
        out.append(s.encode())
        out.append(s[4:].encode())  # a recognisable core of it
    return out


def test_redactor_catches_evasions():
    """Zero-width and tag characters inserted, full-width look-alikes, Cyrillic look-alikes and case changes are all redacted."""
    r = Redactor([SECRET])
    for variant in (SECRET, _zw(SECRET), _tags(SECRET), _fullwidth(SECRET), SECRET.replace("a", "а").replace("e", "е"), SECRET.upper()):
        out = r.text(f"key is {variant} ok")
        assert MARK in out, variant
        assert skeleton(SECRET, keep_space=False)[0] not in skeleton(out, keep_space=False)[0]
        assert out.startswith("key is ") and out.endswith(" ok")


def test_redactor_secret_prefix_tokens():
    """Every secret:-prefixed token is redacted even when nothing is configured, also with zero-width characters inside."""
    r = Redactor([])
    assert r.text("use secret:abc123 now") == f"use {MARK} now"
    assert "abc123" not in r.text("use se\u200bcret:abc123 now")
    assert r.text("no secrets here") == "no secrets here"


def test_redactor_split_across_adjacent_fields():
    """A secret split across two adjacent string leaves (or array elements) is redacted in both halves."""
    r = Redactor([SECRET])
    graph = {"a": ["Your key: " + SECRET[:7], SECRET[7:] + " (keep it)"], "b": {"x": SECRET[:3], "y": SECRET[3:]}}
    red = r.graph(graph)
    flat = "".join(red["a"]) + "".join(red["b"].values())
    assert SECRET[:7] not in flat and SECRET[7:] not in flat
    assert red["a"][0].startswith("Your key: ")


def test_redactor_leaves_clean_text_alone():
    """Text without secret material is returned unchanged (no false redaction of ordinary prose)."""
    r = Redactor([SECRET])
    text = "Share only the 2025 summary; secretary Ann approved it. Ask for detail on any item."
    assert r.text(text) == text


@given(graph=st.recursive(
    st.text(alphabet=st.sampled_from([*"abcSECRTt:\\\"/ ", "\n", "\x00", "\x1f", "\u200b", "é"]), max_size=24),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
))
@settings(max_examples=500, deadline=None)
def test_plainly_clean_never_skips_what_the_walk_would_change(graph):
    """The pre-check is exact in one direction: whatever it calls clean, the full walk leaves alone
    (with and without backslashes, escaped control characters and ``secret:`` in any case)."""
    r = Redactor()
    if r.plainly_clean(graph):
        assert r.graph(graph) == graph


def test_plainly_clean_takes_the_walk_for_an_escaped_control_character():
    r = Redactor()
    assert r.plainly_clean({"a": "line\nbreak", "b": "back\\slash"})  # escapes, none of them \u00..
    assert not r.plainly_clean({"a": "sec\x00ret: tok"})  # JSON writes NUL as \u0000: the walk decides
    assert not r.plainly_clean({"a": "SeCrEt:abc"})


def test_short_secret_in_config_fails_at_start():
    """A configured secret shorter than 4 characters fails the configuration with the field named."""
    from pgwcore.config import load_config
    from subjects.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, pipeline={"secrets": {"values": ["ab"]}})
    assert "pipeline.secrets.values[0]" in str(e.value)


_json_leaf = st.one_of(st.text(max_size=20), st.integers(), st.booleans(), st.none())
_graphs = st.recursive(
    _json_leaf,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=20,
)
_evasions = st.sampled_from([lambda s: s, _zw, _tags, _fullwidth, str.upper, lambda s: s.replace("e", "е")])


def _plant(graph, secret_form, where: int, split: bool):
    """Put ``secret_form`` into the graph: as a new leaf, or split across two adjacent list elements."""
    if split:
        k = max(1, len(secret_form) // 2)
        piece = ["prefix " + secret_form[:k], secret_form[k:] + " suffix"]
    else:
        piece = [f"text {secret_form} more"]
    return {"payload": graph, "deep": [[{"bag": piece}]], "n": where}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph=_graphs, evasion=_evasions, where=st.integers(0, 5), split=st.booleans())
def test_property_no_planted_secret_survives(graph, evasion, where, split):
    """For any generated payload graph with a planted secret (evasions included), the redacted graph holds no trace of it."""
    r = Redactor([SECRET])
    planted = _plant(graph, evasion(SECRET), where, split)
    red = r.graph(planted)

    leaves: list[str] = []

    def walk(x):
        if isinstance(x, str):
            leaves.append(x)
        elif isinstance(x, dict):
            for k, v in x.items():
                leaves.append(k)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(red)
    joined = skeleton("".join(leaves), keep_space=False)[0]
    assert skeleton(SECRET, keep_space=False)[0] not in joined
    assert unicodedata.normalize("NFKC", SECRET).lower() not in joined


@pytest.mark.slow
async def test_no_secret_in_any_downstream_byte(nats_server, tmp_path, nc, monkeypatch):
    """Secrets planted in every position (payload at any depth, keys, every top-level string and id, meta.label,
    reasoning, arrays, split, evasions, refusal echoes), in envelopes refused at every stage (the contract gate's
    discard-and-warn included), appear in no log line and in no byte (body, subject, header) of any stream or
    KV bucket but the agent's own inbound one."""
    monkeypatch.setenv("PGW_TEST_SECRET", ENV_SECRET)
    sf = tmp_path / "secrets.txt"
    sf.write_text(f"\n{FILE_SECRET}\n")
    cfg = {"secrets": {"values": [SECRET], "env": ["PGW_TEST_SECRET"], "files": [str(sf)]},
           "contracts": {"gated": {"accepts": [], "refusal_mode": "discard-and-warn"}}}
    with structlog.testing.capture_logs() as logs:
        async with running_gateway(nats_server, str(tmp_path / "d"), pipeline=cfg), Recorder(nc) as rec:
            m = good_moment()
            m["synopsis"] = f"Rotate the key {_zw(SECRET)} before Friday's release."
            m["findings"][0] = "The old key ends " + ENV_SECRET[:9]
            m["findings"][1] = ENV_SECRET[9:] + " and is in the repo."
            m["recommendations"][0] = f"Revoke {_fullwidth(FILE_SECRET)} in the console."
            m["question"]["options"][0]["reasoning"] = f"Stops use of {SECRET.upper()} at once."
            moment = moment_env(
                "alice", m, reasoning=f"I saw secret:tok-abc-DEF-987 and {SECRET}",
                conventional={"deep": [{"x": {SECRET: [f"v {ENV_SECRET}"]}}]},
                label=f"Rotate {SECRET}",
            )
            clar = env("clarification.request", {
                "questions": [{"id": "q1", "question": f"Is {_tags(SECRET)} still used?", "schema": {"enum": [FILE_SECRET, "no"]}}],
                "reasoning": f"context secret:tok-abc-DEF-987 {ENV_SECRET}",
            })
            clar["meta"]["pgw"] = {"principal": "alice"}
            malformed = moment_env("alice", good_moment(recommended_idx=9),
                                   conventional={"text": f"fallback {SECRET}", "k": [ENV_SECRET]})
            echo_kind = env(f"vendor.{SECRET}.kind", {})
            echo_trust = env("error", {"code": "x", "message": "y"})
            echo_trust["meta"]["contentTrust"] = SECRET  # msgspec would quote the bad enum value
            echo_err = env("error", {"code": "leak", "message": f"failed with {SECRET}", "details": {"k": FILE_SECRET}})
            dup_key = b'{"type":"error","payload":{},"%s":1,"%s":2}' % (SECRET.encode(), SECRET.encode())
            # Every top-level string holds a secret, ids included: the limits stage counts a
            # clarification / schema.request round before redaction, the contract gate logs a discard.
            def every_string(e, n):
                e.update(envelopeId=f"e{n}-{SECRET}", correlationId=f"run-secret:tok-abc-DEF-987:{ENV_SECRET}:{n}:k",
                         nodeId=f"n-{FILE_SECRET}")
                e["meta"].update(label=f"l {SECRET}", traceparent=f"t {ENV_SECRET}")
                return e
            id_clar = every_string(env("clarification.request", {"questions": [{"id": "q", "question": "Which?"}]}), 1)
            id_schema = every_string(env("schema.request", {"envelopeType": "error"}), 2)
            id_discard = every_string(moment_env("alice", good_moment()), 3)
            echo_meta = env("error", {"code": "x", "message": "y"})
            echo_meta["meta"].update(ts=f"2026-01-01T00:00:00Z {SECRET}", source=ENV_SECRET)  # refused by shape
            for e in (moment, clar, malformed, echo_kind, echo_trust, echo_err, id_clar, id_schema, echo_meta):
                await rec.send("planner", e, official=False)  # secrets where the schemas forbid them, on purpose
            await rec.send("gated", id_discard, official=False)
            await rec.send("planner", None, msg_id="planner:dup", raw=dup_key)
            await rec.until(lambda: len([o for o in rec.outcomes]) >= 11, timeout=20)
            await rec.item(lambda i: isinstance(i, BindingMomentItem))
            await rec.item(lambda i: isinstance(i, ClarificationItem))
            notice = await rec.item(lambda i: isinstance(i, NoticeItem))
            assert MARK in str(notice.conventional)
            stored = []
            # Every stream, the KV buckets' included (every stored revision, live or not): bodies,
            # subjects (a KV key is one) and headers. PGW_INBOUND holds what the agent sent.
            js = nc.jetstream()
            for info in await js.streams_info():
                if info.config.name == "PGW_INBOUND":
                    continue
                for m in await stored_msgs(nc, info.config.name):
                    stored += [m.data or b"", m.subject.encode(), repr(m.headers).encode()]
    blob = b"\n".join(stored + rec.raw) + repr(logs).encode()
    assert b"REDACTED" in blob
    assert any(entry["event"] == "envelope discarded by the contract gate" for entry in logs)  # the gate's log ran
    for needle in _needles():
        assert needle not in blob, needle
    # decoded JSON escapes (\uXXXX) too: compare on the skeleton of the decoded text
    text = blob.decode("unicode_escape", errors="ignore")
    skel = skeleton(text, keep_space=False)[0]
    for s in (SECRET, ENV_SECRET, FILE_SECRET):
        assert skeleton(s, keep_space=False)[0] not in skel, s


def test_a_plainly_clean_graph_comes_back_itself_without_the_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 48: ``Redactor.graph`` on a graph the pre-check proves clean (no configured secrets, ASCII, no
    ``secret:``, no escaped control character) returns it itself and never walks it; anything else is walked
    as before (a token is redacted, a control character dropped)."""
    from gateway.stages.redaction import Redactor

    red = Redactor([])
    clean = {"synopsis": "Share only the 2025 summary.\tThen stop.", "items": ["a", {"b": "c\nd"}], "n": 3}

    def walked(*_a: object, **_k: object) -> None:
        raise AssertionError("walked a graph the pre-check proves clean")

    with monkeypatch.context() as mp:
        mp.setattr(Redactor, "_leaves", walked)
        assert red.graph(clean) is clean
    assert red.graph({"a": "key secret:abcdefghijklmnop"}) != {"a": "key secret:abcdefghijklmnop"}
    assert red.graph({"a": "bell\x07here"}) == {"a": "bellhere"}
    assert red.graph({"a": "caf\u00e9 secret:abcdefghijklmnop"})["a"].startswith("caf\u00e9 ")


def test_the_bytes_of_a_member_given_twice_are_read_through_their_escapes() -> None:
    """With no configured secret, a message's bytes are judged as read: a secret: token whose "s" is an escaped
    full-width letter, in a member given twice (the parser keeps the clean one), is found in the bytes; the same
    message without it, and one escaping only a plain accented letter, hold none."""
    red = Redactor()
    disguised = b'{"nodeId": "\\uff53ecret:Marigold-hunter-5531", "nodeId": "node-clean"}'
    assert red.holding(msgspec.json.decode(disguised)) == []  # the parsed value is clean
    assert red.bytes_hold_secret(disguised)
    assert not red.bytes_hold_secret(b'{"nodeId": "node-a", "nodeId": "node-clean"}')
    assert not red.bytes_hold_secret(b'{"nodeId": "caf\\u00e9", "nodeId": "node-clean"}')


_body_pieces = st.sampled_from([
    b'{"a":', b'"b":', b'"text"', b'"secret:x1"', b'"SeCrEt:y2"', b'"sec\\u0072et:z"', b'"\\uff53ecret:w"',
    b'"a\\bb"', b'"a\\fb"', b'"a\\nb"', b'"a\\\\b"', b'"a\\/b"', b'\x07', b'\x00', b'\x1b', b'\x7f', b'\t',
    b'\n', b' ', b'secret :', b'1e5', b'[', b']', b'}', b',', b'caf\xc3\xa9', b'\xff',
])
_bodies = st.one_of(
    _graphs.map(lambda g: json.dumps(g).encode()),  # non-ASCII and controls written as \u escapes
    _graphs.map(lambda g: json.dumps(g, ensure_ascii=False).encode()),
    _body_pieces,
    st.lists(_body_pieces, max_size=12).map(b"".join),  # JSON or not, raw controls, escapes, tokens
    st.text(max_size=40).map(str.encode),
    st.binary(max_size=40),
)


@settings(max_examples=600, deadline=None)
@given(body=_bodies)
def test_bytes_plainly_clean_never_skips_what_the_full_read_would_find(body: bytes) -> None:
    """The one-scan check of a message's bytes (what settling a turn at rest takes first) is exact in
    one direction: bytes it calls clean hold nothing the full read finds, parsed (redacted_turn), as
    text, or member by member with duplicates kept (bytes_hold_secret)."""
    from gateway.at_rest import redacted_turn

    red = Redactor()
    if red.bytes_plainly_clean(body):
        assert redacted_turn(red, body) is None
        assert not red.bytes_hold_secret(body)


def test_bytes_plainly_clean_passes_a_plain_moment_and_reads_every_disguise() -> None:
    """An ordinary turn is judged by the scan; each form that may hide a token or an invisible
    character takes the full read; so does every body once a secret is configured."""
    red = Redactor()
    plain = msgspec.json.encode(moment_env("alice", good_moment()))
    assert red.bytes_plainly_clean(plain)
    assert red.bytes_plainly_clean(b'{"a": "line\\nbreak\\ttab \\"quoted\\" back\\\\slash"}')
    # Not ASCII: judged by two translates of the text (a reader sees every character, no token in its fold).
    assert red.bytes_plainly_clean('{"a": "caf\u00e9 \u0434\u043e\u0436\u0434\u044c"}'.encode())
    for body in (
        b'{"a": "SECRET:abcdefgh"}',  # a token, any case
        b'{"a": "\\u0073ecret:abcdefgh"}',  # a letter escaped
        b'{"a": "\\uff53ecret:abcdefgh"}',  # a full-width letter escaped
        '{"a": "caf\u00e9 \uff53ecret:abcdefgh"}'.encode(),  # a full-width letter, not escaped
        '{"a": "caf\u00e9 \u0455ecret:abcdefgh"}'.encode(),  # a Cyrillic look-alike
        '{"a": "caf\u00e9\u00a0x"}'.encode(),  # a no-break space (marked for approval)
        '{"a": "caf\u00e9\u200bx"}'.encode(),  # a zero-width space (dropped)
        b'{"a": "caf\xc3"}',  # not UTF-8
        b'{"a": "bell\x07here"}',  # a raw control character (not JSON: read as text)
        b'{"a": "del\x7fhere"}',
        b'{"a": "back\\bspace"}',  # an escaped control character
        b'{"a": "form\\ffeed"}',
    ):
        assert not red.bytes_plainly_clean(body), body
    assert not Redactor([SECRET]).bytes_plainly_clean(plain)
