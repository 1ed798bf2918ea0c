"""Reading a taskset and sampling it deterministically.

A task keeps every column of its source row (`Task.row`): workflows, environments and rewards
read what they need from it (a grid world's start and goal, a test case's inputs). `prompt` and
`answer` are the columns `data.prompt_key` / `data.answer_key` name, required by workflows that
prompt with them (single_turn) and optional for the others (an environment builds its own first
message).

Bad rows are skipped and counted rather than raised: real datasets carry a few broken lines, and
one of them should not kill a multi-node launch. Only when *nothing* usable is left do we raise,
with examples, because then the keys or the file are almost certainly wrong.
"""

from __future__ import annotations

import json
import os
import string
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

_MAX_EXAMPLES = 5  # skipped-row messages kept in a report; the count is always exact


@dataclass(frozen=True)
class Task:
    """One problem. `index` is the row's 0-based position in the file (skipped rows included),
    so a task can be traced back to its source line (line number = index + 1 for jsonl)."""

    index: int
    prompt: str | None  # the prompt column after data.prompt_template; None if the row has none
    answer: str | None  # the reference answer; for preference data (DPO) the chosen response
    rejected: str | None = None  # preference data: the rejected response
    row: dict[str, Any] = field(default_factory=dict, compare=False)  # every column of the source row
    id: str = field(default="", compare=False)  # data.id_key's value, else the row index

    @property
    def task_id(self) -> str:
        return self.id or str(self.index)


@dataclass
class TasksetReport:
    """What `read_taskset` kept and dropped, for the launch log."""

    path: str
    rows: int  # valid tasks returned
    skipped: int  # rows dropped (bad JSON, not an object, missing key, bad prompt/answer)
    skipped_examples: list[str] = field(default_factory=list)  # at most 5, e.g. "line 7: missing key 'answer'"


def _check_template(prompt_template: str) -> None:
    """The template must use `{prompt}` and nothing else, or every row would fail alike."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(prompt_template) if name is not None}
    except ValueError as e:  # unbalanced braces
        raise ValueError(
            f"data.prompt_template={prompt_template!r} is not a valid format string ({e}); "
            "write literal braces as '{{' and '}}'"
        ) from None
    if "prompt" not in names:
        raise ValueError(
            f"data.prompt_template={prompt_template!r} does not contain '{{prompt}}'; "
            "add it where the prompt text goes, e.g. 'Question: {prompt}\\nAnswer:'"
        )
    extra = sorted(names - {"prompt"})
    if extra:
        raise ValueError(
            f"data.prompt_template={prompt_template!r} uses unknown fields {extra}; only '{{prompt}}' "
            "is filled in (write literal braces as '{{' and '}}')"
        )


def _jsonl_rows(path: str) -> Iterator[tuple[int, str, Any]]:
    """Yield (0-based line index, location label, parsed object or a ValueError) per non-blank line.

    Lines are read as bytes so a line with invalid UTF-8 is one skipped row, not a crash.
    Blank lines are not rows, but they keep their line number so indices match the file.
    """
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            if not raw.strip():
                continue
            try:
                yield i, f"line {i + 1}", json.loads(raw)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
                yield i, f"line {i + 1}", ValueError(f"invalid JSON ({e.__class__.__name__}: {e})")


def _json_array_rows(path: str) -> Iterator[tuple[int, str, Any]]:
    """A `.json` file holding one top-level array: tolerated because it is the other common layout."""
    with open(path, "rb") as f:
        try:
            data = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: starts with '[' but is not a valid JSON array ({e})") from None
    for i, obj in enumerate(data):
        yield i, f"row {i}", obj


def _parquet_rows(path: str) -> Iterator[tuple[int, str, Any]]:
    import pyarrow.parquet as pq  # imported lazily: jsonl-only users pay nothing

    for i, obj in enumerate(pq.read_table(path).to_pylist()):
        yield i, f"row {i}", obj


def _starts_with_bracket(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return head.startswith(b"[")


def _text_field(obj: dict, key: str) -> str:
    """A reference/response field as text, or raise ValueError with the reason."""
    value = obj[key]
    # bool is an int subclass but True/False as a reference answer is almost surely a data bug.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"answer {key!r} must be a string or number (got {type(value).__name__})")
    if not str(value).strip():
        raise ValueError(f"answer {key!r} is empty")  # nothing to verify against
    return str(value)


def _row_to_task(index: int, obj: Any, prompt_key: str, answer_key: str, template: str,
                 rejected_key: str | None = None, required: tuple[str, ...] = ("prompt", "answer"),
                 id_key: str | None = None, messages_key: str | None = None) -> Task | str:
    """Return a Task, or a short reason the row is unusable. `required`: the columns the row must
    hold, "prompt" and "answer" standing for `prompt_key` and `answer_key` (every column is kept,
    in `Task.row`)."""
    if isinstance(obj, ValueError):
        return str(obj)
    if not isinstance(obj, dict):
        return f"not a JSON object (got {type(obj).__name__})"
    if messages_key is not None and messages_key in obj:  # a conversation to train on (SFT)
        problem = _messages_problem(obj[messages_key], messages_key)
        if problem:
            return problem
        required = ()
    roles = {"prompt": prompt_key, "answer": answer_key}
    needed = [roles.get(column, column) for column in required]
    for key in (*needed, rejected_key):
        if key is not None and key not in obj:
            keys = ", ".join(sorted(map(str, obj))[:8])
            return f"missing key {key!r} (row has: {keys})"
    prompt = obj.get(prompt_key)
    if prompt is not None or "prompt" in required:
        if not isinstance(prompt, str) or not prompt.strip():
            return f"prompt {prompt_key!r} must be a non-empty string (got {prompt!r:.40})"
        prompt = template.format(prompt=prompt)
    try:
        answer = _text_field(obj, answer_key) if answer_key in obj or "answer" in required else None
        rejected = _text_field(obj, rejected_key) if rejected_key is not None else None
    except ValueError as err:
        return str(err)
    task_id = str(obj[id_key]) if id_key is not None and obj.get(id_key) is not None else ""
    return Task(index=index, prompt=prompt, answer=answer, rejected=rejected, row=obj, id=task_id)


def _messages_problem(messages: Any, key: str) -> str | None:
    """Why a conversation column is unusable, or None."""
    if not isinstance(messages, list) or not messages:
        return f"{key!r} must be a non-empty list of messages"
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"{key}[{i}] must be an object with string 'role' and 'content'"
    roles = [m["role"] for m in messages]
    if "assistant" not in roles or roles[0] == "assistant":
        return f"{key!r} needs a message before the first assistant turn and at least one assistant turn"
    return None


def read_taskset(
    path: str, prompt_key: str, answer_key: str, prompt_template: str = "{prompt}", rejected_key: str | None = None,
    required: tuple[str, ...] = ("prompt", "answer"), id_key: str | None = None, messages_key: str | None = None,
) -> tuple[list[Task], TasksetReport]:
    """Read `.jsonl`/`.json` (one object per line, or one top-level array) or `.parquet` rows.

    Rows that are not valid JSON, not objects, lack a required key, or have a non-string/empty
    prompt are skipped and counted in the report. Numeric answers become strings via `str()`.
    """
    _check_template(prompt_template)
    if not os.path.isfile(path):
        raise ValueError(f"taskset file {path!r} does not exist; check data.train_path / data.eval_path")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        rows = _parquet_rows(path)
    elif ext == ".jsonl" or (ext == ".json" and not _starts_with_bracket(path)):
        rows = _jsonl_rows(path)
    elif ext == ".json":
        rows = _json_array_rows(path)
    else:
        raise ValueError(f"taskset file {path!r} has extension {ext!r}; use .jsonl, .json or .parquet")

    tasks: list[Task] = []
    report = TasksetReport(path=path, rows=0, skipped=0)
    for index, where, obj in rows:
        result = _row_to_task(index, obj, prompt_key, answer_key, prompt_template, rejected_key, required, id_key,
                              messages_key)
        if isinstance(result, Task):
            tasks.append(result)
            continue
        report.skipped += 1
        if len(report.skipped_examples) < _MAX_EXAMPLES:
            report.skipped_examples.append(f"{where}: {result}")
    report.rows = len(tasks)
    if not tasks:
        examples = "\n  ".join(report.skipped_examples) or "(the file has no rows)"
        raise ValueError(
            f"taskset {path!r} has no valid rows ({report.skipped} skipped) with "
            f"data.prompt_key={prompt_key!r}, data.answer_key={answer_key!r}; examples:\n  {examples}"
        )
    return tasks, report


class TaskCursor:
    """Deterministic, resumable sampler: epoch e visits the tasks in `default_rng(seed + e)` order.

    Batches wrap across epoch boundaries so every batch is full; the cursor state is just
    (epoch, position), so checkpointing it makes a resumed run draw exactly the same batches.
    """

    def __init__(self, tasks: list[Task], seed: int) -> None:
        if not tasks:
            raise ValueError("TaskCursor needs at least one task; read_taskset returned none")
        self._tasks = list(tasks)
        self._seed = int(seed)
        self._epoch = 0
        self._position = 0
        self._perm_epoch = -1  # epoch whose permutation is cached in _perm
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self._epoch:
            self._perm = np.random.default_rng(self._seed + self._epoch).permutation(len(self._tasks))
            self._perm_epoch = self._epoch
        return self._perm

    def next_batch(self, n: int) -> list[Task]:
        """The next `n` tasks; may span (several) epoch boundaries, e.g. when n > len(tasks)."""
        if n <= 0:
            raise ValueError(f"batch size must be positive, got {n}")
        out: list[Task] = []
        while len(out) < n:
            perm = self._permutation()
            take = min(n - len(out), len(perm) - self._position)
            out.extend(self._tasks[i] for i in perm[self._position : self._position + take])
            self._position += take
            if self._position == len(perm):
                self._epoch += 1
                self._position = 0
        return out

    @property
    def epoch(self) -> int:
        """Completed passes over the task list (for logging)."""
        return self._epoch

    def state_dict(self) -> dict:
        """Everything needed to resume; seed and size are kept to catch resuming on other data."""
        return {"epoch": self._epoch, "position": self._position, "seed": self._seed, "num_tasks": len(self._tasks)}

    def load_state_dict(self, d: dict) -> None:
        for key, mine in (("seed", self._seed), ("num_tasks", len(self._tasks))):
            if key in d and int(d[key]) != mine:
                raise ValueError(
                    f"cursor checkpoint has {key}={d[key]} but this run has {key}={mine}; resuming would "
                    "draw different batches: use the same taskset and seed, or start a fresh run"
                )
        epoch, position = int(d["epoch"]), int(d["position"])
        if epoch < 0 or not 0 <= position < len(self._tasks):
            raise ValueError(f"cursor checkpoint has epoch={epoch}, position={position}; out of range "
                             f"for {len(self._tasks)} tasks (corrupt checkpoint?)")
        self._epoch, self._position = epoch, position


def file_counts(counts: dict[str, int] | int) -> dict[str, int]:
    """One taskset's row counts; checkpoints written before rows were counted by kind hold the
    malformed count alone."""
    return counts if isinstance(counts, dict) else {"malformed": counts}


def row_scalars(rows: dict[str, dict[str, int]], paths: list[str]) -> dict[str, float]:
    """TensorBoard scalars for the rows a stage's tasksets lost: `data/malformed_rows`,
    `data/overlong_skipped`, `data/overlong_truncated`, `data/operators_dropped` (summed over `paths`)."""
    total = {"malformed": 0, "overlong_skipped": 0, "truncated": 0, "operators_dropped": 0}
    for path in dict.fromkeys(p for p in paths if p):
        for key, n in file_counts(rows.get(path, {})).items():
            total[key] = total.get(key, 0) + n
    return {"data/malformed_rows": float(total["malformed"]), "data/overlong_skipped": float(total["overlong_skipped"]),
            "data/overlong_truncated": float(total["truncated"]),
            **({"data/operators_dropped": float(total["operators_dropped"])} if total["operators_dropped"] else {})}
