"""The `trainer` section: steps, microbatches, parallel layout, checkpoints, LoRA."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # Megatron's parallel linears (lora.py)


@dataclass
class LoRAConfig:
    """Low-rank adapters on Megatron's parallel linear layers (rft/trainer/lora.py); per stage."""

    rank: int = 0  # adapter rank (0: off, every weight trains)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # Megatron linears that get adapters: any of linear_qkv, linear_proj, linear_fc1, linear_fc2


@dataclass
class TrainerConfig:
    max_steps: int = MISSING  # optimizer steps in this stage
    micro_batch_size: int = 8  # sequences per forward/backward (padded), unless the token budget below is set
    max_tokens_per_microbatch: int = 0  # >0: rows packed (no padding) up to this many tokens per forward/backward
    logprob_chunk: int = 2048  # positions per chunk of the fused output layer, logprobs and entropy: no whole [tokens, vocabulary] logits (0: whole logits)
    skip_zero_advantage_rows: bool = True  # rows with advantage 0 everywhere skip the forward when only the policy loss sees them
    tensor_parallel_size: int = 1  # Megatron TP
    pipeline_parallel_size: int = 1  # Megatron PP: stages run Megatron's 1F1B schedule (rft/trainer/pipeline.py)
    virtual_pipeline_stages: int = 1  # >1 (with PP >= 2): model chunks per stage, Megatron's interleaved 1F1B
    expert_parallel_size: int = 1  # MoE models: ranks that split each layer's experts (of the TP x DP ranks of a stage)
    moe_aux_loss_coeff: Optional[float] = None  # MoE: load-balancing loss weight (None: the model's router_aux_loss_coef)
    routing_replay: str = "none"  # MoE: none | rollout (routers take the experts vLLM chose per token, R3; GPU rollout)
    sft_batch_size: int = 32  # dataset stages: rows per SFT step, preference pairs per DPO step
    threads: int = 0  # torch CPU threads per rank (0: all cores, half with sync.offset > 0: roles overlap)
    save_interval: int = 0  # also checkpoint every N global steps, per stage if a stage sets it (0: by time and on Slurm's time-limit signal only)
    save_every_min: float = 30.0  # checkpoint when this many minutes passed since the last one (0: off)
    save_model: bool = True  # at each stage's end an HF model directory <run>/models/<stage> (LoRA merged); <run>/model is the last
    save_hf: bool = False  # with each checkpoint also an HF export (<run>/checkpoints/hf/v<step>; mode=bench reads them)
    keep_hf_exports: int = 2  # the newest periodic HF exports (save_hf) kept (0: all); each stage's final model is always kept
    keep_checkpoints: int = 2  # complete checkpoints kept in <output dir>/checkpoints
    async_save: bool = False  # write the trainer's shards in the background while it trains on (its tensors copied to shared host memory, kept for the next save, which a writer process at the lowest CPU priority writes): the checkpoint completes at the first step's control point after every trainer rank's write, so a crash in between resumes from the one before; the next save, a stop and the run's end wait for it. false: every rank waits for each save
    loss_scale: Optional[float] = None  # constant loss scale (None: dynamic with fp16 parameters, 1 otherwise)
    distributed_optimizer: bool = True  # CUDA: shard fp32 masters and AdamW state over DP ranks (Megatron's)
    recompute: str = "none"  # none | selective (core attention) | full (every layer): activations redone in backward
    sequence_parallel: bool = False  # with TP > 1: norms and residuals hold 1/TP of the sequence each (Megatron's SP)
    transformer_impl: str = "auto"  # auto (Transformer Engine on GPUs where it imports, without LoRA) | local | transformer_engine
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank > 0: only adapters train, merged at the stage end
    freeze_vision: bool = False  # vision-language models: the vision tower keeps the weights it started with (for the whole run); only the language model trains
