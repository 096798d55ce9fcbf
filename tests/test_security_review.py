"""The permission review of issue 19: docs/security.md's verb table is the code's."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.security import Party
from gateway.security.jsapi import VERBS, grants, markdown, may_publish, subject_matches
from gateway.security.permissions import Permissions

pytestmark = pytest.mark.security

DOC = Path(__file__).resolve().parent.parent / "docs" / "security.md"


def test_docs_table_is_generated_from_the_permissions() -> None:
    """The table between the jsapi-table markers equals what the permission builders grant today."""
    text = DOC.read_text()
    begin, end = "<!-- jsapi-table:begin -->\n", "<!-- jsapi-table:end -->"
    table = text[text.index(begin) + len(begin):text.index(end)]
    assert table == markdown(), "regenerate with `python -m gateway.security.jsapi`"


def test_subject_matching_follows_nats_rules() -> None:
    """`*` matches one token, `>` one or more, a deny wins over an allow."""
    assert subject_matches("$JS.API.CONSUMER.INFO.*.*", "$JS.API.CONSUMER.INFO.S.d")
    assert not subject_matches("$JS.API.CONSUMER.INFO.*.*", "$JS.API.CONSUMER.INFO.S")
    assert subject_matches("a.>", "a.b.c") and not subject_matches("a.>", "a")
    assert not may_publish(Permissions(pub_allow=("a.>",), pub_deny=("a.b",)), "a.b")


def test_agents_and_principals_get_only_their_own_consumer_verbs() -> None:
    """No agent or principal may call a verb that reads beyond its own durable (DESIGN §7)."""
    own_only = {"CONSUMER.INFO (own)", "CONSUMER.MSG.NEXT (own)", "$JS.ACK (own durable)"}
    for party in (Party("agent", "a"), Party("principal", "p")):
        assert {v.name for v in VERBS if grants("pgw", v, party)} == own_only, party


def test_auditors_get_no_jetstream_verb() -> None:
    """The audit role sees the log only through the kernel (docs/audit.md): no `$JS.API` verb at all."""
    assert not [v.name for v in VERBS if grants("pgw", v, Party("audit", "auditor"))]
