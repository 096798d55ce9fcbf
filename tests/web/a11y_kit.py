"""Accessibility checks of the browser tests (tests/test_surface_a11y.py, tests/test_notify_email_answers.py).

- ``axe_violations``: real axe-core (tests/web/package.json pins it; tests/web/setup.sh
  installs it with ``npm ci``) injected into the page and run with its WCAG 2.0-2.2
  A/AA rules and its best-practice rules. The page's CSP allows only its own scripts,
  so the browser context that runs it is made with ``bypass_csp=True``.
- ``live_text``: the text of every live region (status, log, alert, aria-live) that is
  in the accessibility tree, read from Chromium's own tree (CDP
  ``Accessibility.getFullAXTree``): what a screen reader is told when it changes.
- ``overflow_x``: how far the page is wider than its viewport (WCAG 1.4.10 Reflow).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from surface_kit import not_in_ci

REPO = Path(__file__).resolve().parents[2]
AXE_JS = REPO / "tests" / "web" / "node_modules" / "axe-core" / "axe.min.js"
AXE_TAGS = ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa", "wcag22aa", "best-practice"]

PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 800}
NARROW = {"width": 320, "height": 640}  # WCAG 1.4.10: 1280 px at 400 % zoom

_RUN = """tags => axe.run(document, {runOnly: {type: 'tag', values: tags}, resultTypes: ['violations']})
  .then(r => r.violations.map(v => ({id: v.id, impact: v.impact, help: v.help,
     nodes: v.nodes.slice(0, 5).map(n => n.target.join(' ') + ' :: ' + n.failureSummary)})))"""


def axe_ready() -> str | None:
    """None if axe-core is installed, else the LOUD reason it is not (runs tests/web/setup.sh first)."""
    if not AXE_JS.exists():
        done = subprocess.run(["sh", str(REPO / "tests" / "web" / "setup.sh")], capture_output=True, text=True,
                              check=False, env=dict(os.environ))
        if not AXE_JS.exists():
            return not_in_ci(f"AXE TESTS NOT RUN: {AXE_JS} missing and tests/web/setup.sh could not install it: {done.stderr.strip()}")
    return None


async def axe_violations(page: Any) -> list[dict[str, Any]]:
    """axe-core's violations on the page as it is now (injected once per document)."""
    if not await page.evaluate("typeof window.axe === 'object'"):
        await page.add_script_tag(path=str(AXE_JS))
    return await page.evaluate(_RUN, AXE_TAGS)


async def assert_no_violations(page: Any, state: str) -> None:
    found = await axe_violations(page)
    assert found == [], f"axe-core, state {state!r}: " + "\n".join(
        f"{v['id']} ({v['impact']}): {v['help']}\n    " + "\n    ".join(v["nodes"]) for v in found)


async def overflow_x(page: Any) -> int:
    """CSS pixels by which the document is wider than the viewport (0: it reflows)."""
    return await page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")


async def live_text(page: Any) -> list[str]:
    """The text of each live region in Chromium's accessibility tree (hidden regions are not in it)."""
    cdp = await page.context.new_cdp_session(page)
    try:
        nodes = (await cdp.send("Accessibility.getFullAXTree"))["nodes"]
    finally:
        await cdp.detach()
    by_id = {n["nodeId"]: n for n in nodes}

    def prop(n: dict[str, Any], name: str) -> Any:
        return next((p["value"].get("value") for p in n.get("properties", []) if p["name"] == name), None)

    def text(n: dict[str, Any]) -> str:
        if n.get("ignored"):
            return ""
        if n.get("role", {}).get("value") in ("StaticText", "text"):
            return str(n.get("name", {}).get("value", ""))
        return " ".join(t for c in n.get("childIds", []) if c in by_id and (t := text(by_id[c])))

    roots = [n for n in nodes if not n.get("ignored") and prop(n, "live") in ("polite", "assertive")
             and prop(by_id.get(n.get("parentId", ""), {}), "live") not in ("polite", "assertive")]
    return [text(n) for n in roots]


async def focused(page: Any) -> dict[str, Any]:
    """What has the keyboard focus: tag, id, classes, text, and the moment card it is in."""
    return await page.evaluate("""() => {
      const el = document.activeElement;
      const card = el && el.closest('article');
      return {tag: el ? el.tagName.toLowerCase() : null, id: el?.id || '', cls: el?.className || '',
              text: ((el?.labels && el.labels.length ? el.labels[0].innerText : el?.innerText) || el?.value || '').trim().slice(0, 200),
              moment: card ? (card.dataset.momentId || card.dataset.itemId || '') : null};
    }""")
