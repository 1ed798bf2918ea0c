"""Property-based tests (Hypothesis) of read_taskset and TaskCursor: any mix of valid rows and
garbage (bad JSON, invalid UTF-8, non-objects, missing keys, wrong types, empty or whitespace
strings, NUL bytes, huge strings) keeps exactly the valid rows, in order, at their row positions,
and counts every other row; only a file with no usable row raises, with examples; shards cut from
a file read as that file. A cursor is deterministic for its seed and a resumed one draws exactly
what the uninterrupted one would.
ContextFit (with the quickstart's one-token-per-character tokenizer) never passes on a row longer
than the context: each is skipped or truncated from the left and counted per data.overlong, or
(error) stops the run naming it."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rft.data.context_fit import ContextFit
from rft.data.taskset import Task, TaskCursor, read_taskset
from rft.models.tiny import CHARS, build_char_tokenizer

# database=None: no .hypothesis/ folder left in the checkout; failures print their example anyway
FAST = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

PROMPT, ANSWER = "question", "answer"
TEMPLATES = ["{prompt}", "Q: {prompt}\nA:", "{{literal}} {prompt} ☃"]

# Text with NUL bytes, control characters, astral code points and line/paragraph separators;
# "huge" strings (tens of kB) now and then.
text = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=st.sampled_from("\x00\t\r\x0b\x0c \u2028\u00a0é☃\U0001f600a{}\"\\"), max_size=12),
    st.builds(lambda ch, n: ch * n, st.characters(codec="utf-8"), st.integers(10_000, 60_000)),
)
usable_text = text.filter(lambda s: s.strip())  # what the reader accepts as a prompt or text answer
blank_text = st.text(alphabet=st.sampled_from(" \t\r\x0b\x0c\u00a0\u2028\u3000"), max_size=4)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), text)
json_value = st.recursive(json_scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                               st.dictionaries(text, inner, max_size=3)),
                          max_leaves=6)
answer_value = st.one_of(usable_text, st.integers(), st.floats(allow_nan=False, allow_infinity=False))
extra_columns = st.dictionaries(text.filter(lambda k: k not in (PROMPT, ANSWER)), json_value, max_size=3)


@st.composite
def valid_row(draw) -> dict:
    row = draw(extra_columns)
    row[PROMPT], row[ANSWER] = draw(usable_text), draw(answer_value)
    return row


@st.composite
def invalid_row(draw) -> dict | list | str | int | float | bool | None:
    """A JSON value the reader must skip, with the reason built in."""
    row = draw(valid_row())
    kind = draw(st.sampled_from(["not_object", "no_prompt", "no_answer", "prompt_type", "prompt_blank",
                                 "answer_type", "answer_blank"]))
    if kind == "not_object":
        return draw(st.one_of(json_scalar, st.lists(json_value, max_size=3)))
    if kind == "no_prompt":
        del row[PROMPT]
    elif kind == "no_answer":
        del row[ANSWER]
    elif kind == "prompt_type":
        row[PROMPT] = draw(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                     st.lists(text, max_size=2), st.dictionaries(text, text, max_size=2)))
    elif kind == "prompt_blank":
        row[PROMPT] = draw(blank_text)
    elif kind == "answer_type":
        row[ANSWER] = draw(st.one_of(st.none(), st.booleans(), st.lists(json_scalar, max_size=2),
                                     st.dictionaries(text, json_scalar, max_size=2)))
    else:
        row[ANSWER] = draw(blank_text)
    return row


def dumps(value, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8")


# A jsonl line the reader must skip: not JSON at all, or invalid UTF-8, or valid JSON it cannot use.
garbage_line = st.one_of(
    st.text(max_size=40).filter(lambda s: "\n" not in s and s.strip()).map(lambda s: ("{," + s).encode("utf-8")),
    st.binary(min_size=1, max_size=20).map(lambda b: b"\xff" + b.replace(b"\n", b"")),
    st.tuples(invalid_row(), st.booleans()).map(lambda r: dumps(*r)),
)
valid_line = st.tuples(valid_row(), st.booleans()).map(lambda r: (dumps(*r), r[0]))
blank_line = st.sampled_from([b"", b"  ", b"\t", b"\r"])


def expected_task(index: int, row: dict, template: str) -> Task:
    return Task(index=index, prompt=template.format(prompt=row[PROMPT]), answer=str(row[ANSWER]), row=row)


def write(data: bytes | pa.Table, suffix: str) -> str:
    fd, path = tempfile.mkstemp(suffix=suffix)
    os.close(fd)
    if isinstance(data, pa.Table):
        pq.write_table(data, path)
    else:
        with open(path, "wb") as f:
            f.write(data)
    return path


def read(path: str, template: str):
    try:
        return read_taskset(path, PROMPT, ANSWER, prompt_template=template)
    finally:
        os.unlink(path)


def check_result(read_call, expected: list[Task], rows: int, template: str) -> None:
    """Kept tasks are exactly `expected` (index, prompt, answer and row); every other row is counted;
    with nothing usable, a ValueError that says so and gives examples."""
    if not expected:
        with pytest.raises(ValueError) as err:
            read_call()
        message = str(err.value)
        assert f"no valid rows ({rows} skipped)" in message
        assert ("(the file has no rows)" if rows == 0 else ": ") in message.split("examples:")[1]
        return
    tasks, report = read_call()
    assert (report.rows, report.skipped) == (len(expected), rows - len(expected))
    assert len(report.skipped_examples) == min(5, report.skipped)
    assert [(t.index, t.prompt, t.answer, t.row) for t in tasks] == \
        [(t.index, t.prompt, t.answer, t.row) for t in expected]


@FAST
@given(lines=st.lists(st.one_of(garbage_line.map(lambda b: ("bad", b)),
                                valid_line.map(lambda v: ("ok", v)),
                                blank_line.map(lambda b: ("blank", b))), max_size=12),
       template=st.sampled_from(TEMPLATES), ext=st.sampled_from([".jsonl", ".json"]))
def test_jsonl_keeps_exactly_the_valid_lines_at_their_line_index_and_counts_the_rest(lines, template, ext):
    expected = [expected_task(i, v[1], template) for i, (kind, v) in enumerate(lines) if kind == "ok"]
    rows = sum(kind != "blank" for kind, _ in lines)  # blank lines are not rows but keep their number
    data = b"\n".join(v[0] if kind == "ok" else v for kind, v in lines) + b"\n"
    if data.lstrip().startswith(b"["):
        ext = ".jsonl"  # a .json file starting with '[' is read as one array (tested below)
    path = write(data, ext)
    check_result(lambda: read(path, template), expected, rows, template)


@FAST
@given(rows=st.lists(st.one_of(invalid_row().map(lambda r: ("bad", r)), valid_row().map(lambda r: ("ok", r))),
                     max_size=10),
       template=st.sampled_from(TEMPLATES), ascii_only=st.booleans())
def test_json_array_keeps_exactly_the_valid_elements_at_their_position(rows, template, ascii_only):
    expected = [expected_task(i, r, template) for i, (kind, r) in enumerate(rows) if kind == "ok"]
    path = write(dumps([r for _, r in rows], ascii_only), ".json")
    check_result(lambda: read(path, template), expected, len(rows), template)


parquet_text = st.one_of(st.none(), blank_text, usable_text)


@FAST
@given(cells=st.lists(st.tuples(parquet_text, parquet_text), max_size=10), template=st.sampled_from(TEMPLATES))
def test_parquet_keeps_rows_with_a_prompt_and_an_answer_and_counts_nulls_and_blanks(cells, template):
    table = pa.table({PROMPT: pa.array([p for p, _ in cells], pa.string()),
                      ANSWER: pa.array([a for _, a in cells], pa.string())})
    expected = [expected_task(i, {PROMPT: p, ANSWER: a}, template) for i, (p, a) in enumerate(cells)
                if p is not None and p.strip() and a is not None and a.strip()]
    path = write(table, ".parquet")
    check_result(lambda: read(path, template), expected, len(cells), template)


def write_shards(parts: list[bytes | pa.Table], ext: str) -> str:
    """A folder of shards as the Hub names them (`train-00000-of-0000N<ext>`)."""
    folder = tempfile.mkdtemp()
    for i, part in enumerate(parts):
        path = os.path.join(folder, f"train-{i:05d}-of-{len(parts):05d}{ext}")
        if isinstance(part, pa.Table):
            pq.write_table(part, path)
        else:
            with (gzip.open if ext.endswith(".gz") else open)(path, "wb") as f:
                f.write(part)
    return folder


@FAST
@given(lines=st.lists(st.one_of(garbage_line.map(lambda b: ("bad", b)), valid_line.map(lambda v: ("ok", v)),
                                blank_line.map(lambda b: ("blank", b))), max_size=12),
       cuts=st.lists(st.integers(0, 12), max_size=3), ext=st.sampled_from([".jsonl", ".jsonl.gz", ".parquet"]))
def test_shards_give_exactly_the_tasks_and_counts_of_the_one_file_they_were_cut_from(lines, cuts, ext):
    """However a split is cut into shards (empty ones too), it reads as the file of its rows."""
    bounds = [0, *sorted(min(c, len(lines)) for c in cuts), len(lines)]
    pieces = [lines[a:b] for a, b in zip(bounds, bounds[1:])]
    if ext == ".parquet":  # a table of the valid rows' two columns: parquet has no bad JSON or blank lines
        def table(part):
            ok = [v[1] for kind, v in part if kind == "ok"]
            return pa.table({PROMPT: pa.array([r[PROMPT] for r in ok], pa.string()),
                             ANSWER: pa.array([str(r[ANSWER]) for r in ok], pa.string())})
        whole, parts = write(table(lines), ".parquet"), [table(piece) for piece in pieces]
    else:
        def text(part):
            return b"".join((v[0] if kind == "ok" else v) + b"\n" for kind, v in part)
        whole, parts = write(text(lines), ".jsonl"), [text(piece) for piece in pieces]
    folder = write_shards(parts, ext)
    try:
        try:
            expected = read_taskset(whole, PROMPT, ANSWER)
        except ValueError:
            with pytest.raises(ValueError, match="no valid rows"):
                read_taskset(folder, PROMPT, ANSWER)
            return
        got = read_taskset(folder, PROMPT, ANSWER)
    finally:
        os.unlink(whole)
        shutil.rmtree(folder)
    assert [(t, t.row) for t in got[0]] == [(t, t.row) for t in expected[0]]
    assert (got[1].rows, got[1].skipped) == (expected[1].rows, expected[1].skipped)


def tasks(n: int) -> list[Task]:
    return [Task(i, f"p{i}", str(i)) for i in range(n)]


@settings(max_examples=100, deadline=None, database=None)
@given(n=st.integers(1, 12), seed=st.integers(0, 2**32), sizes=st.lists(st.integers(1, 30), min_size=1, max_size=8),
       data=st.data())
def test_a_resumed_cursor_draws_exactly_what_the_uninterrupted_one_draws(n, seed, sizes, data):
    stop = data.draw(st.integers(0, len(sizes)), label="batches before the checkpoint")
    straight = TaskCursor(tasks(n), seed)
    expected = [straight.next_batch(k) for k in sizes]
    twin = TaskCursor(tasks(n), seed)
    assert [twin.next_batch(k) for k in sizes] == expected  # same seed, same batches
    interrupted = TaskCursor(tasks(n), seed)
    before = [interrupted.next_batch(k) for k in sizes[:stop]]
    resumed = TaskCursor(tasks(n), seed)
    resumed.load_state_dict(json.loads(json.dumps(interrupted.state_dict())))
    assert before + [resumed.next_batch(k) for k in sizes[stop:]] == expected
    # every batch is full and each completed epoch visits every task exactly once
    flat = [t.index for batch in expected for t in batch]
    assert [len(b) for b in expected] == sizes
    for e in range(len(flat) // n):
        assert sorted(flat[e * n:(e + 1) * n]) == list(range(n))
    assert straight.epoch == len(flat) // n


@settings(max_examples=100, deadline=None, database=None)
@given(n=st.integers(1, 8), state=st.fixed_dictionaries(
    {"epoch": st.integers(-3, 5), "position": st.integers(-3, 10)},
    optional={"seed": st.integers(0, 3), "num_tasks": st.integers(0, 10)}))
def test_a_cursor_checkpoint_loads_or_is_refused_with_value_error(n, state):
    cursor = TaskCursor(tasks(n), seed=1)
    fits = (state["epoch"] >= 0 and 0 <= state["position"] < n and state.get("seed", 1) == 1
            and state.get("num_tasks", n) == n)
    if not fits:
        with pytest.raises(ValueError, match="cursor checkpoint"):
            cursor.load_state_dict(state)
        return
    cursor.load_state_dict(state)
    assert cursor.epoch == state["epoch"] and len(cursor.next_batch(n)) == n

TOKENIZER = build_char_tokenizer()
chars = st.text(alphabet=st.sampled_from(CHARS), min_size=1, max_size=40)


def fit_rows(policy: str, context: int, rows: list[tuple[str, str]], max_new: int | None):
    """Rollout rows (prompt + max_new) when max_new is set, else SFT rows (prompt + answer + EOS)."""
    fit = ContextFit(TOKENIZER, chat_template=False, context=context, policy=policy)
    counts: dict = {}
    tasks = [Task(i, p, a) for i, (p, a) in enumerate(rows)]
    if max_new is not None:
        return fit.for_rollouts(tasks, "t.jsonl", max_new, counts), counts.get("t.jsonl")
    return fit.for_references(tasks, "t.jsonl", counts), counts.get("t.jsonl")


@FAST
@given(policy=st.sampled_from(["skip", "truncate_left", "error"]), context=st.integers(2, 40),
       rows=st.lists(st.tuples(chars, chars), min_size=1, max_size=8), max_new=st.none() | st.integers(1, 20))
def test_no_row_longer_than_the_context_is_passed_on_and_every_overlong_row_is_counted(policy, context, rows,
                                                                                       max_new):
    budget = [context - (max_new if max_new is not None else len(a) + 1) for _, a in rows]  # room for the prompt
    overlong = [i for i, (p, _) in enumerate(rows) if len(p) > budget[i]]
    tasks = [Task(i, p, a) for i, (p, a) in enumerate(rows)]
    # truncate_left keeps the end of a prompt when at least one character of it fits
    survivors = [i for i in range(len(rows)) if i not in overlong or (policy == "truncate_left" and budget[i] >= 1)]
    if overlong and policy == "error":
        with pytest.raises(ValueError, match=f"line {overlong[0] + 1} of t.jsonl needs"):
            fit_rows(policy, context, rows, max_new)
        return
    if not survivors:
        with pytest.raises(ValueError, match="every row of t.jsonl is longer than the model's context"):
            fit_rows(policy, context, rows, max_new)
        return
    kept, counts = fit_rows(policy, context, rows, max_new)
    assert [t.index for t in kept] == survivors
    truncated = [i for i in overlong if i in survivors]
    assert counts == {"overlong_skipped": len(overlong) - len(truncated), "truncated": len(truncated)}
    for task in kept:
        original = tasks[task.index]
        assert len(task.prompt) <= budget[task.index]  # fits, response included
        if task.index in truncated:  # the start went, whole characters, no more than needed
            assert original.prompt.endswith(task.prompt) and len(task.prompt) == budget[task.index]
        else:
            assert task == original and task.prompt == original.prompt
