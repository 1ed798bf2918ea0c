"""The copy of each sync's weights an engine keeps for a restart (rollout.on_engine_failure=restart,
rft/explorer/vllm_worker.py's WeightCopy): every bucket that reaches the model is written as it
arrives, a restart reads back the same tensors, and only the newest version is kept."""

import glob
import os

import torch
from safetensors import safe_open

from rft.explorer.vllm_worker import WeightCopy


def _read(path: str) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            found.update({name: f.get_tensor(name) for name in f.keys()})
    return found


def _sync(root, version: int, buckets: list[list[tuple[str, torch.Tensor]]]) -> tuple[str, list[str]]:
    """One sync through a WeightCopy: its directory, and the names the model was given."""
    loaded, copy = [], WeightCopy(str(root))
    load = copy.keeping(lambda named: loaded.extend(name for name, _ in named))
    reused = torch.empty(16)  # the receiver's bucket buffer, overwritten by the next bucket
    for bucket in buckets:
        views, offset = [], 0
        for name, tensor in bucket:
            reused[offset: offset + tensor.numel()] = tensor.flatten()
            views.append((name, reused[offset: offset + tensor.numel()].view(tensor.shape)))
            offset += tensor.numel()
        load(iter(views))
    return copy.commit(version), loaded


def test_a_restart_reads_back_the_weights_of_the_last_sync_and_only_those(tmp_path):
    first = [[("model.embed_tokens.weight", torch.arange(6.0).view(2, 3))], [("model.norm.weight", torch.ones(2))]]
    path, loaded = _sync(tmp_path, 3, first)
    assert path == str(tmp_path / "v3") and loaded == ["model.embed_tokens.weight", "model.norm.weight"]
    kept = _read(path)
    assert torch.equal(kept["model.embed_tokens.weight"], torch.arange(6.0).view(2, 3))  # not the reused buffer's
    assert torch.equal(kept["model.norm.weight"], torch.ones(2))
    second = [[("model.embed_tokens.weight", torch.full((2, 3), 7.0)), ("model.norm.weight", torch.zeros(2))]]
    path, _ = _sync(tmp_path, 4, second)
    assert sorted(os.listdir(tmp_path)) == ["v4"]  # the older copy went, and nothing half written stays
    assert torch.equal(_read(path)["model.embed_tokens.weight"], torch.full((2, 3), 7.0))
