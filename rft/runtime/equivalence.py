"""Whether two runs ended alike, bit for bit: a run that was interrupted and resumed (or hit by
faults, tools/chaos.py) against the uninterrupted run with the same config. They must log the same
metrics at every step and hold the same state in their final checkpoint. Only what depends on the
clock may differ, how far behind the explorer's weights were when a step was trained (a
restarted explorer starts in step), and what a weight sync moved (a restarted explorer is sent
weights an uninterrupted one already held)."""

from __future__ import annotations

import json
import os
from typing import Any

from rft.runtime.checkpoint import whole_shards
from rft.runtime.state import SHARDED

# what depends on the clock, and on restarts: a restarted explorer starts in step (policy/version_lag),
# is sent the weights an uninterrupted one already held (sync/: unchanged weights travel there,
# rft/trainer/trainer.py) and takes back what the lost attempt sampled (rollout/replayed_samples)
CLOCK_KEYS = ("time", "timing/", "perf/", "policy/version_lag", "sync/", "rollout/replayed_samples",
              "rollout/resumed_samples")
# the final checkpoint's state that must match: a trainer's and an explorer's (rft/runtime/state.py)
TRAINER_STATE = ("model", "optimizer", "scheduler", "rng", "publisher")
EXPLORER_STATE = ("version", "cursor")


def step_metrics(run_dir: str, name: str) -> dict[int, dict]:
    """metrics/<name>.jsonl by step, without what depends on the clock."""
    rows = {}
    with open(os.path.join(run_dir, "metrics", f"{name}.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows[row["step"]] = {k: v for k, v in row.items() if not k.startswith(CLOCK_KEYS)}
    return rows


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two checkpoint states differ, bit for bit (tensors with torch.equal)."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and torch.equal(a, b) else [path]
    if isinstance(a, np.ndarray):
        return [] if isinstance(b, np.ndarray) and np.array_equal(a, b) else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{path} (keys)"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{path} (length)"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def run_differences(reference: str, other: str, done: int, states: dict[int, tuple[str, ...]],
                    logs: tuple[str, ...]) -> list[str]:
    """How `other` ended unlike `reference` (empty: alike): the metrics of every step in `logs`
    (e.g. "trainer0", "rollout1", "eval"), and for each rank in `states` those entries of its
    checkpoint of `done` steps."""
    import torch

    found = []
    for name in logs:
        want, got = step_metrics(reference, name), step_metrics(other, name)
        if sorted(got) != sorted(want):
            found.append(f"{name}: steps {sorted(set(got) ^ set(want))} logged by one run only")
        found += [f"{name} step {s} {k}: {v} != {got[s].get(k)}" for s in want if s in got
                  for k, v in want[s].items() if got[s].get(k) != v]
    step_dirs = [os.path.join(run, "checkpoints", f"step{done:08d}") for run in (reference, other)]
    sharded: set[str] = set()  # the trainer ranks' tensors: one set for all of them, compared once below
    for rank, keys in states.items():
        want, got = (torch.load(os.path.join(d, f"rank{rank}.pt"), weights_only=False) for d in step_dirs)
        found += [f"rank {rank}'s final {d}" for key in keys if key in want
                  for d in differences(want[key], got[key], key)]
        in_shards = {key for key in keys if key in want.get(SHARDED, {}).get("components", ())}
        missing = [key for key in keys if key not in want and key not in in_shards]
        found += [f"rank {rank}'s final {key} (not in its checkpoint)" for key in missing]
        sharded |= in_shards
    if sharded:  # compared whole
        want_shards, got_shards = (whole_shards(d) for d in step_dirs)
        found += [f"final {d}" for key in sorted(sharded)
                  for d in differences(want_shards.get(key), got_shards.get(key), key)]
    return found
