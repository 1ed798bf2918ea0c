"""Difficulty scores from the job's judge engines, asked once before a stage's first batch.

    cluster: {judge_ranks: 1}
    judge: {model: /models/Qwen2.5-7B-Instruct}
    data:
      judge_difficulty: {enabled: true}                  # writes each task's `difficulty` column
      selector: {name: curriculum, difficulty_key: difficulty}

The judge reads each training task through `prompt` (a template of {prompt} and {answer}) and
answers with a number; the first number in its reply becomes the task's `key` column, the one the
curriculum selector ranks by (low = easy). A reply without a number, or a call that failed, gives
the task the median of the other scores, so it sits mid-curriculum; both are counted.

Why this is not a `data.operators` entry: task operators run wherever a rank reads the taskset,
before the job's judge engines serve, and they only drop tasks; this asks the judges and adds a
column, so the explorer runs it once they are up (rft/explorer/explorer.py).

The judges are asked once per stage: engine 0 writes the scores to
<run>/data/<stage>/<taskset>.difficulty.jsonl (one row per task: its id, score and the judge's
reply), and every engine, and a resumed run, reads that file. So all engines' selectors rank the
same numbers, and a resume ranks what the first attempt did without asking again.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rft.config import JudgeDifficultyConfig
from rft.data.taskset import Task
from rft.runtime.storage import write_text_atomic

# one number, as a judge writes it: "7", "7.5", "-1", "3/10" (-> 3)
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
TEMPLATE_FIELDS = ("prompt", "answer")
_POLL_S = 0.5


@dataclass
class DifficultyScores:
    """What the judge said: a score per task id, and the count of tasks that got the median."""

    scores: dict[str, float]
    replies: dict[str, str] = field(default_factory=dict)
    unparsed: int = 0  # replies without a number
    failed: int = 0  # calls that timed out or failed

    def scalars(self) -> dict[str, float]:
        values = np.fromiter(self.scores.values(), dtype=float)
        return {"data/judge_difficulty_tasks": float(values.size),
                "data/judge_difficulty_mean": float(values.mean()) if values.size else 0.0,
                "data/judge_difficulty_unparsed": float(self.unparsed), "data/judge_difficulty_failed": float(self.failed)}


def check_template(template: str) -> None:
    """The prompt template names only {prompt} and {answer}; a ValueError names any other field."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as err:
        raise ValueError(f"not a format string: {err}") from None
    for name in fields:
        if name not in TEMPLATE_FIELDS:
            raise ValueError(f"it names {{{name}}}; use {{prompt}} and {{answer}} (write {{{{ and }}}} for literal braces)")


def scores_path(run_dir: str, stage: str, source_path: str) -> str:
    """`<run_dir>/data/<stage>/<base>.difficulty.jsonl`, next to the cleaned taskset."""
    base = os.path.splitext(os.path.basename(source_path))[0]
    return os.path.join(run_dir, "data", stage, f"{base}.difficulty.jsonl")


def first_number(reply: str) -> float | None:
    match = _NUMBER.search(reply)
    return float(match.group()) if match else None


async def ask_judges(tasks: list[Task], cfg: JudgeDifficultyConfig, judges) -> DifficultyScores:
    """One call per task to the judge engines (`judges`: rft.explorer.judge.JudgeClient), at most
    `cfg.concurrency` in flight; greedy, so the same judge gives the same score."""
    slots = asyncio.Semaphore(cfg.concurrency)
    ask = judges.chat if cfg.chat else judges.complete
    answered, every = 0, max(1, len(tasks) // 10)  # a progress line per tenth of the taskset

    async def one(task: Task) -> str | BaseException:
        nonlocal answered
        text = cfg.prompt.format(prompt=task.prompt or "", answer=task.answer or "")
        request = [{"role": "user", "content": text}] if cfg.chat else text
        async with slots:
            try:
                return await ask(request, max_new_tokens=cfg.max_new_tokens, temperature=0.0)
            except Exception as err:  # JudgeError, JudgeTimeout: the task gets the median, counted
                return err
            finally:
                answered += 1
                if answered % every == 0 and answered < len(tasks):
                    print(f"data.judge_difficulty: {answered}/{len(tasks)} tasks answered", flush=True)

    replies = await asyncio.gather(*(one(t) for t in tasks))
    numbers = [None if isinstance(r, BaseException) else first_number(r) for r in replies]
    found = [n for n in numbers if n is not None]
    if not found:
        example = next((r for r in replies if not isinstance(r, BaseException)), replies[0] if replies else None)
        raise ValueError(f"data.judge_difficulty: the judge answered no number for any of {len(tasks)} tasks (e.g. "
                         f"{str(example)[:200]!r}); check data.judge_difficulty.prompt and .chat (a model without a "
                         "chat template needs chat=false), and judge.model")
    median = float(np.median(found))
    return DifficultyScores(
        scores={t.task_id: median if n is None else n for t, n in zip(tasks, numbers)},
        replies={t.task_id: (f"<{type(r).__name__}: {r}>" if isinstance(r, BaseException) else r)
                 for t, r in zip(tasks, replies)},
        unparsed=sum(n is None and not isinstance(r, BaseException) for n, r in zip(numbers, replies)),
        failed=sum(isinstance(r, BaseException) for r in replies))


def write_scores(path: str, result: DifficultyScores) -> None:
    summary = {"unparsed": result.unparsed, "failed": result.failed}
    lines = [json.dumps({"summary": summary})]
    lines += [json.dumps({"id": task_id, "score": score, "reply": result.replies.get(task_id, "")}, ensure_ascii=False)
              for task_id, score in result.scores.items()]
    write_text_atomic(path, "\n".join(lines) + "\n", "the judged difficulty scores")


def read_scores(path: str, tasks: list[Task]) -> DifficultyScores:
    """The scores a first attempt (or engine 0) wrote; a file of another taskset is refused."""
    with open(path) as f:
        try:
            rows = [json.loads(line) for line in f if line.strip()]
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not a file of difficulty scores ({err}); delete it to ask the judges "
                             "again") from None
    summary = rows[0].get("summary", {}) if rows else {}
    scores = {row["id"]: float(row["score"]) for row in rows[1:]}
    replies = {row["id"]: row.get("reply", "") for row in rows[1:]}
    missing = [t.task_id for t in tasks if t.task_id not in scores]
    if missing or len(scores) != len(tasks):
        raise ValueError(f"{path} holds difficulty scores of another taskset ({len(scores)} tasks, {len(missing)} of "
                         f"this stage's {len(tasks)} missing, e.g. {missing[:3]}); delete it to ask the judges again")
    return DifficultyScores(scores, replies, int(summary.get("unparsed", 0)), int(summary.get("failed", 0)))


def _wait_for(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the difficulty scores {path} did not appear within {timeout_s:g}s (sync.timeout_s): "
                               "engine 0 asks the judges and writes them; see its log")
        time.sleep(_POLL_S)


def score_tasks(tasks: list[Task], cfg: JudgeDifficultyConfig, path: str, ask: Callable[[], DifficultyScores] | None,
                timeout_s: float) -> DifficultyScores:
    """Fill each task's `cfg.key` column with its judged difficulty. `ask` (given on engine 0 only)
    asks the judges when `path` does not exist yet; other engines wait for engine 0's file."""
    if not os.path.exists(path):
        if ask is None:
            _wait_for(path, timeout_s)
        else:
            started = time.monotonic()
            print(f"data.judge_difficulty: asking the judges how hard each of {len(tasks)} tasks is", flush=True)
            result = ask()
            write_scores(path, result)
            print(f"data.judge_difficulty: {len(tasks)} tasks scored in {time.monotonic() - started:.1f}s "
                  f"({result.unparsed} replies without a number, {result.failed} failed calls: given the median) "
                  f"-> {path}", flush=True)
    result = read_scores(path, tasks)
    for task in tasks:
        task.row[cfg.key] = result.scores[task.task_id]
    return result
