"""Realistic binding moments for tests (spec 000 §5 shape)."""

from __future__ import annotations

import copy
from typing import Any

GOOD_MOMENT: dict[str, Any] = {
    "synopsis": "Share only your 2025 tax summary with Harbor Accounting, not the full ledger.",
    "findings": [
        "Harbor requested the full ledger for the 2025 filing.",
        "Their engagement letter covers the annual filing only.",
        "The 2025 summary has every figure the filing form needs.",
    ],
    "recommendations": [
        "Send the 2025 tax summary PDF through the client portal.",
        "Decline the ledger request with a note naming the engagement scope.",
    ],
    "offer": "Ask for detail on any item.",
    "question": {
        "stem": "Which records should Harbor Accounting receive for the 2025 filing?",
        "options": [
            {"label": "Send the 2025 tax summary only", "reasoning": "Covers the filing and keeps the ledger private."},
            {"label": "Send the full ledger", "reasoning": "Matches their request if they need line items later."},
            {"label": "Send nothing yet", "reasoning": "Waits until you have spoken with them."},
        ],
        "recommended_idx": 0,
        "hatches": {"free_text": True, "dialogue": True},
    },
    "meta": {"decision_class": "consent"},
}


def good_moment(**question_overrides: Any) -> dict[str, Any]:
    m = copy.deepcopy(GOOD_MOMENT)
    m["question"].update(question_overrides)
    return m
