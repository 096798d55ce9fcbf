"""Pieces of the notifier checked against their specs' own examples (issue 17).

RFC 8291 Appendix A (Web Push encryption), the webhook signature a receiver
verifies (docs/notifications.md), quiet hours in the principal's time zone,
and the [notifier] configuration's refusals.
"""

from __future__ import annotations

import base64
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from consumers.notify.quiet import quiet_until
from consumers.notify.webhook_verify import WebhookSignatureError, sign, verify
from consumers.notify.webpush import MAX_PLAINTEXT, encrypt
from pgwcore.config import load_config
from pgwcore.notifier_config import PrincipalNotify
from subjects.errors import ConfigError


def b64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def test_rfc8291_appendix_a() -> None:
    """The same keys and salt give exactly the RFC's bytes: header and ciphertext."""
    as_private = ec.derive_private_key(int.from_bytes(b64("yfWPiYE-n46HLnH0KqZOF1fJJU3MYrct3AELtAQ-oRw")), ec.SECP256R1())
    body = encrypt(
        b"When I grow up, I want to be a watermelon",
        b64("BCVxsr7N_eNgVRqvHtD0zTZsEc6-VV-JvLexhqUzORcxaOzi6-AYWXvTBHm4bjyPjs7Vd8pZGH6SRpkNtoIAiw4"),
        b64("BTBZMqHH6r4Tts7J_aSIgg"), as_private=as_private, salt=b64("DGv6ra1nlYgDCS1FRnbzlw"))
    assert body == b64(
        "DGv6ra1nlYgDCS1FRnbzlwAAEABBBP4z9KsN6nGRTbVYI_c7VJSPQTBtkgcy27mlmlMoZIIgDll6e3vCYLocInmYWAmS6TlzAC8wEqKK6PBru3jl7A_"
        "yl95bQpu6cVPTpK4Mqgkf1CXztLVBSt2Ks3oZwbuwXPXLWyouBWLVWGNWQexSgSxsj_Qulcy4a-fN")


def test_oversize_push_payload_refused() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        encrypt(b"x" * (MAX_PLAINTEXT + 1), b"\x04" + b"\x00" * 64, b"\x00" * 16)


SECRET = b"whsec-0123456789abcdef"


def test_webhook_signature_round_trip_and_refusals() -> None:
    body = b'{"type": "moment.waiting"}'
    header = sign(SECRET, body, 1_700_000_000)
    assert header.startswith("t=1700000000,v1=") and len(header.split("v1=")[1]) == 64
    assert verify(SECRET, header, body, now=1_700_000_010) == 1_700_000_000
    with pytest.raises(WebhookSignatureError, match="does not match"):
        verify(SECRET, header, body + b" ", now=1_700_000_010)
    with pytest.raises(WebhookSignatureError, match="does not match"):
        verify(b"another-secret-entirely", header, body, now=1_700_000_010)
    with pytest.raises(WebhookSignatureError, match="replay"):
        verify(SECRET, header, body, now=1_700_000_000 + 301)
    with pytest.raises(WebhookSignatureError, match="malformed"):
        verify(SECRET, "v1=abc", body, now=1_700_000_000)
    with pytest.raises(WebhookSignatureError, match="no Pgw-Signature"):
        verify(SECRET, None, body)
    seen: dict[str, float] = {}
    verify(SECRET, header, body, notification_id="n1", seen=seen, now=1_700_000_001)
    with pytest.raises(WebhookSignatureError, match="already received"):
        verify(SECRET, header, body, notification_id="n1", seen=seen, now=1_700_000_002)
    # Rotation: two v1 entries, either secret verifies.
    both = header + ",v1=" + sign(b"the-next-secret-000000", body, 1_700_000_000).split("v1=")[1]
    assert verify(b"the-next-secret-000000", both, body, now=1_700_000_000)


def _at(tz: str, text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(tz)).timestamp()


@pytest.mark.parametrize(("window", "local", "wake"), [
    ("22:00-07:00", "2026-03-10T23:30", "2026-03-11T07:00"),  # wraps midnight, before it
    ("22:00-07:00", "2026-03-11T03:00", "2026-03-11T07:00"),  # after midnight
    ("22:00-07:00", "2026-03-11T07:00", None),  # the end is outside
    ("22:00-07:00", "2026-03-11T21:59", None),
    ("12:00-13:30", "2026-03-11T12:45", "2026-03-11T13:30"),  # a window within one day
    ("12:00-13:30", "2026-03-11T11:00", None),
])
def test_quiet_hours_in_the_principals_zone(window: str, local: str, wake: str | None) -> None:
    pc = PrincipalNotify(quiet_hours=window, timezone="Europe/Paris")
    got = quiet_until(pc, _at("Europe/Paris", local))
    assert got == (_at("Europe/Paris", wake) if wake else None)


def test_quiet_hours_follow_daylight_saving() -> None:
    """Europe/Paris springs forward on 2026-03-29: 07:00 local is then 05:00 UTC, not 06:00."""
    pc = PrincipalNotify(quiet_hours="22:00-07:00", timezone="Europe/Paris")
    wake = quiet_until(pc, _at("Europe/Paris", "2026-03-29T01:00"))
    assert wake == datetime.fromisoformat("2026-03-29T05:00+00:00").timestamp()
    assert quiet_until(PrincipalNotify(), 0.0) is None


@pytest.mark.parametrize(("notifier", "words"), [
    ({"principals": {"alice": {"timezone": "Mars/Olympus"}}}, "notifier.principals.alice.timezone"),
    ({"principals": {"alice": {"quiet_hours": "22:00-25:00"}}}, "HH:MM-HH:MM"),
    ({"principals": {"alice": {"quiet_hours": "07:00-07:00"}}}, "empty window"),
    ({"principals": {"alice": {"email": "not-an-address"}}}, "notifier.principals.alice.email"),
    ({"principals": {"alice": {"webhook_url": "https://hooks.example/x"}}}, "needs a webhook_secret_file"),
    ({"principals": {"alice": {"webhook_url": "ftp://hooks.example/x", "webhook_secret_file": "f"}}}, "http:// or https://"),
    ({"principals": {"alice": {"webhook_secret_file": "f"}}}, "set without webhook_url"),
    ({"principals": {"alice": {"reminder_before_s": 0}}}, "reminder_before_s"),
    ({"principals": {"al ice": {}}}, "notifier.principals.al ice"),
    ({"principals": {"alice": {"colour": "red"}}}, "colour"),
    ({"principals": {"alice": {"email": "alice@example.com"}}}, "notifier.smtp.host is not"),
    ({"smtp": {"host": "mail.example", "starttls": False}}, "STARTTLS"),
    ({"smtp": {"host": "127.0.0.1", "starttls": False, "credentials_file": "c"}}, "only over STARTTLS"),
    ({"smtp": {"from_addr": "nobody"}}, "from_addr"),
    ({"vapid_subject": "pgw-admin"}, "RFC 8292"),
    ({"surface_url": "pgw.example"}, "surface_url"),
    ({"push_hosts": ["https://fcm.googleapis.com"]}, "push_hosts"),
    ({"max_attempts": 0}, "max_attempts"),
])
def test_bad_notifier_config_is_refused_with_the_field_named(notifier: dict, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, notifier=notifier)
    assert words in str(e.value)


@pytest.mark.parametrize(("doc", "heading"), [("docs/notifications.md", "## Configuration")])
def test_the_documented_configuration_loads(doc: str, heading: str) -> None:
    """The [notifier] example of docs/notifications.md is valid configuration (the README's copy moved there)."""
    import re
    from pathlib import Path

    import msgspec

    text = (Path(__file__).resolve().parent.parent / doc).read_text().split(heading, 1)[1]
    block = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    config = load_config(None, **msgspec.toml.decode(block.encode()))
    alice = config.notifier.for_principal("alice")
    assert alice.email and alice.webhook_url and alice.quiet_hours and config.notifier.smtp.host
