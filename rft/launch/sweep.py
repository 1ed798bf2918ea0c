"""`python -m rft.launch -m ... a=1,2`: a Hydra sweep. Locally the runs go one after another; on
Slurm every run is composed and checked first, then all are submitted as ONE job array (one array
task per run, each with the same nodes x tasks layout) through the same submitit executor as a
single run.

Hydra's basic launcher calls `rft.launch.main` once per run (same process); `main` queues Slurm
runs here and `SweepCallback.on_multirun_end` submits the queue. Why not hydra-submitit-launcher:
it runs the Hydra task function inside every Slurm task, so each task would re-compose the config,
and it cannot start ranks through launch/rank.sh (the container entry); this keeps one submit path.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from rft.config import RFTConfig, config_error
from rft.runtime.run_dir import Owner

# Slurm runs composed, checked and owning their run directories (with what each does to an earlier
# attempt there), waiting for the array submit
QUEUED: list[tuple[RFTConfig, Owner, str | None]] = []
EXIT_CODES: list[int] = []  # local runs' exit codes, for the sweep's own exit status


def check_one_array(runs: list[RFTConfig]) -> None:
    """Runs of one array share the job shape; each has its own output dir."""
    first = OmegaConf.to_container(OmegaConf.structured(runs[0].cluster))
    for i, run in enumerate(runs[1:], start=1):
        other = OmegaConf.to_container(OmegaConf.structured(run.cluster))
        for key in first:
            if first[key] != other[key]:
                config_error(f"cluster.{key}", other[key],
                             f"sweep run {i} differs from run 0 ({first[key]!r}); one Slurm array has one "
                             "job shape: sweep cluster keys in separate launches")
    seen: dict[str, int] = {}
    for i, run in enumerate(runs):
        if run.run.output_dir in seen:
            config_error("run.output_dir", run.run.output_dir,
                         f"sweep runs {seen[run.run.output_dir]} and {i} would share it; leave it unset in "
                         "sweeps (each run gets <sweep dir>/<n>) or make it name the swept key, e.g. "
                         "run.output_dir=out/seed${seed}")
        seen[run.run.output_dir] = i


def leave_finished(cfg: RFTConfig, number: int) -> bool:
    """A sweep launched again (the same command, the same sweep dir) resumes its unfinished runs and
    leaves its finished ones as they are, saying so; True for a finished run. (A single launch into a
    finished run is refused instead, rft/launch/attempts.py: there it is more likely a mistake.)
    `run.resume=never` starts every run over, `require` trains a finished run's last steps again."""
    from rft.runtime.run_dir import finished

    if cfg.run.resume != "auto" or not finished(cfg.run.output_dir):
        return False
    print(f"rft: sweep run {number} -> {cfg.run.output_dir}: finished (its summary.json), left as it is")
    return True


class SweepCallback(Callback):
    """Submits the queued Slurm runs as one array when Hydra's sweep ends; sets the exit status."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from rft.launch.submit import submit_array
        from rft.runtime.run_dir import release

        code = max(EXIT_CODES, default=0)
        if QUEUED:
            runs = list(QUEUED)
            QUEUED.clear()
            try:
                check_one_array([cfg for cfg, _, _ in runs])
            except ValueError as err:
                for cfg, owner, _ in runs:
                    release(cfg.run.output_dir, owner)
                print(f"rft: config error: {err}", file=sys.stderr)
                sys.exit(2)
            code = max(code, submit_array(runs, os.path.abspath(config.hydra.sweep.dir)))
        sys.exit(code)
