"""Which transformer layers the trainer builds: Megatron's local spec, or Transformer Engine's.

`trainer.transformer_impl`:
  - `local`: Megatron's local layer spec, every piece plain PyTorch, so it runs on CPU (every test)
    and on GPUs; core attention is PyTorch's fused kernels (rft/trainer/attention.py).
  - `transformer_engine`: Megatron's TE spec (`get_gpt_layer_with_transformer_engine_spec`): each
    pre-norm fused into the linear after it (`TELayerNormColumnParallelLinear`), TE's fused
    attention (THD for packed microbatches), TE's norms, and Megatron's fused SwiGLU, bias-dropout-
    add and RoPE kernels. GPUs only.
  - `auto` (default): Transformer Engine where it can run (a GPU, `transformer_engine` importable)
    and no stage trains LoRA adapters; local otherwise.

LoRA needs the local layers: its adapter on `linear_qkv` or `linear_fc1` must see the normalised
input, and TE's fused layer takes the input before its norm. TE names the fused norms' weights
`linear_qkv.layer_norm_weight` and `linear_fc1.layer_norm_weight`; `rft/weights/hf_megatron.py`
maps them like the local spec's `input_layernorm` and `pre_mlp_layernorm`.

The TE path has not run anywhere yet: TE does not install on the CPU machines tests run on, and
the GPU machine lent so far had no TE wheel for its torch. `tests/dist/test_transformer_engine.py`
(gpu-marked, run by tools/gpu_truth.sh) checks it against the local spec where TE imports.
"""

from __future__ import annotations

import importlib

import torch

from rft.weights.hf_megatron import local_spec_name


def transformer_engine_missing() -> str | None:
    """Why Transformer Engine cannot build this rank's layers, or None when it can."""
    if not torch.cuda.is_available():
        return "Transformer Engine runs on GPUs only, and this rank has none"
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as e:  # an ImportError, or a library built for another torch or CUDA (OSError)
        return (f"transformer_engine does not import here ({type(e).__name__}: {e}); install it into the "
                "container (pip install transformer-engine[pytorch], built for its torch and CUDA)")
    return None


def resolve_transformer_impl(requested: str, lora: bool) -> str:
    """The layers `build_gpt_model` builds for trainer.transformer_impl=`requested`; `lora`: some
    stage of the run trains adapters (config_checks refuses that with transformer_engine)."""
    if requested == "local" or (requested == "auto" and lora):
        return "local"
    missing = transformer_engine_missing()
    if requested == "auto":
        return "local" if missing else "transformer_engine"
    if missing:
        raise ValueError(f"trainer.transformer_impl=transformer_engine: {missing}. Or set "
                         "trainer.transformer_impl=auto (Transformer Engine where it can run) or local")
    return "transformer_engine"


def why_these_layers(requested: str, lora: bool, impl: str) -> str:
    """Why `resolve_transformer_impl` chose `impl`, for a GPU run's log."""
    if impl == "transformer_engine" or requested == "local":
        return f"{impl} (trainer.transformer_impl={requested})"
    return f"local ({'LoRA adapters need them' if lora else transformer_engine_missing()})"


def check_saved_layers(saved_model_state: dict | None, built: str) -> None:
    """A checkpoint resumes only into the layers it was saved from (Transformer Engine's hold their
    norms inside the fused linears); said here rather than as load_state_dict's key listing."""
    if saved_model_state is None:
        return
    saved = "transformer_engine" if any(local_spec_name(k) != k for k in saved_model_state) else "local"
    if saved != built:
        raise ValueError(f"the checkpoint holds {saved} layers and this run built {built} ones "
                         f"(trainer.transformer_impl); resume where {saved} layers are built: set "
                         f"trainer.transformer_impl={saved}")


def fused_kernel_flags(impl: str) -> dict[str, bool]:
    """TransformerConfig's kernel fusions: with Transformer Engine, Megatron's fused SwiGLU,
    bias-dropout-add and RoPE (TE's kernels); none on the local path, which must run on CPU.
    Gradient-accumulation fusion stays off: it needs Megatron DDP's `main_grad` on every linear,
    and Megatron's local output layer needs Apex for it."""
    fused = impl == "transformer_engine"
    return {"bias_activation_fusion": fused, "bias_dropout_fusion": fused, "apply_rope_fusion": fused,
            "masked_softmax_fusion": False, "persist_layer_norm": False, "gradient_accumulation_fusion": False}


class RMSNorm(torch.nn.RMSNorm):
    """PyTorch's RMSNorm, which Megatron's local spec builds (WrappedTorchNorm) but refuses under
    sequence parallelism only because it does not mark its weight: marked here, as Megatron's own
    fused norms do, so that the weight's gradient, from 1/TP of the sequence on each TP rank, is
    summed over TP (master_weights.sync_grads; Megatron's DDP on CUDA). WrappedTorchNorm also
    leaves the weight in fp32 in a bf16/fp16 model."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        # in the model's dtype, as every other parameter (Megatron's own norms, Megatron-LM's
        # Float16Module): its distributed optimizer maps a parameter group's params to their
        # fp32 masters assuming one dtype, and saved the wrong moments, or failed, for fp32 norms
        # beside bf16 biases
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def block_spec(config, qk_norm: bool, vp_stage: int | None = None):
    """This pipeline stage's layers (of its virtual stage `vp_stage`) in `config.transformer_impl`:
    in a mixture-of-experts model (`config.moe_layer_freq`, one 0/1 per layer), routed experts in
    place of the MLP where the pattern says 1."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    make = _transformer_engine_layer if config.transformer_impl == "transformer_engine" else _local_layer
    dense, final_norm = make(qk_norm, None)
    routed = make(qk_norm, config.num_moe_experts)[0] if config.num_moe_experts else None
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    pattern = config.moe_layer_freq if routed is not None else None
    layers = [routed if pattern and pattern[offset + i] else dense
              for i in range(get_num_layers_to_build(config, vp_stage=vp_stage))]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)


def _local_layer(qk_norm: bool, num_experts: int | None):
    """Megatron's local layer spec (no Transformer Engine) with its core attention replaced by
    PyTorch's fused kernels (rft/trainer/attention.py): flash attention on GPUs, variable-length
    for packed microbatches, instead of an fp32 score matrix per head; every norm is `RMSNorm`.
    Routed experts (`num_experts`) are Megatron's SequentialMLP: one expert after the other, plain
    PyTorch (its grouped GEMM needs Transformer Engine)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from rft.trainer.attention import FusedCoreAttention

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm",
                                    qk_layernorm=qk_norm)
    layer = spec.submodules
    layer.self_attention.submodules.core_attention = FusedCoreAttention
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    if qk_norm:
        layer.self_attention.submodules.q_layernorm = layer.self_attention.submodules.k_layernorm = RMSNorm
    return spec, RMSNorm


def _transformer_engine_layer(qk_norm: bool, num_experts: int | None):  # GPU path: tests/dist/test_transformer_engine.py
    """Megatron's own Transformer Engine spec, unchanged (routed experts as TE's grouped GEMM), and
    TE's norm for the final one."""
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=bool(num_experts),
                                                      qk_layernorm=qk_norm), TENorm
