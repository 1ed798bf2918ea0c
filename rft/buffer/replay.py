"""Priority replay: groups of experience trained on again in later steps (`buffer.replay`).

    after each step:  every group the step trained becomes a candidate (its shard is kept as .done)
    before a step:    the `groups_per_step` eligible candidates of highest priority join its batch

A candidate is eligible when it was used fewer than `max_uses` times, at least `cooldown` steps
ago, and its priority is above 0; with `buffer.max_staleness` and `stale=drop` also only while
its weights are no more than max_staleness trainer steps old (with `stale=reweight` a step holding
replayed rows is trained with truncated importance weights, like any stale experience:
rft/trainer/trainer.py; a step whose fresh shards are dropped as stale trains none of its rows,
and the groups replayed in it count as used). Ties in priority go to the older group, then the
group id, so the choice is a function of the pool alone.

Fresh shards keep their exactly-once life cycle (rft/buffer/shards.py): replay never claims, it
reads consumed shards (checksums verified) by name. The pool is a checkpoint component of trainer
rank 0, so a resumed run replays exactly what the uninterrupted one would, and every reuse is a
line of `<run>/buffer/replay.jsonl` (step, group, shard, use count, priority).

Registry PRIORITIES, signature fn(entry: Candidate, step: int, config: ReplayConfig) -> float:
    age         0.5 ** (age / half_life): recent experience first
    reward_std  the group's reward standard deviation x age's decay: groups that still teach
                (a GRPO group with equal rewards has zero advantage)
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from rft.buffer.shards import ExperienceBuffer, ShardCorruptError
from rft.config import ReplayConfig
from rft.registry import Registry
from rft.runtime.monitor import drop_from_step
from rft.runtime.storage import append_jsonl

PRIORITIES = Registry("replay priority", params=("entry", "step", "config"), returns="float (0: not eligible)")
LOG = "replay.jsonl"


@dataclass
class Candidate:
    """A group trained once, as the pool remembers it."""

    shard: str  # the consumed shard holding it (its ready name; the file is <shard>.done)
    group_id: str
    step: int  # the trainer step that first trained it
    version: int  # the weights version that generated it
    rows: int
    reward_mean: float
    reward_std: float
    uses: int = 0  # times replayed
    last_used: int = -1  # the step of its last replay (-1: never)


@PRIORITIES.register("age")
def age(entry: Candidate, step: int, config: ReplayConfig) -> float:
    return 0.5 ** ((step - entry.step) / config.half_life)


@PRIORITIES.register("reward_std")
def reward_std(entry: Candidate, step: int, config: ReplayConfig) -> float:
    return entry.reward_std * age(entry, step, config)


class ReplayPool:
    """Trainer rank 0's candidates and their use counts; a checkpoint component ("replay")."""

    def __init__(self, buffer: ExperienceBuffer, config: ReplayConfig, max_staleness: int | None = None,
                 drop_stale: bool = True):
        self.buffer, self.config = buffer, config
        self.max_staleness = max_staleness if drop_stale else None
        self.priority = PRIORITIES.resolve(config.priority)
        self.candidates: list[Candidate] = []
        self.log_path = os.path.join(buffer.root, LOG)
        self.skipped = 0  # candidates whose shard failed its checksum (left out of the pool)

    def add(self, step: int, shards: list[tuple[str, pa.Table]]) -> None:
        """The groups of `step`'s fresh shards (ready name, rows), committed just now."""
        for name, table in shards:
            groups = table.group_by("group_id").aggregate([("reward", "mean"), ("reward", "stddev"),
                                                           ("reward", "count"), ("version", "min")])
            for row in sorted(groups.to_pylist(), key=lambda r: r["group_id"]):
                self.candidates.append(Candidate(
                    shard=name, group_id=row["group_id"], step=step, version=int(row["version_min"]),
                    rows=int(row["reward_count"]), reward_mean=float(row["reward_mean"]),
                    reward_std=float(row["reward_stddev"] or 0.0)))
        del self.candidates[: max(0, len(self.candidates) - self.config.capacity)]  # the oldest leave

    def eligible(self, c: Candidate, step: int) -> bool:
        if c.uses >= self.config.max_uses or (c.last_used >= 0 and step - c.last_used < self.config.cooldown):
            return False
        return self.max_staleness is None or step - 1 - c.version <= self.max_staleness

    def take(self, step: int) -> tuple[pa.Table | None, dict[str, float]]:
        """Rows of the groups replayed at `step` (None if none), recorded as used; and scalars."""
        cfg = self.config
        scored = [(self.priority(c, step, cfg), c) for c in self.candidates if self.eligible(c, step)]
        scored.sort(key=lambda pair: (-pair[0], pair[1].step, pair[1].group_id))
        tables, used, by_shard = [], 0, {}
        for priority, c in scored:
            if priority <= 0 or used == cfg.groups_per_step:
                break
            try:
                if c.shard not in by_shard:
                    by_shard[c.shard] = self.buffer.read_consumed(c.shard)
            except (OSError, ShardCorruptError) as err:
                print(f"rft: replay leaves group {c.group_id} out: {err}", flush=True)
                self.candidates.remove(c)
                self.skipped += 1
                continue
            shard = by_shard[c.shard]
            tables.append(shard.filter(pc.equal(shard.column("group_id"), c.group_id)))
            c.uses, c.last_used = c.uses + 1, step
            used += 1
            append_jsonl(self.log_path, {"step": step, "group_id": c.group_id, "shard": c.shard, "uses": c.uses,
                                         "priority": priority, "rows": c.rows})
        rows = sum(t.num_rows for t in tables)
        scalars = {"replay/groups": float(used), "replay/rows": float(rows),
                   "replay/candidates": float(len(self.candidates))}
        if not tables:
            return None, scalars
        return pa.concat_tables(tables, promote_options="permissive"), scalars

    def resumed_at(self, step: int) -> None:
        """A run resumed at trainer step `step` replays from there again: earlier log lines stay."""
        drop_from_step(self.log_path, step)

    def state_dict(self) -> dict:
        return {"candidates": [dataclasses.asdict(c) for c in self.candidates], "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.candidates = [Candidate(**c) for c in state["candidates"]]
        self.skipped = int(state.get("skipped", 0))


def replay_log(run_dir: str) -> list[dict]:
    """Every reuse recorded in <run>/buffer/replay.jsonl (tests, tools)."""
    path = os.path.join(run_dir, "buffer", LOG)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
