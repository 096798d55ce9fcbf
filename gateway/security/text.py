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

import re
import unicodedata

import msgspec

from gateway.security.skeleton import CharTable

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


# What a principal reads (spec 000 §9: the slots are rendered as written) holds no
# invisible format character: they hide text from the reader (tags, "ASCII smuggling"),
# split words so filters miss them (zero-width joiners and spaces), or truncate a
# rendering (NUL after a BOM). Kept: the bidi *marks* right-to-left text needs
# (LRM, RLM, ALM), a ZWJ inside an emoji sequence, an emoji flag's tag sequence, and one
# variation selector after the character it selects a form of (an emoji's presentation, a Han
# ideograph's variant); a run of them, or one after anything else, carries data no one sees.
_KEEP_CF = {0x200E, 0x200F, 0x061C}
_FILLERS = {0x034F, 0x115F, 0x1160, 0x3164, 0xFFA0, 0x180B, 0x180C, 0x180D, 0x180F}
_ZWJ = 0x200D


def _pictographic(ch: str) -> bool:
    c = ord(ch)
    return c >= 0x1F000 or 0x2600 <= c <= 0x27BF or c in (0xFE0F, 0x20E3) or 0x1F3FB <= c <= 0x1F3FF


# The ASCII characters visible() drops: every control but tab, LF and CR, and DEL. As bytes too, for
# scanning a message's bytes (bytes.translate deletes them in one C loop).
ASCII_CONTROL_BYTES = bytes([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])
_ASCII_CONTROLS = re.compile("[" + re.escape(ASCII_CONTROL_BYTES.decode()) + "]")


def may_hide(text: str) -> bool:
    """False when ``text`` certainly has nothing :func:`visible` would drop (cheap, for whole batches)."""
    # An ASCII text that is printable holds no control character at all (one C loop, no regex).
    return not text.isascii() or (not text.isprintable() and _ASCII_CONTROLS.search(text) is not None)


def _visible_char(ch: str) -> str:
    """What :func:`visible` keeps of ``ch`` where no tag or joiner is near (those are judged in context)."""
    c = ord(ch)
    if c in _KEEP_CF:
        return ch
    if c in _FILLERS:
        return ""
    cat = unicodedata.category(ch)
    return "" if cat == "Cf" or (cat == "Cc" and ch not in "\t\n\r") else ch


_VISIBLE = CharTable(_visible_char)  # each character met (up to CHARS_KEPT), as visible() keeps it alone
# A ZWJ, a tag or a variation selector: kept or dropped by its neighbours.
_IN_CONTEXT = re.compile("[\u200d\ufe00-\ufe0f\U000e0000-\U000e007f\U000e0100-\U000e01ef]")
_IN_CONTEXT_SPLIT = re.compile(f"({_IN_CONTEXT.pattern})")
HAN = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x3134F))  # the Han ideographs' blocks


def _variation_selector(c: int) -> bool:
    return 0xFE00 <= c <= 0xFE0F or 0xE0100 <= c <= 0xE01EF


def _selects(vs: int, base: str) -> bool:
    """Whether a variation selector ``vs`` right after ``base`` selects a form of it, as each is used: one
    selector after a character that is no selector, the supplement's (U+E0100 ...) after a Han ideograph
    only. Any other is invisible data: a run of selectors after one emoji can carry any bytes."""
    b = ord(base)
    if _variation_selector(b):
        return False
    return vs < 0xE0100 or any(lo <= b <= hi for lo, hi in HAN)


def visible(text: str) -> str:
    """``text`` without the invisible characters above (idempotent; ASCII text is checked cheaply).

    Text with no joiner, tag or variation selector is one ``str.translate`` (each character judged on its
    own, as the loop below judges it there): the loop's Python call per character cost about 1 us, so
    a megabyte of French or Russian in an envelope's strings cost the gateway half a second."""
    if text.isascii():
        return _ASCII_CONTROLS.sub("", text) if _ASCII_CONTROLS.search(text) else text
    if _IN_CONTEXT.search(text) is None:
        return text.translate(_VISIBLE)
    # A joiner, tag or selector is judged by its neighbours, one at a time; the text between two of them
    # is translated whole (each of its characters judged on its own, as above). Judged character by
    # character, 100,000 characters of prose with an emoji's selector in every hundred cost 23 ms (5 ms
    # now); a text that is a joiner or selector in every second or third character costs about the same
    # either way (30-35 ms at 110,000 characters).
    parts = _IN_CONTEXT_SPLIT.split(text)  # [text, context character, text, ..., text]
    out: list[str] = []
    last = ""  # the last character kept (out[-1])
    in_flag = False  # inside an emoji flag's tag sequence (U+1F3F4, tags, U+E007F)
    count = len(parts)
    for j in range(1, count, 2):
        between = parts[j - 1]
        if between:
            kept = _VISIBLE[ord(between)] if len(between) == 1 else between.translate(_VISIBLE)
            if kept:
                out.append(kept)
                last = kept[-1]
            before = between[-1]
            in_flag = ord(before) == _BLACK_FLAG
        else:
            before = parts[j - 2] if j > 1 else ""  # the context character before it
        ch = parts[j]
        c = ord(ch)
        if _TAG_FIRST <= c <= _TAG_LAST:
            if in_flag:
                out.append(ch)
                last = ch
                in_flag = c != _CANCEL_TAG
            continue
        in_flag = False
        if c == _ZWJ:
            after = parts[j + 1][:1] or (parts[j + 2] if j + 2 < count else "")
            keep = bool(last) and bool(after) and _pictographic(last) and _pictographic(after)
        else:  # a variation selector: kept right after the character it selects a form of, itself kept
            keep = bool(before) and last == before and _selects(c, before)
        if keep:
            out.append(ch)
            last = ch
    out.append(parts[-1].translate(_VISIBLE))
    return "".join(out)


def _unseen(ch: str) -> bool:
    """A character a reader cannot see, or cannot tell from a plain space, where it stands."""
    c = ord(ch)
    if ch in "\t\n\r" or ch == " ":
        return False
    cat = unicodedata.category(ch)
    return (cat in ("Cf", "Cc", "Zl", "Zp", "Zs", "Co", "Cn") or c in _FILLERS or _TAG_FIRST <= c <= _TAG_LAST
            or _variation_selector(c))


_SEEN_ONLY = CharTable(lambda ch: "" if _unseen(ch) else ch)  # each character met (up to CHARS_KEPT)


def all_seen(text: str) -> bool:
    """``text`` holds no character a reader cannot see: :func:`marked` marks none and :func:`visible` drops
    none (what it drops, a reader cannot see). One ``str.translate``."""
    return len(text.translate(_SEEN_ONLY)) == len(text)


# Characters drawn as a quotation mark, other than ASCII's ": in a JSON string the gateway quotes a text in,
# they are not escaped, so one could pass for the closing quote (a review: 'todo.txt” (to add one line ...').
_QUOTE_LOOKALIKES = str.maketrans({c: f"⟦U+{ord(c):04X}⟧" for c in
                                   "\u00ab\u00bb\u02ba\u02dd\u02ee\u030b\u030e\u2018\u2019\u201a\u201b"
                                   "\u201c\u201d\u201e\u201f\u2033\u2036\u2039\u203a\u275d\u275e"
                                   "\u301d\u301e\u301f\uff02"})


def quoted(text: str) -> str:
    """``text`` as a JSON string, in a sentence of the gateway's: its quotes escaped and every character drawn
    as a quotation mark written ``⟦U+XXXX⟧``, so no part of it reads as the end of the gateway's quotes."""
    return msgspec.json.encode(text).decode().translate(_QUOTE_LOOKALIKES)


def marked(text: str) -> str:
    """``text`` with every character a reader could not see written as ``⟦U+XXXX⟧`` where it stands.

    For data a principal approves as it will be used (a gated action's arguments, docs/gate.md
    "What the principal sees"), where :func:`visible` would drop what it cannot show: here nothing
    is dropped, so what she reads is what will run. Marked: every format (Cf: bidi controls and
    marks, zero-width spaces and joiners, soft hyphen, word joiner), control (Cc, but tab and line
    breaks), separator other than the plain space (no-break and other look-alike spaces), filler,
    variation selector, tag, private-use and unassigned character.
    """
    if text.isascii() and not _ASCII_CONTROLS.search(text):
        return text
    return "".join(f"⟦U+{ord(ch):04X}⟧" if _unseen(ch) else ch for ch in text)
