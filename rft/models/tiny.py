"""A tiny Qwen2 model with a character-level tokenizer, created locally with a fixed seed.

This is the quickstart's model: nothing is downloaded, and both vLLM and transformers load it as
an ordinary HF directory. The vocabulary covers what arithmetic prompts and answers need. With
`vision` it is Qwen2.5-VL-shaped instead: the same decoder (multimodal RoPE) behind a small
vision tower, the tokenizer with Qwen2.5-VL's image tokens and an image processor saved beside it.
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
# Qwen2.5-VL's: an image is <|vision_start|>, one <|image_pad|> per merged patch, <|vision_end|>
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# The tiny vision tower's images: 14-pixel patches merged 2 x 2, so a 56 x 56 image is 4 image
# tokens; images are resized to between 4 and 16 merged patches (56 x 56 to 112 x 112 pixels)
PATCH, MERGE, MIN_PIXELS, MAX_PIXELS = 14, 2, 56 * 56, 112 * 112


def build_char_tokenizer(vision: bool = False):
    """A `PreTrainedTokenizerFast` that maps each character to one token id (`vision`: and
    Qwen2.5-VL's image tokens, after the characters)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Split into single characters; keep spaces and newlines as tokens of their own.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    built = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    if vision:
        built.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return built


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
    tokenizer = build_char_tokenizer(cfg.vision)
    model = _vision_language_model(cfg, tokenizer, seed) if cfg.vision else _language_model(cfg, tokenizer, seed)
    tmp_dir = tempfile.mkdtemp(dir=os.path.dirname(out_dir), prefix=".building-")
    model.save_pretrained(tmp_dir, safe_serialization=True)
    tokenizer.save_pretrained(tmp_dir)
    if cfg.vision:
        _image_processor().save_pretrained(tmp_dir)
    with open(os.path.join(tmp_dir, "rft_tiny.json"), "w") as f:
        json.dump({"seed": seed, "chars": "".join(CHARS)}, f)
    try:
        os.replace(tmp_dir, out_dir)  # appear complete or not at all
    except OSError:  # another launch built it meanwhile: the same bytes
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _language_model(cfg: TinyModelConfig, tokenizer, seed: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

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
    return Qwen2ForCausalLM(config)


def _vision_language_model(cfg: TinyModelConfig, tokenizer, seed: int):
    """Qwen2.5-VL's layout at the tiny model's size. Multimodal RoPE splits a head's rotary
    frequencies over (time, height, width) in Qwen2.5-VL's proportions (16:24:24 of 64)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    half = cfg.hidden_size // cfg.num_attention_heads // 2
    section = [half // 4, half * 3 // 8, half - half // 4 - half * 3 // 8]
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in VISION_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings, rope_theta=10000.0,
            rope_scaling={"type": "mrope", "mrope_section": section},
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=cfg.hidden_size,
                           patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1], in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=cfg.tie_word_embeddings, dtype="float32")
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config)


def _image_processor():
    """Qwen2.5-VL's image processor (its PIL implementation: torchvision's wheels on PyPI are
    CUDA builds that do not load beside CPU torch) for the tiny vision tower's patch sizes."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                    min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
