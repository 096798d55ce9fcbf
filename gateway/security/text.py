"""Invisible characters that make a text render differently from what it says.

A binding moment is a decision shown to a human (spec 000 §9): a bidi
override can make "Approve" *display* as another word (CVE-2021-42574,
"Trojan Source"), and Unicode tag characters carry text no one sees (prompt
smuggling). Slot text containing them is refused, never silently stripped
(DESIGN §2: nothing is silently mangled). Marks needed by right-to-left
scripts (LRM, RLM, ALM) and the joiners of emoji sequences stay allowed, and
tag characters are allowed in their one legitimate use: an emoji flag tag
sequence (U+1F3F4, tags, U+E007F).
"""

from __future__ import annotations

_BIDI_CONTROLS = {
    0x202A: "LEFT-TO-RIGHT EMBEDDING",
    0x202B: "RIGHT-TO-LEFT EMBEDDING",
    0x202C: "POP DIRECTIONAL FORMATTING",
    0x202D: "LEFT-TO-RIGHT OVERRIDE",
    0x202E: "RIGHT-TO-LEFT OVERRIDE",
    0x2066: "LEFT-TO-RIGHT ISOLATE",
    0x2067: "RIGHT-TO-LEFT ISOLATE",
    0x2068: "FIRST STRONG ISOLATE",
    0x2069: "POP DIRECTIONAL ISOLATE",
}
_TAG_FIRST, _TAG_LAST, _CANCEL_TAG, _BLACK_FLAG = 0xE0000, 0xE007F, 0xE007F, 0x1F3F4


def hidden_controls(text: str, *, tags: bool = True) -> str | None:
    """Name of the first disallowed invisible control in ``text`` (with its index), or None.

    ``tags=False`` checks bidi controls only (slots where the redactor's own
    tests plant tag-character evasions that must still be delivered redacted).
    """
    in_flag = False
    for i, ch in enumerate(text):
        c = ord(ch)
        if c in _BIDI_CONTROLS:
            return f"U+{c:04X} {_BIDI_CONTROLS[c]} at index {i}"
        if _TAG_FIRST <= c <= _TAG_LAST:
            if in_flag or not tags:
                if c == _CANCEL_TAG:
                    in_flag = False
                continue
            return f"U+{c:05X} TAG CHARACTER at index {i}"
        in_flag = c == _BLACK_FLAG
    return None
