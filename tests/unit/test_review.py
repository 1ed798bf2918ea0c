"""The human-review queue (rft/review/queue.py), its terminal UI driven by Textual's headless pilot
(rft/review/app.py), and the command line (rft/review/__main__.py). Real files in tmp_path
throughout: the queue's whole point is what survives on disk."""

import asyncio
import json
import os
import subprocess
import sys

import pytest

from rft.review import queue
from rft.review.app import ReviewApp

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_item(item_id: str, step: int = 0, rewards=(0.0, 1.0, 0.5), prompt: str = "2+2?") -> dict:
    return {"id": item_id, "step": step, "reason": "flagged", "task_id": f"task-{item_id}", "prompt": prompt,
            "responses": [{"text": f"{item_id} answer {n}", "reward": r, "metrics": {"len": n}}
                          for n, r in enumerate(rewards)],
            "experiences": [{"tokens": [n]} for n in range(len(rewards))]}


def run_dir_with(tmp_path, *items: dict) -> str:
    run = str(tmp_path / "run")
    for item in items:
        assert queue.enqueue(run, item) is not None
    return run


def header(app: ReviewApp) -> str:
    return str(app.query_one("#header").content)


def drive(run: str, *keys: str) -> dict:
    """Open the UI on `run`, press `keys`, close it; returns what it showed last (or that it quit)."""
    async def go() -> dict:
        app = ReviewApp(run)
        async with app.run_test() as pilot:
            await pilot.press(*keys)
            await pilot.pause()
            if not app.is_running:
                return {"quit": True}
            return {"quit": False, "header": header(app), "status": str(app.query_one("#status").content),
                    "pending": [i["id"] for i in app.pending_items]}
    return asyncio.run(go())


# -- the queue on disk ------------------------------------------------------------------------------

def test_enqueue_is_atomic_and_idempotent(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    path = queue.enqueue(run, make_item("a", step=3))
    assert path == os.path.join(queue.queue_dir(run), "a.json")
    assert json.load(open(path))["responses"][1]["reward"] == 1.0
    assert os.listdir(queue.queue_dir(run)) == ["a.json"]  # no temporary file left behind
    # a resumed run sends the same id again: the first copy stands
    assert queue.enqueue(run, make_item("a", step=3, prompt="changed")) is None
    assert json.load(open(path))["prompt"] == "2+2?"
    # a crash between writing and renaming leaves neither a torn item nor its temporary file
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError):
        queue.enqueue(run, make_item("b"))
    monkeypatch.undo()
    assert os.listdir(queue.queue_dir(run)) == ["a.json"]
    # leftovers a reader may meet: a partial temporary file and a torn item are skipped
    open(os.path.join(queue.queue_dir(run), "c.json.tmp123"), "w").write('{"id": "c"')
    open(os.path.join(queue.queue_dir(run), "d.json"), "w").write('{"id": "d", "step"')
    queue.enqueue(run, make_item("e", step=1))
    assert [i["id"] for i in queue.items(run)] == ["e", "a"]  # sorted by (step, id)


def test_ids_become_distinct_portable_file_names(tmp_path):
    run = run_dir_with(tmp_path, make_item("x/y"), make_item("x:y"), make_item("x_y"))
    names = sorted(os.listdir(queue.queue_dir(run)))
    assert len(names) == 3 and all("/" not in n and ":" not in n for n in names)
    assert [i["id"] for i in queue.items(run)] == ["x/y", "x:y", "x_y"]
    queue.label(run, "x:y", [1.0, None, 0.0], "scored")
    assert [i["id"] for i in queue.pending(run)] == ["x/y", "x_y"]


def test_bad_items_and_labels_are_refused_naming_the_field(tmp_path):
    run = run_dir_with(tmp_path, make_item("a"))
    with pytest.raises(ValueError, match="'task_id'"):
        queue.enqueue(run, {k: v for k, v in make_item("b").items() if k != "task_id"})
    with pytest.raises(ValueError, match="'experiences' has 2 rows"):
        queue.enqueue(run, {**make_item("b"), "experiences": [{}, {}]})
    with pytest.raises(ValueError, match="'step'"):
        queue.enqueue(run, {**make_item("b"), "step": "3"})
    with pytest.raises(ValueError, match=r"'a'.*3 entries"):
        queue.label(run, "a", [1.0], "scored")
    with pytest.raises(ValueError, match=r"'a'.*scores\[1\]=1.5"):
        queue.label(run, "a", [1.0, 1.5, None], "scored")
    with pytest.raises(ValueError, match="'a'.*verdict"):
        queue.label(run, "a", [None] * 3, "maybe")
    with pytest.raises(ValueError, match="'nope'.*no such item"):
        queue.label(run, "nope", [None] * 3, "skip")
    assert not os.path.exists(queue.labels_path(run))


def test_torn_last_label_line_is_ignored_and_the_next_label_survives(tmp_path):
    run = run_dir_with(tmp_path, make_item("a"), make_item("b"))
    record = queue.label(run, "a", [1.0, None, 0.0], "scored", note="ok")
    assert record["item"] == "a" and record["scores"] == [1.0, None, 0.0] and record["reviewer"]
    with open(queue.labels_path(run), "a") as f:
        f.write('{"item": "b", "scores": [1.0, ')  # a crash mid-append
    assert set(queue.labels(run)) == {"a"}
    assert [i["id"] for i in queue.pending(run)] == ["b"]
    # the next label starts on a line of its own instead of being glued to the torn one
    queue.label(run, "b", [None, None, None], "skip")
    assert queue.labels(run)["b"]["verdict"] == "skip" and queue.pending(run) == []
    # a later label replaces an earlier one
    queue.label(run, "a", [0.0, 0.0, 0.0], "scored")
    assert queue.labels(run)["a"]["scores"] == [0.0, 0.0, 0.0]


def test_export_sft_and_dpo_rows(tmp_path):
    run = run_dir_with(tmp_path, make_item("a"), make_item("b", step=1), make_item("c", step=2),
                       make_item("d", step=3))
    queue.label(run, "a", [0.0, 1.0, 0.5], "scored")
    queue.label(run, "b", [None, 0.5, None], "scored")  # one scored response: no DPO pair
    queue.label(run, "c", [1.0, 1.0, 0.0], "skip")  # skipped: left out whatever its scores
    # d has no label: left out
    out = str(tmp_path / "out" / "sft.jsonl")
    assert queue.export(run, "sft", out) == 3
    rows = [json.loads(line) for line in open(out)]
    assert rows == [{"question": "2+2?", "answer": "a answer 1", "task_id": "task-a", "score": 1.0},
                    {"question": "2+2?", "answer": "a answer 2", "task_id": "task-a", "score": 0.5},
                    {"question": "2+2?", "answer": "b answer 1", "task_id": "task-b", "score": 0.5}]
    assert queue.export(run, "sft", out, min_score=0.9) == 1
    out = str(tmp_path / "dpo.jsonl")
    assert queue.export(run, "dpo", out) == 1
    assert [json.loads(line) for line in open(out)] == [
        {"question": "2+2?", "chosen": "a answer 1", "rejected": "a answer 0", "task_id": "task-a"}]
    with pytest.raises(ValueError, match="kind"):
        queue.export(run, "rlhf", out)


# -- the terminal UI --------------------------------------------------------------------------------

@pytest.mark.parametrize("keys, scores", [
    (("1", "down", "0", "enter"), [1.0, 0.0, None]),
    (("j", "h", "k", "1", "down", "down", "down", "0", "enter"), [1.0, 0.5, 0.0]),  # stops at the last
])
def test_keys_score_the_selected_response(tmp_path, keys, scores):
    run = run_dir_with(tmp_path, make_item("a"), make_item("b", step=1))
    shown = drive(run, *keys)
    assert queue.labels(run)["a"]["scores"] == scores
    assert queue.labels(run)["a"]["verdict"] == "scored"
    assert "b" not in queue.labels(run)
    assert shown["header"].startswith("item 1 of 1 · step 1 · task task-b · reason flagged")
    assert "saved label for a" in shown["status"]


def test_skip_and_enter_without_a_score(tmp_path):
    run = run_dir_with(tmp_path, make_item("a"), make_item("b", step=1))
    shown = drive(run, "enter")  # nothing scored: not saved, the reviewer is told what to press
    assert queue.labels(run) == {} and "no response scored" in shown["status"]
    drive(run, "1", "s")
    assert queue.labels(run)["a"]["verdict"] == "skip"
    assert queue.labels(run)["a"]["scores"] == [None, None, None]


def test_labels_survive_a_restart_of_the_ui(tmp_path):
    run = run_dir_with(tmp_path, make_item("a"), make_item("b", step=1))
    assert drive(run, "1", "enter", "q") == {"quit": True}  # nothing unsaved: q quits at once
    shown = drive(run)
    assert shown["pending"] == ["b"] and shown["header"].startswith("item 1 of 1 · step 1")


def test_next_previous_keep_unsaved_scores_and_q_warns_about_them(tmp_path):
    run = run_dir_with(tmp_path, make_item("a"), make_item("b", step=1))

    async def go() -> None:
        app = ReviewApp(run)
        async with app.run_test() as pilot:
            await pilot.press("1", "n")
            assert app.current["id"] == "b" and header(app).startswith("item 2 of 2")
            await pilot.press("n")  # wraps around to the first
            assert app.current["id"] == "a"
            assert "your score: 1 (correct)" in str(app.query("ResponseView").first().content)
            await pilot.press("q")  # unsaved scores: the first q only warns
            assert app.is_running and "press q again" in str(app.query_one("#status").content)
            await pilot.press("p", "0", "enter")
            assert queue.labels(run)["b"]["scores"] == [0.0, None, None]
            await pilot.press("q", "q")
        assert "a" not in queue.labels(run)

    asyncio.run(go())


def test_items_the_run_adds_appear_without_a_restart(tmp_path):
    run = run_dir_with(tmp_path, make_item("a"))
    queue.label(run, "a", [1.0, 1.0, 1.0], "scored")

    class FastPoll(ReviewApp):
        POLL_S = 0.05

    async def go() -> None:
        app = FastPoll(run)
        async with app.run_test() as pilot:
            assert "Nothing to review: 1 of 1" in str(app.query_one("#empty").content)
            queue.enqueue(run, make_item("b", step=4))
            for _ in range(40):
                await pilot.pause(0.05)
                if len(app.query("ResponseView")) == 3:  # drawn, not just read
                    break
            assert header(app).startswith("item 1 of 1 · step 4 · task task-b")
            assert len(app.query("#empty")) == 0
            # an item sorted before the shown one arrives: the reviewer stays on what they read
            await pilot.press("down", "1")
            queue.enqueue(run, make_item("c", step=1))
            for _ in range(40):
                await pilot.pause(0.05)
                if len(app.pending_items) == 2:
                    break
            assert header(app).startswith("item 2 of 2 · step 4 · task task-b")
            assert app.selected == 1 and app.scores["b"] == [None, 1.0, None]

    asyncio.run(go())


# -- the command line -------------------------------------------------------------------------------

def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rft.review", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_cli_list_export_and_missing_queue(tmp_path):
    run = run_dir_with(tmp_path, make_item("a"), make_item("b", step=1), make_item("c", step=2))
    queue.label(run, "b", [1.0, 0.0, None], "scored")
    result = cli(run, "--list")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["2 pending, 1 labelled, 3 queued", "a", "c"]
    result = cli(run, "--export", "dpo", "--out", str(tmp_path / "pairs.jsonl"))
    assert result.returncode == 0 and "wrote 1 dpo rows" in result.stdout
    assert json.loads(open(tmp_path / "pairs.jsonl").read())["chosen"] == "b answer 0"

    result = cli(str(tmp_path / "no-such-run"), "--list")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no-such-run" in result.stderr and "buffer.operators" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
