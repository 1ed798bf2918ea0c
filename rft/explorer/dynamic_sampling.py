"""Dynamic sampling (DAPO): keep the groups a sample filter accepts, generate more until a step's
batch is full."""

from __future__ import annotations

from typing import Callable

import torch

from rft.algorithms.advantages import group_index
from rft.buffer.experience import Experience


def run_filtered(generate: Callable[[int, int], list[Experience]], sample_filter: Callable, tasks: int,
                 max_rounds: int) -> tuple[list[Experience], dict[str, float]]:
    """Generate `tasks` groups, drop those the filter rejects (e.g. all rewards equal: zero
    advantage, nothing to learn), and generate more until `tasks` groups are kept or `max_rounds`
    rounds ran. `generate(num_tasks, round)` returns the experiences of that many tasks (their
    groups named by `group_id`; a task whose samples all failed has none).
    Returns at most `tasks` groups (fewer if rounds ran out; all of the first round if none was
    kept) and counts for the log."""
    kept: list[Experience] = []
    first: list[Experience] | None = None
    generated = 0
    for round_index in range(max_rounds):
        missing = tasks - len({e.group_id for e in kept})
        if missing <= 0:
            break
        experiences = generate(missing, round_index)
        first = experiences if first is None else first
        generated += missing
        if experiences:
            rewards = torch.tensor([float(e.reward) for e in experiences])
            keep = sample_filter(rewards, group_index([e.group_id for e in experiences])).tolist()
            kept += [e for e, k in zip(experiences, keep) if k]
    if not kept:  # nothing passed: train on the first round (zero advantages) rather than stall
        kept = first or []
    stats = {"rollout/groups_generated": float(generated),
             "rollout/groups_kept": float(len({e.group_id for e in kept}))}
    return kept, stats
