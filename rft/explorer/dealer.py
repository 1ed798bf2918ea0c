"""Dealing a batch's tasks to the job's engines by load, and collecting what the engines report.

Every engine (one per rollout group, rft/runtime/topology.py) holds the same tasks in the same order: each
reads the taskset and draws a step's batch from an identically seeded cursor. A task is therefore
named by its index in the batch alone, and dealing it is one atomic counter in the control group's
store (rft/runtime/preemption.py, hosted by rank 0):

    engine e, whenever it has room:  i = store.add("<batch>", 1) - 1;  run task i if i < n

An engine holds at most `window` tasks of a batch at once, so a fast engine comes back for more
while a slow one is still busy: the slow one is dealt fewer (pull, not a fixed split). A task's
samples and every turn of its trajectories stay on the engine that took it (its prefix cache holds
the prompt and the conversation). Experience does not depend on which engine ran a task: a
sample's seed comes from the task's index, and each engine's rows are sorted by it.

`total` and `gather` are the engines' meeting points (dynamic sampling's kept groups of a round,
an evaluation's results): every engine posts, every engine waits for all (rft/runtime/membership.py),
with the control group's timeout and an error that names the engines that never posted.

Losing an engine (rollout.on_engine_failure=continue): the counter simply stops handing it tasks,
but the tasks it took are lost with it (its shard of the step is never written). At the end of a
batch the engines meet and post the tasks they ran (`redeal`); the ones nobody ran are dealt
again among the engines left, the same way, until none is left:

    outcome = run(deal(batch))
    while (again := redeal(batch, outcome.tasks_run)) is not None:  outcome += run(again)

Why a store counter rather than a router process (verl, slime): the engines live in separate
Slurm tasks on any node, the store already joins them, and a counter needs no process of its own
that could die.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Deal:
    """How an engine takes the tasks of one batch: `claim()` returns the next free index."""

    claim: Callable[[], int]
    window: int  # tasks this engine holds at once


def local_deal(tasks: int) -> Deal:
    """One engine alone: every task, all in flight at once (rollout.max_concurrent_tasks bounds
    the trajectories)."""
    return Deal(claim=itertools.count().__next__, window=max(tasks, 1))


class Dealer:
    """Engine `index` of `count`; keys live under `prefix` in the control group's store. `ranks`
    are the engines' global ranks (their leaders'), how the store marks a lost one; `tolerated`
    the ones the run goes on without (rft/runtime/membership.py)."""

    def __init__(self, store: dist.Store, index: int, count: int, timeout_s: float, prefix: str = "rft-deal",
                 ranks: list[int] | None = None, tolerated: frozenset[int] = frozenset()):
        self.store, self.index, self.count, self.timeout_s = store, index, count, timeout_s
        self.prefix = prefix
        self.ranks = ranks or list(range(count))
        self.meeting = None
        if count > 1:
            from rft.runtime.membership import Meeting

            self.meeting = Meeting(store, self.ranks, self.ranks[index], timeout_s, self._name, tolerated)

    def _name(self, rank: int) -> str:
        return f"rollout engine {self.ranks.index(rank)} (rank {rank})"

    def present(self) -> int:
        """Engines at the last meeting (fewer than `count` once one is lost)."""
        return len(self.meeting.present) if self.meeting else 1

    def deal(self, batch: str, tasks: int) -> Deal:
        """This engine's share of batch `batch` (a name every engine uses alike) of `tasks` tasks.

        The window is half of an even share: with n tasks and E engines an engine holds at most
        ceil(n / 2E) at once, so at least half of the batch goes to whichever engine is free first.
        """
        if self.count == 1:
            return local_deal(tasks)
        return self._deal_of(f"{self.prefix}/{batch}/next", list(range(tasks)), tasks)

    def _deal_of(self, key: str, indices: list[int], tasks: int) -> Deal:
        def claim() -> int:
            # a TCP round trip to rank 0 (~0.1 ms), taken on the engine's event loop between tasks
            j = self.store.add(key, 1) - 1
            return indices[j] if j < len(indices) else tasks

        return Deal(claim=claim, window=max(1, math.ceil(len(indices) / (2 * self.present()))))

    def redeal(self, batch: str, tasks: int, ran: list[int]) -> Deal | None:
        """After this engine ran `ran` of batch `batch`'s `tasks` tasks: a deal of the ones no
        engine ran (an engine was lost holding them), or None when every task ran (a meeting:
        every engine calls it alike; `batch` must be new for each call of a batch's redeals)."""
        if self.count == 1:
            return None
        done = {i for share in self.gather(f"{batch}/ran", ran).values() for i in share}
        left = [i for i in range(tasks) if i not in done]
        return self._deal_of(f"{self.prefix}/{batch}/again", left, tasks) if left else None

    def gather(self, key: str, payload: object) -> dict[int, object]:
        """Every present engine's `payload` for `key`, by engine index (a meeting: all engines
        call it alike; a lost engine that never posted is missing)."""
        if self.meeting is None:
            return {self.index: payload}
        posted = self.meeting.post(f"{self.prefix}/{key}", payload)
        return {self.ranks.index(rank): value for rank, value in sorted(posted.items())}

    def total(self, key: str, value: int) -> int:
        """The sum of every present engine's `value` (a meeting)."""
        return sum(self.gather(key, value).values())
