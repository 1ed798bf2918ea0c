"""The checks of how the model is laid out and built (rft/config/checks.py runs them): its family,
experts and expert parallelism, the trainer's parallel layout, Transformer Engine, LoRA syncs."""

from __future__ import annotations

from typing import Optional

from rft.config.derived import VLLM_LORA_RANKS, stage_configs, vllm_lora_rank
from rft.config.errors import config_error
from rft.config.model import hf_config_json
from rft.config.run import RFTConfig

ROUTING_REPLAY_MODES = ("none", "rollout")  # trainer.routing_replay (rft/trainer/routing_replay.py)


def model_shape(cfg: RFTConfig) -> Optional[tuple[int, int, int]]:
    """(attention heads, key/value heads, layers) of the model, read without loading it."""
    hf = hf_config_json(cfg.model)
    if hf is None:
        return None
    heads = hf.get("num_attention_heads", 1)
    return heads, hf.get("num_key_value_heads") or heads, hf.get("num_hidden_layers", 1)


def check_model_family(cfg: RFTConfig) -> None:
    """The trainer knows the model's architecture and RoPE variant (rft/models/families.py); a
    model the run only samples from (mode=explore|serve|bench) needs neither."""
    from rft.models.families import check_rope, family, num_experts

    hf = hf_config_json(cfg.model)
    if hf is None or cfg.model.tiny is not None or cfg.mode not in ("both", "train"):
        return
    try:
        family(hf)
        check_rope(hf)
    except ValueError as err:
        config_error("model.path", cfg.model.path, f"its config.json: {err}")
    check_experts(cfg, num_experts(hf))


def check_experts(cfg: RFTConfig, experts: int) -> None:
    """Expert parallelism needs experts to split, in equal parts, over ranks of a pipeline stage;
    LoRA adapters cover dense layers only."""
    trainer = cfg.trainer
    ep, tp, pp = trainer.expert_parallel_size, trainer.tensor_parallel_size, trainer.pipeline_parallel_size
    if ep < 1:
        config_error("trainer.expert_parallel_size", ep, "use 1 or more")
    if ep > 1 and not experts:
        config_error("trainer.expert_parallel_size", ep, f"model.path={cfg.model.path!r} has no experts to split: use 1")
    if experts and experts % ep:
        config_error("trainer.expert_parallel_size", ep, f"must divide the model's {experts} experts")
    stage_ranks = cfg.cluster.trainer_ranks // max(pp, 1)
    if ep > 1 and stage_ranks % ep:
        config_error("trainer.expert_parallel_size", ep,
                     f"must divide the {stage_ranks} trainer ranks of a pipeline stage (cluster.trainer_ranks / "
                     f"trainer.pipeline_parallel_size = TP {tp} x DP {stage_ranks // max(tp, 1)})")
    if trainer.moe_aux_loss_coeff is not None and trainer.moe_aux_loss_coeff < 0:
        config_error("trainer.moe_aux_loss_coeff", trainer.moe_aux_loss_coeff, "use 0 (off) or more, or null")
    if trainer.routing_replay not in ROUTING_REPLAY_MODES:
        config_error("trainer.routing_replay", trainer.routing_replay, f"choose one of {ROUTING_REPLAY_MODES}")
    if trainer.routing_replay == "rollout" and not experts:
        config_error("trainer.routing_replay", "rollout",
                     f"model.path={cfg.model.path!r} has no experts to route: use none")
    if trainer.routing_replay == "rollout" and cfg.rollout.partial_rollout:
        config_error("rollout.partial_rollout", True, "a sample cut by a weight update goes on in a new request, whose "
                     "routed experts cover only its own tokens: use partial_rollout=false with "
                     "trainer.routing_replay=rollout")
    if trainer.routing_replay == "rollout" and trainer.recompute == "full":
        config_error("trainer.routing_replay", "rollout", "trainer.recompute=full re-runs the routers in backward, "
                     "after the replayed routes are released: use recompute=none or selective")
    if experts:
        for name, stage in stage_configs(cfg):
            prefix = f"stages[{name}]." if cfg.stages else ""
            if stage.trainer.lora.rank:
                config_error(f"{prefix}trainer.lora.rank", stage.trainer.lora.rank,
                             "LoRA adapters are not supported on mixture-of-experts models yet: set it to 0")


def check_parallel_layout(cfg: RFTConfig) -> None:
    """TP must split whole heads and key/value groups, PP whole layers (trainer and vLLM alike)."""
    shape = model_shape(cfg)
    if shape is None:
        return
    heads, kv_heads, layers = shape
    tp, pp = cfg.trainer.tensor_parallel_size, cfg.trainer.pipeline_parallel_size
    if heads % tp or kv_heads % tp:
        config_error("trainer.tensor_parallel_size", tp,
              f"must divide the model's {heads} attention heads and {kv_heads} key/value heads")
    if layers % pp:
        config_error("trainer.pipeline_parallel_size", pp, f"must divide the model's {layers} layers")
    vpp = cfg.trainer.virtual_pipeline_stages
    if vpp > 1 and layers % (pp * vpp):
        config_error("trainer.virtual_pipeline_stages", vpp,
                     f"pipeline_parallel_size x virtual_pipeline_stages = {pp} x {vpp} must divide the "
                     f"model's {layers} layers")
    rtp = cfg.rollout.tensor_parallel_size
    if heads % rtp:
        config_error("rollout.tensor_parallel_size", rtp, f"must divide the model's {heads} attention heads")


def check_transformer_engine(cfg: RFTConfig) -> None:
    """Transformer Engine's layers run on GPUs only: refused before any rank starts without one.
    (Whether `transformer_engine` imports is the ranks' matter: a login node may lack it.)"""
    if cfg.trainer.transformer_impl != "transformer_engine":
        return
    fix = "or set trainer.transformer_impl=auto (Transformer Engine where it can run) or local"
    if cfg.cluster.kind == "slurm" and cfg.cluster.gpus_per_node == 0:
        config_error("trainer.transformer_impl", "transformer_engine", "Transformer Engine runs on GPUs and "
                     f"this job's nodes get none (cluster.gpus_per_node=0): pick a GPU partition, {fix}")
    if cfg.cluster.kind == "local":
        import torch

        if not torch.cuda.is_available():
            config_error("trainer.transformer_impl", "transformer_engine",
                         f"Transformer Engine runs on GPUs and this machine has none: run on a GPU node, {fix}")


def check_lora_sync(cfg: RFTConfig) -> None:
    if cfg.sync.lora not in ("merged", "adapter"):
        config_error("sync.lora", cfg.sync.lora, "use merged (W + B A, every weight) or adapter (A and B only)")
    if cfg.sync.lora != "adapter" or not vllm_lora_rank(cfg):
        return
    if cfg.sync.engine == "checkpoint":
        config_error("sync.lora", cfg.sync.lora, "adapters travel over the weight groups (sync.engine=gloo/nccl/auto); "
                                                 "with the checkpoint engine use sync.lora=merged")
    if cfg.rollout.openai_api or cfg.mode == "serve":
        config_error("sync.lora", cfg.sync.lora, "the OpenAI endpoint serves the base weights without the adapter; "
                                                 "use sync.lora=merged with rollout.openai_api")
    if max(s.trainer.lora.rank for _, s in stage_configs(cfg)) > VLLM_LORA_RANKS[-1]:
        config_error("trainer.lora.rank", max(s.trainer.lora.rank for _, s in stage_configs(cfg)),
                     f"vLLM's LoRA takes ranks up to {VLLM_LORA_RANKS[-1]}; use sync.lora=merged for larger ones")
