"""What a launch does with an earlier attempt in its run directory (rft/runtime/run_dir.py): resume
from its newest complete checkpoint, in the layout it was saved from, or start over with the
earlier files set aside."""

from __future__ import annotations

import contextlib
import os

from omegaconf import OmegaConf

from rft.config import RFTConfig, config_error
from rft.runtime.checkpoint import Resume


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
        refuse_another_layout(cfg, next_attempt_dir(run_dir), resume)
        return f"resume from {resume.step_dir} ({resume.done} steps done)"
    if policy == "require":
        config_error("run.resume", policy,
                     f"{run_dir} holds an earlier attempt but no complete checkpoint to resume from; "
                     f"run.resume=auto starts it over (the earlier attempt kept in {next_attempt_dir(run_dir)}), "
                     "or launch into a new run.output_dir")
    why = "run.resume=never" if policy == "never" else "no complete checkpoint to resume from"
    return f"start over ({why}); the earlier attempt's files are in {set_aside_attempt(run_dir)}"


# the layout a checkpoint's trainer tensors reshard across (rft/trainer/sharded_state.py), when
# every tensor component was saved sharded and no rank changes place (reshard_refusal)
RESHARDABLE = ("cluster.trainer_ranks", "trainer.tensor_parallel_size", "trainer.pipeline_parallel_size",
               "trainer.virtual_pipeline_stages", "trainer.expert_parallel_size")
# what a resume keeps whatever the checkpoint holds: Transformer Engine's layers name their norms
# otherwise, and LoRA adapters are saved per rank in their stage's rank
CHECKPOINT_LAYOUT = ("trainer.transformer_impl",)
# checkpoint components holding tensors of one TP x PP shard, when not saved sharded
PER_RANK_TENSORS = {"model": "the model (a checkpoint from before sharded saves)",
                    "optimizer": "a LoRA stage's optimizer",
                    "lora": "LoRA adapters", "critic": "the PPO critic", "ref_model": "the reference model"}


def refuse_another_layout(cfg: RFTConfig, attempt_dir: str, resume: Resume | None = None) -> None:
    """A relaunch that would resume a checkpoint into a layout it cannot load is refused here,
    naming the key, instead of failing in every rank. Compares with the config the earlier launch
    saved (<run>/config.yaml); what that config lacks (an older rft) is not compared. A change of
    RESHARDABLE keys passes when the checkpoint (`resume`) holds its trainer tensors sharded."""
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
    resharded = [(key, OmegaConf.select(saved, key), OmegaConf.select(now, key)) for key in RESHARDABLE]
    resharded = [(key, before, after) for key, before, after in resharded if before is not None and before != after]
    why = reshard_refusal(cfg, resume, [key for key, _, _ in resharded]) if resharded else None
    for key, before, after in changed + (resharded if why else []):
        if before is not None and before != after:
            config_error(key, after, f"the checkpoint in run.output_dir={cfg.run.output_dir} was saved with "
                         f"{key}={before}, and {why or 'a checkpoint resumes only into the layout it was saved from'}: "
                         f"launch with {key}={before}, start over with run.resume=never (the earlier attempt "
                         f"kept in {attempt_dir}), or launch into a new run.output_dir")


def reshard_refusal(cfg: RFTConfig, resume: Resume | None, keys: list[str]) -> str | None:
    """Why the checkpoint cannot load into the new trainer layout, or None when it can: it holds
    per-rank tensors, or rollout ranks would take other global ranks (their files and experience
    shards are named by those)."""
    if cfg.mode not in ("both", "train"):
        return None  # no trainer ranks: nothing of theirs to load
    if "cluster.trainer_ranks" in keys and cfg.mode != "train":
        return ("a run with rollout ranks keeps its number of trainer ranks (the rollout ranks' checkpoint files "
                "and experience shards are named by their global ranks); TP, PP and virtual stages may change "
                "within them")
    if resume is None:
        return None
    held = resume.load(0)  # trainer rank 0's file: which components it saved whole
    plain = [what for name, what in PER_RANK_TENSORS.items() if held.get(name) is not None]
    return f"it holds {plain[0]} per rank, which loads only into the same layout" if plain else None
