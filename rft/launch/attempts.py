"""What a launch does with an earlier attempt in its run directory (rft/runtime/run_dir.py): resume
from its newest complete checkpoint, in the layout it was saved from, or start over with the
earlier files set aside."""

from __future__ import annotations

import contextlib
import os

from omegaconf import OmegaConf

from rft.config import RFTConfig, config_error


def saving_ranks(cfg: RFTConfig) -> list[int]:
    """The ranks whose files make a checkpoint complete, in the ranks this mode starts (rft/runtime/task.py)."""
    from rft.runtime.topology import Topology

    return Topology.of(cfg).voting_ranks


def start_or_resume(cfg: RFTConfig) -> str | None:
    """What this launch does with an earlier attempt in run.output_dir (rft/runtime/run_dir.py):
    resume from its newest complete checkpoint, or start over with its files moved to
    <run>/attempts/<n>. Raises ValueError (a finished run with `run.resume=auto`, or
    `run.resume=require` and nothing to resume). Returns the plan's line about it, or None for a fresh directory."""
    from rft.runtime.checkpoint import newest_complete
    from rft.runtime.run_dir import finished, has_earlier_attempt, next_attempt_dir, set_aside_attempt

    run_dir, policy = cfg.run.output_dir, cfg.run.resume
    if not has_earlier_attempt(run_dir):
        return None
    resume = newest_complete(run_dir, saving_ranks(cfg))
    if policy == "auto" and finished(run_dir):
        config_error("run.output_dir", run_dir,
                     f"holds a finished run (summary.json); launch into a new run.output_dir, start it over with "
                     f"run.resume=never (the finished run is kept in {next_attempt_dir(run_dir)}), or train its "
                     "last steps again from its newest checkpoint with run.resume=require")
    if policy != "never" and resume is not None:
        refuse_another_layout(cfg, next_attempt_dir(run_dir))
        return f"resume from {resume.step_dir} ({resume.done} steps done)"
    if policy == "require":
        config_error("run.resume", policy,
                     f"{run_dir} holds an earlier attempt but no complete checkpoint to resume from; "
                     f"run.resume=auto starts it over (the earlier attempt kept in {next_attempt_dir(run_dir)}), "
                     "or launch into a new run.output_dir")
    why = "run.resume=never" if policy == "never" else "no complete checkpoint to resume from"
    return f"start over ({why}); the earlier attempt's files are in {set_aside_attempt(run_dir)}"


# what the trainer's checkpoint files are laid out by (rft/runtime/checkpoint.py: one file per rank, Megatron
# shards under their parameter names, LoRA adapters of the stage's rank): a resume keeps each
CHECKPOINT_LAYOUT = ("cluster.trainer_ranks", "trainer.tensor_parallel_size", "trainer.pipeline_parallel_size",
                     "trainer.virtual_pipeline_stages", "trainer.transformer_impl")


def refuse_another_layout(cfg: RFTConfig, attempt_dir: str) -> None:
    """A relaunch that would resume a checkpoint into another layout is refused here, naming the
    key, instead of failing in every rank's load_state_dict. Compares with the config the earlier
    launch saved (<run>/config.yaml); what that config lacks (an older rft) is not compared."""
    from rft.config import stage_configs

    path = os.path.join(cfg.run.output_dir, "config.yaml")
    if not os.path.exists(path):
        return
    saved, now = OmegaConf.load(path), OmegaConf.structured(cfg)
    changed = [(key, OmegaConf.select(saved, key), OmegaConf.select(now, key)) for key in CHECKPOINT_LAYOUT]
    with contextlib.suppress(Exception):  # a config an older rft saved may not fit today's schema
        earlier = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RFTConfig), saved))
        ranks = {name: stage.trainer.lora.rank for name, stage in stage_configs(earlier)}
        changed += [(f"stages[{name}].trainer.lora.rank", ranks.get(name), stage.trainer.lora.rank)
                    for name, stage in stage_configs(cfg)]
    for key, before, after in changed:
        if before is not None and before != after:
            config_error(key, after, f"the checkpoint in run.output_dir={cfg.run.output_dir} was saved with "
                         f"{key}={before}, and a checkpoint resumes only into the layout it was saved from: "
                         f"launch with {key}={before}, start over with run.resume=never (the earlier attempt "
                         f"kept in {attempt_dir}), or launch into a new run.output_dir")
