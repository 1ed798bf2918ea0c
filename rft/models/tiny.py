"""A tiny Qwen2 model with a character-level tokenizer, created locally with a fixed seed.

This is the quickstart's model: nothing is downloaded, and both vLLM and transformers load it as
an ordinary HF directory. The vocabulary covers what arithmetic prompts and answers need.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile

from rft.config import TinyModelConfig

# Character vocabulary: digits, operators, a few letters and punctuation for templates.
CHARS = list("0123456789+-*=?. \nabcdefghijklmnopqrstuvwxyz")
SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_char_tokenizer():
    """A `PreTrainedTokenizerFast` that maps each character to one token id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Split into single characters; keep spaces and newlines as tokens of their own.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def create_tiny_model(cfg: TinyModelConfig, out_dir: str, seed: int) -> str:
    """Write a random-init Qwen2 model plus its char tokenizer to `out_dir` (idempotent).

    Built once per shape, seed and library versions into a cache (RFT_CACHE_DIR, default
    ~/.cache/rft/tiny) and copied from there: building it imports transformers' model classes,
    4 of the 7 s a quickstart launch spent before submitting (measured), and the copy is the same
    bytes as a build."""
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    cached = os.path.join(os.environ.get("RFT_CACHE_DIR") or os.path.expanduser("~/.cache/rft"), "tiny",
                          _cache_key(cfg, seed))
    try:
        if not os.path.isfile(os.path.join(cached, "rft_tiny.json")):
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            _build(cfg, cached, seed)
    except OSError:  # no writable cache (a read-only home): build it where it goes
        _build(cfg, out_dir, seed)
        return out_dir
    tmp_dir = f"{out_dir}.tmp{os.getpid()}"
    shutil.copytree(cached, tmp_dir)
    os.replace(tmp_dir, out_dir)  # appear complete or not at all
    return out_dir


def _cache_key(cfg: TinyModelConfig, seed: int) -> str:
    """What the built files depend on: the shape, the seed, this builder and the libraries."""
    from importlib.metadata import version

    with open(__file__, "rb") as f:
        source = f.read()
    described = json.dumps({"cfg": dataclasses.asdict(cfg), "seed": seed, "torch": version("torch"),
                            "transformers": version("transformers"), "tokenizers": version("tokenizers"),
                            "source": hashlib.sha256(source).hexdigest()}, sort_keys=True)
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def _build(cfg: TinyModelConfig, out_dir: str, seed: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    tmp_dir = tempfile.mkdtemp(dir=os.path.dirname(out_dir), prefix=".building-")
    model.save_pretrained(tmp_dir, safe_serialization=True)
    tokenizer.save_pretrained(tmp_dir)
    with open(os.path.join(tmp_dir, "rft_tiny.json"), "w") as f:
        json.dump({"seed": seed, "chars": "".join(CHARS)}, f)
    try:
        os.replace(tmp_dir, out_dir)  # appear complete or not at all
    except OSError:  # another launch built it meanwhile: the same bytes
        shutil.rmtree(tmp_dir, ignore_errors=True)
