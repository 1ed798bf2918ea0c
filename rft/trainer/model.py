"""Build a megatron-core GPTModel from an HF directory, load its weights, export HF tensors.

The trainer's model is Megatron's own `GPTModel` with the local (non-Transformer-Engine) layer
spec, so the same code runs on CPU (gloo, see cpu_compat.py) and on GPUs.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from rft.weights.hf_megatron import (
    Geometry,
    hf_to_megatron_full,
    megatron_full_to_hf,
    padded_vocab,
    tp_split_dim,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_model_parallel(tp: int, seed: int) -> None:
    """Megatron's parallel state over the already-initialised default group (trainer ranks)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rft.trainer.cpu_compat import apply_cpu_redirects

    apply_cpu_redirects()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)


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


def build_gpt_model(hf_path: str, dtype: str = "float32"):
    """A GPTModel shaped like the HF model at `hf_path` (weights not loaded). Returns (model, geometry)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(hf_path)
    if hf.model_type not in ("llama", "qwen2"):
        raise ValueError(f"model.path={hf_path!r}: model_type {hf.model_type!r} is not supported yet; "
                         "use a Llama or Qwen2 architecture")
    geo = Geometry.from_hf(hf)
    tp = parallel_state.get_tensor_model_parallel_world_size()
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
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
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
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab(geo.vocab_size, tp),
        max_sequence_length=hf.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=geo.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(getattr(hf, "rope_theta", 10000)),
    )
    if on_gpu:
        model = model.cuda()
    return model, geo


def load_hf_weights(model, hf_state: dict[str, torch.Tensor], geo: Geometry) -> None:
    """Copy HF weights into this rank's TP shard of `model`; every parameter must be covered."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    full = hf_to_megatron_full(hf_state, geo, tp)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(full))
    if missing:
        raise KeyError(f"HF checkpoint does not cover Megatron parameters: {missing[:5]}")
    with torch.no_grad():
        for name, param in params.items():
            dim = tp_split_dim(name)
            src = full[name] if dim is None else full[name].chunk(tp, dim=dim)[rank]
            if src.shape != param.shape:
                raise ValueError(f"{name}: HF-derived shape {tuple(src.shape)} != {tuple(param.shape)}")
            param.copy_(src.to(param.dtype))


def export_hf_weights(model, geo: Geometry) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield HF-named full tensors, gathering TP shards (a collective: all TP ranks iterate)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    for name, param in model.named_parameters():
        dim = tp_split_dim(name)
        full = param.detach()
        if dim is not None and tp > 1:
            shards = [torch.empty_like(full) for _ in range(tp)]
            torch.distributed.all_gather(shards, full.contiguous(), group=group)
            full = torch.cat(shards, dim=dim)
        yield from megatron_full_to_hf(name, full, geo, tp)
