"""Run checkpoints: every rank writes its own state file for the same step; a checkpoint is
complete when all ranks' files exist. A (re)started job resumes from the newest complete one.

    <run>/checkpoints/step00000123/rank0.pt ... rank<W-1>.pt   (trainer ranks, engine leaders)
    <run>/checkpoints/requeues.json                            (how often the job requeued itself)

`step00000123` means 123 steps are done and the weight sync of the 123rd is still to come: ranks
save after agreeing at a step's control point, before that step's sync (rft/preemption.py), so a
resumed job starts with that sync. Trainer files hold the Megatron shard, optimizer, scheduler,
RNG, taskset cursor and the step's pending log line; rollout files hold the step, the rollout
taskset cursor and its weights version. Why per-rank torch.save rather than Megatron's
dist_checkpointing: a resume always uses the same TP x PP layout (a requeue re-runs the same job),
and this needs no extra dependency on CPU; resharding checkpoints would want dist_checkpointing.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_STEP_DIR = re.compile(r"^step(\d{8,})$")


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _rank_file(step_dir: str, rank: int) -> str:
    return os.path.join(step_dir, f"rank{rank}.pt")


def save_rank_state(run_dir: str, done: int, rank: int, state: dict[str, Any]) -> str:
    """Write this rank's state for `done` completed steps atomically (temp file + rename)."""
    step_dir = os.path.join(checkpoint_root(run_dir), f"step{done:08d}")
    os.makedirs(step_dir, exist_ok=True)
    final = _rank_file(step_dir, rank)
    tmp = f"{final}.tmp{os.getpid()}"
    torch.save(state, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def _step_dirs(run_dir: str) -> list[tuple[int, str]]:
    root = checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root)
             if (m := _STEP_DIR.match(name))]
    return sorted(found)


def _stand_ins(step_dir: str) -> dict[int, int]:
    """Ranks lost before this checkpoint (rollout.on_engine_failure=continue) -> the engine whose
    state a restarted one takes (engines' states differ only in their own totals)."""
    try:
        with open(os.path.join(step_dir, "stand_ins.json")) as f:
            return {int(k): v for k, v in json.load(f).items()}
    except FileNotFoundError:
        return {}


def record_stand_ins(run_dir: str, done: int, stand_ins: dict[int, int]) -> None:
    """Rank 0, once the present ranks saved at `done`: the lost ones count as saved by stand-ins."""
    from rft.monitor import write_json_atomic

    write_json_atomic(os.path.join(checkpoint_root(run_dir), f"step{done:08d}", "stand_ins.json"), stand_ins)


def _complete(step_dir: str, ranks: Sequence[int]) -> bool:
    stand_ins = _stand_ins(step_dir)
    return all(os.path.exists(_rank_file(step_dir, stand_ins.get(r, r))) for r in ranks)


@dataclass(frozen=True)
class Resume:
    """Where a restarted job picks up: `done` steps complete, their files in `step_dir`."""

    done: int
    step_dir: str

    def load(self, rank: int) -> dict[str, Any]:
        own = _rank_file(self.step_dir, rank)
        if not os.path.exists(own):  # lost before this checkpoint: restart as the engine standing in
            own = _rank_file(self.step_dir, _stand_ins(self.step_dir).get(rank, rank))
        return torch.load(own, weights_only=False)


def newest_complete(run_dir: str, ranks: Sequence[int]) -> Resume | None:
    """The newest checkpoint every saving rank (rft.cluster.voting_ranks) finished writing (a
    crash mid-save leaves an incomplete one, which is skipped)."""
    for done, step_dir in reversed(_step_dirs(run_dir)):
        if _complete(step_dir, ranks):
            return Resume(done, step_dir)
    return None


def prune(run_dir: str, ranks: Sequence[int], keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (and incomplete ones older than them)."""
    complete = [(d, p) for d, p in _step_dirs(run_dir) if _complete(p, ranks)]
    if len(complete) <= keep:
        return
    oldest_kept = complete[-keep][0]
    for done, path in _step_dirs(run_dir):
        if done < oldest_kept:
            shutil.rmtree(path, ignore_errors=True)


def seed_all(seed: int) -> None:
    """Seed every global RNG a rank's state holds (`rng_state`): Python's `random` and NumPy's
    global generator included, which a user's reward or workflow may draw from; unseeded, each
    launch started them from the OS, and a run and its resumed twin held different states."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["megatron_cuda"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_cuda"])


class SaveClock:
    """`trainer.save_every_min`: a checkpoint is due when this many minutes passed since the last
    one (or the start). Each rank keeps its own clock and votes at the step's control point; the
    vote's OR makes every rank save at the same step (rft/preemption.py)."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60.0
        self.last = time.monotonic()

    def due(self) -> bool:
        return self.seconds > 0 and time.monotonic() - self.last >= self.seconds

    def saved(self) -> None:
        self.last = time.monotonic()


def _requeues_path(run_dir: str) -> str:
    return os.path.join(checkpoint_root(run_dir), "requeues.json")


def requeue_count(run_dir: str) -> int:
    try:
        with open(_requeues_path(run_dir)) as f:
            return int(json.load(f)["requeues"])
    except FileNotFoundError:
        return 0


def record_requeue(run_dir: str, done: int) -> int:
    """Count one more requeue (written before asking Slurm, so a crash cannot undercount)."""
    from rft.monitor import write_json_atomic

    count = requeue_count(run_dir) + 1
    os.makedirs(checkpoint_root(run_dir), exist_ok=True)
    write_json_atomic(_requeues_path(run_dir), {"requeues": count, "last_at_step": done})
    return count
