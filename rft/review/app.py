"""The terminal UI a person scores queued rollouts with (`python -m rft.review RUN_DIR`).

Made for a plain SSH session on a login node: keys only (no mouse), text only, and nothing kept in
memory that matters: every decision goes straight through `queue.label`, which fsyncs it, so the
UI may be closed (or its connection dropped) at any time and reopened where the reviewer left off.
Scores given to an item but not yet saved live only in this session.

The queue is re-read every `POLL_S` seconds, but only when the queue directory's file names or the
labels file changed: items can carry full training rows, and re-parsing them all every two seconds
on a shared login node would be wasteful.
"""

from __future__ import annotations

import asyncio
import os

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Static

from rft.review import queue

SCORE_NAMES = {1.0: "correct", 0.0: "wrong", 0.5: "half"}


class ResponseView(Static):
    """One sampled response: its number, reward, metrics and the score given in this session."""


class ReviewApp(App):
    """Shows one pending item at a time; the reviewer scores its responses and saves the label."""

    TITLE = "rft review"
    ENABLE_COMMAND_PALETTE = False  # ctrl+p would only confuse a reviewer who uses p for "previous"
    POLL_S = 2.0
    CSS = """
    #header { background: $primary; color: $text; padding: 0 1; text-style: bold; }
    #body { height: 1fr; }
    .prompt { padding: 0 1; border: round $secondary; border-title-color: $text-muted; }
    ResponseView { padding: 0 1; margin: 1 0 0 0; border: round $panel; }
    ResponseView.-selected { border: heavy $accent; background: $boost; }
    #empty { padding: 2 2; }
    #status { height: 1; padding: 0 1; color: $text-muted; }
    """
    # short footer labels, one entry per pair of keys, so that every binding fits an 80-column terminal
    BINDINGS = [
        Binding("up,k", "select(-1)", "select", key_display="↑↓/kj"),
        Binding("down,j", "select(1)", "select", show=False),
        Binding("1", "score(1.0)", "correct"),
        Binding("0", "score(0.0)", "wrong"),
        Binding("h", "score(0.5)", "half"),
        Binding("enter", "save", "save+next"),
        Binding("s", "skip", "skip"),
        Binding("n", "move(1)", "item", key_display="n/p"),
        Binding("p", "move(-1)", "prev item", show=False),
        Binding("pageup", "page(-1)", "scroll", show=False),
        Binding("pagedown", "page(1)", "scroll", show=False),
        Binding("q", "quit_review", "quit"),
    ]

    def __init__(self, run_dir: str):
        super().__init__()
        self.run_dir = run_dir
        self.pending_items: list[dict] = []  # the queue's unlabelled items, in queue.items order
        self.index = 0  # which of pending_items is shown
        self.selected = 0  # which response of it is selected
        self.scores: dict[str, list[float | None]] = {}  # item id -> scores given, not yet saved
        self.total = self.labelled = 0
        self._signature: tuple | None = None
        self._shown_id: str | None = ""  # id whose widgets are mounted ("" = nothing mounted yet)
        self._quit_armed = False
        self._lock = asyncio.Lock()  # the poll timer runs in its own task; rebuilds must not interleave

    @property
    def current(self) -> dict | None:
        return self.pending_items[self.index] if self.pending_items else None

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        yield VerticalScroll(id="body", can_focus=False)  # keys go to the app's bindings, not to scrolling
        yield Static(id="status")
        yield Footer(compact=True)

    async def on_mount(self) -> None:
        await self.reload()
        self.set_interval(self.POLL_S, self.reload)

    # -- reading the queue -------------------------------------------------------------------------

    def _disk_signature(self) -> tuple:
        try:
            names = tuple(sorted(os.listdir(queue.queue_dir(self.run_dir))))
        except OSError:
            names = ()
        try:
            st = os.stat(queue.labels_path(self.run_dir))
            labels = (st.st_size, st.st_mtime_ns)
        except OSError:
            labels = None
        return names, labels

    async def reload(self, force: bool = False) -> None:
        """Re-read the queue if it changed on disk, keeping the shown item when it is still pending."""
        async with self._lock:
            signature = self._disk_signature()
            if signature == self._signature and not force:
                return
            self._signature = signature
            shown = self.current["id"] if self.current else None
            every, done = queue.items(self.run_dir), queue.labels(self.run_dir)
            self.total, self.labelled = len(every), sum(1 for i in every if i["id"] in done)
            self.pending_items = [i for i in every if i["id"] not in done]
            ids = [i["id"] for i in self.pending_items]
            if shown in ids:
                self.index = ids.index(shown)
            else:
                if shown is not None and shown in done:
                    self._status(f"{shown} was labelled elsewhere; showing the next pending item")
                self.index = min(self.index, max(len(ids) - 1, 0))
            await self._show()

    # -- drawing -----------------------------------------------------------------------------------

    async def _show(self) -> None:
        """Draw the current item (mounting its widgets only when the item changed)."""
        item = self.current
        self._draw_header()
        item_id = item["id"] if item else None
        if item_id == self._shown_id:
            self._draw_responses()
            return
        body = self.query_one("#body", VerticalScroll)
        await body.remove_children()
        self._shown_id = item_id
        if item is None:
            await body.mount(Static(self._empty_text(), id="empty"))
            return
        self.selected = 0
        views = [ResponseView(classes="response") for _ in item["responses"]]
        prompt = Static(Text(item["prompt"]), classes="prompt")
        prompt.border_title = "prompt"
        await body.mount_all([prompt, *views])
        self._draw_responses()
        body.scroll_home(animate=False)

    def _empty_text(self) -> Text:
        return Text(
            f"Nothing to review: {self.labelled} of {self.total} queued items are labelled.\n\n"
            f"This screen re-reads {queue.queue_dir(self.run_dir)} every {self.POLL_S:g} s, so items the "
            "run adds appear here by themselves. Leave it open, or quit (q) and come back later with\n\n"
            f"    python -m rft.review {self.run_dir}")

    def _draw_header(self) -> None:
        item = self.current
        if item is None:
            text = f"no pending items · {self.labelled} of {self.total} labelled"
        else:
            text = (f"item {self.index + 1} of {len(self.pending_items)} · step {item['step']} · "
                    f"task {item['task_id']} · reason {item['reason']}")
        self.query_one("#header", Static).update(Text(text))

    def _draw_responses(self) -> None:
        item = self.current
        if item is None:
            return
        scores = self._scores_of(item)
        for n, view in enumerate(self.query(ResponseView)):
            if n >= len(item["responses"]):
                break
            r = item["responses"][n]
            marker = "▶" if n == self.selected else " "  # visible without colour, too
            score = scores[n]
            given = "—" if score is None else f"{score:g} ({SCORE_NAMES.get(score, 'scored')})"
            metrics = "  ".join(f"{k}={_short(v)}" for k, v in r["metrics"].items())
            title = f"{marker} #{n + 1}  reward {_short(r['reward'])}  ·  your score: {given}"
            view.update(Text.assemble((title, "bold"), "\n", (metrics, "dim") if metrics else "",
                                      "\n" if metrics else "", r["text"]))
            view.set_class(n == self.selected, "-selected")

    def _status(self, message: str, severity: str = "information") -> None:
        self.query_one("#status", Static).update(Text(message))
        self.notify(message, severity=severity, markup=False)

    def _scores_of(self, item: dict) -> list[float | None]:
        return self.scores.setdefault(item["id"], [None] * len(item["responses"]))

    # -- actions -----------------------------------------------------------------------------------

    def action_select(self, delta: int) -> None:
        self._quit_armed = False
        item = self.current
        if item is None:
            return
        self.selected = max(0, min(len(item["responses"]) - 1, self.selected + delta))
        self._draw_responses()
        views = list(self.query(ResponseView))
        if self.selected < len(views):
            self.query_one("#body", VerticalScroll).scroll_to_widget(views[self.selected], animate=False)

    def action_score(self, value: float) -> None:
        self._quit_armed = False
        item = self.current
        if item is None:
            return
        self._scores_of(item)[self.selected] = value
        self._draw_responses()

    def action_page(self, direction: int) -> None:
        body = self.query_one("#body", VerticalScroll)
        (body.scroll_page_down if direction > 0 else body.scroll_page_up)(animate=False)

    async def action_save(self) -> None:
        item = self.current
        if item is None:
            return
        if all(s is None for s in self._scores_of(item)):
            # a "scored" label without a score would drop the item from the queue and teach nothing
            self._status("no response scored yet: press 1 / 0 / h on a response first, or s to skip the item",
                         severity="warning")
            return
        await self._save(item, "scored")

    async def action_skip(self) -> None:
        item = self.current
        if item is not None:
            await self._save(item, "skip")

    async def _save(self, item: dict, verdict: str) -> None:
        self._quit_armed = False
        async with self._lock:
            scores = self._scores_of(item) if verdict == "scored" else [None] * len(item["responses"])
            try:
                queue.label(self.run_dir, item["id"], scores, verdict)
            except (OSError, ValueError) as e:  # the item vanished, or the disk is full: say so, keep the scores
                self._status(f"could not save the label for {item['id']}: {e}", severity="error")
                return
            self.scores.pop(item["id"], None)
            # by id: a poll may have re-read the queue (new dicts) since the key was pressed
            self.pending_items = [i for i in self.pending_items if i["id"] != item["id"]]
            self.labelled += 1
            self.index = min(self.index, max(len(self.pending_items) - 1, 0))
            scored = sum(s is not None for s in scores)
            what = "skipped" if verdict == "skip" else f"{scored} of {len(scores)} responses scored"
            self._status(f"saved label for {item['id']} ({what})")
            await self._show()

    async def action_move(self, delta: int) -> None:
        self._quit_armed = False
        async with self._lock:
            if len(self.pending_items) < 2:
                return
            self.index = (self.index + delta) % len(self.pending_items)  # wraps: the queue is a loop
            await self._show()

    def action_quit_review(self) -> None:
        unsaved = [i for i, s in self.scores.items() if any(x is not None for x in s)
                   and any(p["id"] == i for p in self.pending_items)]
        if unsaved and not self._quit_armed:
            self._quit_armed = True
            self._status(f"{len(unsaved)} item(s) have scores that are not saved (enter saves): "
                         "press q again to quit anyway", severity="warning")
            return
        self.exit()


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
