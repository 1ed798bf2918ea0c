"""TensorBoard event files: `tensorboard/<rank>/` per rank, `tensorboard/<rank>_optim/` for each
optimizer step (PPO epochs and mini-batches give several per trainer step)."""

from __future__ import annotations

import os
from typing import Any

from rft.runtime.trackers import TRACKERS, TrackedRun


@TRACKERS.register("tensorboard")
class TensorBoardTracker:
    """Each rank writes its own TensorBoard run: TensorBoard reads one writer per directory
    reliably, and a resumed rank's `purge_step` hides only its own events from the steps the
    previous attempt logged after its checkpoint."""

    def __init__(self, cfg: Any, run: TrackedRun):
        from torch.utils.tensorboard import SummaryWriter

        self.run, self.optim_writer = run, None
        # flushed by its own thread every few seconds: no file I/O on the step's critical path
        self.writer = SummaryWriter(os.path.join(run.run_dir, "tensorboard", run.rank_name), flush_secs=5,
                                    purge_step=run.resume_step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)

    def log_optimizer_steps(self, first: int, steps: list[dict[str, float]]) -> None:
        """Run `<rank>_optim/`, whose x axis counts optimizer steps from 1; the trainer steps' own
        scalars (their means) stay in the rank's run."""
        from torch.utils.tensorboard import SummaryWriter

        if self.optim_writer is None:  # a resumed run hides what the last attempt logged after `first`
            self.optim_writer = SummaryWriter(os.path.join(self.run.run_dir, "tensorboard", f"{self.run.rank_name}_optim"),
                                              flush_secs=5, purge_step=first if self.run.resume_step is not None else None)
        for n, scalars in enumerate(steps):
            for key, value in scalars.items():
                self.optim_writer.add_scalar(f"optim/{key}", float(value), global_step=first + n)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        if self.optim_writer is not None:
            self.optim_writer.close()
