"""What follows from a composed config: each stage's full config, the job's size, what a stage
needs (rollouts, a critic), the weight-sync engine and dtype, vLLM's LoRA rank."""

from __future__ import annotations

import copy
import os
from dataclasses import replace

from omegaconf import OmegaConf

from rft.config.cluster import SyncConfig
from rft.config.model import ModelConfig
from rft.config.run import RFTConfig


# stage_configs' results by the config they came from (its repr: the dataclass tree, field by field).
# The launcher's checks and plan resolve the stages six times; through OmegaConf's typed merges that
# was about 1.5 s of its start on 2 cores (measured).
_RESOLVED: dict[str, list[tuple[str, RFTConfig]]] = {}


def stage_configs(cfg: RFTConfig) -> list[tuple[str, RFTConfig]]:
    """Resolve `stages:` into one full config per stage; overrides go through the typed schema."""
    if not cfg.stages:
        return [("main", cfg)]
    key = repr(cfg)
    if key not in _RESOLVED:
        _RESOLVED.clear()  # one config at a time is resolved again and again; keep no others
        _RESOLVED[key] = _resolve_stages(cfg)
    return copy.deepcopy(_RESOLVED[key])  # callers may change what they get


def _resolve_stages(cfg: RFTConfig) -> list[tuple[str, RFTConfig]]:
    base = OmegaConf.structured(cfg)
    base.stages = []
    resolved = []
    for index, stage in enumerate(cfg.stages):
        merged = base
        for section in ("algorithm", "trainer", "rollout", "data"):
            override = getattr(stage, section)
            if override:
                try:
                    merged = OmegaConf.merge(merged, {section: override})
                except Exception as err:  # omegaconf raises ConfigKeyError / ValidationError
                    raise ValueError(
                        f"stages[{index}] ({stage.name}).{section}: {err}. "
                        f"Use keys that exist under `{section}` (the configuration reference lists them)."
                    ) from None
        resolved.append((stage.name, OmegaConf.to_object(merged)))
    return resolved


def adapter_sync(stage: RFTConfig) -> bool:
    """A LoRA stage whose syncs send the adapters to vLLM's LoRA support (sync.lora=adapter)."""
    return stage.trainer.lora.rank > 0 and stage.sync.lora == "adapter"


def trains_lora(cfg: RFTConfig) -> bool:
    """Some stage trains LoRA adapters (the trainer's model then needs the local layer spec)."""
    return any(s.trainer.lora.rank > 0 for _, s in stage_configs(cfg))


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values


def vllm_lora_rank(cfg: RFTConfig) -> int:
    """The max_lora_rank vLLM's engines start with: the largest adapter-synced stage's rank rounded
    up to a rank vLLM supports (0: LoRA off in vLLM)."""
    ranks = [s.trainer.lora.rank for _, s in stage_configs(cfg) if adapter_sync(s)]
    return next((r for r in VLLM_LORA_RANKS if r >= max(ranks)), 0) if ranks else 0


def generated_data(cfg: RFTConfig) -> list[RFTConfig]:
    """The configs whose data sections the launcher writes before launch (rft.launch.compose.prepare): the
    top level's if it sets data.arithmetic, data.shapes or data.from_env, and each stage's that sets
    one of them itself. A stage that only inherits the top level's generator reads its own files:
    they are the user's, never overwritten."""
    generators = ("arithmetic", "shapes", "from_env")
    sections = [cfg] if any(getattr(cfg.data, g) is not None for g in generators) else []
    for stage, (_, resolved) in zip(cfg.stages, stage_configs(cfg) if cfg.stages else []):
        if stage.data and any(g in stage.data for g in generators):
            sections.append(resolved)
    return sections


def world_size(cfg: RFTConfig) -> int:
    """Tasks the job runs: trainer + rollout + judge ranks; only trainer ranks for mode=train, no
    trainer ranks for mode=explore; one for mode=bench."""
    if cfg.mode == "bench":
        return 1
    if cfg.mode == "train":
        return cfg.cluster.trainer_ranks
    if cfg.mode == "serve":
        return cfg.cluster.rollout_ranks
    trainers = 0 if cfg.mode == "explore" else cfg.cluster.trainer_ranks
    return trainers + cfg.cluster.rollout_ranks + cfg.cluster.judge_ranks


def judge_span(cfg: RFTConfig) -> int:
    """Tasks one judge engine spans: its TP size on GPU nodes (a task per GPU), else 1."""
    return cfg.judge.tensor_parallel_size if cfg.cluster.gpus_per_node else 1


def judge_model(cfg: RFTConfig) -> ModelConfig:
    """The model the judge engines serve: judge.model, or the policy's starting weights. Another
    model's shape is its own config.json's: model.tiny describes the policy (its 64 positions held
    any judge.model of the quickstart to 64 tokens)."""
    if cfg.judge.model is None:
        return cfg.model
    return replace(cfg.model, path=cfg.judge.model, tiny=None)


def sync_engine(sync: SyncConfig, on_gpu: bool, colocated: bool = False) -> str:
    """The weight-transfer engine `sync.engine=auto` resolves to on this hardware: nccl on GPUs,
    gloo on CPU. Colocated roles (cluster.colocate) use the checkpoint engine everywhere, as NCCL
    cannot join two processes on one GPU (rft/runtime/colocation.py); so do decoupled jobs
    (sync.decoupled), which share no process group."""
    if sync.engine != "auto":
        return sync.engine
    return "checkpoint" if colocated or sync.decoupled else ("nccl" if on_gpu else "gloo")


def wire_dtype(cfg: RFTConfig) -> str:
    """The dtype weights travel in: by default the model's, which vLLM runs in (model.dtype), so the
    engine samples from the weights the trainer trains. (bfloat16 on GPUs whatever model.dtype was
    the default: an fp32 model then trained in fp32 while vLLM sampled from bf16-rounded weights,
    which biases the importance ratios.) A narrower sync.wire_dtype halves the bytes; the plan says
    the engine then samples from rounded weights."""
    return cfg.sync.wire_dtype if cfg.sync.wire_dtype != "auto" else cfg.model.dtype


def buffer_dir(cfg: RFTConfig) -> str:
    """Where the run's experience shards go (buffer.path, by default <run.output_dir>/buffer)."""
    return cfg.buffer.path or os.path.join(cfg.run.output_dir, "buffer")


def needs_rollouts(stage: RFTConfig) -> bool:
    """Whether a stage learns from the explorer's rollouts (else it trains from a dataset)."""
    return stage.algorithm.policy_loss not in ("sft", "dpo")


def needs_critic(stage: RFTConfig) -> bool:
    """Whether a stage trains a critic: GAE on rollouts. A dataset stage (sft, dpo) never does, even
    when it inherits advantage=gae from a top-level `algorithm=ppo`: it computes no advantages."""
    return needs_rollouts(stage) and stage.algorithm.advantage == "gae"
