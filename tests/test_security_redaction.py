"""SR-1 against disguises (issue 19): every evasion of the held-out pass is a row of `make security`.

Unit rows run each disguise through the :class:`Redactor`; the end-to-end row
plants all of them in one gateway run (and a principal's free-text answer)
and greps every downstream byte: PGW_OUTBOUND, PGW_SURFACE, PGW_VERDICTS, the
KV buckets PGW_MOMENTS, PGW_DEDUP and PGW_SLACK, every call the Slack surface
made to (a stand-in for) Slack's Web API, the log lines. A hypothesis
property test generates disguises built from the same transformations.
"""

from __future__ import annotations

import base64
import contextlib
import json
import unicodedata
import urllib.parse

import pytest
import structlog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.slack.service import SlackSurface
from gateway.security.confusables import data_version, prototypes
from gateway.security.text import visible
from gateway.stages.redaction import MARK, Redactor, skeleton
from pgwcore.config import load_config
from subjects.client import Surface
from subjects.wire import BindingMomentItem, FreeTextAnswer
from tests.disguises import DISGUISES as SHARED_DISGUISES
from tests.moments import good_moment
from tests.notify_peers import Relay, smtp_server
from tests.pipeline_helpers import Recorder, moment_env, running_gateway, stream_bytes
from tests.slack_standin import BOT_TOKEN, SIGNING_SECRET, slack_standin

pytestmark = pytest.mark.security

TABLE = "redaction disguises (SR-1)"
SLACK_ENV = {"PGW_SLACK_BOT_TOKEN": BOT_TOKEN, "PGW_SLACK_SIGNING_SECRET": SIGNING_SECRET}
SECRET = "NYX-deploy-Key-4471-Quartz"
ZWJ, ZWSP, BOM = "\u200d", "\u200b", "\ufeff"


def tags_only(s: str) -> str:
    """The whole secret in Unicode tag characters ("ASCII smuggling"): invisible to a reader."""
    return "".join(chr(0xE0000 + ord(c)) for c in s)


def greek_capitals(s: str) -> str:
    """Greek capital look-alikes: Nu for N, Upsilon for Y, Chi for X, Kappa for K."""
    return s.translate(str.maketrans({"N": "\u039d", "Y": "\u03a5", "X": "\u03a7", "K": "\u039a"}))


def every_confusable(s: str) -> str:
    """Each character replaced by some other character UTS #39 lists as its look-alike."""
    inverse: dict[str, str] = {}
    for src, proto in sorted(prototypes().items(), reverse=True):
        if len(proto) == 1 and proto.isascii():
            inverse.setdefault(proto, src)
    return "".join(inverse.get(c, c) for c in s)


def split_with_text(s: str) -> str:
    h = len(s) // 2
    return f"{s[:h]} -- and, by the way, the rest is -- {s[h:]}"


def thirds_with_text(s: str) -> str:
    a, b = len(s) // 3, 2 * len(s) // 3
    return f"{s[:a]} (a) {s[a:b]} (b) {s[b:]}"


DISGUISES = {
    "plain": lambda s: s,
    "tag characters (whole secret)": tags_only,
    "tag characters between letters": lambda s: "".join(c + "\U000e0041" for c in s),
    "Greek capital look-alikes (N, Y)": greek_capitals,
    "a UTS #39 confusable for every letter": every_confusable,
    "full-width": lambda s: "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in s),
    "zero-width joiners": ZWJ.join,
    "zero-width spaces": ZWSP.join,
    "NUL after BOM": lambda s: BOM + "\x00" + "\x00".join(s),
    "bidi override": lambda s: "\u202e" + s + "\u202c",
    "combining marks (zalgo)": lambda s: "".join(c + "\u0301" for c in s),
    "enclosing marks": lambda s: "".join(c + "\u20dd" for c in s),
    "Braille blanks between letters": "\u2800".join,
    "upper case": str.upper,
    "base64": lambda s: base64.b64encode(s.encode()).decode(),
    "base64url of a sentence": lambda s: base64.urlsafe_b64encode(f"the key: {s}!".encode()).decode(),
    "base64 glued to a word": lambda s: "token" + base64.b64encode(s.encode()).decode(),
    "URL-encoding": lambda s: urllib.parse.quote(s, safe=""),
    "URL-encoding (every byte)": lambda s: "".join(f"%{b:02X}" for b in s.encode()),
    "hex": lambda s: s.encode().hex(),
    "hex with 0x": lambda s: "0x" + s.encode().hex().upper(),
    "base64 of URL-encoding": lambda s: base64.b64encode(urllib.parse.quote(s).encode()).decode(),
    "two halves, text between": split_with_text,
    "three pieces, text between": thirds_with_text,
    # The disguises every text rule is tested with (tests/disguises.py): one generator for all.
    **{f"shared: {name}": f for name, f in SHARED_DISGUISES.items()},
}
TOKEN = "secret:tok-88-ZULU"
TOKEN_DISGUISES = {
    "secret: token in tag characters": tags_only,
    "secret: token, NUL inside": lambda s: s[:3] + "\x00" + s[3:],
    # UTS #39 draws the long s as "f"; it reads "s" (the third docs-only attack of the ninth session).
    "secret: token with a long s": lambda s: "\u017f" + s[1:],
}


def _gone(red: str, secret: str) -> bool:
    """No form of ``secret`` is left in ``red``: its fold is absent, with tags read both ways."""
    want = skeleton(secret, keep_space=False)[0]
    return all(want not in skeleton(red, keep_space=False, tags=t)[0] for t in (False, True))


@pytest.mark.parametrize("name", list(DISGUISES), ids=lambda v: v.replace(" ", "_"))
def test_disguised_secret_is_redacted(name: str, security_table) -> None:
    """A configured secret in this disguise, in the middle of a sentence, comes out redacted and the sentence stays readable."""
    r = Redactor([SECRET])
    text = f"Deploy with {DISGUISES[name](SECRET)} today."
    red = r.text(text)
    ok = MARK in red and _gone(red, SECRET) and red.startswith("Deploy with") and red.endswith("today.")
    security_table.record(TABLE, name, "agent text", "Redactor", "redacted", "redacted" if ok else f"LEAKED: {red[:60]!r}", ok)
    assert ok, red


@pytest.mark.parametrize("name", list(TOKEN_DISGUISES), ids=lambda v: v.replace(" ", "_"))
def test_disguised_secret_token_is_redacted(name: str, security_table) -> None:
    """A ``secret:``-prefixed token in this disguise is redacted with no secrets configured."""
    red = Redactor([]).text(f"use {TOKEN_DISGUISES[name](TOKEN)} now")
    ok = MARK in red and "zulu" not in skeleton(red, keep_space=False, tags=True)[0]
    security_table.record(TABLE, name, "agent text", "Redactor", "redacted", "redacted" if ok else f"LEAKED: {red[:60]!r}", ok)
    assert ok, red


def test_invisible_characters_never_reach_the_reader(security_table) -> None:
    """Zero-width joiners, NUL after a BOM, bidi controls and stray tags are dropped; emoji ZWJ sequences and flags stay."""
    r = Redactor([])
    dirty = f"Ap{ZWJ}prove{ZWSP} {BOM}\x00now \u202eev\u202c ok\U000e0049\U000e0047"
    assert r.text(dirty) == "Approve now ev ok"
    family, flag = "\U0001F468\u200d\U0001F469", "\U0001F3F4\U000E0067\U000E0062\U000E0073\U000E0063\U000E0074\U000E007F"
    assert r.text(f"{family} {flag}") == f"{family} {flag}"
    assert visible("\u05e9\u05dc\u05d5\u05dd\u200f") == "\u05e9\u05dc\u05d5\u05dd\u200f"  # RLM kept for RTL text
    security_table.record(TABLE, "invisible/format characters", "agent text", "Redactor", "dropped", "dropped", True)


def test_clean_text_is_left_alone() -> None:
    """Ordinary prose, ids and numbers are not redacted (no false match from the coarse fold)."""
    r = Redactor([SECRET])
    for text in ("Share only the 2025 summary; secretary Ann approved it.", "01J9ZQ4V6Y8W3K2M1N0P7R5T", "deadbeefcafe0042",
                 "https://example.com/a%20b?q=1", "Key 4471 and Quartz are unrelated words here."):
        assert r.text(text) == text, text


def test_confusables_data_is_the_full_uts39_file() -> None:
    """The fold uses every mapping of the UTS #39 data file, not a hand-picked table."""
    assert data_version() == "13.0.0"
    assert len(prototypes()) > 6000
    missed = []
    for src, proto in prototypes().items():
        if len(proto) == 1 and proto.isascii() and proto.isalnum():
            secret = f"Zq7{proto}Wm4x"
            if MARK not in Redactor([secret]).text(f"use {secret.replace(proto, src)} now"):
                missed.append(f"U+{ord(src):04X}->{proto}")
    assert not missed, missed[:10]


ENCODINGS = {"base64", "base64url of a sentence", "base64 glued to a word", "URL-encoding", "URL-encoding (every byte)",
             "hex", "hex with 0x", "base64 of URL-encoding"}
# Character-level disguises applied on top; an encoded run only gets those that keep it
# decodable as displayed (case changes and look-alike letters would change the bytes).
ON_TOP = ["zero-width joiners", "full-width", "upper case", "Greek capital look-alikes (N, Y)", "tag characters between letters"]
ON_ENCODED = ["zero-width joiners", "full-width", "tag characters between letters"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.sampled_from(list(DISGUISES)), second=st.sampled_from([None, *ON_TOP]),
       secret=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{11,30}", fullmatch=True),
       before=st.text(alphabet=st.characters(categories=["L", "N", "Zs", "P"]), max_size=15), after=st.text(max_size=15))
def test_property_generated_disguises(first, second, secret, before, after) -> None:
    """Any secret, disguised by one transformation and maybe a character-level one on top, amid any text, never survives."""
    r = Redactor([secret])
    disguised = DISGUISES[first](secret)
    # The shared disguises carry their own mixtures; one on top may change what a look-alike
    # imitates (a Greek small upsilon imitates u, its capital Y), so none is stacked on them.
    if second is not None and not first.startswith("shared: ") and (first not in ENCODINGS or second in ON_ENCODED):
        disguised = DISGUISES[second](disguised)
    red = r.text(f"{before} {disguised} {after}")
    assert _gone(red, secret), (disguised, red)
    assert MARK in red or not visible(disguised), "only a wholly invisible disguise may vanish unmarked"


@pytest.mark.slow
async def test_no_disguise_reaches_any_downstream_byte(nats_server, tmp_path, nc, security_table) -> None:
    """Every disguise planted in a binding moment (option reasoning included) and a principal's free-text answer
    holding the secret leave no trace of it in any stream, KV bucket, log line or the answer-enabled e-mail (both parts
    and its confirmation page), and no invisible character on the surface."""
    cfg = {"secrets": {"values": [SECRET]}}
    # A bidi control in a slot is refused by the moment grammar before redaction
    # (gateway/security/text.py hidden_controls): the refuse half of "drop or refuse".
    names = [n for n in DISGUISES if n != "bidi override"]
    with structlog.testing.capture_logs() as logs, smtp_server(tmp_path) as relay:
        async with running_gateway(nats_server, str(tmp_path / "d"), pipeline=cfg), Recorder(nc) as rec, \
                mail_notifier(nats_server, tmp_path, relay), \
                slack_standin() as slack, SlackSurface(load_config(
                    None, data_dir=str(tmp_path / "s"), nats_url=nats_server.client_url,
                    slack={"enabled": True, "api_url": slack.url, "http_port": 0,
                           "principals": {"alice": {"user": "U0ALICE"}}}), environ=SLACK_ENV):
            m = good_moment()
            half = len(names) // 2  # each list takes at most 32 entries
            m["findings"] = [f"{n}: {DISGUISES[n](SECRET)}" for n in names[:half]]
            m["recommendations"] = [f"{n}: {DISGUISES[n](SECRET)}" for n in names[half:]]
            m["offer"] = f"Ask about {tags_only(SECRET)}{ZWJ} anytime{BOM}\x00."
            m["question"]["options"][1]["reasoning"] = f"Matches their request\U000e0041\U000e0042 ({ZWSP}{greek_capitals(SECRET)})."
            out = await rec.roundtrip("planner", moment_env("alice", m, reasoning=split_with_text(SECRET)))
            assert out.status == "accepted", (out.code, out.reason, out.details)
            item = await rec.item(lambda i: isinstance(i, BindingMomentItem))
            bm = item.binding_moment
            shown = [bm.synopsis, *bm.findings, *bm.recommendations, bm.offer, *(o.reasoning for o in bm.question.options)]
            for text in shown:
                assert text == visible(text), f"invisible characters reached the surface: {text!r}"
            mailed = await the_mail(relay)  # sent while the moment waits, with its answer links
            assert all(MARK in part for part in mailed[1:]), "the mail and its page carry the redacted moment"
            reply = await Surface(nc, "alice").resolve(out.moment_id, FreeTextAnswer(text=f"Use {SECRET} and {every_confusable(SECRET)} instead"))
            assert reply.status == "accepted"
            await rec.verdict(lambda v: v.verdict_class == "resolved")
            await rec.until(lambda: any(getattr(o, "moment_id", None) == out.moment_id and o.__struct_config__.tag == "resolution"
                                        for o in rec.outcomes))
            # The Slack surface posted the moment and, once answered, updated its message: every byte it
            # sent to Slack is grepped too (only what the gateway put on the surface subject reaches Slack).
            await slack.wait(lambda: any(m.versions for m in slack.of(out.moment_id)))
            to_slack = json.dumps(slack.calls, ensure_ascii=False)
            assert MARK in to_slack, "the moment reached Slack (redacted), so the grep below covers it"
            stored: list[bytes] = [to_slack.encode()]
            # Every revision a KV bucket still stores, deleted or superseded ones included (a bucket
            # whose records were all closed has no live keys, yet its stream keeps their history).
            for s in ("PGW_OUTBOUND", "PGW_SURFACE", "PGW_VERDICTS", "KV_PGW_MOMENTS", "KV_PGW_DEDUP",
                      "KV_PGW_NOTIFY", "KV_PGW_ANSWER_LINKS", "KV_PGW_SLACK"):
                stored += await stream_bytes(nc, s)
            stored += [m.encode() for m in mailed]
    blob = b"\n".join(stored + rec.raw).decode("utf-8", errors="replace") + repr(logs)
    text = blob.encode().decode("unicode_escape", errors="ignore")
    assert MARK in blob
    leaks = []
    for t in (blob, text):
        if not _gone(t, SECRET):
            leaks.append("fold")
        for enc in (base64.b64encode(SECRET.encode()).decode(), SECRET.encode().hex(), urllib.parse.quote(SECRET, safe="")):
            if enc in t:
                leaks.append(enc)
        if SECRET[len(SECRET) // 2:] in unicodedata.normalize("NFKC", t):
            leaks.append("second half")
    ok = not leaks
    security_table.record(TABLE, f"all {len(names)} disguises + principal free text, end to end", "agent planner, principal alice",
                          "PGW_OUTBOUND/SURFACE/VERDICTS, KV MOMENTS/DEDUP/NOTIFY/ANSWER_LINKS/SLACK, e-mail, Slack API, logs", "no trace", "no trace" if ok else f"LEAKED {leaks}", ok)
    assert ok, leaks


@contextlib.asynccontextmanager
async def mail_notifier(nats_server, tmp_path, relay: Relay):
    """A notifier mailing alice the whole moment with answer links (answer_by_email), through aiosmtpd."""
    from consumers.notify.service import Notifier
    from pgwcore.config import load_config
    from pgwcore.connect import connect

    config = load_config(None, data_dir=str(tmp_path / "n"), nats_url=nats_server.client_url, notifier={
        "presence_grace_s": 0, "answer_port": 0,
        "smtp": {"host": relay.host, "port": relay.port, "credentials_file": str(relay.credentials_file),
                 "ca_file": str(relay.ca_file)},
        "principals": {"alice": {"email": "alice@example.com", "web_push": False, "answer_by_email": True}}})
    n_nc = await connect(nats_server.client_url, name="notifier")
    try:
        async with Notifier(config, n_nc) as notifier:
            yield notifier
    finally:
        await n_nc.drain()


async def the_mail(relay: Relay) -> list[str]:
    """The mail's raw bytes, its decoded text and HTML parts, and the confirmation page of its first link."""
    import re
    from email import policy
    from email.parser import BytesParser

    import aiohttp

    from tests.polling import until

    async def arrived() -> bool:
        return bool(relay.box.envelopes)

    await until(arrived, timeout=15, what="the mail")
    raw = relay.box.envelopes[0].original_content
    mail = BytesParser(policy=policy.default).parsebytes(raw)
    text, htm = mail.get_body(("plain",)).get_content(), mail.get_body(("html",)).get_content()
    link = re.search(r"https?://\S+/answer/\S+", text).group(0)
    async with aiohttp.ClientSession() as s, s.get(link) as r:
        assert r.status == 200, "the confirmation page opens"
        page = await r.text()
    return [raw.decode("utf-8", "replace"), text, htm, page]
