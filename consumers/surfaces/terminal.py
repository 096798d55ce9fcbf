"""The terminal surface: ``pgw surface --principal alice``.

Interactive mode is a full-screen arrow-key picker (spec 000 §9.2): ↑/↓ (or
1-4) pick an option, ``f`` opens the answer-space hatch, ``d`` the
question-space hatch, Enter answers, ←/→ switch between pending items, ``s``
lists her standing approvals (``r`` revokes the chosen one). The
gateway's reply (accepted, or why refused) is shown on the status line.

``--json`` mode is for scripts: one JSON object per line on stdout
(``{"event": "item", "item": …, "plan": …}`` and
``{"event": "reply", "moment_id": …, "reply": …}``), answers read from stdin
as ``ResolveRequest`` JSON lines (``{"moment_id": …, "resolution": …}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import termios
import threading
import tty
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import msgspec

from consumers.surfaces.feed import SurfaceFeed
from consumers.surfaces.model import (
    ClarificationPlan,
    DecisionPlan,
    Plan,
    WithdrawPlan,
    plan_item,
    plan_to_builtins,
)
from consumers.surfaces.text import (
    HATCH_KEYS,
    STANDING_HELP,
    STANDING_KEY,
    WHOLE_KEY,
    Style,
    describe_standing,
    render_plan,
    render_standing,
)
from subjects.util import one_line
from subjects.wire import (
    ClarificationAnswers,
    DialogueVeto,
    FreeTextAnswer,
    OptionChoice,
    Resolution,
    ResolveReply,
    resolve_request_decoder,
)

# Refusal codes of the resolution service, in words a principal understands.
if TYPE_CHECKING:
    from subjects.approvals import StandingApproval

REFUSAL_TEXT = {
    "already_resolved": "already answered (on another device or surface)",
    "expired": "this moment expired before your answer arrived",
    "unknown_moment": "the gateway does not know this moment",
    "hatch_closed": "that hatch is closed for this moment",
    "index_out_of_range": "no such option",
    "untrusted_content_blocks_approval": "untrusted content cannot approve an action",
    "no_gateway": "no gateway is answering; nothing was recorded",
    "timeout": "the gateway did not reply in time",
}
GONE_CODES = {"already_resolved", "expired", "unknown_moment"}


def refusal_text(reply: ResolveReply) -> str:
    words = REFUSAL_TEXT.get(reply.code or "", reply.reason or "refused")
    return f"Refused ({reply.code}): {words}"


def plan_key(plan: Plan) -> str:
    return getattr(plan, "moment_id", None) or getattr(plan, "item_id", "") or id(plan).__str__()


def answerable(plan: Plan) -> bool:
    return isinstance(plan, DecisionPlan | ClarificationPlan)


# ---------------------------------------------------------------------------
# Non-interactive mode
# ---------------------------------------------------------------------------

_line_enc = msgspec.json.Encoder()


def _emit(out: TextIO, obj: dict[str, Any]) -> None:
    out.write(_line_enc.encode(obj).decode() + "\n")
    out.flush()


def _stdin_lines(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[bytes | None], stream: Any) -> None:
    """Read stdin in a daemon thread (works for pipes, files and TTYs alike)."""
    try:
        for line in iter(stream.readline, b""):
            loop.call_soon_threadsafe(queue.put_nowait, line)
    finally:
        loop.call_soon_threadsafe(queue.put_nowait, None)


async def run_json(feed: SurfaceFeed, *, stdin: Any = None, out: TextIO | None = None, follow: bool = False) -> int:
    """Items out as JSON lines, answers in from stdin; exit at stdin EOF unless ``follow``."""
    out = out or sys.stdout
    stdin = stdin or sys.stdin.buffer
    snapshot_done = asyncio.Event()
    failure: list[BaseException] = []

    async def pump_items() -> None:
        try:
            async for raw in feed.items(on_snapshot=snapshot_done.set):
                _emit(out, _item_event(raw))
        except Exception as e:  # noqa: BLE001 - reported as a JSON line, then exit 1
            failure.append(e)
            _emit(out, {"event": "error", "error": str(e)})
            snapshot_done.set()

    items_task = asyncio.create_task(pump_items())
    lines: asyncio.Queue[bytes | None] = asyncio.Queue()
    threading.Thread(
        target=_stdin_lines, args=(asyncio.get_running_loop(), lines, stdin), daemon=True
    ).start()
    try:
        while True:
            get = asyncio.create_task(lines.get())
            done, _ = await asyncio.wait({get, items_task}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                break  # the item feed failed
            line = get.result()
            if line is None:
                if follow:
                    await items_task
                break
            if not line.strip():
                continue
            await snapshot_done.wait()
            try:
                req = resolve_request_decoder.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                _emit(out, {"event": "error", "error": f"not a resolve request: {e}"})
                continue
            reply = await feed.resolve(req.moment_id, req.resolution)
            _emit(out, {"event": "reply", "moment_id": req.moment_id, "reply": msgspec.to_builtins(reply)})
        await snapshot_done.wait()
    finally:
        items_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await items_task
    return 1 if failure else 0


def _item_event(raw: bytes) -> dict[str, Any]:
    plan = plan_item(raw)
    try:
        item: Any = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        item = raw.decode("utf-8", "replace")
    return {"event": "item", "item": item, "plan": plan_to_builtins(plan)}


# ---------------------------------------------------------------------------
# Interactive mode
# ---------------------------------------------------------------------------

KEYS = {
    b"\x1b[A": "up", b"\x1bOA": "up",
    b"\x1b[B": "down", b"\x1bOB": "down",
    b"\x1b[C": "right", b"\x1bOC": "right",
    b"\x1b[D": "left", b"\x1bOD": "left",
    b"\x1b[5~": "pgup", b"\x1b[6~": "pgdn",
    b"\r": "enter", b"\n": "enter",
    b"\x7f": "backspace", b"\x08": "backspace",
    b"\t": "right", b"\x1b[Z": "left",
    b"\x03": "quit", b"\x04": "quit",
}


def parse_keys(data: bytes) -> list[str]:
    """Split raw terminal input into key names (or the typed text, prefixed ``char:``)."""
    out: list[str] = []
    i = 0
    while i < len(data):
        for seq in sorted((s for s in KEYS if data.startswith(s, i)), key=len, reverse=True):
            out.append(KEYS[seq])
            i += len(seq)
            break
        else:
            if data[i] == 0x1B:
                # an unknown escape sequence: swallow it whole, a lone ESC is "esc"
                j = i + 1
                if j < len(data) and data[j] in b"[O":
                    j += 1
                    while j < len(data) and not (0x40 <= data[j] <= 0x7E):
                        j += 1
                    out.append("unknown")
                    i = j + 1
                else:
                    out.append("esc")
                    i += 1
                continue
            # one UTF-8 character
            n = 1
            b0 = data[i]
            if b0 >= 0xF0:
                n = 4
            elif b0 >= 0xE0:
                n = 3
            elif b0 >= 0xC0:
                n = 2
            ch = data[i : i + n].decode("utf-8", "replace")
            if ch.isprintable():
                out.append("char:" + ch)
            i += n
    return out


@dataclass
class Prompt:
    """A line being typed: a hatch answer, an objection or a clarification answer."""

    kind: str  # "free_text" | "dialogue" | "answers"
    label: str
    key: str
    buffer: str = ""
    question_ids: list[str] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)


class TerminalSurface:
    """Full-screen interactive surface over a :class:`SurfaceFeed`."""

    def __init__(self, feed: SurfaceFeed, *, out: TextIO | None = None, fd_in: int = 0, color: bool = True) -> None:
        self.feed = feed
        self.out = out or sys.stdout
        self.fd_in = fd_in
        self.style = Style(color)
        self.board: dict[str, Plan] = {}
        self.current = 0
        self.selected: dict[str, int | None] = {}
        self.whole: set[str] = set()  # moments whose arguments are shown in full
        self.standing: list[StandingApproval] | None = None  # her standing approvals while that view is open
        self.standing_sel = 0
        self.scroll = 0
        self.prompt: Prompt | None = None
        self.status = "Connecting…"
        self.loaded = False  # the first pending list has answered: until then "connecting", never "nothing waiting"
        self.busy = False
        self.quit = asyncio.Event()
        self._keys: asyncio.Queue[bytes] = asyncio.Queue()

    # -- state --------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self.board)

    def current_plan(self) -> tuple[str, Plan] | None:
        keys = self.keys()
        if not keys:
            return None
        self.current = max(0, min(self.current, len(keys) - 1))
        return keys[self.current], self.board[keys[self.current]]

    def apply(self, raw: bytes) -> None:
        plan = plan_item(raw)
        if isinstance(plan, WithdrawPlan):
            if self.board.pop(plan.moment_id, None) is not None:
                self.status = f"A moment was withdrawn ({plan.reason})."
                if self.prompt and self.prompt.key == plan.moment_id:
                    self.prompt = None
            return
        self.board[plan_key(plan)] = plan
        if self.status == "Connecting…":
            self.status = ""

    # -- drawing ------------------------------------------------------------
    def frame(self) -> str:
        st = self.style
        cols, rows = shutil.get_terminal_size((100, 40))
        width = max(40, min(cols, 110) - 2)
        keys = self.keys()
        head = st(f" Principal Gateway · ~{self.feed.principal} ", "rev", "bold")
        count = f" {len(keys)} pending" + (f" · item {self.current + 1}/{len(keys)} (←/→)" if len(keys) > 1 else "")
        top = [head + st(count, "dim"), ""]
        cur = self.current_plan()
        if self.standing is not None:
            body, help_ = render_standing(self.standing, self.standing_sel, st, width), STANDING_HELP
        elif cur is None:
            body = [st("Nothing is waiting for you. New moments appear here as agents send them." if self.loaded
                       else "Connecting to the gateway to see what is waiting for you…", "dim")]
            help_ = f"{STANDING_KEY} standing approvals · q quit"
        else:
            key, plan = cur
            body = render_plan(plan, width=width, color=st.color, selected=self.selected.get(key), whole=key in self.whole)
            help_ = self.help_line(plan)
        bottom: list[str] = [""]
        if self.prompt:
            bottom.append(st(self.prompt.label, "bold"))
            bottom.append("> " + self.prompt.buffer + "▏")
            bottom.append(st("Enter send · Esc cancel", "dim"))
        else:
            bottom.append(st(help_, "dim"))
        bottom.append(self.status)
        room = max(5, rows - len(top) - len(bottom) - 1)
        self.scroll = max(0, min(self.scroll, max(0, len(body) - room)))
        window = body[self.scroll : self.scroll + room]
        if len(body) > room:
            window.append(st(f"… PgUp/PgDn to scroll ({self.scroll + 1}-{self.scroll + len(window)}/{len(body)})", "dim"))
        lines = top + window + bottom
        return "\x1b[H\x1b[2J" + "\r\n".join(lines) + "\r\n"

    def help_line(self, plan: Plan) -> str:
        if isinstance(plan, DecisionPlan):
            parts = ["↑/↓ choose", "Enter answer"]
            parts += [f"{HATCH_KEYS[h.kind]} {h.label.lower()}" for h in plan.hatches]
            if plan.attachments:
                parts.append(f"{WHOLE_KEY} arguments in full")
            return " · ".join([*parts, f"{STANDING_KEY} standing approvals", "q quit"])
        if isinstance(plan, ClarificationPlan):
            return f"Enter answer the questions · {STANDING_KEY} standing approvals · q quit"
        return f"x dismiss · {STANDING_KEY} standing approvals · q quit"

    def draw(self) -> None:
        self.out.write(self.frame())
        self.out.flush()

    # -- input --------------------------------------------------------------
    async def handle(self, key: str) -> None:
        if self.prompt:
            await self.handle_prompt(key)
            return
        cur = self.current_plan()
        if key in ("quit", "char:q"):
            self.quit.set()
            return
        if key == "char:" + STANDING_KEY or self.standing is not None:
            await self.handle_standing(key)
            return
        if key in ("left", "right"):
            n = len(self.board)
            if n:
                self.current = (self.current + (1 if key == "right" else -1)) % n
                self.scroll = 0
            return
        if key == "pgup":
            self.scroll = max(0, self.scroll - 10)
            return
        if key == "pgdn":
            self.scroll += 10
            return
        if cur is None:
            return
        mkey, plan = cur
        if isinstance(plan, DecisionPlan):
            n = len(plan.options)
            sel = self.selected.get(mkey)
            if key == "up":
                self.selected[mkey] = (n - 1) if sel is None else (sel - 1) % n
            elif key == "down":
                self.selected[mkey] = 0 if sel is None else (sel + 1) % n
            elif key.startswith("char:") and key[5:].isdigit() and 1 <= int(key[5:]) <= n:
                self.selected[mkey] = int(key[5:]) - 1
            elif key == "enter":
                if sel is None:
                    self.status = "Choose an option with ↑/↓ (or its number) first."
                else:
                    await self.send(mkey, OptionChoice(index=sel), f"option {sel + 1}: {plan.options[sel].label}")
            elif key == "char:" + WHOLE_KEY and plan.attachments:
                self.whole ^= {mkey}
            elif key == "char:" + HATCH_KEYS["free_text"]:
                if any(h.kind == "free_text" for h in plan.hatches):
                    self.prompt = Prompt("free_text", "Your answer in your own words:", mkey)
                else:
                    self.status = "The agent closed the answer-space hatch for this moment."
            elif key == "char:" + HATCH_KEYS["dialogue"]:
                if any(h.kind == "dialogue" for h in plan.hatches):
                    self.prompt = Prompt("dialogue", "What is wrong with the question? (optional)", mkey)
                else:
                    self.status = "The agent closed the question-space hatch for this moment."
        elif isinstance(plan, ClarificationPlan):
            if key == "enter":
                ids = [q.id for q in plan.questions]
                self.prompt = Prompt("answers", f"1. {one_line(plan.questions[0].question)}", mkey, question_ids=ids)
        elif key == "char:x":
            self.board.pop(mkey, None)
            self.status = "Dismissed."

    async def handle_standing(self, key: str) -> None:
        """Her standing approvals (docs/gate.md): ``s`` opens the list (asked afresh) and closes it, ↑/↓ choose,
        ``r`` revokes the chosen one; Esc closes it too."""
        if key in ("esc", "char:" + STANDING_KEY) and self.standing is not None:
            self.standing = None
            return
        if key == "char:" + STANDING_KEY or (key == "char:r" and self.standing):
            revoke = self.standing[self.standing_sel].scope_id if key == "char:r" and self.standing else None
            reply = await self.feed.approvals(revoke=revoke)
            if revoke is not None:
                self.status = (f"Revoked: {describe_standing(reply.revoked)}. The next such call asks you again."
                               if reply.ok and reply.revoked else f"Not revoked: {reply.refusal.reason if reply.refusal else '?'}")
                reply = await self.feed.approvals()
            if not reply.ok:
                self.status = f"The standing approvals could not be read: {reply.refusal.reason if reply.refusal else '?'}"
            self.standing = list(reply.approvals or [])
            self.standing_sel = max(0, min(self.standing_sel, len(self.standing) - 1))
        elif self.standing and key in ("up", "down"):
            self.standing_sel = (self.standing_sel + (1 if key == "down" else -1)) % len(self.standing)

    async def handle_prompt(self, key: str) -> None:
        p = self.prompt
        assert p is not None
        if key == "esc":
            self.prompt = None
            self.status = "Cancelled."
        elif key == "backspace":
            p.buffer = p.buffer[:-1]
        elif key.startswith("char:"):
            p.buffer += key[5:]
        elif key == "enter":
            text = p.buffer.strip()
            if p.kind == "free_text":
                if not text:
                    self.status = "Type your answer, or Esc to cancel."
                    return
                self.prompt = None
                await self.send(p.key, FreeTextAnswer(text=text), "your own answer")
            elif p.kind == "dialogue":
                self.prompt = None
                await self.send(p.key, DialogueVeto(objection=text or None), "you rejected the question")
            else:
                if not text:
                    self.status = "Type an answer, or Esc to cancel."
                    return
                qid = p.question_ids[len(p.answers)]
                p.answers[qid] = text
                p.buffer = ""
                plan = self.board.get(p.key)
                if len(p.answers) < len(p.question_ids) and isinstance(plan, ClarificationPlan):
                    nxt = len(p.answers)
                    p.label = f"{nxt + 1}. {one_line(plan.questions[nxt].question)}"
                else:
                    self.prompt = None
                    await self.send(p.key, ClarificationAnswers(answers=p.answers), "your answers")

    async def send(self, key: str, resolution: Resolution, what: str) -> None:
        if self.busy:
            return
        self.busy = True
        self.status = f"Sending {what}…"
        self.draw()
        try:
            reply = await self.feed.resolve(key, resolution)
        finally:
            self.busy = False
        if reply.status == "accepted":
            self.board.pop(key, None)
            self.status = self.style(f"✔ Accepted: {what}.", "green", "bold")
        else:
            if reply.code in GONE_CODES:
                self.board.pop(key, None)
            self.status = self.style("✖ " + refusal_text(reply), "red", "bold")

    # -- main loop ----------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        old = termios.tcgetattr(self.fd_in)
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def readable() -> None:
            try:
                data = os.read(self.fd_in, 1024)
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(self.fd_in)
                events.put_nowait(("key", "quit"))
                return
            for k in parse_keys(data):
                events.put_nowait(("key", k))

        async def pump() -> None:
            try:
                async for raw in self.feed.items(on_snapshot=lambda: events.put_nowait(("loaded", None))):
                    events.put_nowait(("item", raw))
            except Exception as e:  # noqa: BLE001 - shown to the principal, then we stop
                events.put_nowait(("error", str(e)))

        tty.setcbreak(self.fd_in)
        attrs = termios.tcgetattr(self.fd_in)
        attrs[0] &= ~(termios.ICRNL | termios.IXON)  # Enter arrives as \r; Ctrl-S is a key
        attrs[3] &= ~termios.ISIG  # Ctrl-C is read as a key: we restore the terminal ourselves
        termios.tcsetattr(self.fd_in, termios.TCSANOW, attrs)
        self.out.write("\x1b[?1049h\x1b[?25l")  # alternate screen, hide cursor
        loop.add_reader(self.fd_in, readable)
        feeder = asyncio.create_task(pump())
        code = 0
        try:
            self.draw()
            while not self.quit.is_set():
                kind, value = await events.get()
                if kind == "item":
                    self.apply(value)
                elif kind == "loaded":
                    self.loaded = True
                    self.status = "" if self.status == "Connecting…" else self.status
                elif kind == "key":
                    await self.handle(value)
                else:
                    self.status = self.style(f"✖ {value}", "red", "bold")
                    code = 1
                    self.draw()
                    break
                if events.empty():
                    self.draw()
        finally:
            loop.remove_reader(self.fd_in)
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeder
            self.out.write("\x1b[?25h\x1b[?1049l")
            self.out.flush()
            termios.tcsetattr(self.fd_in, termios.TCSADRAIN, old)
        if code:
            print(f"pgw surface: {self.status}", file=sys.stderr)
        return code


__all__ = ["TerminalSurface", "parse_keys", "refusal_text", "run_json"]
