"""The step schedule the trainer and the explorer both follow: when weights move, when they vote.

Steps are counted per stage (`t` for the trainer, `e` for the explorer, 0-based). In a rollout
stage with `sync.offset = k` and `sync.interval = N`:

    explorer step e:  generate + write shard e (weights of the last sync it received)
                      then, for each trainer step t paired with e (below):
                          vote at the control point of trainer step t   (rft/runtime/preemption.py)
                          receive the weights the trainer published after step t, if it did
    trainer step t:   train on shard t, vote, publish after t if `publishes_after(t)`

The explorer's step e pairs with trainer step e - k, so it generates shard e + 1 while the trainer
trains on shard e + 1 - k: k = 0 is synchronous (the roles take turns), k = 1 is one-step-off
pipelining (both busy at once). The trainer publishes every N steps, so shard e carries the
weights of trainer step (last published t <= e - 1 - k); its staleness when trained (trainer steps
since those weights) is at most k + N - 1. The explorer's last step pairs with every trainer step
left, so each trainer vote meets exactly one explorer vote. Publishes whose weights the explorer
would never generate with (t + k >= S - 1, before the last) are skipped; the stage's last one
always goes (the stage-end eval and the next stage use it).

Dataset stages (SFT, DPO) have no offset or interval: weights move only where the explorer
evaluates and at the stage end.
"""

from __future__ import annotations

from rft.config import RFTConfig, needs_rollouts


def is_eval_step(cfg: RFTConfig, global_step: int, step: int, max_steps: int) -> bool:
    """Interval evals after global step `global_step` (the stage-end eval is separate)."""
    interval = cfg.monitor.eval_interval
    return bool(interval) and global_step % interval == 0 and step + 1 < max_steps


def free_running(cfg: RFTConfig, stage: RFTConfig) -> bool:
    """Whether the explorer runs free of the trainer's steps in this stage (rft/runtime/free_run.py)."""
    return cfg.sync.free_run and cfg.mode == "both" and needs_rollouts(stage)


def stage_offset(cfg: RFTConfig, stage: RFTConfig) -> int:
    """How many steps the explorer runs ahead in this stage (0 outside rollout stages)."""
    return cfg.sync.offset if needs_rollouts(stage) else 0


def publishes_after(cfg: RFTConfig, stage: RFTConfig, stage_start: int, t: int, resumed: bool = False) -> bool:
    """Whether the trainer sends its weights after its stage step `t` (`stage_start`: global
    steps done before the stage). `resumed`: `t` is the step a restarted job resumes at; a
    restarted explorer holds the initial weights, so it always gets the trainer's."""
    if cfg.mode == "explore" or (cfg.mode == "train" and not cfg.sync.decoupled):  # no weights move
        return False  # (a decoupled explorer loads what the trainer job writes: rft/runtime/decoupled.py)
    steps = stage.trainer.max_steps
    if t + 1 == steps or resumed:
        return True
    if not needs_rollouts(stage):
        return is_eval_step(cfg, stage_start + t + 1, t, steps)
    return (t + 1) % cfg.sync.interval == 0 and t + stage_offset(cfg, stage) < steps - 1


def paired_trainer_steps(cfg: RFTConfig, stage: RFTConfig, e: int) -> list[int]:
    """The trainer steps whose control points (and publishes) the explorer meets after its step `e`."""
    steps, k = stage.trainer.max_steps, stage_offset(cfg, stage)
    if e + 1 < steps:
        return [e - k] if e >= k else []
    return list(range(max(0, steps - 1 - k), steps))


def max_lag(cfg: RFTConfig) -> int:
    """The most trainer steps a shard's weights can be behind when it is trained (rollout stages)."""
    return cfg.sync.offset + cfg.sync.interval - 1
