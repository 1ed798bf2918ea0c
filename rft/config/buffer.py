"""The `buffer` section: experience shards on the shared filesystem, staleness, experience
operators and replay."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ReplayConfig:
    """Experience trained on again (rft/buffer/replay.py). Off by default (groups_per_step 0)."""

    groups_per_step: int = 0  # groups of earlier steps added to each step's batch (0: no replay)
    priority: str = "age"  # age | reward_std | file.py:fn or dotted path to fn(entry, step, config) -> float (0: not eligible)
    half_life: float = 4.0  # age, reward_std: priority halves every this many steps of age
    max_uses: int = 1  # times one group may be trained again
    cooldown: int = 1  # steps between two trainings of one group
    capacity: int = 1024  # candidate groups kept (the oldest leave first)


@dataclass
class BufferConfig:
    path: Optional[str] = None  # the shards' directory (None: <run.output_dir>/buffer; decoupled jobs share <run>/buffer)
    format: str = "parquet"  # parquet | arrow
    lease_s: float = 600.0  # a claimed shard not committed within this returns to the pool
    wait_timeout_s: float = 1800.0  # trainer gives up waiting for experience after this
    poll_s: float = 0.002  # how often the trainer looks for a new shard (one directory listing)
    max_staleness: Optional[int] = None  # a shard whose weights are more trainer steps old is stale (None: no limit)
    stale: str = "drop"  # drop: skip its step, keep it as <name>.stale | reweight: train it with truncated IS
    operators: list[Any] = field(default_factory=list)  # experience operators between workflow and buffer (rft/buffer/operators.py)
    replay: ReplayConfig = field(default_factory=ReplayConfig)  # experience trained on again (rft/buffer/replay.py)
