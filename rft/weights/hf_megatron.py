"""HF <-> Megatron-core names and layouts for the families of rft/models/families.py (Llama, Qwen2,
Qwen3, Qwen3-MoE).

Layouts that differ:
  - QKV is one fused `linear_qkv` in Megatron, ordered per query group: for each KV head g,
    the query heads of that group, then k_g, then v_g. TP splits it on dim 0 by whole groups.
  - gate and up projections are one `linear_fc1` = [gate; up]; under TP each rank holds
    [gate_r; up_r], so the full tensor is *not* a plain concatenation when TP > 1.
  - Megatron pads the vocabulary to a multiple of TP; HF tensors carry the real vocabulary.
  - Qwen3's per-head q/k RMSNorms are Megatron's `q_layernorm` / `k_layernorm` (replicated).
  - Transformer Engine's layer spec fuses each pre-norm into the linear after it: its weight is
    `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`, mapped as the local spec's
    `input_layernorm` / `pre_mlp_layernorm` (`local_spec_name`).
  - Under pipeline parallelism a stage numbers its layers from 0; names here use global layer
    numbers, and `rft/trainer/hf_weights.py` translates.
  - Mixture of experts (Qwen3-MoE): HF's router `mlp.gate` is Megatron's `mlp.router`; expert j's
    gate/up/down projections are `mlp.experts.local_experts.<j>.linear_fc1` (= [gate; up]) and
    `linear_fc2`, each whole on its rank: rft runs experts without tensor parallelism (expert
    TP 1; expert parallelism splits them instead, also over the TP ranks), because Megatron
    gathers an expert's tokens over expert-TP ranks in pieces of different sizes, which gloo
    cannot. Names here number experts
    globally; under expert parallelism a rank holds a contiguous slice of them, and
    `rft/trainer/hf_weights.py` translates. Transformer Engine's grouped experts name expert j's
    weights `mlp.experts.linear_fc1.weight<j>`, mapped like the local spec's (`local_spec_name`).
Megatron-Bridge does this mapping too, but it does not install on Python 3.11 with
megatron-core 0.16 (it needs a newer core), so the few rules live here and are tested against
`transformers` logits.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rft.models.families import (
    check_rope,
    family,
    has_qkv_bias,
    language_config,
    moe_layers,
    mrope_section,
    num_experts,
    rope_parameters,
)


@dataclass(frozen=True)
class Geometry:
    """What the mapping needs to know about the model's shapes."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int  # HF (real) vocabulary size
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool = False  # Qwen3
    rope_theta: float = 10000.0

    rope_type: str = "default"  # rft.models.families.ROPE_TYPES
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is the experts (0-based, global)
    moe_topk: int = 0  # experts each token is routed to
    moe_ffn_hidden_size: int = 0  # one expert's intermediate size
    moe_norm_topk: bool = True  # the top-k routing weights renormalised to sum to 1
    mrope_section: tuple[int, ...] = ()  # multimodal RoPE (Qwen2.5-VL): the rotary split over (t, h, w)
    vision: bool = False  # a vision tower in front (HF `visual.*`, Megatron `vision.*`, whole on every rank)

    @staticmethod
    def from_hf(hf_config) -> "Geometry":
        """The shapes of an HF config (transformers' object); ValueError for an architecture or a
        RoPE variant rft does not support (rft/models/families.py). A vision-language model's
        are its language model's, with its vision tower beside them."""
        vision = language_config(hf_config) is not hf_config
        mrope = mrope_section(hf_config)
        hf_config = language_config(hf_config)
        fam = family(hf_config)
        heads = hf_config.num_attention_heads
        return Geometry(
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            hidden_size=hf_config.hidden_size,
            vocab_size=hf_config.vocab_size,
            tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=has_qkv_bias(hf_config),
            qk_norm=fam.qk_norm,
            rope_theta=rope_parameters(hf_config)["rope_theta"],
            rope_type=check_rope(hf_config),
            num_experts=num_experts(hf_config),
            moe_layers=moe_layers(hf_config),
            moe_topk=int(getattr(hf_config, "num_experts_per_tok", 0) or 0),
            moe_ffn_hidden_size=int(getattr(hf_config, "moe_intermediate_size", 0) or 0),
            moe_norm_topk=bool(getattr(hf_config, "norm_topk_prob", True)),
            mrope_section=mrope,
            vision=vision,
        )


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Geometry) -> torch.Tensor:
    """HF q/k/v (weight [out, in] or bias [out]) -> Megatron's per-group fused layout."""
    per_group = g.num_heads // g.num_kv_heads
    tail = q.shape[1:]
    q = q.reshape(g.num_kv_heads, per_group * g.head_dim, *tail)
    k = k.reshape(g.num_kv_heads, g.head_dim, *tail)
    v = v.reshape(g.num_kv_heads, g.head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, g: Geometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    per_group = g.num_heads // g.num_kv_heads
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g.num_kv_heads, (per_group + 2) * g.head_dim, *tail)
    q, k, v = torch.split(grouped, [per_group * g.head_dim, g.head_dim, g.head_dim], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


# Megatron parameter suffix -> (TP split dim or None if replicated)
_TP_DIM = {
    "embedding.word_embeddings.weight": 0,
    "output_layer.weight": 0,
    "self_attention.linear_qkv.weight": 0,
    "self_attention.linear_qkv.bias": 0,
    "self_attention.linear_proj.weight": 1,
    "linear_fc1.weight": 0,  # a dense MLP's, or an expert's (mlp.experts.local_experts.<j>.)
    "linear_fc2.weight": 1,
}

_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


_TE_FUSED_NORMS = {  # Transformer Engine's name -> the local layer spec's
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def local_spec_name(megatron_name: str) -> str:
    """The local layer spec's name for a parameter of either spec (the mapping below uses those)."""
    for te_suffix, local_suffix in _TE_FUSED_NORMS.items():
        if megatron_name.endswith("." + te_suffix):
            return megatron_name[: -len(te_suffix)] + local_suffix
    return _GROUPED_EXPERT.sub(lambda m: f".mlp.experts.local_experts.{m.group(2)}.{m.group(1)}.weight", megatron_name)


_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def expert_index(megatron_name: str) -> int | None:
    """The expert a parameter belongs to (as its name numbers it), or None outside the experts."""
    found = _EXPERT.search(megatron_name)
    return int(found.group(1)) if found else None


def renumber_expert(megatron_name: str, index: int) -> str:
    return _EXPERT.sub(f".mlp.experts.local_experts.{index}.", megatron_name)


# A vision tower's parameters: transformers' module, its names under HF's `visual.` (the Hub's
# checkpoint layout) and the trainer's `vision.` (rft/trainer/vision.py), whole on every TP rank
HF_VISION, VISION = "visual.", "vision."


def tp_split_dim(megatron_name: str) -> int | None:
    if expert_index(megatron_name) is not None or megatron_name.startswith(VISION):
        return None  # experts are whole on every rank (expert TP 1); so is a vision tower
    for suffix, dim in _TP_DIM.items():
        if megatron_name.endswith(suffix):
            return dim
    return None  # norms are replicated


def hf_to_megatron_full(hf: dict[str, torch.Tensor], g: Geometry, tp: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) Megatron tensors from an HF state dict. fc1 is [gate; up] per TP rank."""
    out: dict[str, torch.Tensor] = {}
    vocab = padded_vocab(g.vocab_size, tp)

    def pad_vocab(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(vocab - t.shape[0], *t.shape[1:])]) if vocab > t.shape[0] else t

    out["embedding.word_embeddings.weight"] = pad_vocab(hf["model.embed_tokens.weight"])
    for i in range(g.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], g)
        if g.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], g)
        out[m + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        if g.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        if i in g.moe_layers:
            out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
            mlps = [(h + f"mlp.experts.{j}.", m + f"mlp.experts.local_experts.{j}.") for j in range(g.num_experts)]
        else:
            mlps = [(h + "mlp.", m + "mlp.")]
        for hf_mlp, mlp in mlps:
            gate, up = hf[hf_mlp + "gate_proj.weight"], hf[hf_mlp + "up_proj.weight"]
            parts = tp if mlp == m + "mlp." else 1  # an expert is not split over TP
            out[mlp + "linear_fc1.weight"] = torch.cat(
                [torch.cat([gc, uc]) for gc, uc in zip(gate.chunk(parts), up.chunk(parts))])
            out[mlp + "linear_fc2.weight"] = hf[hf_mlp + "down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not g.tied_embeddings:
        out["output_layer.weight"] = pad_vocab(hf["lm_head.weight"])
    if g.vision:
        out.update((VISION + name[len(HF_VISION):], t) for name, t in hf.items() if name.startswith(HF_VISION))
    return out


def megatron_full_to_hf(name: str, full: torch.Tensor, g: Geometry,
                        tp: int) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors for one full (TP-gathered) Megatron parameter."""
    if name == "embedding.word_embeddings.weight":
        # a tied lm_head is the same tensor: HF checkpoints and vLLM's loaders skip it, so do we
        yield "model.embed_tokens.weight", full[: g.vocab_size]
        return
    if name == "output_layer.weight":
        yield "lm_head.weight", full[: g.vocab_size]
        return
    if name == "decoder.final_layernorm.weight":
        yield "model.norm.weight", full
        return
    if name.startswith(VISION):
        yield HF_VISION + name[len(VISION):], full
        return
    parts = name.split(".")
    layer, rest = parts[2], ".".join(parts[3:])
    h = f"model.layers.{layer}."
    if rest == "input_layernorm.weight":
        yield h + "input_layernorm.weight", full
    elif rest == "pre_mlp_layernorm.weight":
        yield h + "post_attention_layernorm.weight", full
    elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = split_qkv(full, g)
        yield from ((h + f"self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v)))
    elif rest == "self_attention.linear_proj.weight":
        yield h + "self_attn.o_proj.weight", full
    elif rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        yield h + f"self_attn.{rest.split('.')[1][0]}_norm.weight", full
    elif rest == "mlp.router.weight":
        yield h + "mlp.gate.weight", full
    elif rest.startswith("mlp.") and rest.endswith(("linear_fc1.weight", "linear_fc2.weight")):
        expert = expert_index(name)
        hf_mlp = h + ("mlp." if expert is None else f"mlp.experts.{expert}.")
        if rest.endswith("linear_fc1.weight"):
            shards = [s.chunk(2) for s in full.chunk(tp if expert is None else 1)]
            yield hf_mlp + "gate_proj.weight", torch.cat([s[0] for s in shards])
            yield hf_mlp + "up_proj.weight", torch.cat([s[1] for s in shards])
        else:
            yield hf_mlp + "down_proj.weight", full
    else:
        raise KeyError(f"no HF mapping for Megatron parameter {name}")
