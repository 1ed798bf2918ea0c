"""A stage's taskset as the ranks read it: the rows of `data.train_path` / `data.eval_path` with the
stage's `data` settings, cleaned by the stage's task operators when it trains on them, with the
rows each step lost counted for the run summary."""

from __future__ import annotations

from rft.config import DataConfig, operator_specs
from rft.data.task_operators import apply_task_operators, cleaned_paths
from rft.data.taskset import Task, read_taskset


def read_stage_tasks(path: str, data: DataConfig, rows: dict[str, dict[str, int]], preferences: bool = False,
                     required: tuple[str, ...] = ("prompt", "answer"), messages_key: str | None = None,
                     cleaned_in: tuple[str, str] | None = None) -> list[Task]:
    """Read a taskset with a stage's `data` settings (rft.config.DataConfig) and record in
    `rows[path]["malformed"]` how many malformed rows it skipped (the run summary reports them;
    rft/data/context_fit.py adds the rows longer than the context).
    `preferences`: rows are (prompt, chosen, rejected) pairs (data.chosen_key, data.rejected_key).
    `required`: the columns the stage's workflow needs (rft.explorer.workflows.required_columns).
    `messages_key`: SFT rows holding a conversation in this column need no prompt or answer.
    `cleaned_in`: (run directory, stage name) of a training taskset: `data.operators` run on it
    (rft/data/task_operators.py), the rows they keep and a report of what they dropped are written
    to <run>/data/<stage>/, and `rows[path]["operators_dropped"]` counts the dropped rows."""
    answer_key = data.chosen_key if preferences else data.answer_key
    tasks, report = read_taskset(path, data.prompt_key, answer_key, data.prompt_template,
                                 data.rejected_key if preferences else None, required, data.id_key, messages_key,
                                 system_key=data.system_key, system_prompt=data.system_prompt, image_key=data.image_key)
    rows[report.path] = {"malformed": report.skipped}
    if cleaned_in is not None and data.operators:
        cleaned, report_path = cleaned_paths(*cleaned_in, path)
        kept, _ = apply_task_operators(tasks, operator_specs(data.operators), path, cleaned, report_path)
        rows[report.path]["operators_dropped"] = len(tasks) - len(kept)
        tasks = kept
    return tasks
