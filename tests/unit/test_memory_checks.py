"""The colocated-memory check before submit (rft/config/memory_checks.py): the parameter count from
config.json, the trainer's resident bytes per GPU, and a layout that cannot fit refused naming keys."""

import json

import pytest

from rft.config import ClusterConfig, RFTConfig
from rft.config.memory_checks import check_colocated_memory, parameter_count, trainer_bytes_per_gpu

# Qwen2.5-1.5B's config.json sizes: 1.54B parameters as its model card states (1.31B without embeddings)
QWEN25_1_5B = {"hidden_size": 1536, "num_hidden_layers": 28, "vocab_size": 151936, "num_attention_heads": 12,
               "num_key_value_heads": 2, "intermediate_size": 8960, "tie_word_embeddings": True}


def test_the_parameter_count_of_a_known_model():
    assert parameter_count(QWEN25_1_5B) == pytest.approx(1.54e9, rel=0.01)
    assert parameter_count({"hidden_size": 8}) is None  # sizes missing: no estimate


def _colocated(tmp_path, trainer_ranks: int = 1, utilization: float = 0.85, **trainer) -> RFTConfig:
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_1_5B))
    cfg = RFTConfig(cluster=ClusterConfig(kind="slurm", colocate=True, gpus_per_node=trainer_ranks,
                                          trainer_ranks=trainer_ranks, rollout_ranks=trainer_ranks))
    cfg.model.path, cfg.rollout.gpu_memory_utilization = str(tmp_path), utilization
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    return cfg


def test_the_trainer_keeps_18_bytes_a_parameter_at_dp1_and_shards_the_optimizer_over_dp(tmp_path):
    params = parameter_count(QWEN25_1_5B)
    assert trainer_bytes_per_gpu(_colocated(tmp_path), params) == 18 * params
    assert trainer_bytes_per_gpu(_colocated(tmp_path, trainer_ranks=4), params) == (6 + 12 / 4) * params
    assert trainer_bytes_per_gpu(_colocated(tmp_path, tensor_parallel_size=2), params) == 9 * params


def test_a_colocated_layout_that_cannot_fit_is_refused_naming_the_keys(tmp_path):
    # 1.54B x 18 B = 27.8 GB of trainer state beside 0.85 x 80 GB of woken engine
    with pytest.raises(ValueError, match=r"cluster\.colocate=True is invalid: the trainer's resident state \(27\.8 GB "
                                         r"per GPU for 1\.54B parameters.*lower rollout\.gpu_memory_utilization to 0\.60"):
        check_colocated_memory(_colocated(tmp_path), 80)
    check_colocated_memory(_colocated(tmp_path, utilization=0.6), 80)  # what it says fits
    check_colocated_memory(_colocated(tmp_path), None)  # the GPU's memory not known: not checked
    with pytest.raises(ValueError, match=r"split the trainer further"):
        check_colocated_memory(_colocated(tmp_path), 24)  # the trainer state alone nearly fills a 24 GB GPU
