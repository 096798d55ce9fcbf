"""What a notification says, and the e-mail and webhook channels (docs/notifications.md).

Content: by default only who waits and where to answer, "A decision from agent
X waits" and the surface link; the synopsis only for a principal with
``show_synopsis = true``, and then only as the gateway put it on the
principal's surface, i.e. after the pipeline's redaction (spec 002 SR-1): the
notifier never reads an envelope.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from datetime import UTC, datetime
from email.message import EmailMessage
from email.utils import formatdate
from pathlib import Path
from typing import Any

import aiohttp
import aiosmtplib
import msgspec

from consumers.notify.answers import AnswerMail
from consumers.notify.store import Job
from consumers.notify.webhook_verify import ID_HEADER, SIGNATURE_HEADER, sign
from consumers.notify.webpush import PushResult
from pgwcore.notifier_config import PrincipalNotify, SmtpConfig
from subjects.errors import PgwError

MAX_SYNOPSIS = 300  # a notification is a pointer, not the moment


class ChannelConfigError(PgwError):
    """A file the notifier configuration names cannot be used."""


@dataclass(frozen=True)
class Notice:
    title: str
    body: str
    url: str
    tag: str
    moment_id: str

    def push_payload(self) -> bytes:
        """The service worker's payload (the bus contract): title, body, url, moment_id, tag."""
        return msgspec.json.encode({"title": self.title, "body": self.body, "url": self.url,
                                    "moment_id": self.moment_id, "tag": self.tag})


def render(job: Job, pc: PrincipalNotify, surface_url: str) -> Notice:
    what = "question" if job.item == "clarification" else "decision"
    title = f"Reminder: a {what} waits" if job.kind == "reminder" else f"A {what} waits"
    body = f"A {what} from agent {job.agent} waits."
    if job.kind == "reminder" and job.expires_at:
        at = datetime.fromtimestamp(job.expires_at, pc.zone).strftime("%H:%M %Z")
        body = f"A {what} from agent {job.agent} waits; it expires at {at}."
    if pc.show_synopsis and job.synopsis:
        syn = job.synopsis if len(job.synopsis) <= MAX_SYNOPSIS else job.synopsis[:MAX_SYNOPSIS] + "…"
        body += ("\nUntrusted content: " if job.untrusted else "\n") + syn
    return Notice(title, body, surface_url, f"pgw-{job.moment_id}", job.moment_id)


def read_secret(path: str, what: str) -> bytes:
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode & 0o777
        data = p.read_bytes().strip()
    except OSError as e:
        raise ChannelConfigError(f"{what} {p}: cannot read ({e.strerror})") from e
    if mode & 0o077:
        raise ChannelConfigError(f"{what} {p} has mode {mode:o}; it must be 0600 (chmod 600 {p})")
    if len(data) < 16:
        raise ChannelConfigError(f"{what} {p} holds fewer than 16 bytes; use a long random secret")
    return data


def read_smtp_credentials(path: str) -> tuple[str, str]:
    """Two lines: user name, then password."""
    lines = [ln for ln in read_secret_text(path).splitlines() if ln.strip()]
    if len(lines) != 2:
        raise ChannelConfigError(f"SMTP credentials file {path}: want two lines (user name, then password)")
    return lines[0].strip(), lines[1].strip()


def read_secret_text(path: str) -> str:
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode & 0o777
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ChannelConfigError(f"SMTP credentials file {p}: cannot read ({e})") from e
    if mode & 0o077:
        raise ChannelConfigError(f"SMTP credentials file {p} has mode {mode:o}; it must be 0600 (chmod 600 {p})")
    return text


class Mailer:
    """SMTP with STARTTLS (RFC 3207) and AUTH (RFC 4954), on asyncio (aiosmtplib)."""

    def __init__(self, cfg: SmtpConfig) -> None:
        self.cfg = cfg
        self.login = read_smtp_credentials(cfg.credentials_file) if cfg.credentials_file else None
        self.tls: ssl.SSLContext | None = None
        if cfg.starttls:
            try:
                self.tls = ssl.create_default_context(cafile=cfg.ca_file)
            except (OSError, ssl.SSLError) as e:
                raise ChannelConfigError(f"notifier.smtp.ca_file {cfg.ca_file}: {e}") from e

    def message(self, job: Job, notice: Notice, to: str, answer: AnswerMail | None = None) -> EmailMessage:
        m = EmailMessage()
        m["From"] = self.cfg.from_addr
        m["To"] = to
        m["Subject"] = notice.title
        m["Date"] = formatdate(localtime=False)
        m["Message-ID"] = f"<{job.notification_id}@pgw-notifier>"  # the same on a repeat
        m["Auto-Submitted"] = "auto-generated"  # RFC 3834 §5: no auto-replies, please
        if answer is None:
            m.set_content(f"{notice.body}\n\nOpen your surface to answer: {notice.url}\n")
            return m
        # The whole moment, with answer links (answer_by_email): a text part and an HTML part.
        m.set_content(f"{answer.text}\nOr open your surface: {notice.url}\n")
        m.add_alternative(answer.html, subtype="html")
        return m

    async def send(self, job: Job, notice: Notice, to: str, answer: AnswerMail | None = None) -> PushResult:
        assert self.cfg.host is not None
        user, password = self.login or (None, None)
        try:
            await aiosmtplib.send(
                self.message(job, notice, to, answer), hostname=self.cfg.host, port=self.cfg.port,
                start_tls=self.cfg.starttls, use_tls=False, tls_context=self.tls,
                username=user, password=password, timeout=self.cfg.timeout_s)
        except aiosmtplib.SMTPRecipientsRefused as e:
            codes = [r.code for r in e.recipients]
            if all(500 <= c < 600 for c in codes):
                return PushResult("failed", codes[0], str(e)[:300])
            return PushResult("retry", codes[0] if codes else None, str(e)[:300])
        except aiosmtplib.SMTPResponseException as e:
            # 5xx other than authentication is permanent for this message; 4xx and 535 may pass later.
            permanent = 500 <= e.code < 600 and e.code != 535
            return PushResult("failed" if permanent else "retry", e.code, f"{e.code} {e.message}"[:300])
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as e:
            return PushResult("retry", None, f"{type(e).__name__}: {e}"[:300])
        return PushResult("sent", 250, "")


def webhook_body(job: Job, notice: Notice, pc: PrincipalNotify) -> bytes:
    body: dict[str, Any] = {
        "type": "moment.reminder" if job.kind == "reminder" else "moment.waiting",
        "id": job.notification_id,
        "principal": job.principal,
        "agent": job.agent,
        "moment_id": job.moment_id,
        "item": job.item,
        "title": notice.title,
        "text": notice.body,
        "url": notice.url,
        "expires_at": datetime.fromtimestamp(job.expires_at, UTC).isoformat().replace("+00:00", "Z")
        if job.expires_at else None,
    }
    if pc.show_synopsis and job.synopsis:
        body["synopsis"] = job.synopsis
    return msgspec.json.encode(body)


async def send_webhook(session: aiohttp.ClientSession, url: str, secret: bytes, job: Job, notice: Notice,
                       pc: PrincipalNotify, *, timeout_s: float, now: int) -> PushResult:
    body = webhook_body(job, notice, pc)
    headers = {"Content-Type": "application/json", SIGNATURE_HEADER: sign(secret, body, now),
               ID_HEADER: job.notification_id, "User-Agent": "pgw-notifier"}
    try:
        async with session.post(url, data=body, headers=headers, allow_redirects=False,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            status, text = r.status, (await r.text(errors="replace"))[:300]
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return PushResult("retry", None, f"{type(e).__name__}: {e}"[:300])
    if 200 <= status < 300 or status == 409:  # 409: the receiver already has this id (a repeat)
        return PushResult("sent", status, "")
    if status in (408, 425, 429) or status >= 500:
        return PushResult("retry", status, text)
    return PushResult("failed", status, text)
