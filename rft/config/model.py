"""The `model` section: which HF model the run trains, and what rft reads from its config.json
without loading it (the context length every rank agrees on)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class TinyModelConfig:
    """A random-weight Qwen2 model with a character-level tokenizer, built locally (no download)."""

    num_layers: int = 2  # transformer layers
    hidden_size: int = 128  # model width
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # key/value heads (grouped-query attention)
    intermediate_size: int = 384  # SwiGLU inner width
    max_position_embeddings: int = 128  # longest sequence (prompt + response)
    tie_word_embeddings: bool = False  # share input embedding and output layer
    vision: bool = False  # Qwen2.5-VL-shaped: a small vision tower (2 blocks, width 64, 14-pixel patches merged 2 x 2) before the same decoder (multimodal RoPE), image tokens in the tokenizer, an image processor beside it


@dataclass
class ModelConfig:
    name: str = MISSING  # short name used in logs
    path: str = MISSING  # HF model directory (config.json, weights, tokenizer)
    tiny: Optional[TinyModelConfig] = None  # if set, `path` is created from this config before launch
    dtype: str = "float32"  # float32 | bfloat16 | float16: trainer master weights and vLLM dtype
    chat_template: bool = False  # wrap prompts with the tokenizer's chat template
    max_seq_len: int = 4096  # longest prompt + response rft gives the model (capped by max_position_embeddings)
    needs_gpu: bool = False  # too big for CPU nodes: refuse to run where the ranks get no GPU


def hf_config_json(model: ModelConfig) -> Optional[dict[str, Any]]:
    """The model's config.json as a dict (the tiny model's from its settings), without loading it."""
    if model.tiny is not None:
        t = model.tiny
        return {"num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
                "num_hidden_layers": t.num_layers, "max_position_embeddings": t.max_position_embeddings}
    path = os.path.join(model.path, "config.json")
    if not os.path.isfile(path):
        return None

    with open(path) as f:
        return json.load(f)


def context_length(model: ModelConfig) -> int:
    """Tokens of prompt + response rft gives the model: `model.max_seq_len`, capped by the model's
    max_position_embeddings. vLLM's max_model_len; every taskset row is fitted into it
    (rft/data/context_fit.py), so a trainer microbatch holds at most micro_batch_size x this."""
    hf = hf_config_json(model) or {}
    return min(model.max_seq_len, hf.get("max_position_embeddings") or model.max_seq_len)
