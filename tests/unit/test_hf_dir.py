"""What an HF directory rft writes holds besides its weights (rft/weights/hf_dir.py), and how many
of a series of them the checkpoint writer keeps (rft/weights/engines.py's CheckpointSender)."""

import json
import os
import stat

import torch

from rft.weights.engines import CheckpointSender, SyncLayout
from rft.weights.hf_dir import copy_model_files, run_models

TABLE = [("model.embed_tokens.weight", (4, 2), "torch.bfloat16")]


def _source(tmp_path) -> str:
    source = tmp_path / "source"
    source.mkdir()
    names = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer.model", "chat_template.jinja",
             "merges.txt", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"]
    for name in names:
        (source / name).write_text(json.dumps({"torch_dtype": "float32"}) if name == "config.json" else name)
    (source / "original").mkdir()  # e.g. a Llama release's consolidated weights: not an HF loader's
    return str(source)


def test_every_file_of_the_source_but_its_weights_is_copied_and_the_config_says_the_dtype(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    copy_model_files(_source(tmp_path), str(out), "bfloat16")
    assert sorted(os.listdir(out)) == ["chat_template.jinja", "config.json", "generation_config.json", "merges.txt",
                                       "tokenizer.json", "tokenizer.model"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _writer(tmp_path, keep) -> CheckpointSender:
    layout = SyncLayout(engine="checkpoint", host="", port=0, sender_ranks=[0], receiver_names=[], timeout_s=1.0,
                        bucket_bytes=1 << 20, checkpoint_dir=str(tmp_path / "hf"))
    return CheckpointSender(layout, 0, _source(tmp_path), keep_versions=keep)


def test_exports_every_n_steps_keep_the_newest_by_count_readable_by_others(tmp_path):
    writer = _writer(tmp_path, keep=2)
    for step in (150, 300, 340):  # versions skip: pruning counts directories, not step numbers
        writer.send(TABLE, iter([(TABLE[0][0], torch.ones(4, 2))]), step)
    assert sorted(os.listdir(tmp_path / "hf")) == ["v000300", "v000340"]
    weights = tmp_path / "hf" / "v000340" / "stage0-00000.safetensors"
    assert stat.S_IMODE(os.stat(weights).st_mode) & 0o044  # safetensors alone writes 0600
    assert "tokenizer.model" in os.listdir(tmp_path / "hf" / "v000340")


def test_a_runs_models_are_its_exports_then_each_stages(tmp_path):
    run = tmp_path / "run"
    writer = _writer(tmp_path, keep=None)
    writer.layout = SyncLayout(**{**writer.layout.as_dict(), "checkpoint_dir": str(run / "checkpoints" / "hf")})
    writer.send(TABLE, iter([(TABLE[0][0], torch.ones(4, 2))]), 7)
    for stage in ("sft", "grpo"):
        writer.write(str(run / "models" / stage), TABLE, iter([(TABLE[0][0], torch.ones(4, 2))]), 0)
    (run / "models" / "broken").mkdir()  # a stage's export that never completed (no index): not a model
    assert run_models(str(run)) == [str(run / "checkpoints" / "hf" / "v000007"), str(run / "models" / "sft"),
                                    str(run / "models" / "grpo")]
