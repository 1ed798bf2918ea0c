"""read_taskset on real files (jsonl, json, parquet, broken rows) and TaskCursor determinism."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rft.data.taskset import Task, TaskCursor, read_taskset


def _write_lines(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_jsonl_reads_rows_with_template_and_numeric_answers(tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", [
        json.dumps({"question": "1+1=", "answer": 2}),
        json.dumps({"question": "2+2=", "answer": "4", "extra": True}),
        json.dumps({"question": "half?", "answer": 0.5}),
    ])
    tasks, report = read_taskset(path, "question", "answer", prompt_template="Q: {prompt}\nA:")
    assert tasks == [Task(0, "Q: 1+1=\nA:", "2"), Task(1, "Q: 2+2=\nA:", "4"), Task(2, "Q: half?\nA:", "0.5")]
    assert (report.path, report.rows, report.skipped, report.skipped_examples) == (path, 3, 0, [])


def test_malformed_rows_are_skipped_counted_and_indices_match_lines(tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", [
        json.dumps({"q": "ok0", "a": "0"}),
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"q": "no answer"}),
        json.dumps({"q": 7, "a": "1"}),
        json.dumps({"q": "   ", "a": "1"}),
        "",  # blank line: not a row, but line numbering continues
        json.dumps({"q": "ok7", "a": 7}),
    ])
    tasks, report = read_taskset(path, "q", "a")
    assert [(t.index, t.prompt, t.answer) for t in tasks] == [(0, "ok0", "0"), (7, "ok7", "7")]
    assert report.rows == 2 and report.skipped == 5
    ex = report.skipped_examples
    assert len(ex) == 5
    assert ex[0].startswith("line 2: invalid JSON")
    assert ex[1].startswith("line 3: not a JSON object")
    assert ex[2].startswith("line 4: missing key 'a'")
    assert ex[3].startswith("line 5: prompt 'q' must be a non-empty string")
    assert ex[4].startswith("line 6: prompt 'q'")


def test_invalid_utf8_line_is_skipped_not_fatal(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"q": "\xff\xfe", "a": "1"}\n{"q": "fine", "a": "2"}\n')
    tasks, report = read_taskset(str(path), "q", "a")
    assert [t.index for t in tasks] == [1] and report.skipped == 1


def test_examples_are_capped_at_five_but_count_is_exact(tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", ["bad"] * 9 + [json.dumps({"q": "x", "a": "y"})])
    tasks, report = read_taskset(path, "q", "a")
    assert len(tasks) == 1 and tasks[0].index == 9
    assert report.skipped == 9 and len(report.skipped_examples) == 5


def test_parquet_reads_rows_and_skips_nulls(tmp_path):
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"problem": ["a", None, "c"], "solution": [1, 2, None]}), path)
    tasks, report = read_taskset(path, "problem", "solution", prompt_template="{prompt}?")
    assert tasks == [Task(0, "a?", "1")]
    assert report.skipped == 2
    assert report.skipped_examples[0].startswith("row 1: prompt 'problem'")
    assert report.skipped_examples[1].startswith("row 2: answer 'solution'")


def test_json_extension_accepts_lines_and_top_level_array(tmp_path):
    lines = _write_lines(tmp_path / "lines.json", [json.dumps({"q": "x", "a": "1"})])
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([{"q": "x", "a": "1"}, 3, {"q": "y", "a": 2}]))
    assert read_taskset(lines, "q", "a")[0] == [Task(0, "x", "1")]
    tasks, report = read_taskset(str(arr), "q", "a")
    assert tasks == [Task(0, "x", "1"), Task(2, "y", "2")] and report.skipped == 1


def test_missing_file_error_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="nope.jsonl"):
        read_taskset(missing, "q", "a")


def test_unknown_extension_is_rejected(tmp_path):
    path = _write_lines(tmp_path / "t.csv", ["q,a"])
    with pytest.raises(ValueError, match=r"\.csv"):
        read_taskset(path, "q", "a")


@pytest.mark.parametrize("template", ["no placeholder", "{prompt} {other}", "{prompt"])
def test_bad_template_names_the_config_key(tmp_path, template):
    path = _write_lines(tmp_path / "t.jsonl", [json.dumps({"q": "x", "a": "1"})])
    with pytest.raises(ValueError, match="data.prompt_template"):
        read_taskset(path, "q", "a", prompt_template=template)


def test_literal_braces_in_template_are_kept(tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", [json.dumps({"q": "x", "a": "1"})])
    assert read_taskset(path, "q", "a", prompt_template="{{json}} {prompt}")[0][0].prompt == "{json} x"


def test_zero_valid_rows_raises_with_count_and_examples(tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", [json.dumps({"question": "x", "answer": "1"})] * 3)
    with pytest.raises(ValueError) as err:
        read_taskset(path, "prompt", "answer")
    msg = str(err.value)
    assert "3 skipped" in msg and "line 1: missing key 'prompt'" in msg and "question" in msg


def _tasks(n: int) -> list[Task]:
    return [Task(i, f"p{i}", str(i)) for i in range(n)]


def test_cursor_is_deterministic_and_covers_each_epoch_once():
    a, b = TaskCursor(_tasks(10), seed=3), TaskCursor(_tasks(10), seed=3)
    batches_a = [a.next_batch(5) for _ in range(4)]
    assert batches_a == [b.next_batch(5) for _ in range(4)]
    epoch0 = [t.index for t in batches_a[0] + batches_a[1]]
    epoch1 = [t.index for t in batches_a[2] + batches_a[3]]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1  # each epoch is reshuffled with seed + epoch
    assert epoch0 != [t.index for t in TaskCursor(_tasks(10), seed=4).next_batch(10)]


def test_cursor_wraps_across_epochs_with_full_batches():
    cur = TaskCursor(_tasks(5), seed=0)
    batches = [cur.next_batch(3) for _ in range(5)]  # 15 draws = exactly 3 epochs
    assert all(len(b) == 3 for b in batches)
    flat = [t.index for b in batches for t in b]
    for e in range(3):
        assert sorted(flat[5 * e : 5 * e + 5]) == list(range(5))
    assert cur.epoch == 3
    assert len(TaskCursor(_tasks(2), seed=0).next_batch(7)) == 7  # batch larger than the taskset


def test_cursor_resume_gives_identical_next_batch():
    original = TaskCursor(_tasks(7), seed=11)
    original.next_batch(4)
    original.next_batch(4)  # mid-epoch 1
    state = json.loads(json.dumps(original.state_dict()))  # checkpoints go through JSON/pickle
    resumed = TaskCursor(_tasks(7), seed=11)
    resumed.load_state_dict(state)
    assert [resumed.next_batch(3) for _ in range(5)] == [original.next_batch(3) for _ in range(5)]


def test_cursor_resume_on_other_data_is_refused():
    state = TaskCursor(_tasks(7), seed=11).state_dict()
    with pytest.raises(ValueError, match="num_tasks"):
        TaskCursor(_tasks(8), seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        TaskCursor(_tasks(7), seed=12).load_state_dict(state)


def test_cursor_rejects_bad_batch_size():
    with pytest.raises(ValueError):
        TaskCursor(_tasks(3), seed=0).next_batch(0)
