"""A run's sharded checkpoint as an HF model directory, in one process.

    config   <- <run>/config.yaml (the run's own, as its ranks got it)
    model    <- a GPTModel at TP = PP = EP = 1, built like the trainer's
    weights  <- the checkpoint's layout-free shards (megatron-core's dist_checkpointing reshards
                whatever TP x PP x EP saved them), and a LoRA stage's adapters, merged
    out      -> safetensors in model.dtype + every file of the source model besides its weights

The same writer as the run's own exports (rft/weights/engines.py's CheckpointSender.write), so a
converted checkpoint and the run's export of the same step hold the same tensors.

Why not Megatron-Bridge's converters: they need a newer megatron-core than 0.16 (the newest for
Python 3.11), and rft's checkpoints carry rft's components (LoRA adapters beside the model).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from rft.config import RFTConfig, stage_configs
from rft.runtime.checkpoint import Resume, checkpoint_root, newest_complete, saved_layout, sharded_dir
from rft.runtime.state import SHARDED

CONVERTED = "v{step:06d}"  # under <run>/checkpoints/hf, beside trainer.save_hf's exports: mode=bench finds it


class ExportError(ValueError):
    """What the user must change; the CLI prints it without a traceback."""


@dataclass
class Checkpoint:
    """A run's checkpoint as rft.export reads it."""

    cfg: RFTConfig
    step: int
    step_dir: str
    stage: str  # the stage it was saved in
    stage_cfg: RFTConfig
    sharded: list[str]  # the components saved layout-free
    layout: dict[str, Any]  # what saved it: trainer_ranks, ...


def run_config(run_dir: str) -> RFTConfig:
    """The run's config as its ranks got it (<run>/config.yaml), typed."""
    from omegaconf import OmegaConf

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        raise ExportError(f"{run_dir} is not an rft run directory (no config.yaml): give the run.output_dir of a run")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RFTConfig), OmegaConf.load(path)))


def find_checkpoint(run_dir: str, step: int | None = None) -> Checkpoint:
    """Checkpoint `step` of the run (None: its newest complete one)."""
    cfg = run_config(run_dir)
    if step is None:
        resume = newest_complete(run_dir, [0])
        if resume is None:
            raise ExportError(f"{run_dir} has no complete checkpoint in {checkpoint_root(run_dir)}; a finished run's "
                              f"model is already an HF directory: {os.path.join(run_dir, 'model')}")
    else:
        step_dir = os.path.join(checkpoint_root(run_dir), f"step{step:08d}")
        if not os.path.isdir(step_dir):
            found = sorted(int(name[4:]) for name in os.listdir(checkpoint_root(run_dir))
                           if name.startswith("step") and name[4:].isdigit()) if os.path.isdir(checkpoint_root(run_dir)) else []
            raise ExportError(f"--step {step}: {run_dir} has no checkpoint of that step; it has {found or 'none'}")
        resume = Resume(step, step_dir)
    rank0 = resume.load(0)
    stage_index = rank0["progress"]["stage_index"]
    name, stage_cfg = stage_configs(cfg)[stage_index]
    return Checkpoint(cfg, resume.done, resume.step_dir, name, stage_cfg,
                      list(rank0.get(SHARDED, {}).get("components", [])), saved_layout(resume.step_dir) or {})


def _one_process_group() -> None:
    """A process group of this process alone: megatron-core's layers and gathers need one."""
    import torch.distributed as dist

    from rft.runtime.topology import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def load_checkpoint_model(ckpt: Checkpoint):
    """The checkpoint's policy in one process (TP = PP = EP = 1), a LoRA stage's adapters merged.
    Returns (model, geometry)."""
    from megatron.core import dist_checkpointing

    from rft.trainer.lora import LoRA
    from rft.trainer.model import build_gpt_model, init_model_parallel
    from rft.trainer.sharded_state import ShardedModel

    if "model" not in ckpt.sharded:
        raise ExportError(f"{ckpt.step_dir} holds the model in its rank files (a checkpoint of an rft from before "
                          "layout-free checkpoints): resume the run once and let it save, then export")
    _one_process_group()
    init_model_parallel(1, ckpt.cfg.seed)
    cfg = ckpt.cfg
    # the local layers whatever the run trained with: megatron-core gives Transformer Engine's and the
    # local spec's parameters the same checkpoint keys (a local norm is saved as the fused linear's
    # `layer_norm_weight`), so a checkpoint of GPU layers converts on a CPU node
    model, geo = build_gpt_model(cfg.model.path, cfg.model.dtype, transformer_impl="local")
    template = {"model": ShardedModel(model).checkpoint_shards("model.", loading=True)}
    lora = None
    lora_cfg = ckpt.stage_cfg.trainer.lora
    if lora_cfg.rank:
        if "lora" not in ckpt.sharded:
            raise ExportError(f"{ckpt.step_dir} was saved in LoRA stage {ckpt.stage} by an rft that kept adapters "
                              "per rank: export a checkpoint of another stage, or the stage's final model "
                              "(<run>/models/<stage>)")
        lora = LoRA(model, geo, lora_cfg.rank, lora_cfg.alpha, 0.0, lora_cfg.target_modules, cfg.seed)
        template["lora"] = lora.checkpoint_shards("lora.", loading=True)
    state = dist_checkpointing.load(template, sharded_dir(ckpt.step_dir))
    ShardedModel(model).load_state_dict(state["model"])
    if lora is not None:
        lora.load_state_dict(state["lora"])
        lora.merge()
    return model, geo


def export_checkpoint(run_dir: str, step: int | None = None, out: str | None = None, say=print) -> str:
    """Write checkpoint `step` of the run (None: the newest) as an HF model directory; returns it."""
    from rft.trainer.hf_weights import export_hf_weights, hf_table
    from rft.weights.engines import INDEX, CheckpointSender, SyncLayout

    started = time.time()
    ckpt = find_checkpoint(run_dir, step)
    out = os.path.abspath(out or os.path.join(checkpoint_root(run_dir), "hf", CONVERTED.format(step=ckpt.step)))
    if os.path.exists(os.path.join(out, INDEX)):
        raise ExportError(f"{out} holds an HF model already: remove it, or give another --out")
    saved = ", ".join(f"{k}={v}" for k, v in ckpt.layout.items() if k == "trainer_ranks")
    say(f"rft.export: checkpoint step {ckpt.step} (stage {ckpt.stage}{'; ' + saved if saved else ''}) of {run_dir}")
    model, geo = load_checkpoint_model(ckpt)
    say(f"rft.export: loaded in {time.time() - started:.1f}s; writing {ckpt.cfg.model.dtype} safetensors")
    layout = SyncLayout(engine="checkpoint", host="", port=0, sender_ranks=[0], receiver_names=[], timeout_s=0.0,
                        bucket_bytes=ckpt.cfg.sync.bucket_mb << 20, checkpoint_dir=os.path.dirname(out))
    writer = CheckpointSender(layout, 0, ckpt.cfg.model.path, keep_versions=None)
    written = writer.write(out, hf_table(model, geo, getattr(torch, ckpt.cfg.model.dtype)), export_hf_weights(model, geo),
                           ckpt.step)
    say(f"rft.export: {out} ({written / 2**20:,.1f} MiB of weights, {time.time() - started:.1f}s)")
    return out
