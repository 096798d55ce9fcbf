"""The ``[slack]`` section (docs/surfaces.md "Slack"): the Slack surface and whom it serves.

Decoded into ``pgwcore.config.Config.slack`` with the rest of the file, so a
typo'd key or a bad value fails start-up with the field named. The bot token,
the signing secret and the Socket Mode app token are never in this file: each
comes from a file named here (mode 0600) or from the environment
(``PGW_SLACK_BOT_TOKEN``, ``PGW_SLACK_SIGNING_SECRET``, ``PGW_SLACK_APP_TOKEN``).
"""

from __future__ import annotations

import contextlib
import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from msgspec import Meta, Struct, field

from subjects.names import principal_token

# Slack member ids: U… or W… (Enterprise Grid), upper-case letters and digits.
_SLACK_USER = re.compile(r"^[UW][A-Z0-9]{2,30}$")
_SLACK_CHANNEL = re.compile(r"^[CGDU][A-Z0-9]{2,30}$")


class _Section(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


class SlackPrincipal(_Section):
    """One principal on Slack: the Slack member who *is* the principal, and where moments go."""

    user: str  # the principal's Slack member id; the only user whose presses count
    channel: str = ""  # "" = a DM from the app to ``user``; else a channel id (C…/G…)

    def __post_init__(self) -> None:
        if not _SLACK_USER.match(self.user):
            raise ValueError(f"user: {self.user!r} is not a Slack member id (U… or W…)")
        if self.channel and not _SLACK_CHANNEL.match(self.channel):
            raise ValueError(f"channel: {self.channel!r} is not a Slack channel id (C…, G…, D…)")


class SlackConfig(_Section):
    """The Slack surface (``pgw surface-slack``; ``pgw up`` runs it when ``enabled``)."""

    enabled: bool = False
    # "http": Slack POSTs interactions to http_host:http_port + path (behind your HTTPS proxy);
    # "socket": Socket Mode, no public endpoint (needs an app-level token, xapp-…).
    mode: Literal["http", "socket"] = "http"
    http_host: str = "127.0.0.1"
    http_port: Annotated[int, Meta(ge=0, le=65535)] = 3000
    path: str = "/slack/interactions"
    bot_token_file: str = ""  # xoxb-…; else $PGW_SLACK_BOT_TOKEN
    signing_secret_file: str = ""  # else $PGW_SLACK_SIGNING_SECRET
    app_token_file: str = ""  # xapp-… (Socket Mode only); else $PGW_SLACK_APP_TOKEN
    api_url: str = "https://slack.com/api/"  # the Web API; tests point it at a loopback stand-in
    surface_url: str = ""  # a link to the app, shown where Slack cannot carry a moment whole
    # Slack's 429s and connection errors are retried this many times in one call (Retry-After
    # respected); after that the item is redelivered later, with back-off.
    max_retries: Annotated[int, Meta(ge=0, le=20)] = 5
    backoff_max_s: Annotated[float, Meta(gt=0, le=3600)] = 60.0
    principals: dict[str, SlackPrincipal] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.principals:
            try:
                principal_token(name)
            except ValueError as e:
                raise ValueError(f"principals.{name}: {e}") from e
        if not self.path.startswith("/"):
            raise ValueError(f"path: {self.path!r} must start with /")
        parts = urlsplit(self.api_url)
        if parts.scheme not in ("http", "https") or not parts.hostname or not self.api_url.endswith("/"):
            raise ValueError(f"api_url: {self.api_url!r} must be an http(s) URL ending in /")
        users = [p.user for p in self.principals.values()]
        if len(set(users)) != len(users):
            raise ValueError("principals: one Slack user is mapped to two principals")

    def principal_of(self, slack_user: str) -> str | None:
        """The principal this Slack member is, or None (anyone else is refused)."""
        for name, p in self.principals.items():
            if p.user == slack_user:
                return principal_token(name)
        return None


# The bus state of the Slack surface (docs/contract.md): shared by the gateway, which creates it
# for an isolated deployment, and the surface, which creates it itself in open mode.
SLACK_BUCKET = "PGW_SLACK"
SLACK_RECORD_TTL_S = 35 * 86400  # longer than PGW_SURFACE keeps an item (30 days): no redelivery outlives its record
SURFACE_STREAM = "PGW_SURFACE"


def slack_durable(principal: str) -> str:
    """The durable on PGW_SURFACE the Slack surface of ``principal`` pulls from."""
    return f"slack-{principal_token(principal)}"


async def ensure_slack_state(js: Any, principal: str, *, prefix: str = "pgw") -> None:
    """Create (idempotently) the durable ``slack-P`` on PGW_SURFACE and the bucket PGW_SLACK.

    Direct get is on for the bucket, so that a read names its key in the subject and the
    server can confine P's Slack identity to P's keys (``slack_permissions``).
    """
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, KeyValueConfig, StorageType
    from nats.js.errors import BadRequestError, NotFoundError

    from subjects.names import Subjects

    await js.add_consumer(SURFACE_STREAM, ConsumerConfig(
        durable_name=slack_durable(principal), filter_subject=Subjects(prefix).surface(principal),
        ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=60, max_deliver=-1))
    try:
        await js.stream_info(f"KV_{SLACK_BUCKET}")
    except NotFoundError:
        with contextlib.suppress(BadRequestError):  # made meanwhile by another process
            await js.create_key_value(KeyValueConfig(bucket=SLACK_BUCKET, history=1, storage=StorageType.FILE,
                                                     direct=True, ttl=SLACK_RECORD_TTL_S))
