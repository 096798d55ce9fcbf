"""The ``[notifier]`` section (issue 17, docs/notifications.md): channels and their rules.

Decoded into ``pgwcore.config.Config.notifier`` with the rest of the file, so a
typo'd key or a bad value fails start-up with the field named. Files named
here (SMTP credentials, webhook secrets) are read by the notifier at start,
where a missing or unreadable one is reported with its path.
"""

from __future__ import annotations

import re
from datetime import time as dtime
from typing import Annotated
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from msgspec import Meta, Struct, field

from subjects.names import principal_token

_HHMM = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)$")
_EMAIL = re.compile(r"^[^@\s<>,;]+@[^@\s<>,;]+\.[^@\s<>,;]+$|^[^@\s<>,;]+@localhost$")

# RFC 8030 push services of the major browsers; a subscription naming another host is
# refused (the notifier would otherwise POST wherever a principal points it).
DEFAULT_PUSH_HOSTS = [
    "fcm.googleapis.com",  # Chrome, Edge on Android, Opera
    "*.push.services.mozilla.com",  # Firefox
    "*.notify.windows.com",  # Edge on Windows
    "*.push.apple.com",  # Safari (web.push.apple.com)
]


def _bad(where: str, why: str) -> ValueError:
    # A ValueError in __post_init__ becomes msgspec's ValidationError with the table path
    # (``$.notifier.principals.alice``); load_config reports it as a ConfigError.
    return ValueError(f"{where}: {why}")


class _Section(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


def parse_quiet_hours(value: str, where: str) -> tuple[dtime, dtime]:
    """``"22:00-07:00"`` -> (start, end); a window may wrap midnight; start == end is refused."""
    start, sep, end = value.partition("-")
    ms, me = _HHMM.match(start.strip()), _HHMM.match(end.strip())
    if not sep or not ms or not me:
        raise _bad(where, f"{value!r} is not HH:MM-HH:MM (24-hour clock, e.g. \"22:00-07:00\")")
    a, b = dtime(int(ms[1]), int(ms[2])), dtime(int(me[1]), int(me[2]))
    if a == b:
        raise _bad(where, f"{value!r} is an empty window (start equals end)")
    return a, b


def check_http_url(value: str, where: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _bad(where, f"{value!r} must be an http:// or https:// URL with a host")
    return value


class PrincipalNotify(_Section):
    """How one principal wants to be told (``[notifier.principals.NAME]``)."""

    email: str | None = None  # address the notice is mailed to
    webhook_url: str | None = None  # chat bridge endpoint, POSTed a signed JSON body
    webhook_secret_file: str | None = None  # HMAC-SHA256 key: the file's bytes, surrounding whitespace removed
    web_push: bool = True  # to every push subscription the principal's PWA registered
    show_synopsis: bool = False  # opt-in: the (redacted) synopsis in the notification
    quiet_hours: str | None = None  # "22:00-07:00" in `timezone`: notifications wait for the end
    timezone: str = "UTC"  # IANA name, e.g. "Europe/Paris"
    reminder_before_s: Annotated[int, Meta(ge=1, le=30 * 86400)] | None = None  # remind this long before expiry
    # Opt-in: the e-mail carries the whole moment and one answer link per option and hatch
    # (docs/notifications.md "Answering from the e-mail"); it puts the decision in the mailbox.
    answer_by_email: bool = False

    def check(self, where: str) -> None:
        """Every value of the table; ``where`` names it in the error."""
        if self.email is not None and not _EMAIL.match(self.email):
            raise _bad(f"{where}.email", f"{self.email!r} is not an e-mail address")
        if self.answer_by_email and not self.email:
            raise _bad(f"{where}.answer_by_email", "set, but the principal has no email address")
        if self.webhook_url is not None:
            check_http_url(self.webhook_url, f"{where}.webhook_url")
            if not self.webhook_secret_file:
                raise _bad(f"{where}.webhook_secret_file", "a webhook_url needs a webhook_secret_file (its HMAC key)")
        elif self.webhook_secret_file:
            raise _bad(f"{where}.webhook_secret_file", "set without webhook_url")
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError) as e:
            raise _bad(f"{where}.timezone", f"{self.timezone!r} is not an IANA time zone (e.g. \"Europe/Paris\")") from e
        if self.quiet_hours is not None:
            parse_quiet_hours(self.quiet_hours, f"{where}.quiet_hours")

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    @property
    def quiet(self) -> tuple[dtime, dtime] | None:
        return parse_quiet_hours(self.quiet_hours, "quiet_hours") if self.quiet_hours else None


class SmtpConfig(_Section):
    """The mail relay (``[notifier.smtp]``): STARTTLS unless ``starttls = false`` on loopback."""

    host: str | None = None  # unset: no e-mail channel
    port: Annotated[int, Meta(ge=1, le=65535)] = 587
    starttls: bool = True
    credentials_file: str | None = None  # two lines: user name, then password (0600)
    from_addr: str = "pgw@localhost"
    ca_file: str | None = None  # PEM bundle to trust instead of the system's (a private relay)
    timeout_s: Annotated[float, Meta(gt=0)] = 30.0

    def __post_init__(self) -> None:
        if not _EMAIL.match(self.from_addr):
            raise _bad("notifier.smtp.from_addr", f"{self.from_addr!r} is not an e-mail address")
        if self.host is not None and not self.starttls and self.host not in ("127.0.0.1", "localhost", "::1"):
            raise _bad("notifier.smtp.starttls", "only a loopback relay may be used without STARTTLS")
        if self.credentials_file and not self.starttls:
            raise _bad("notifier.smtp.credentials_file", "credentials are sent only over STARTTLS")


class NotifierConfig(_Section):
    """The notifier consumer, ``pgw notifier`` (issue 17, docs/notifications.md)."""

    enabled: bool = True  # `pgw up` runs it
    # The link every notification carries; "" = the browser surface, http://{surfaces.web_host}:{web_port}/
    surface_url: str = ""
    durable: str = "pgw-notifier"
    # RFC 8292 §2.1: the contact the push service may use; mailto: or https:
    vapid_subject: str = "mailto:pgw@localhost"
    push_hosts: list[str] = field(default_factory=lambda: list(DEFAULT_PUSH_HOSTS))
    push_allow_http: bool = False  # http:// endpoints (only for a loopback test push service)
    push_ttl_s: Annotated[int, Meta(ge=0, le=28 * 86400)] = 3600  # RFC 8030 §5.2 TTL header
    # A restarted notifier waits this long for surfaces to re-announce before sending.
    presence_grace_s: Annotated[float, Meta(ge=0, le=600)] = 12.0
    max_attempts: Annotated[int, Meta(ge=1, le=100)] = 8  # then the dead letter
    backoff_base_s: Annotated[float, Meta(gt=0)] = 2.0
    backoff_max_s: Annotated[float, Meta(gt=0)] = 300.0
    http_timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    concurrency: Annotated[int, Meta(ge=1, le=256)] = 16
    push_max_per_principal: Annotated[int, Meta(ge=1, le=1000)] = 20  # devices; one more is refused
    smtp: SmtpConfig = field(default_factory=SmtpConfig)
    # E-mail answers (docs/notifications.md "Answering from the e-mail"): the notifier serves the
    # confirmation pages the links open. answer_url is the base URL the links carry ("" =
    # http://{answer_host}:{answer_port}); put it behind your HTTPS reverse proxy in production.
    answer_url: str = ""
    answer_host: str = "127.0.0.1"
    answer_port: Annotated[int, Meta(ge=0, le=65535)] = 8767  # 0: any free port
    # The HMAC key of the links: a file (0600, at least 32 bytes) or $PGW_ANSWER_KEY; never this TOML.
    # "" = {data_dir}/keys/answer_link.key, made on first start when keys.create allows.
    answer_key_file: str = ""
    # A link works this long after the mail is sent (and never after the moment expires).
    answer_link_ttl_s: Annotated[int, Meta(ge=60, le=30 * 86400)] = 7 * 86400
    principals: dict[str, PrincipalNotify] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.surface_url:
            check_http_url(self.surface_url, "notifier.surface_url")
        if self.answer_url:
            check_http_url(self.answer_url, "notifier.answer_url")
        if not self.vapid_subject.startswith(("mailto:", "https://")):
            raise _bad("notifier.vapid_subject", "must be a mailto: or https: URI (RFC 8292 §2.1)")
        for name, p in self.principals.items():
            try:
                principal_token(name)
            except ValueError as e:
                raise _bad(f"notifier.principals.{name}", str(e)) from e
            p.check(f"notifier.principals.{name}")
            if p.email and not self.smtp.host:
                raise _bad(f"notifier.principals.{name}.email", "set, but notifier.smtp.host is not: no relay to mail through")
        for h in self.push_hosts:
            if not h or "/" in h or ":" in h:
                raise _bad("notifier.push_hosts", f"{h!r} is not a host name (or *.domain)")

    def for_principal(self, principal: str) -> PrincipalNotify:
        """The principal's settings; a principal not listed gets Web Push only, no synopsis."""
        return self.principals.get(principal_token(principal)) or PrincipalNotify()
