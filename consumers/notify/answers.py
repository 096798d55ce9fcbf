"""Answering from the e-mail: signed answer links and the confirmation pages they open.

For a principal with ``answer_by_email = true`` (docs/notifications.md
"Answering from the e-mail") the notifier's mail carries the whole moment,
rendered from the shared render plan (``consumers/surfaces/model.py``, so the
renderer invariants of spec 000 §9.1, §9.3 and §12.5 hold as on every
surface), with one link per option and one per open hatch.

- **A GET never answers.** Mail security scanners and link previews fetch
  every link in a mail. A link opens a confirmation page that shows the
  moment and the chosen answer; only the page's POST answers.
- **Links carry a token**: ``base64url(claims) "." base64url(HMAC-SHA256)``,
  the claims binding the principal, the moment, the answer (``o0``..``o3``,
  ``free_text``, ``dialogue``, ``answers``; or ``arguments``, which only
  shows), the expiry and a per-mail nonce.
  The key is a file (0600) or ``$PGW_ANSWER_KEY``, never the TOML. A forged,
  expired, used or foreign token (another principal's or another moment's,
  pasted into this URL) gets a page saying which, and answers nothing.
- **Single use across restarts and instances**: the POST first *creates* the
  key ``{P}.{moment}.{nonce}.{answer}`` in the KV bucket ``PGW_ANSWER_LINKS``
  (its TTL outlives every token); a second POST finds it and is refused. A
  value under that key that is no used-link record (one the notifier did not
  write: docs/security.md "Replies") uses no link: it is skipped with a
  warning and taken by compare-and-set on its revision, still one winner.
- **The principal's own identity**: the answer goes to ``principal.P.resolve``
  (the same path and first-answer-wins rule as every surface: the other
  surfaces get ``withdrawn``), P being the token's principal, over a
  connection made with P's own credentials when ``pgw creds`` wrote them
  (``{creds_dir}/principal-P.creds``), so the server lets it answer only P's
  moments; on an open development server the notifier's own connection.
- **A gateway-made moment tells who recommends and shows what would run**
  (docs/surfaces.md renderer invariants 8 and 9): its recommendation is
  marked as the gateway's policy's, never the agent's; its attached
  arguments (the plan's ``attachments``, docs/gate.md "What the principal
  sees") are never clipped: the mail links to a page showing them whole
  (``arguments``, a GET that answers nothing), and every confirmation page
  shows them whole above the button that answers.
- Only what the gateway put on P's surface subject (already redacted, spec
  002 SR-1) is mailed or shown; the page reads the moment again from
  ``principal.P.pending`` (the gateway's record), so a moment answered
  elsewhere shows as such.
- **Every principal can answer** (WCAG 2.2 AA, docs/surfaces.md
  "Accessibility"): each page has a main landmark and one h1, reflows at
  320 CSS px (text boxes take the width they are given), follows the
  system's dark scheme, and says every deadline in P's time zone
  (``[notifier.principals.P] timezone``), the zone named.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import html
import os
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo

import msgspec
from aiohttp import web

from consumers.notify.store import foreign
from consumers.surfaces.model import (
    AuthorizationPlan,
    ClarificationPlan,
    DecisionPlan,
    NoticePlan,
    Plan,
    WithdrawPlan,
    plan_item,
)
from consumers.surfaces.text import RECOMMENDER
from pgwcore.logs import get_logger
from pgwcore.streams import ensure_kv
from subjects.client import Surface
from subjects.errors import PgwError
from subjects.wire import (
    ClarificationAnswers,
    DialogueVeto,
    FreeTextAnswer,
    OptionChoice,
    Resolution,
)

if TYPE_CHECKING:
    from nats.aio.client import Client

    from pgwcore.config import Config

log = get_logger("pgw.notifier")

USED_BUCKET = "PGW_ANSWER_LINKS"
USED_TTL_S = 31 * 86400.0  # longer than any token lives (notifier.answer_link_ttl_s <= 30 days)
KEY_ENV = "PGW_ANSWER_KEY"
_DOMAIN = b"pgw-answer-link/v1\n"  # the MAC covers this label too: a token of no other kind verifies
CHOICES = ("o0", "o1", "o2", "o3", "free_text", "dialogue", "answers")
WHOLE = "arguments"  # the link to a gateway-made moment's arguments in full: it shows, never answers
MAX_TEXT = 4000


class _Used(msgspec.Struct):
    """A used link's record in ``PGW_ANSWER_LINKS``, as ``AnswerLinks._mark_used`` writes it."""

    at: float


_used_dec = msgspec.json.Decoder(_Used)


class AnswerKeyError(PgwError):
    """The answer-link key cannot be used."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def load_answer_key(config: Config) -> bytes:
    """``$PGW_ANSWER_KEY``, else ``notifier.answer_key_file``, else ``{data}/keys/answer_link.key`` (made once)."""
    env = os.environ.get(KEY_ENV, "").strip()
    if env:
        if len(env) < 32:
            raise AnswerKeyError(f"${KEY_ENV} holds fewer than 32 characters; use a long random secret")
        return env.encode()
    named = config.notifier.answer_key_file
    path = Path(named).expanduser() if named else Path(config.data_path) / "keys" / "answer_link.key"
    if not path.exists() and not named and config.keys.create:
        from pgwcore.identity import write_private

        write_private(path, secrets.token_urlsafe(48) + "\n")
        log.info("answer-link key created", path=str(path))
    try:
        mode = path.stat().st_mode & 0o777
        data = path.read_bytes().strip()
    except OSError as e:
        raise AnswerKeyError(f"answer-link key {path}: cannot read ({e.strerror}); set notifier.answer_key_file "
                             f"or ${KEY_ENV}") from e
    if mode & 0o077:
        raise AnswerKeyError(f"answer-link key {path} has mode {mode:o}; it must be 0600 (chmod 600 {path})")
    if len(data) < 32:
        raise AnswerKeyError(f"answer-link key {path} holds fewer than 32 bytes; use a long random secret")
    return data


class Claims(msgspec.Struct, forbid_unknown_fields=True):
    p: str  # principal
    m: str  # moment id
    c: str  # the answer: o0..o3, free_text, dialogue, answers; or WHOLE (shows the arguments, answers nothing)
    x: int  # expires, seconds since the epoch
    n: str  # nonce of the mail

    @property
    def used_key(self) -> str:
        return f"{self.p}.{self.m}.{self.n}.{self.c}"


_claims_dec = msgspec.json.Decoder(Claims)


class TokenRefused(Exception):
    """Why a link answers nothing; ``page`` is what the principal reads."""

    def __init__(self, code: str, status: int, page: str) -> None:
        super().__init__(code)
        self.code = code
        self.status = status
        self.page = page


class Tokens:
    def __init__(self, key: bytes) -> None:
        self._key = key

    def _mac(self, body: str) -> bytes:
        return hmac.new(self._key, _DOMAIN + body.encode(), hashlib.sha256).digest()

    def mint(self, claims: Claims) -> str:
        body = _b64(msgspec.json.encode(claims))
        return f"{body}.{_b64(self._mac(body))}"

    def verify(self, token: str, *, now: float | None = None) -> Claims:
        body, dot, mac = token.partition(".")
        # The MAC is compared in its one canonical spelling (unpadded base64url of the 32 bytes): a
        # decoder takes other spellings of the same bytes (a last character differing only in its
        # unused bits, padding, the standard alphabet's twins of - and _), which are not this token.
        good = bool(dot) and hmac.compare_digest(mac.encode("utf-8", "surrogatepass"), _b64(self._mac(body)).encode())
        if not good:
            raise TokenRefused("forged", 403, "This answer link is not valid: it was not made by this gateway, "
                               "or it was changed. Nothing was answered.")
        try:
            claims = _claims_dec.decode(_unb64(body))
        except (ValueError, msgspec.DecodeError) as e:
            raise TokenRefused("forged", 403, "This answer link is not valid. Nothing was answered.") from e
        if claims.x <= (time.time() if now is None else now):
            raise TokenRefused("expired", 410, "This answer link has expired. Nothing was answered; "
                               "open your surface to see whether the decision still waits.")
        return claims


UNREACHABLE = TokenRefused("unavailable", 503, "The gateway cannot be reached just now. Nothing was answered; "
                           "try the link again in a minute.")


# -- rendering -------------------------------------------------------------------

def choice_text(plan: Plan, choice: str) -> str:
    """What the principal answers with this link, in words."""
    if choice.startswith("o") and isinstance(plan, DecisionPlan):
        opt = plan.options[int(choice[1:])]
        return f"Option {opt.index + 1}: {opt.label}"
    for h in getattr(plan, "hatches", []):
        if h.kind == choice:
            return h.label
    return "Answer the questions"


def arguments_chars(plan: Plan) -> int:
    """How many characters a gateway-made moment's attached arguments hold (0: none attached)."""
    return sum(a.chars for a in plan.attachments) if isinstance(plan, DecisionPlan) else 0


def answer_choices(plan: Plan) -> list[str]:
    """One link per option and per open hatch (spec 000 §9.1); one for a clarification; none for anything else."""
    if isinstance(plan, DecisionPlan):
        return [f"o{o.index}" for o in plan.options] + [h.kind for h in plan.hatches]
    if isinstance(plan, ClarificationPlan):
        return ["answers"]
    return []


_CSS = {
    "body": "font-family:-apple-system,Segoe UI,Roboto,Helvetica,Arial,sans-serif;color:#1b1f24;"
            "background:#f4f5f7;margin:0;padding:16px",
    "card": "max-width:640px;margin:0 auto;background:#fff;border:1px solid #d0d7de;border-radius:8px;padding:20px",
    "untrusted": "background:#b42318;color:#fff;font-weight:bold;padding:8px 12px;border-radius:4px;margin:0 0 12px",
    "blocked": "background:#b42318;color:#fff;font-weight:bold;padding:8px 12px;border-radius:4px",
    "notice": "background:#f5c542;color:#1b1f24;font-weight:bold;padding:8px 12px;border-radius:4px",
    "meta": "color:#57606a;font-size:13px;margin:0 0 12px",
    "h": "font-size:13px;text-transform:uppercase;letter-spacing:.04em;color:#57606a;margin:16px 0 4px",
    "stem": "font-size:18px;font-weight:bold;margin:20px 0 8px",
    "option": "border:1px solid #d0d7de;border-radius:6px;padding:10px 12px;margin:8px 0",
    "badge": "display:inline-block;background:#dafbe1;color:#116329;border:1px solid #4ac26b;border-radius:10px;"
             "font-size:12px;padding:1px 8px;margin-left:6px",
    "reason": "color:#424a53;margin:4px 0 8px",
    "link": "display:inline-block;border:1px solid #0f1b33;color:#0f1b33;background:#ffffff;border-radius:6px;"
            "padding:6px 12px;text-decoration:none;font:inherit",
    "hatch": "margin:10px 0",
    "foot": "color:#57606a;font-size:12px;margin-top:20px",
    "h1": "font-size:20px;margin:0 0 12px",
    "box": "display:block;width:100%;max-width:100%;box-sizing:border-box;font:inherit;margin-top:4px",
    "pre": "white-space:pre-wrap;overflow-wrap:anywhere",
    "dd": "margin:4px 0 12px",
}
# The pages' dark scheme (prefers-color-scheme), matched on the very inline style it overrides, so
# the two cannot drift; mail clients drop <style>, the mail stays light. Every pair keeps 4.5:1.
_DARK = {
    "body": "background:#0d1117;color:#e6edf3",
    "card": "background:#161b22;border-color:#3d444d",
    "meta": "color:#9da7b3", "h": "color:#9da7b3", "foot": "color:#9da7b3", "reason": "color:#c9d1d9",
    "option": "border-color:#3d444d",
    "badge": "background:#12361f;color:#7ee2a8;border-color:#2f8f56",
    "link": "background:#161b22;color:#9ecbff;border-color:#9ecbff",
}


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _st(name: str) -> str:
    return f' style="{_CSS[name]}"'


def arguments_html(plan: DecisionPlan, links: dict[str, str], whole: bool) -> str:
    """A gateway-made moment's attached arguments: in full (``whole``), else the link to them, else where to read them."""
    chars = arguments_chars(plan)
    if whole:
        out = [f'<h2 class="arguments"{_st("h")}>Arguments in full ({chars:,} characters)</h2><dl class="whole">']
        out += [f"<dt><b>{_e(a.name)}</b> ({a.chars:,} characters)</dt><dd{_st('dd')}><pre{_st('pre')}>{_e(a.text)}</pre></dd>"
                for a in plan.attachments]
        return "".join(out) + "</dl>"
    if WHOLE in links:
        return (f'<p class="arguments"><a class="whole" href="{_e(links[WHOLE])}"{_st("link")}>Show the arguments '
                f"in full ({chars:,} characters)</a></p>")
    return f'<p class="arguments"{_st("meta")}>Each answer link opens a page with the arguments in full.</p>'


def plan_html(plan: Plan, links: dict[str, str] | None = None, zone: ZoneInfo | None = None, *,
              whole: bool = False) -> str:
    """The moment as an HTML fragment (inline styles: mail clients drop style sheets); times in ``zone``;
    ``whole``: a gateway-made moment's attached arguments in full (a page), else a link to them (the mail)."""
    out: list[str] = []
    if plan.untrusted:
        out.append(f'<p class="untrusted"{_st("untrusted")}>UNTRUSTED: built from untrusted content; '
                   "check it before you act on it.</p>")
    meta = f"From agent {_e(plan.agent)}"
    if getattr(plan, "expires_at", None):
        meta += f" · answer before {_e(when(plan.expires_at, zone))}"  # type: ignore[attr-defined]
    out.append(f'<p class="meta"{_st("meta")}>{meta}</p>')
    links = links or {}
    match plan:
        case DecisionPlan():
            if plan.hem:  # a moment the gateway made: the gateway asks, not the agent
                out.append(f"<p{_st('meta')}>The gateway asks your approval before agent {_e(plan.agent)} acts.</p>")
            if plan.calibration_note:
                out.append(f"<p{_st('meta')}>Note: {_e(plan.calibration_note)}</p>")
            # spec 000 §9.1: all four briefing slots, each under its own heading.
            out.append(f'<h2{_st("h")}>Synopsis</h2><p class="synopsis">{_e(plan.synopsis)}</p>')
            for title, items in (("Findings", plan.findings), ("Recommendations", plan.recommendations)):
                body = "".join(f"<li>{_e(x)}</li>" for x in items) or "<li>(none)</li>"
                out.append(f'<h2{_st("h")}>{title}</h2><ul class="{title.lower()}">{body}</ul>')
                if title == "Findings" and plan.attachments:
                    out.append(arguments_html(plan, links, whole))
            out.append(f'<h2{_st("h")}>Offer</h2><p class="offer">{_e(plan.offer)}</p>')
            out.append(f'<p class="stem"{_st("stem")}>{_e(plan.stem)}</p>')
            for opt in plan.options:
                # §9.1: the recommendation is marked, never pre-selected: every link looks the same.
                badge = (f' <span class="recommended"{_st("badge")}>★ recommended by '
                         f"{_e(RECOMMENDER[plan.recommended_by])}</span>" if opt.recommended else "")
                link = links.get(f"o{opt.index}")
                a = f'<a class="answer" href="{_e(link)}"{_st("link")}>Choose option {opt.index + 1}</a>' if link else ""
                out.append(f'<div class="option"{_st("option")}><b>{opt.index + 1}. {_e(opt.label)}</b>{badge}'
                           f'<p class="reasoning"{_st("reason")}>{_e(opt.reasoning)}</p>{a}</div>')
            for h in plan.hatches:
                link = links.get(h.kind)
                label = (f'<a class="answer hatch-{h.kind}" href="{_e(link)}"{_st("link")}>{_e(h.label)}</a>'
                         if link else f"<b>{_e(h.label)}</b>")
                out.append(f'<p class="hatch"{_st("hatch")}>{label} <span{_st("meta")}>{_e(h.hint)}</span></p>')
        case ClarificationPlan():
            out.append(f'<p class="stem"{_st("stem")}>The agent asks you '
                       f'{"questions" if len(plan.questions) > 1 else "a question"}</p><ol>')
            out += [f"<li>{_e(q.question)}</li>" for q in plan.questions]
            out.append("</ol>")
            if "answers" in links:
                out.append(f'<a class="answer" href="{_e(links["answers"])}"{_st("link")}>Answer</a>')
        case AuthorizationPlan():
            if plan.status == "BLOCKED":
                out.append(f'<p class="blocked"{_st("blocked")}>BLOCKED: authorization envelope '
                           f"({_e(plan.variant)}) not shown</p>")
            else:
                out.append(f'<p class="stem"{_st("stem")}>{_e(plan.title)}</p>')
            out += [f"<p><b>{_e(f.label)}:</b> {_e(f.value)}</p>" for f in plan.fields]
        case NoticePlan():
            out.append(f'<p class="notice"{_st("notice")}>NOTICE: not a decision</p><p>{_e(plan.diagnostic)}</p>')
            if plan.conventional is not None:
                out.append(f'<p>What the agent sent:</p><pre{_st("pre")}>{_e(plan.conventional)}</pre>')
        case WithdrawPlan():
            out.append(f"<p>This moment was withdrawn ({_e(plan.reason)}).</p>")
    return "\n".join(out)


def plan_text(plan: Plan, links: dict[str, str] | None = None, zone: ZoneInfo | None = None) -> str:
    """The plain-text part: the terminal's rendering (consumers/surfaces/text.py) and the links; times in ``zone``."""
    from consumers.surfaces.text import HATCH_KEYS, WHOLE_KEY, render_plan

    # The terminal binds the hatches to keys; in a mail each is a link below instead.
    keys = {f"  [{k}] " for k in HATCH_KEYS.values()}
    lines = [f"  • {ln[6:]}" if ln[:6] in keys else ln for ln in render_plan(plan, width=76, color=False)]
    links = links or {}
    # The terminal shows the arguments in full on a key; the mail links to a page that shows them.
    whole = f"  [{WHOLE_KEY}] show the arguments in full"
    where = (f"  Show the arguments in full ({arguments_chars(plan):,} characters): {links[WHOLE]}" if WHOLE in links
             else "  Each answer link opens a page with the arguments in full.")
    lines = [where if ln.startswith(whole) else ln for ln in lines]
    # The terminal shows raw UTC times; the mail says them in the principal's zone.
    if expires := getattr(plan, "expires_at", None):
        lines = [ln.replace(f"Answer before {expires}", f"Answer before {when(expires, zone)}") for ln in lines]
    if plan.created_at:
        lines = [ln.replace(plan.created_at, when(plan.created_at, zone)) for ln in lines]
    answers = {c: url for c, url in links.items() if c != WHOLE}
    if answers:
        lines += ["", "Answer (each link opens a confirmation page; nothing is answered until you confirm):"]
        lines += [f"  {choice_text(plan, c)}: {url}" for c, url in answers.items()]
    return "\n".join(lines) + "\n"


def when(ts: str | float, zone: ZoneInfo | None = None) -> str:
    """A deadline in the principal's zone, the zone named: "2026-11-22 21:00 CET (Europe/Paris)".

    ``ts``: an RFC 3339 time (a moment's expires_at) or seconds since the epoch; text that is
    neither is shown as it is.
    """
    try:
        at = (datetime.fromtimestamp(ts, UTC) if isinstance(ts, int | float)
              else datetime.fromisoformat(ts.replace("Z", "+00:00")))
    except (ValueError, OverflowError, OSError):
        return str(ts)
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    zone = zone or ZoneInfo("UTC")
    local = at.astimezone(zone)
    name = local.tzname() or ""
    return f"{local:%Y-%m-%d %H:%M} {name}" + (f" ({zone.key})" if zone.key not in (name, "UTC", "Etc/UTC") else "")


_DARK_CSS = "@media (prefers-color-scheme: dark){" + "".join(
    f'[style="{_CSS[name]}"]{{' + ";".join(f"{d} !important" for d in decl.split(";")) + "}"
    for name, decl in _DARK.items()) + "}"


def page(title: str, body: str) -> str:
    """A whole page: one main landmark; the body's opening <h2> (if any) is the page's <h1>."""
    if body.startswith("<h2"):
        end = body.index("</h2>")
        body = f'<h1{_st("h1")}' + body[3:end] + "</h1>" + body[end + 5:]
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><meta name="robots" content="noindex">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<meta name="color-scheme" content="light dark"><title>{_e(title)}</title>'
            f"<style>{_DARK_CSS}</style></head>"
            f'<body{_st("body")}><main class="card"{_st("card")}>{body}</main></body></html>')


def mail_html(plan: Plan, links: dict[str, str], expires: str, zone: ZoneInfo | None = None) -> str:
    foot = (f'<p class="foot"{_st("foot")}>Each link opens a confirmation page; nothing is answered until you '
            f"press the button there. The links work once, until {_e(expires)}. Anyone who has this e-mail can "
            "answer: do not forward it.</p>")
    return page("A decision waits", f"<h2>A decision waits for you</h2>{plan_html(plan, links, zone)}{foot}")


# -- the confirmation pages ------------------------------------------------------

@dataclass
class AnswerMail:
    """What an answer-enabled mail carries: both parts and the links (for the log, never the tokens)."""

    text: str
    html: str
    links: dict[str, str]


class AnswerLinks:
    """Mints the links of a mail and serves the pages they open (an aiohttp app in the notifier)."""

    def __init__(self, config: Config, nc: Client, js: Any) -> None:
        self.config = config
        self.cfg = config.notifier
        self.nc = nc
        self.js = js
        self.tokens = Tokens(load_answer_key(config))
        self.used: Any = None
        self._runner: web.AppRunner | None = None
        self._conns: dict[str, Client] = {}
        self._lock = asyncio.Lock()
        self.port = self.cfg.answer_port

    @property
    def base_url(self) -> str:
        return (self.cfg.answer_url or f"http://{self.cfg.answer_host}:{self.port}").rstrip("/")

    # -- minting ----------------------------------------------------------------
    def mail(self, principal: str, raw_item: str, moment_expires: float | None, *, now: float | None = None) -> AnswerMail:
        now = time.time() if now is None else now
        plan = plan_item(raw_item)
        exp = now + self.cfg.answer_link_ttl_s
        if moment_expires is not None:
            exp = min(exp, moment_expires)
        nonce = secrets.token_hex(12)
        mid = getattr(plan, "moment_id", "")
        choices = answer_choices(plan) + ([WHOLE] if arguments_chars(plan) else [])
        links = {c: self.url(principal, mid, c, self.tokens.mint(Claims(principal, mid, c, int(exp), nonce)))
                 for c in choices}
        zone = self.cfg.for_principal(principal).zone
        until = when(exp, zone)
        text = plan_text(plan, links, zone)
        if links:
            text += f"\nThe links work once, until {until}. Anyone who has this e-mail can answer: do not forward it.\n"
        return AnswerMail(text, mail_html(plan, links, until, zone), links)

    def url(self, principal: str, moment_id: str, choice: str, token: str) -> str:
        return f"{self.base_url}/answer/{principal}/{moment_id}/{choice}?t={token}"

    # -- serving ----------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._headers], client_max_size=64 * 1024)
        app.router.add_get("/answer/{principal}/{moment}/{choice}", self._get)
        app.router.add_post("/answer/{principal}/{moment}/{choice}", self._post)
        return app

    async def start(self) -> AnswerLinks:
        self.used = await ensure_kv(self.js, USED_BUCKET, ttl=USED_TTL_S)
        self._runner = web.AppRunner(self.app(), access_log=None)  # the URLs hold tokens: no access log
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.answer_host, self.cfg.answer_port)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        log.info("answer links served", url=self.base_url)
        return self

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        conns, self._conns = self._conns, {}
        for c in conns.values():
            try:
                await c.drain()
            except Exception:
                log.debug("closing a principal connection failed", exc_info=True)

    @web.middleware
    async def _headers(self, request: web.Request, handler: Any) -> web.StreamResponse:
        resp = await handler(request)
        resp.headers["Content-Security-Policy"] = ("default-src 'none'; style-src 'unsafe-inline'; "
                                                   "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
        resp.headers["Referrer-Policy"] = "no-referrer"  # the URL holds the token
        resp.headers["Cache-Control"] = "no-store"
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["X-Robots-Tag"] = "noindex"
        return resp

    def _refusal(self, r: TokenRefused) -> web.Response:
        body = f'<h2>Nothing was answered</h2><p class="refused" data-code="{_e(r.code)}">{_e(r.page)}</p>'
        return web.Response(text=page("Nothing was answered", body), status=r.status, content_type="text/html")

    async def _check(self, request: web.Request) -> Claims:
        """The token of this URL: genuine, unexpired, for this principal, moment and answer, unused."""
        claims = self.tokens.verify(request.query.get("t", ""))
        info = request.match_info
        if (claims.p, claims.m, claims.c) != (info["principal"], info["moment"], info["choice"]):
            raise TokenRefused("foreign", 403, "This answer link belongs to another principal, moment or answer. "
                               "Nothing was answered.")
        pc = self.cfg.principals.get(claims.p)
        if pc is None or not pc.answer_by_email or claims.c not in (*CHOICES, WHOLE):
            raise TokenRefused("not_enabled", 403, "Answering by e-mail is not turned on for this principal. "
                               "Nothing was answered.")
        if (await self._use_of(claims.used_key))[0]:
            raise TokenRefused("used", 409, "This answer link was already used. Each link answers once.")
        return claims

    async def _use_of(self, key: str) -> tuple[bool, int]:
        """(used, revision of the key's value, 0 if none). A value that is no used-link record was not
        written here: it is logged and uses nothing."""
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.used.get(key)
        except KeyNotFoundError:
            return False, 0
        if entry.value is None:
            return False, 0
        try:
            _used_dec.decode(entry.value)
        except msgspec.DecodeError:  # a ValidationError is one
            foreign(USED_BUCKET, key, entry.revision)
            return False, entry.revision
        return True, entry.revision

    async def _mark_used(self, key: str) -> bool:
        """Mark a link used; False if it was already (``create``: one winner). A value under the key that
        is no used-link record is taken by compare-and-set on its revision: one winner all the same."""
        from nats.js.errors import KeyWrongLastSequenceError

        value = msgspec.json.encode(_Used(time.time()))
        try:
            await self.used.create(key, value)
        except KeyWrongLastSequenceError:
            pass
        else:
            return True
        used, revision = await self._use_of(key)
        if used or not revision:
            return False
        try:
            await self.used.update(key, value, last=revision)
        except KeyWrongLastSequenceError:
            return False
        return True

    async def _surface(self, principal: str) -> Surface:
        """P's own connection (``pgw creds``'s file) when there is one, so the server confines it to P."""
        async with self._lock:  # one connection per principal, also when two pages open at once
            return Surface(await self._conn(principal), principal, prefix=self.config.prefix, presence=False)

    async def _conn(self, principal: str) -> Client:
        nc = self._conns.get(principal)
        if nc is None:
            sec = self.config.security
            folder = Path(sec.creds_dir) if sec.creds_dir else Path(self.config.data_path) / "creds"
            creds = folder / f"principal-{principal}.creds"
            if creds.exists():
                from pgwcore.connect import connect

                nc = await connect(self.config.nats_url, creds=str(creds), tls=self.config.tls.files(),
                                   name=f"pgw-notifier-answers-{principal}")
                self._conns[principal] = nc
            else:
                nc = self.nc
        return nc

    async def _moment(self, claims: Claims) -> Plan:
        surface = await self._surface(claims.p)
        reply = await surface.pending_reply()
        for item in reply.items:
            if getattr(item, "moment_id", None) == claims.m:
                plan = plan_item(item)
                if claims.c in answer_choices(plan) or (claims.c == WHOLE and arguments_chars(plan)):
                    return plan
                raise TokenRefused("not_answerable", 409, "This moment cannot be answered with this link.")
        if reply.more:  # a part of the list: not there is not gone (a review)
            raise TokenRefused("not_listed", 503, "More decisions wait than the gateway lists at once, and this "
                               "one is not among them yet: answer some others first, then open this link again. "
                               "Nothing was answered.")
        raise TokenRefused("gone", 410, "This decision no longer waits: it was answered (here or on another "
                           "surface), withdrawn, or it expired. Nothing was answered.")

    def _form(self, plan: Plan, claims: Claims) -> str:
        fields = ""
        if claims.c == "free_text":
            fields = ('<p><label for="text">Your answer</label><textarea id="text" name="text" rows="5" '
                      f'cols="60" maxlength="{MAX_TEXT}" required{_st("box")}></textarea></p>')
        elif claims.c == "dialogue":
            fields = ('<p><label for="objection">What is wrong with the question? (optional)</label>'
                      f'<textarea id="objection" name="objection" rows="4" cols="60" maxlength="{MAX_TEXT}"'
                      f'{_st("box")}></textarea></p>')
        elif claims.c == "answers" and isinstance(plan, ClarificationPlan):
            fields = "".join(
                f'<p><label for="q{i}">{_e(q.question)}</label><textarea id="q{i}" name="q:{_e(q.id)}" rows="3" '
                f'cols="60" maxlength="{MAX_TEXT}" required{_st("box")}></textarea></p>' for i, q in enumerate(plan.questions))
        return (f'<h2>Your answer: <span class="chosen">{_e(choice_text(plan, claims.c))}</span></h2>'
                # No action: the form posts to this very URL, also behind a proxy that adds a path prefix.
                f'<form method="post">{fields}'
                f'<button type="submit"{_st("link")}>Send this answer</button></form>'
                f'<p{_st("foot")}>Nothing has been answered yet. Close this page to answer nothing.</p>')

    async def _get(self, request: web.Request) -> web.Response:
        """Show the moment and the chosen answer; answers nothing (scanners and previews GET every link)."""
        try:
            claims = await self._check(request)
            plan = await self._moment(claims)
        except TokenRefused as r:
            return self._refusal(r)
        except Exception:
            log.exception("answer page failed")
            return self._refusal(UNREACHABLE)
        zone = self.cfg.for_principal(claims.p).zone
        if claims.c == WHOLE:
            body = ("<h2>The arguments in full</h2><p>The tool receives them exactly as sent; what looks like a secret "
                    "is shown as [REDACTED] here. To answer, use a link in the e-mail.</p><hr>"
                    + plan_html(plan, zone=zone, whole=True))
            return web.Response(text=page("The arguments in full", body), content_type="text/html")
        # The page shows the arguments in full above nothing but the moment: she answers what will run.
        body = self._form(plan, claims) + "<hr>" + plan_html(plan, zone=zone, whole=True)
        return web.Response(text=page("Confirm your answer", body), content_type="text/html")

    def _resolution(self, plan: Plan, claims: Claims, form: Any) -> Resolution:
        def text(name: str) -> str:
            value = form.get(name, "")
            return value.strip()[:MAX_TEXT] if isinstance(value, str) else ""

        if claims.c.startswith("o"):
            return OptionChoice(index=int(claims.c[1:]))
        if claims.c == "free_text":
            if not text("text"):
                raise TokenRefused("empty", 400, "Write your answer before you send it. Nothing was answered.")
            return FreeTextAnswer(text=text("text"))
        if claims.c == "dialogue":
            return DialogueVeto(objection=text("objection") or None)
        assert isinstance(plan, ClarificationPlan)
        answers = {q.id: text(f"q:{q.id}") for q in plan.questions}
        if not all(answers.values()):
            raise TokenRefused("empty", 400, "Answer every question before you send. Nothing was answered.")
        return ClarificationAnswers(answers=answers)

    async def _post(self, request: web.Request) -> web.Response:
        """Answer once: mark the token used (create: one winner), then resolve as the token's principal."""
        try:
            claims = await self._check(request)
            if claims.c == WHOLE:
                raise TokenRefused("not_answerable", 409, "This link shows the arguments; it answers nothing. "
                                   "Nothing was answered.")
            plan = await self._moment(claims)
            resolution = self._resolution(plan, claims, await request.post())
            if not await self._mark_used(claims.used_key):
                raise TokenRefused("used", 409, "This answer link was already used. Each link answers once.")
            surface = await self._surface(claims.p)
            try:
                reply = await surface.resolve(claims.m, resolution)
            except Exception:
                log.exception("e-mail answer not confirmed by the gateway", principal=claims.p, moment_id=claims.m)
                raise TokenRefused("unconfirmed", 503, "The gateway did not confirm this answer in time; the link is "
                                   "used. Open your surface to see whether the decision still waits.") from None
        except TokenRefused as r:
            return self._refusal(r)
        except Exception:
            log.exception("answer page failed")
            return self._refusal(UNREACHABLE)
        if reply.status != "accepted":
            log.info("e-mail answer refused by the gateway", principal=claims.p, moment_id=claims.m, code=reply.code)
            return self._refusal(TokenRefused(reply.code or "refused", 409,
                                              f"The gateway did not take this answer: {reply.reason or reply.code}."))
        log.info("answered from e-mail", principal=claims.p, moment_id=claims.m, answer=claims.c)
        body = (f'<h2 class="accepted">Answer sent</h2><p>{_e(choice_text(plan, claims.c))}</p>'
                "<p>The agent has your answer; your other surfaces show the decision as answered.</p>")
        return web.Response(text=page("Answer sent", body), content_type="text/html")
