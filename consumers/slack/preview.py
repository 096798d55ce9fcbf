"""A static HTML preview of Block Kit blocks, for docs and eyeballing (not a Slack client).

``python -m consumers.slack.preview --png docs/img/slack-moment.png`` renders
the blocks the Slack surface posts for the sample moment (the same
``blocks.render`` and ``blocks.closed`` calls the surface makes) to HTML in
Slack's look, and screenshots it in headless Chromium. Only the block types
the surface uses are drawn; text is escaped, mrkdwn ``*bold*`` and
``:emoji:`` shortcodes of ours are shown as Slack would.
"""

from __future__ import annotations

import argparse
import html
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from consumers.slack import blocks as kit
from consumers.surfaces.model import plan_item

# Text glyphs standing in for Slack's emoji images (a headless Chromium may have no emoji font).
EMOJI = {":star:": "<span style='color:#e8a200'>★</span>", ":warning:": "⚠", ":white_check_mark:": "<span style='color:#2bac76'>✔</span>",
         ":hourglass:": "⌛", ":no_entry:": "⛔", ":leftwards_arrow_with_hook:": "↩"}

CSS = """
body { font-family: Lato, 'Helvetica Neue', Helvetica, Arial, sans-serif; font-size: 15px; color: #1d1c1d;
       background: #fff; margin: 0; padding: 16px 20px; width: 760px; }
.msg { display: flex; gap: 8px; margin-bottom: 18px; }
.avatar { width: 36px; height: 36px; border-radius: 6px; background: #4a154b; color: #fff; font-weight: 700;
          display: flex; align-items: center; justify-content: center; font-size: 13px; flex: none; }
.who { font-weight: 900; } .app { font-size: 10px; background: #e8e8e8; padding: 1px 3px; border-radius: 2px;
       color: #616061; margin-left: 4px; } .time { color: #616061; font-size: 12px; margin-left: 6px; }
.body { flex: 1; } .header { font-size: 18px; font-weight: 900; margin: 6px 0 4px; }
.section { display: flex; justify-content: space-between; gap: 12px; margin: 6px 0; white-space: pre-wrap;
           line-height: 1.4; } .section .text { flex: 1; }
.context { color: #616061; font-size: 13px; margin: 2px 0 6px; }
.divider { border-top: 1px solid #ddd; margin: 10px 0; }
.actions { display: flex; gap: 8px; margin: 8px 0; }
button { font: inherit; font-size: 14px; font-weight: 700; border: 1px solid #bbb; background: #fff;
         border-radius: 4px; padding: 4px 12px; height: 32px; white-space: nowrap; }
.caption { color: #616061; font-size: 12px; margin: 0 0 8px 44px; font-style: italic; }
"""


def _text(obj: dict[str, Any]) -> str:
    t = html.escape(obj.get("text", ""))
    if obj.get("type") == "mrkdwn":
        t = re.sub(r"\*([^*]+)\*", r"<b>\1</b>", t)
        t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
        t = re.sub(r"&lt;@(\w+)&gt;", r"<b style='color:#1264a3'>@alice</b>", t)
        for code, char in EMOJI.items():
            t = t.replace(code, char)
    return t


def blocks_html(blocks: kit.Blocks) -> str:
    out = []
    for b in blocks:
        match b["type"]:
            case "header":
                out.append(f"<div class='header'>{_text(b['text'])}</div>")
            case "section":
                acc = b.get("accessory")
                btn = f"<button>{_text(acc['text'])}</button>" if acc else ""
                out.append(f"<div class='section'><div class='text'>{_text(b['text'])}</div>{btn}</div>")
            case "context":
                out.append("<div class='context'>" + " ".join(_text(e) for e in b["elements"]) + "</div>")
            case "divider":
                out.append("<div class='divider'></div>")
            case "actions":
                out.append("<div class='actions'>" + "".join(f"<button>{_text(e['text'])}</button>"
                                                              for e in b["elements"]) + "</div>")
    return "\n".join(out)


def page(messages: list[tuple[str, kit.Blocks]]) -> str:
    body = "".join(
        f"<div class='caption'>{html.escape(caption)}</div><div class='msg'><div class='avatar'>PG</div>"
        f"<div class='body'><span class='who'>Principal Gateway</span><span class='app'>APP</span>"
        f"<span class='time'>10:42</span>{blocks_html(bl)}</div></div>"
        for caption, bl in messages)
    return f"<!doctype html><meta charset='utf-8'><style>{CSS}</style>{body}"


def sample_item() -> dict[str, Any]:
    moment = {
        "synopsis": "Share only your 2025 tax summary with Harbor Accounting, not the full ledger.",
        "findings": ["Harbor requested the full ledger for the 2025 filing.",
                     "Their engagement letter covers the annual filing only.",
                     "The 2025 summary has every figure the filing form needs."],
        "recommendations": ["Send the 2025 tax summary PDF through the client portal.",
                            "Decline the ledger request with a note naming the engagement scope."],
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
    mid = "5f0c2a9be41d47a0b8f3c2d1e0a9b8c7"
    return {"item": "binding_moment", "agent": "planner", "principal": "alice", "created_at": "2026-11-27T10:42:00Z",
            "untrusted": False, "moment_id": mid, "envelope_id": mid, "correlation_id": mid,
            "expires_at": "2026-11-27T18:00:00Z", "hem": False, "binding_moment": moment}


def sample_messages() -> list[tuple[str, kit.Blocks]]:
    plan = plan_item(sample_item())
    _, live = kit.render(plan, "alice")
    _, done = kit.closed(plan, "alice", ":white_check_mark: *Answered in Slack* by <@U0ALICE>:",
                         "Option 1: Send the 2025 tax summary only")
    kit.check_blocks(live)
    kit.check_blocks(done)
    return [("As posted (the DM with the principal)", live), ("The same message once answered (updated in place)", done)]


def screenshot(html_text: str, png: Path, *, chromium: str = "/usr/bin/chromium", height: int = 1560) -> None:
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "slack.html"
        src.write_text(html_text)
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                        "--hide-scrollbars", f"--window-size=800,{height}", f"--screenshot={png.resolve()}",
                        src.as_uri()], check=True, capture_output=True, timeout=60)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--html", type=Path, help="write the HTML here")
    p.add_argument("--png", type=Path, help="screenshot it here with headless Chromium")
    args = p.parse_args(argv)
    text = page(sample_messages())
    if args.html:
        args.html.write_text(text)
    if args.png:
        screenshot(text, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
