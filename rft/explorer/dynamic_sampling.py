"""Dynamic sampling (DAPO): keep the groups the sample filter and the experience operators leave,
generate more until a step's batch is full."""

from __future__ import annotations

from typing import Callable

import torch

from rft.algorithms.advantages import group_index
from rft.buffer.experience import Experience

Rows = list[Experience]


def filter_rows(sample_filter: Callable) -> Callable[[Rows], Rows]:
    """A sample filter (rft/algorithms/filters.py: a keep mask from rewards and group ids) as a
    step on rows, like an experience operator (rft/buffer/operators.py)."""
    def apply(experiences: Rows) -> Rows:
        if not experiences:
            return experiences
        rewards = torch.tensor([float(e.reward) for e in experiences])
        keep = sample_filter(rewards, group_index([e.group_id for e in experiences])).tolist()
        return [e for e, k in zip(experiences, keep) if k]

    return apply


def run_filtered(generate: Callable[[int, int], Rows], process: Callable[[Rows], Rows], tasks: int,
                 max_rounds: int, kept_by_all: Callable[[int, int], int] = lambda kept, _round: kept,
                 ) -> tuple[Rows, dict[str, float]]:
    """Generate `tasks` groups, `process` them (the sample filter, then the experience operators:
    drop groups with all rewards equal, zero advantage, nothing to learn; shape rewards), and
    generate more until `tasks` groups are kept or `max_rounds` rounds ran. `generate(num_tasks,
    round)` returns the experiences of that many tasks (their groups named by `group_id`; a task
    whose samples all failed has none).
    Returns at most `tasks` groups (fewer if rounds ran out; all of the first round if none was
    kept) and counts for the log.

    With several engines each runs this loop on its share of every round (rft/explorer/dealer.py):
    `kept_by_all(kept here, round)` sums the groups every engine kept so far, so all engines
    ask the next round for the same number of tasks and stop at the same round."""
    kept: list[Experience] = []
    first: list[Experience] | None = None
    generated, kept_total = 0, 0
    for round_index in range(max_rounds):
        missing = tasks - kept_total
        if missing <= 0:
            break
        experiences = generate(missing, round_index)
        first = experiences if first is None else first
        generated += missing
        kept += process(experiences)
        kept_total = kept_by_all(len({e.group_id for e in kept}), round_index)
    if kept_total == 0:  # nothing passed: train on the first round (zero advantages) rather than stall
        kept = first or []
        kept_total = kept_by_all(len({e.group_id for e in kept}), max_rounds)
    stats = {"rollout/groups_generated": float(generated), "rollout/groups_kept": float(kept_total)}
    return kept, stats
