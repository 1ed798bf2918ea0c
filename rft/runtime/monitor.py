"""Scalars (metrics/<rank>.jsonl and the trackers), the progress file the launcher renders, and the end-of-run summary.

Ranks never print progress themselves (their stdout goes to per-rank log files); they write small
JSON files atomically into the run directory and the launcher turns them into a live progress bar
and the summary table.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from rft.runtime.storage import append_jsonl, read_jsonl


def peak_rss_gb() -> float:
    """This process's peak resident memory in GiB (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def write_json_atomic(path: str, payload: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def drop_from_step(path: str, step: int) -> None:
    """Rewrite a jsonl log without entries at `step` or later (a resumed run logs them again)."""
    rows = read_jsonl(path)
    kept = [r for r in rows if r.get("step", 0) < step]
    if len(kept) == len(rows):
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)


class Monitor:
    """Per-rank scalar logger: the jsonl copy the launcher, the plots and tools read (the source
    of truth), plus the trackers of `monitor.loggers` (TensorBoard by default, W&B, MLflow:
    rft/runtime/trackers/)."""

    def __init__(self, cfg: Any, rank_name: str, resume_step: int | None = None):
        from rft.runtime.trackers import TrackedRun, Trackers

        run_dir = cfg.run.output_dir
        self.jsonl = os.path.join(run_dir, "metrics", f"{rank_name}.jsonl")
        os.makedirs(os.path.dirname(self.jsonl), exist_ok=True)
        if resume_step is not None:  # the steps from the checkpoint on are logged again
            drop_from_step(self.jsonl, resume_step)
        group = cfg.monitor.group or os.path.basename(os.path.normpath(run_dir))
        self.trackers = Trackers(cfg, TrackedRun(run_dir, rank_name, group, resume_step))

    def log_optimizer_steps(self, first: int, steps: list[dict[str, float]]) -> None:
        """Each optimizer step's scalars, where a tracker shows them on their own axis (TensorBoard's
        `<rank>_optim` run)."""
        tensorboard = self.trackers.get("tensorboard")
        if tensorboard is not None:
            tensorboard.log_optimizer_steps(first, steps)

    def log(self, step: int, scalars: dict[str, float], stage: str) -> None:
        values = {key: float(value) for key, value in scalars.items()}
        self.trackers.call("log", step, values)
        append_jsonl(self.jsonl, {"step": step, "stage": stage, "time": time.time(), **values})

    def flush(self) -> None:
        """Before a checkpoint: what was logged up to it is durable in every tracker."""
        self.trackers.call("flush")

    def close(self) -> None:
        """At the rank's end, or when it stops for a requeue (then again at its finish: a no-op)."""
        self.trackers.call("close")
        self.trackers.active.clear()


def progress_path(run_dir: str) -> str:
    return os.path.join(run_dir, "progress.json")


def eval_path(run_dir: str) -> str:
    return os.path.join(run_dir, "metrics", "eval.jsonl")


def rank_summary_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "metrics", f"summary-rank{rank}.json")
