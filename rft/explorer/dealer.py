"""Dealing a batch's tasks to the job's engines by load, and collecting what the engines report.

Every engine (one per rollout group, rft/cluster.py) holds the same tasks in the same order: each
reads the taskset and draws a step's batch from an identically seeded cursor. A task is therefore
named by its index in the batch alone, and dealing it is one atomic counter in the control group's
store (rft/preemption.py, hosted by rank 0):

    engine e, whenever it has room:  i = store.add("<batch>", 1) - 1;  run task i if i < n

An engine holds at most `window` tasks of a batch at once, so a fast engine comes back for more
while a slow one is still busy: the slow one is dealt fewer (pull, not a fixed split). A task's
samples and every turn of its trajectories stay on the engine that took it (its prefix cache holds
the prompt and the conversation). Experience does not depend on which engine ran a task: a
sample's seed comes from the task's index, and each engine's rows are sorted by it.

`total` and `gather` are the engines' meeting points (dynamic sampling's kept groups of a round,
an evaluation's results): every engine posts, every engine waits for all, with the control
group's timeout and an error that names the engines that never posted.

Why a store counter rather than a router process (verl, slime): the engines live in separate
Slurm tasks on any node, the store already joins them, and a counter needs no process of its own
that could die.
"""

from __future__ import annotations

import datetime
import itertools
import math
import pickle
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
    """Engine `index` of `count`; keys live under `prefix` in the control group's store."""

    def __init__(self, store: dist.Store, index: int, count: int, timeout_s: float, prefix: str = "rft-deal"):
        self.store, self.index, self.count, self.timeout_s = store, index, count, timeout_s
        self.prefix = prefix

    def deal(self, batch: str, tasks: int) -> Deal:
        """This engine's share of batch `batch` (a name every engine uses alike) of `tasks` tasks.

        The window is half of an even share: with n tasks and E engines an engine holds at most
        ceil(n / 2E) at once, so at least half of the batch goes to whichever engine is free first.
        """
        if self.count == 1:
            return local_deal(tasks)
        key = f"{self.prefix}/{batch}/next"
        # a TCP round trip to rank 0 (~0.1 ms), taken on the engine's event loop between tasks
        return Deal(claim=lambda: self.store.add(key, 1) - 1,
                    window=max(1, math.ceil(tasks / (2 * self.count))))

    def gather(self, key: str, payload: object) -> list[object]:
        """Every engine's `payload` for `key`, in engine order (a barrier: all engines call it)."""
        if self.count == 1:
            return [payload]
        base = f"{self.prefix}/{key}"
        names = [f"{base}/{e}" for e in range(self.count)]
        self.store.set(names[self.index], pickle.dumps(payload))
        try:
            self.store.wait(names, datetime.timedelta(seconds=self.timeout_s))
        except Exception as err:  # torch's DistStoreError / timeout: name who is missing
            missing = [e for e, name in enumerate(names) if not self.store.check([name])]
            raise TimeoutError(f"rollout engine {self.index}: engine(s) {missing} did not report {key!r} within "
                               f"{self.timeout_s:.0f}s (sync.timeout_s): did they die? see their logs") from err
        payloads = [pickle.loads(self.store.get(name)) for name in names]
        if self.store.add(f"{base}/read", 1) == self.count:  # the last reader frees rank 0's memory
            for name in names + [f"{base}/read"]:
                self.store.delete_key(name)
        return payloads

    def total(self, key: str, value: int) -> int:
        """The sum of every engine's `value` (a barrier)."""
        return sum(self.gather(key, value))
