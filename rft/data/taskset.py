"""Reading a taskset and sampling it deterministically.

A task keeps every column of its source row (`Task.row`): workflows, environments and rewards
read what they need from it (a grid world's start and goal, a test case's inputs). `prompt` and
`answer` are the columns `data.prompt_key` / `data.answer_key` name (dotted keys read nested
fields, rft/data/rows.py), required by workflows that prompt with them (single_turn) and optional
for the others (an environment builds its own first message). A prompt is text, or chat messages
ending with a user turn; either way `Task.prompt` is the text the model answers (the last user
turn's), and rft/data/prompts.py `prompt_messages` gives the messages a task is sent.

Where the rows come from (a file, a folder or glob of shards, a `datasets` save_to_disk folder,
`path@split`) is rft/data/sources.py.

Bad rows are skipped and counted rather than raised: real datasets carry a few broken lines, and
one of them should not kill a multi-node launch. Only when *nothing* usable is left do we raise,
with examples, because then the keys or the file are almost certainly wrong.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rft.data import sources
from rft.data.images import MARK, place_images, read_images
from rft.data.rows import Message, MissingKey, get, has_key, lookup, prompt_messages, system_prompt, text_field

_MAX_EXAMPLES = 5  # skipped-row messages kept in a report; the count is always exact

# rows shaped like another framework's layout, and the config group that reads them (conf/data/)
_LAYOUT_HINTS = ((("prompt", "reward_model"), "verl"), (("prompt", "response"), "trinity"))


@dataclass(frozen=True)
class Task:
    """One problem. `index` is the row's 0-based position in its split (skipped rows included), so
    a task can be traced back to its source line (line number = index + 1 for jsonl)."""

    index: int
    prompt: str | None  # the prompt text after data.prompt_template (messages: the last user turn); None: the row has none
    answer: str | None  # the reference answer; for preference data (DPO) the chosen response
    rejected: str | None = None  # preference data: the rejected response
    row: dict[str, Any] = field(default_factory=dict, compare=False)  # every column of the source row
    id: str = field(default="", compare=False)  # data.id_key's value, else the row index
    # the system prompt sent first: a messages prompt's own system turn, else data.system_key's column,
    # else data.system_prompt
    system: str | None = None
    history: tuple[Message, ...] = field(default=(), hash=False)  # a messages prompt's turns before its last user turn
    # a vision-language row's images, encoded (data.image_key, rft/data/images.py), in the order of
    # their placeholders in `prompt`
    images: tuple[bytes, ...] = field(default=(), hash=False, repr=False)

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


@dataclass(frozen=True)
class RowKeys:
    """Which columns of a row are what (the `data` section's keys; dotted keys read nested fields)."""

    prompt: str
    answer: str
    template: str = "{prompt}"
    rejected: str | None = None  # preference data
    required: tuple[str, ...] = ("prompt", "answer")  # "prompt"/"answer" stand for the two keys above
    id: str | None = None
    messages: str | None = None  # SFT conversations
    system: str | None = None  # data.system_key
    system_prompt: str | None = None  # data.system_prompt
    images: str | None = None  # data.image_key
    base_dir: str = ""  # where an image column's relative paths start: the taskset's folder


def _prompt(obj: dict, keys: RowKeys) -> tuple[str | None, str | None, tuple[Message, ...]]:
    """(prompt text after the template, the prompt's own system turn, the turns between) of a row.
    A messages prompt's last user turn is the text, and the template fills that turn."""
    value = lookup(obj, keys.prompt)
    if isinstance(value, list):
        messages = prompt_messages(value, keys.prompt)
        own_system = messages.pop(0)["content"] if messages[0]["role"] == "system" else None
        return keys.template.format(prompt=messages[-1]["content"]), own_system, tuple(messages[:-1])
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"prompt {keys.prompt!r} must be a non-empty string or a list of chat messages "
                         f"(got {value!r:.40})")
    return keys.template.format(prompt=value), None, ()


def _row_to_task(index: int, obj: Any, keys: RowKeys) -> Task | str:
    """Return a Task, or a short reason the row is unusable (every column is kept, in `Task.row`)."""
    if isinstance(obj, ValueError):
        return str(obj)
    if not isinstance(obj, dict):
        return f"not a JSON object (got {type(obj).__name__})"
    required = keys.required
    try:
        if keys.messages is not None and has_key(obj, keys.messages):  # a conversation to train on (SFT)
            problem = _messages_problem(lookup(obj, keys.messages), keys.messages)
            if problem:
                return problem
            required = ()
        roles = {"prompt": keys.prompt, "answer": keys.answer}
        for key in (*[roles.get(column, column) for column in required], keys.rejected):
            if key is not None:
                lookup(obj, key)  # MissingKey names the key
        prompt, system, history = None, None, ()
        if "prompt" in required or get(obj, keys.prompt) is not None:
            prompt, system, history = _prompt(obj, keys)
        if system is None:  # a messages prompt's own system turn wins over the column and the setting
            system = system_prompt(obj, keys.system, keys.system_prompt)
        answer = text_field(obj, keys.answer) if "answer" in required or has_key(obj, keys.answer) else None
        rejected = text_field(obj, keys.rejected) if keys.rejected is not None else None
        images: tuple[bytes, ...] = ()
        if keys.images is not None and prompt is not None:
            if any(MARK in turn["content"] for turn in history):
                raise ValueError(f"images go in the last user turn; an earlier turn of {keys.prompt!r} marks one")
            images = read_images(lookup(obj, keys.images), keys.images, keys.base_dir)
            prompt = place_images(prompt, len(images), keys.images)
    except (MissingKey, ValueError) as err:
        return str(err)
    task_id = get(obj, keys.id) if keys.id is not None else None  # optional: the row index stands in
    return Task(index=index, prompt=prompt, answer=answer, rejected=rejected, row=obj,
                id="" if task_id is None else str(task_id),
                system=system, history=history, images=images)


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


def _layout_hint(first_row: Any, keys: RowKeys) -> str:
    """A hint when the keys miss the rows and the rows look like a layout a config group reads."""
    if not isinstance(first_row, dict) or (has_key(first_row, keys.prompt) and has_key(first_row, keys.answer)):
        return ""
    for columns, group in _LAYOUT_HINTS:
        if all(c in first_row for c in columns):
            return (f"\nthe rows look like {group}'s layout: add `+data={group}` to the command line, after any "
                    "+experiment=... (the later one sets data.prompt_key etc.)")
    return ""


def read_taskset(
    path: str, prompt_key: str, answer_key: str, prompt_template: str = "{prompt}", rejected_key: str | None = None,
    required: tuple[str, ...] = ("prompt", "answer"), id_key: str | None = None, messages_key: str | None = None,
    *, system_key: str | None = None, system_prompt: str | None = None, image_key: str | None = None,
) -> tuple[list[Task], TasksetReport]:
    """Read the rows `path` names (rft/data/sources.py: a .jsonl/.json/.parquet file, gzipped json,
    a folder or glob of shards, a save_to_disk folder, `path@split`) as tasks.

    Rows that are not valid JSON, not objects, lack a required key, or have a bad prompt (not
    non-empty text nor chat messages ending with a user turn) or answer are skipped and counted in
    the report, each example naming the row (shard, line or row) and the key. Numeric answers become
    strings via `str()`. `required`: the columns the row must hold, "prompt" and "answer" standing
    for `prompt_key` and `answer_key`. `image_key`: the column of a row's images (rft/data/images.py:
    an unreadable image skips its row).
    """
    _check_template(prompt_template)
    try:
        source = sources.resolve(path)
    except ValueError as err:
        raise ValueError(f"{err}; check data.train_path / data.eval_path") from None
    keys = RowKeys(prompt_key, answer_key, prompt_template, rejected_key, required, id_key, messages_key,
                   system_key, system_prompt, image_key, source.folder)

    tasks: list[Task] = []
    report = TasksetReport(path=path, rows=0, skipped=0)
    first_row = None
    for index, where, obj in sources.rows(source):
        first_row = obj if first_row is None else first_row
        result = _row_to_task(index, obj, keys)
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
            + _layout_hint(first_row, keys)
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
