"""The single-turn workflow: tasks -> prompts -> `n` samples each -> rewards -> experience rows."""

from __future__ import annotations

from typing import Callable

from rft.buffer.taskset import Task
from rft.explorer.prompts import format_prompt
from rft.explorer.rewards import RewardScorer
from rft.explorer.vllm_engine import RolloutEngine


def run_single_turn(engine: RolloutEngine, tasks: list[Task], n: int, scorer: RewardScorer,
                    max_new_tokens: int, temperature: float, top_p: float, stop: list[str],
                    seed: int, chat_template: bool) -> dict[str, list]:
    """Generate and score; returns experience columns (one row per sample, groups contiguous)."""
    prompts = [format_prompt(t, engine.tokenizer, chat_template) for t in tasks]
    groups = engine.generate(prompts, n, max_new_tokens, temperature, top_p, stop, seed)
    samples = [s for group in groups for s in group]
    answers = [t.answer for t in tasks for _ in range(n)]
    rewards = scorer.score([s.text for s in samples], answers)
    return {
        "task_index": [t.index for t in tasks for _ in range(n)],
        "prompt_ids": [s.prompt_ids for s in samples],
        "response_ids": [s.response_ids for s in samples],
        "response_logprobs": [s.response_logprobs for s in samples],
        "reward": rewards,
        "finished": [s.finished for s in samples],
    }


def keep_groups(rows: dict[str, list], keep: list[bool]) -> dict[str, list]:
    """The rows whose entry in `keep` is True (a filter keeps or drops whole groups)."""
    return {k: [v for v, kept in zip(values, keep) if kept] for k, values in rows.items()}


def run_filtered(generate: Callable[[int, int], dict[str, list]], sample_filter: Callable, tasks: int,
                 group_size: int, max_rounds: int) -> tuple[dict[str, list], dict[str, float]]:
    """Dynamic sampling (DAPO): generate `tasks` groups, drop those the filter rejects (e.g. all
    rewards equal: zero advantage, nothing to learn), and generate more until `tasks` groups are
    kept or `max_rounds` rounds ran. `generate(num_tasks, round)` returns experience columns.
    Returns at most `tasks` groups (fewer if rounds ran out; all of the first round if none kept)
    and counts for the log."""
    import torch

    kept: dict[str, list] | None = None
    first = None
    generated = 0
    for round_index in range(max_rounds):
        missing = tasks - (len(kept["reward"]) // group_size if kept else 0)
        if missing <= 0:
            break
        rows = generate(missing, round_index)
        first = first or rows
        generated += missing
        mask = sample_filter(torch.tensor(rows["reward"], dtype=torch.float32), group_size).tolist()
        rows = keep_groups(rows, mask)
        kept = rows if kept is None else {k: kept[k] + rows[k] for k in kept}
    if not kept["reward"]:  # nothing passed: train on the first round (zero advantages) rather than stall
        kept = first
    stats = {"rollout/groups_generated": float(generated),
             "rollout/groups_kept": float(len(kept["reward"]) // group_size)}
    return kept, stats


def evaluate(engine: RolloutEngine, tasks: list[Task], scorer: RewardScorer, max_new_tokens: int,
             temperature: float, stop: list[str], seed: int, chat_template: bool) -> float:
    """Accuracy (mean reward of one sample per task; greedy when temperature is 0)."""
    prompts = [format_prompt(t, engine.tokenizer, chat_template) for t in tasks]
    groups = engine.generate(prompts, 1, max_new_tokens, temperature, 1.0, stop, seed)
    rewards = scorer.score([g[0].text for g in groups], [t.answer for t in tasks])
    return sum(rewards) / max(len(rewards), 1)
