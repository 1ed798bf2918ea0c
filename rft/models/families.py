"""The architectures rft trains, as data: one `Family` per HF `model_type`, saying how its layers
map onto megatron-core's GPT layers, and the RoPE variants rft reproduces.

A new architecture that fits these layers is one entry in FAMILIES. RoPE frequencies are computed
by transformers' own functions (`ROPE_INIT_FUNCTIONS`) from the model's config.json, so the
trainer, an HF export and vLLM agree: vLLM reads the same config.json and implements the same
variants. Every function here takes the config.json as a dict (the launcher checks a model
without loading it) or as transformers' config object (the trainer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """How one HF architecture's layers map onto megatron-core's."""

    name: str  # for messages
    qkv_bias: bool | None  # biases on q, k and v: always (True), never (False), or config.json's attention_bias
    qk_norm: bool  # a per-head RMSNorm on q and k before RoPE (Megatron's q_layernorm / k_layernorm)
    moe: bool = False  # routed experts in place of the MLP (in the layers `moe_layers` names)


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", qkv_bias=None, qk_norm=False),
    "qwen2": Family("Qwen2", qkv_bias=True, qk_norm=False),
    "qwen3": Family("Qwen3", qkv_bias=None, qk_norm=True),
    "qwen3_moe": Family("Qwen3-MoE", qkv_bias=None, qk_norm=True, moe=True),
    # Qwen2.5-VL's language model: Qwen2's layers with multimodal RoPE (`mrope_section`)
    "qwen2_5_vl_text": Family("Qwen2.5-VL", qkv_bias=True, qk_norm=False),
}

# Vision-language models (model_type -> the model_type of their language model): a vision tower
# whose image features take the place of image tokens in the language model's input embeddings
# (rft/trainer/vision.py). transformers 5 nests the language model's settings under `text_config`;
# checkpoints on the Hub written before it keep them at the top level, beside `vision_config`.
VISION_LANGUAGE = {"qwen2_5_vl": "qwen2_5_vl_text"}

# RoPE variants as transformers names them (`rope_type`); "default" is plain RoPE. "dynamic" is
# left out on purpose: transformers rescales its frequencies only past the original context
# while vLLM scales them for every position, so trainer and sampler would score different models.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DEFAULT_ROPE_THETA = 10000.0  # what transformers' Llama and Qwen configs take when config.json names none


def _get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def language_config(config: Any) -> Any:
    """The language model's settings of a config.json (dict or transformers config): a
    vision-language model's `text_config` (or, in the Hub's older layout, its top level under the
    language model's model_type); any other model's config itself."""
    model_type = _get(config, "model_type")
    if model_type not in VISION_LANGUAGE:
        return config
    if not isinstance(config, dict):
        return config.get_text_config()
    text = config.get("text_config") or {k: v for k, v in config.items() if k != "vision_config"}
    return {**text, "model_type": VISION_LANGUAGE[model_type]}


def is_vision_language(config: Any) -> bool:
    return _get(config, "model_type") in VISION_LANGUAGE


def mrope_section(config: Any) -> tuple[int, ...]:
    """Multimodal RoPE's split of a head's rotary frequencies between the temporal, height and
    width positions (Qwen2.5-VL), or () for plain RoPE."""
    return tuple(rope_parameters(language_config(config)).get("mrope_section") or ())


def family(config: Any) -> Family:
    """The Family of a config.json (dict or transformers config); ValueError naming the
    model_type and the supported ones otherwise."""
    config = language_config(config)
    model_type = _get(config, "model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    if _get(config, "mlp_bias", False):
        raise ValueError("MLP biases (mlp_bias=true) are not supported")
    return FAMILIES[model_type]


def has_qkv_bias(config: Any) -> bool:
    bias = family(config).qkv_bias
    return bool(_get(config, "attention_bias", False)) if bias is None else bias


def num_experts(config: Any) -> int:
    """Routed experts per MoE layer (0: a dense model). transformers 5 names it num_local_experts
    in the config.json it writes; checkpoints on the Hub say num_experts."""
    if not family(config).moe:
        return 0
    return int(_get(config, "num_experts", None) or _get(config, "num_local_experts", 0) or 0)


def moe_layers(config: Any) -> tuple[int, ...]:
    """The layers (0-based) whose MLP is routed experts: every `decoder_sparse_step`-th one, less
    `mlp_only_layers` (Qwen3-MoE's rule; the released models route every layer)."""
    if not num_experts(config):
        return ()
    step = int(_get(config, "decoder_sparse_step", 1) or 1)
    dense = set(_get(config, "mlp_only_layers", None) or ())
    return tuple(i for i in range(int(_get(config, "num_hidden_layers"))) if i not in dense and (i + 1) % step == 0)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of a config.json, whichever way it writes them: transformers 5's
    `rope_parameters`, or the older `rope_scaling` (with `type` or `rope_type`) beside
    `rope_theta`. Always has `rope_type` and `rope_theta`."""
    found = dict(_get(config, "rope_parameters") or {})
    scaling = dict(_get(config, "rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    merged = {**scaling, **{k: v for k, v in found.items() if v is not None}}
    merged.setdefault("rope_type", scaling.get("rope_type", "default"))
    if merged["rope_type"] == "mrope":  # older Qwen2.5-VL configs: plain RoPE frequencies, split three ways
        merged["rope_type"] = "default"
    theta = merged.get("rope_theta", _get(config, "rope_theta"))
    merged["rope_theta"] = float(DEFAULT_ROPE_THETA if theta is None else theta)
    return merged


def check_rope(config: Any) -> str:
    """The model's rope_type, if rft supports it; ValueError naming it and the supported ones."""
    rope_type = rope_parameters(config)["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    return rope_type


def rope_frequencies(hf_config: Any) -> tuple[Any, float]:
    """(inverse frequencies [head_dim / 2], attention scaling) of the model's RoPE, exactly as
    transformers computes them. The scaling (YaRN's) multiplies cos and sin, so both q and k:
    the trainer folds its square into the attention's softmax scale."""
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = check_rope(hf_config)
    if rope_type == "default":
        params = rope_parameters(hf_config)
        head_dim = _get(hf_config, "head_dim") or hf_config.hidden_size // hf_config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        return 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)
