"""Decoupled jobs (sync.decoupled): the explorer and the trainer as two jobs, in two allocations
that scale and restart on their own, on one run.output_dir. They share two of its directories:

    <run>/buffer/     experience: the explorer job writes shard e at its step e + 1, the trainer job
                      trains it at its step e + 1 (ExperienceBuffer: atomic renames, no broker)
    <run>/weights/    the checkpoint engine's versions: the trainer job writes v<t> after its step t
                      (every sync.interval steps and the stage's last), keeping the newest two
    <run>/explorer/   the explorer job's own run directory (checkpoints, logs, metrics, TensorBoard)
    <run>/trainer/    the trainer job's

    explorer job (mode=explore)                       trainer job (mode=train)
      for each step:                                    for each step t:
        load the newest complete version of weights/      wait for shard t - 1 of every engine
        wait while its shard would be trained more         train on it
          than buffer.max_staleness steps after them       write v<t> to weights/ if the schedule says so
        generate the shard, unless it exists               checkpoint by its own schedule
      wait for the stage's last version; evaluate

Why either job can be killed and launched again, alone, without losing or repeating experience:
- The explorer resumes from its own checkpoint and runs the steps after it again. A step whose
  shard exists is not written again (the trainer may have trained it already), and the step's
  generation journal (rft/explorer/journal.py) gives back the samples the killed attempt drew,
  so its task order and data pipeline go on exactly as before.
- The trainer resumes from its own checkpoint at step d and returns to the pool the shards it
  took after it (ExperienceBuffer.reopen, rft/runtime/task.py), which it trains again from the same state: every
  shard is trained once in the run that goes on, and the weights it publishes again are the ones
  the explorer may already serve.
A job that waits for the other (no shard, no newer weights) gives up after buffer.wait_timeout_s
with a message naming the other job: it may still wait in Slurm's queue.
"""

from __future__ import annotations

import os
from dataclasses import replace

from omegaconf import DictConfig, OmegaConf, open_dict

from rft.config import RFTConfig

JOB_DIRS = {"explore": "explorer", "train": "trainer"}  # mode -> the job's own sub-directory
OTHER_JOB = {"explore": "the trainer job (mode=train)", "train": "the explorer job (mode=explore)"}


def split_run_dir(dcfg: DictConfig) -> None:
    """A decoupled job's paths, from the run.output_dir both jobs are given (in place, before the
    config resolves, so that paths built on run.output_dir, such as generated data, are the
    job's own): its files under <run>/<explorer|trainer>/, the shared buffer and weights beside."""
    given = OmegaConf.to_container(dcfg.run, resolve=False).get("output_dir")
    if "${now:" in str(given):
        raise ValueError(f"run.output_dir: {given} differs between launches, and sync.decoupled=true needs both jobs "
                         "on one directory: name it, e.g. run.output_dir=runs/my-run, in both commands")
    shared = os.path.abspath(dcfg.run.output_dir)
    with open_dict(dcfg):
        dcfg.run.output_dir = os.path.join(shared, JOB_DIRS[dcfg.mode])
        dcfg.buffer.path = dcfg.buffer.path or os.path.join(shared, "buffer")
        dcfg.sync.checkpoint_dir = dcfg.sync.checkpoint_dir or os.path.join(shared, "weights")


def explorer_producers(cfg: RFTConfig) -> list[int]:
    """The explorer job's engine leaders, which write its shards (its ranks count from 0)."""
    from rft.runtime.topology import Topology

    return Topology.of(replace(cfg, mode="explore")).engine_leaders
