"""Weights & Biases: each logging rank is a run of project `monitor.wandb.project`, named
`<group>/<rank>`, in W&B group `monitor.group` (the run, or the sweep), job type `trainer` or
`rollout`, with the resolved config as its config.

`monitor.wandb.mode=offline` (the default: compute nodes often have no internet) writes
`<run dir>/wandb/offline-run-*` for `wandb sync` to upload later; `online` streams. A resumed rank
reuses its run id (in `metrics/<rank>.trackers.json`), so `wandb sync` of every attempt's folder
fills one run, each step once: offline, it skips the steps the earlier attempts' files hold, and
first logs again, from the jsonl, the steps before its checkpoint that a killed attempt had not
written out.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from rft.runtime.trackers import TRACKERS, TrackedRun


@TRACKERS.register("wandb")
class WandbTracker:
    def __init__(self, cfg: Any, run: TrackedRun):
        import wandb
        from omegaconf import OmegaConf

        conf = cfg.monitor.wandb
        run_id = run.saved_id("wandb")
        if run_id is None:
            run_id = secrets.token_hex(4)  # W&B's own ids are 8 characters of [0-9a-z] too
            run.save_id("wandb", run_id)
        # a resumed offline run goes on after the last step its earlier attempts' files hold (a run
        # killed -9 may hold fewer steps than its jsonl); online, W&B's server itself drops steps at
        # or below its last one
        self.logged_through, backfill = -1, []
        if run.resume_step is not None and conf.mode == "offline":
            from rft.runtime.trackers.wandb_files import history

            self.logged_through = max((row["_step"] for row in history(run.run_dir, run_id)), default=-1)
            # W&B's service writes its files behind the run: a rank killed -9 loses the steps it had
            # not written yet, also from before the checkpoint, which the resumed rank never logs
            # again. The jsonl has them (its steps from the checkpoint on are already dropped).
            backfill = [(step, scalars) for step, scalars in run.logged_steps() if step > self.logged_through]
        self.run = wandb.init(
            project=conf.project, entity=conf.entity, dir=run.run_dir, id=run_id, name=run.name, group=run.group,
            job_type=re.sub(r"\d+$", "", run.rank_name), tags=list(conf.tags), resume="allow", mode=conf.mode,
            config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True), reinit="create_new",
            # the rank's stdout is its log file, not W&B's; its CPU sampling would cost the rank cycles
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, init_timeout=60))
        for step, scalars in backfill:
            self.log(step, scalars)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if step > self.logged_through:
            self.run.log(scalars, step=step)

    def flush(self) -> None:
        """Nothing to do: `log` hands each step to W&B's own service process, which writes it out
        even if this rank is killed."""

    def close(self) -> None:
        self.run.finish()
