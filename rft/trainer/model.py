"""Build a megatron-core GPTModel (this rank's TP x PP shard) shaped like an HF directory.

Weights move in and out through `rft/weights/convert.py`.

The trainer's model is Megatron's own `GPTModel` with the local (non-Transformer-Engine) layer
spec, so the same code runs on CPU (gloo, see cpu_compat.py) and on GPUs. With
trainer.sequence_parallel the norms and residuals between TP matmuls hold [s/TP, b, h].
"""

from __future__ import annotations

import glob
import os
import torch
import torch.nn.functional as F

from rft.weights.hf_megatron import Geometry, padded_vocab

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_model_parallel(tp: int, seed: int, pp: int = 1) -> None:
    """Megatron's parallel state over the already-initialised default group (trainer ranks)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rft.trainer.cpu_compat import apply_cpu_redirects

    apply_cpu_redirects()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(seed)


def collective_device() -> torch.device:
    """Where tensors built for a collective must live: NCCL (GPU trainers) takes CUDA tensors only."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_hf_state(path: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint directory."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model.path={path!r} holds no *.safetensors weights; save the model with "
                         "save_pretrained(..., safe_serialization=True)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


RECOMPUTE = {  # trainer.recompute -> TransformerConfig keywords: activations recomputed in backward
    "none": {},
    "selective": {"recompute_granularity": "selective"},  # core attention only: the cheap, big part
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


class RMSNorm(torch.nn.RMSNorm):
    """PyTorch's RMSNorm, which Megatron's local spec builds (WrappedTorchNorm) but refuses under
    sequence parallelism only because it does not mark its weight: marked here, as Megatron's own
    fused norms do, so that the weight's gradient, from 1/TP of the sequence on each TP rank, is
    summed over TP (master_weights.sync_grads; Megatron's DDP on CUDA)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def block_spec(config, qk_norm: bool):
    """This pipeline stage's layers: Megatron's local layer spec (no Transformer Engine) with its
    core attention replaced by PyTorch's fused kernels (rft/trainer/attention.py): flash attention
    on GPUs, variable-length for packed microbatches, instead of an fp32 score matrix per head;
    every norm, the final one included, is `RMSNorm`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from rft.trainer.attention import FusedCoreAttention

    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm)
    layer = spec.submodules
    layer.self_attention.submodules.core_attention = FusedCoreAttention
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    if qk_norm:
        layer.self_attention.submodules.q_layernorm = layer.self_attention.submodules.k_layernorm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=RMSNorm)


def build_gpt_model(hf_path: str, dtype: str = "float32", tie_embeddings: bool | None = None,
                    recompute: str = "none", sequence_parallel: bool = False):
    """A GPTModel shaped like the HF model at `hf_path` (weights not loaded). Returns (model, geometry).

    `tie_embeddings` overrides the HF config's tying (None: as the HF model); the critic is built
    untied so its output layer (a value head) is its own and the PP embedding group leaves it alone.
    `recompute` (trainer.recompute): none | selective (core attention) | full (every layer's
    activations), trading backward compute for activation memory. `sequence_parallel`
    (trainer.sequence_parallel, TP > 1): between the tensor-parallel matmuls each TP rank holds
    [s/TP, b, h] of the hidden states, so norms, residuals and dropout cost 1/TP of the memory
    and compute; microbatches are padded to a multiple of TP (forward.sequence_multiple).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(hf_path)
    if hf.model_type not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"model.path={hf_path!r}: model_type {hf.model_type!r} is not supported yet; "
                         "use a Llama, Qwen2 or Qwen3 architecture")
    if getattr(hf, "mlp_bias", False):
        raise ValueError(f"model.path={hf_path!r}: MLP biases are not supported")
    geo = Geometry.from_hf(hf)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if geo.num_layers % pp:
        raise ValueError(f"trainer.pipeline_parallel_size={pp} does not divide the model's "
                         f"{geo.num_layers} layers")
    on_gpu = torch.cuda.is_available()
    params_dtype = _DTYPES[dtype]
    config = TransformerConfig(
        num_layers=geo.num_layers,
        hidden_size=geo.hidden_size,
        num_attention_heads=geo.num_heads,
        num_query_groups=geo.num_kv_heads,
        kv_channels=geo.head_dim,
        ffn_hidden_size=hf.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=geo.qkv_bias,
        qk_layernorm=geo.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel and tp > 1,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=params_dtype,
        deallocate_pipeline_outputs=True,  # a sent output keeps only its graph until its backward
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,  # HF weights are loaded right after
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # losses are normalised by the whole batch's token count (train_step.py): Megatron's DDP
        # must sum gradients over DP replicas, not average them
        calculate_per_token_loss=True,
        **RECOMPUTE[recompute],
    )
    # microbatches differ in length and rows: pipeline stages exchange shapes first. Set after
    # construction: TransformerConfig refuses it with its default MoE token dispatcher, even
    # in a model without experts.
    config.variable_seq_lengths = True
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, geo.qk_norm),
        vocab_size=padded_vocab(geo.vocab_size, tp),
        max_sequence_length=hf.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=geo.tied_embeddings if tie_embeddings is None else tie_embeddings,
        position_embedding_type="rope",
        rotary_base=geo.rope_theta,
    )
    model.real_vocab_size = geo.vocab_size  # logits beyond it are padding (forward.model_forward)
    if on_gpu:
        model = model.cuda()
    return model, geo
