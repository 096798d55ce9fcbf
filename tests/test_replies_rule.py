"""The reply rule's literal-subject check (subjects/replies.py), character by character.

A reply subject is admitted only when what follows its inbox prefix is a literal subject: no
wildcard, no empty token, no white space and no control character. The bus tests
(tests/test_security_replies.py) send hostile reply subjects through a real server; this one
holds the character check to its definition on every code point.
"""

from __future__ import annotations

import sys

import pytest

from subjects.replies import Asker, _literal, reply_allowed

ALICE = (Asker("principal", "alice"),)


def _refused_char(c: str) -> bool:
    """The definition: white space as ``str.isspace`` reads it, or a control character (C0, DEL)."""
    return c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F


def test_every_code_point_is_judged_as_defined() -> None:
    wrong = [hex(cp) for cp in range(sys.maxunicode + 1)
             if chr(cp) != "." and _literal(f"ab{chr(cp)}cd") == _refused_char(chr(cp))]
    assert wrong == []


@pytest.mark.parametrize("c", ["\t", "\n", "\r", "\x00", "\x1b", "\x7f", " ", "\u00a0", "\u2028", "\u3000", "\x1c"])
def test_a_reply_subject_holding_white_space_or_a_control_gets_no_answer(c: str) -> None:
    assert reply_allowed("_INBOX_principal_alice.AbC123.7", ALICE, shared_inbox=False)
    assert not reply_allowed(f"_INBOX_principal_alice.AbC{c}123.7", ALICE, shared_inbox=False)
    assert not reply_allowed(f"_INBOX.AbC{c}123.7", ALICE, shared_inbox=True)


@pytest.mark.parametrize("rest", ["", "a..b", "*", "a.>", "a.*.b", ".a", "a."])
def test_a_wildcard_or_empty_token_is_no_literal(rest: str) -> None:
    assert not _literal(rest)
