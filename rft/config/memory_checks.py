"""Whether a colocated layout fits its GPUs, estimated before submit from the model's config.json.

Colocated (cluster.colocate), a vLLM engine and a trainer rank share each GPU and take turns, but
the trainer's state stays resident while the engine is awake: its bf16 weights, its fp32 gradient
buffer, and the fp32 master weights with AdamW's two moments (the last three sharded over the DP
ranks by Megatron's distributed optimizer), all split over TP x PP. The woken engine takes back its
rollout.gpu_memory_utilization share of the GPU. At DP=1 that is 18 bytes per parameter beside the
engine: with the default 0.85, beyond about 0.6B parameters on 80 GB. verl and slime offload the
optimizer state to host memory while the engine generates; rft refuses the layout instead, naming
the keys that make it fit.

The parameter count is the usual dense/MoE transformer sum from config.json (embeddings, attention
with grouped KV heads, gated MLP or experts; norms and biases left out: under 0.1%)."""

from __future__ import annotations

from typing import Any, Optional

from rft.config.errors import config_error
from rft.config.model import hf_config_json
from rft.config.run import RFTConfig

GB = 1e9
RESIDENT_BYTES = 2 + 4  # bf16 weights, fp32 gradient buffer (Megatron's DDP), per parameter
OPTIMIZER_BYTES = 4 + 4 + 4  # fp32 master weights, AdamW's exp_avg and exp_avg_sq, per parameter
HEADROOM = 0.95  # CUDA context, NCCL buffers and activations need the rest


def parameter_count(config: dict[str, Any]) -> Optional[int]:
    """Parameters of an HF decoder's config.json (None where it lacks the sizes)."""
    try:
        hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    except KeyError:
        return None
    heads = config.get("num_attention_heads", 1)
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads", heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o; k and v
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    if experts:
        mlp = experts * 3 * hidden * config.get("moe_intermediate_size", config.get("intermediate_size", 0))
        mlp += hidden * experts  # the router
    else:
        mlp = 3 * hidden * config.get("intermediate_size", 4 * hidden)  # gate, up, down
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + mlp)


def trainer_bytes_per_gpu(cfg: RFTConfig, parameters: int) -> float:
    """The trainer's resident state on each of its GPUs (weights, gradients, optimizer state)."""
    t = cfg.trainer
    model_parallel = t.tensor_parallel_size * t.pipeline_parallel_size
    dp = max(cfg.cluster.trainer_ranks // model_parallel, 1)
    optimizer = OPTIMIZER_BYTES / (dp if t.distributed_optimizer else 1)
    return parameters * (RESIDENT_BYTES + optimizer) / model_parallel


def checkpoint_bytes_per_rank(cfg: RFTConfig, parameters: int) -> float:
    """What each trainer rank writes to a checkpoint: the weights (in model.dtype) and the optimizer
    state, spread over the trainer ranks (sharded saves write each tensor once, replicas sharing the
    work). An upper bound for a LoRA stage, which saves its adapters and their optimizer only."""
    weights = 4 if cfg.model.dtype in ("float32", "fp32") else 2
    return parameters * (weights + OPTIMIZER_BYTES) / max(cfg.cluster.trainer_ranks, 1)


def check_colocated_memory(cfg: RFTConfig, gpu_memory_gb: Optional[float]) -> None:
    """Refuse a colocated GPU layout whose trainer state and woken engine exceed a GPU's memory
    (`gpu_memory_gb`: cluster.gpu_memory_gb, or what nvidia-smi reports on the launcher's node;
    None: not known, not checked)."""
    if not (cfg.cluster.colocate and cfg.cluster.gpus_per_node and gpu_memory_gb):
        return
    config = hf_config_json(cfg.model)
    parameters = parameter_count(config) if config else None
    if parameters is None:
        return
    engine = cfg.rollout.gpu_memory_utilization * gpu_memory_gb * GB
    trainer = trainer_bytes_per_gpu(cfg, parameters)
    if engine + trainer <= HEADROOM * gpu_memory_gb * GB:
        return
    room = HEADROOM - trainer / (gpu_memory_gb * GB)
    fix = (f"lower rollout.gpu_memory_utilization to {room:.2f} or less" if room >= 0.2 else
           "split the trainer further (trainer.tensor_parallel_size, trainer.pipeline_parallel_size, more "
           "cluster.trainer_ranks with trainer.distributed_optimizer=true)")
    config_error("cluster.colocate", True,
                 f"the trainer's resident state ({trainer / GB:.1f} GB per GPU for {parameters / 1e9:.2f}B parameters: "
                 f"bf16 weights, fp32 gradients, fp32 masters and AdamW's moments over TP x PP"
                 f"{' and DP' if cfg.trainer.distributed_optimizer else ''}) and the woken engine "
                 f"(rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization:g} of {gpu_memory_gb:g} GB) "
                 f"exceed {HEADROOM:.0%} of a GPU: {fix}, or run the roles on their own GPUs (cluster.colocate=false)")
