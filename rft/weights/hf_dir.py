"""The files of an HF model directory besides its weights: what every directory rft writes
(weight syncs through files, periodic exports, each stage's final model) takes from the model it
started from, so that transformers, vLLM and tokenizers load it as they load the source.

Everything but the weights is copied: config and generation config, and every tokenizer and
template file whatever its name (`tokenizer.model`, `chat_template.jinja`, `merges.txt`, a
`added_tokens.json`, a model card): a list of known names would lose the next one a model adds.
"""

from __future__ import annotations

import json
import os
import shutil

INDEX = "model.safetensors.index.json"  # written last: an HF directory rft writes is complete once it is there
# weights and their indexes: the writer's own take their place
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".index.json")


def copy_model_files(source: str, directory: str, dtype: str | None = None) -> None:
    """Copy every file of the model directory `source` except weights into `directory` (not its
    subdirectories: HF model directories keep none a loader reads). With `dtype` ("bfloat16", ...),
    config.json says the weights' dtype (the source's may differ: a float32 checkpoint trained in bf16)."""
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if os.path.isfile(path) and not name.endswith(WEIGHT_SUFFIXES):
            shutil.copy(path, os.path.join(directory, name))
    config = os.path.join(directory, "config.json")
    if dtype is not None and os.path.exists(config):
        with open(config) as f:
            values = json.load(f)
        # transformers < 4.56 reads torch_dtype, later ones dtype (and still accept torch_dtype)
        values.update({key: dtype for key in ("torch_dtype", "dtype") if key in values} or {"torch_dtype": dtype})
        tmp = config + ".tmp"
        with open(tmp, "w") as f:
            json.dump(values, f, indent=2)
        os.replace(tmp, config)


def stage_model_dir(run_dir: str, stage_names: list[str], index: int) -> str:
    """Where stage `index` leaves its model: <run>/models/<name>, or <index>-<name> where two stages
    share a name."""
    name = stage_names[index]
    unique = stage_names.count(name) == 1
    return os.path.join(run_dir, "models", name if unique else f"{index}-{name}")


def final_model_link(run_dir: str) -> str:
    """<run>/model: the newest stage's model (a link into <run>/models)."""
    return os.path.join(run_dir, "model")


def point_final_model_at(run_dir: str, directory: str) -> None:
    """Make <run>/model name `directory` (relative, so the run directory may move), atomically."""
    link = final_model_link(run_dir)
    tmp = f"{link}.tmp{os.getpid()}"
    os.symlink(os.path.relpath(directory, run_dir), tmp)
    os.replace(tmp, link)


def run_models(run_dir: str) -> list[str]:
    """The complete HF model directories a run left: its periodic exports (<run>/checkpoints/hf/v<step>,
    trainer.save_hf; `python -m rft.export`'s), oldest first, then each stage's final model
    (<run>/models/<stage>), in the order the stages ended."""
    import glob

    exports = []
    for path in glob.glob(os.path.join(run_dir, "checkpoints", "hf", "v*")):
        step = os.path.basename(path)[1:]
        if step.isdigit() and os.path.exists(os.path.join(path, INDEX)):
            exports.append((int(step), path))
    stages = [(os.path.getmtime(os.path.join(path, INDEX)), path)
              for path in glob.glob(os.path.join(run_dir, "models", "*")) if os.path.exists(os.path.join(path, INDEX))]
    return [path for _, path in sorted(exports)] + [path for _, path in sorted(stages)]
