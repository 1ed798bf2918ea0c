"""TensorBoard scalars, the progress file the launcher renders, and the end-of-run summary.

Ranks never print progress themselves (their stdout goes to per-rank log files); they write small
JSON files atomically into the run directory and the launcher turns them into a live progress bar
and the summary table.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def peak_rss_gb() -> float:
    """This process's peak resident memory in GiB (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def write_json_atomic(path: str, payload: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def append_jsonl(path: str, payload: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(payload) + "\n")


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
    """Per-rank scalar logger: TensorBoard events plus a jsonl copy the launcher and tools read.

    Each rank writes its own TensorBoard run (`tensorboard/<rank name>/`): TensorBoard reads one
    writer per directory reliably, and a resumed rank's `purge_step` hides only its own events
    from steps the previous attempt logged after its checkpoint.
    """

    def __init__(self, run_dir: str, rank_name: str, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = run_dir
        self.metrics_dir = os.path.join(run_dir, "metrics")
        os.makedirs(self.metrics_dir, exist_ok=True)
        self.jsonl = os.path.join(self.metrics_dir, f"{rank_name}.jsonl")
        if resume_step is not None:
            drop_from_step(self.jsonl, resume_step)
        # flushed by its own thread every few seconds: no file I/O on the step's critical path
        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard", rank_name), flush_secs=5,
                                    purge_step=resume_step)
        self.rank_name, self.resumed, self.optim_writer = rank_name, resume_step is not None, None

    def log_optimizer_steps(self, first: int, steps: list[dict[str, float]]) -> None:
        """Each optimizer step's scalars (PPO epochs and mini-batches give several per trainer step)
        in TensorBoard run `<rank name>_optim/`, whose x axis counts optimizer steps from 1; the
        trainer steps' own scalars (their means) stay in the rank's run."""
        from torch.utils.tensorboard import SummaryWriter

        if self.optim_writer is None:  # a resumed run hides what the last attempt logged after `first`
            self.optim_writer = SummaryWriter(os.path.join(self.run_dir, "tensorboard", f"{self.rank_name}_optim"),
                                              flush_secs=5, purge_step=first if self.resumed else None)
        for n, scalars in enumerate(steps):
            for key, value in scalars.items():
                self.optim_writer.add_scalar(f"optim/{key}", float(value), global_step=first + n)

    def log(self, step: int, scalars: dict[str, float], stage: str) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, float(value), global_step=step)
        append_jsonl(self.jsonl, {"step": step, "stage": stage, "time": time.time(), **scalars})

    def close(self) -> None:
        self.writer.close()
        if self.optim_writer is not None:
            self.optim_writer.close()


def progress_path(run_dir: str) -> str:
    return os.path.join(run_dir, "progress.json")


def eval_path(run_dir: str) -> str:
    return os.path.join(run_dir, "metrics", "eval.jsonl")


def rank_summary_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "metrics", f"summary-rank{rank}.json")
