"""The typed config tree: every key rft understands, its default and a one-line doc.

One schema module per section (model, data, algorithm, rollout, trainer, buffer, cluster; run.py
holds the root `RFTConfig`); derived.py computes what follows from a composed config; checks.py
validates one before any process starts (`validate()`, imported from there: it reads the
extension registries, which sit above this package). This package imports nothing of rft but
itself, so every other layer may import it. Each key's doc line is the comment beside its field;
the docs site's configuration reference is generated from them (reference.py).
"""

from rft.config.algorithm import LR_DECAYS, AlgorithmConfig
from rft.config.buffer import BufferConfig, ReplayConfig
from rft.config.cluster import ClusterConfig, SyncConfig
from rft.config.data import (
                             ArithmeticTaskConfig,
                             DataConfig,
                             EnvTasksConfig,
                             JudgeDifficultyConfig,
                             SelectorConfig,
                             ShapesTaskConfig,
                             operator_specs,
)
from rft.config.derived import (
                             VLLM_LORA_RANKS,
                             adapter_sync,
                             buffer_dir,
                             generated_data,
                             judge_model,
                             judge_span,
                             needs_critic,
                             needs_rollouts,
                             stage_configs,
                             sync_engine,
                             trains_lora,
                             vllm_lora_rank,
                             wire_dtype,
                             world_size,
)
from rft.config.errors import config_error
from rft.config.model import ModelConfig, TinyModelConfig, context_length, hf_config_json
from rft.config.reference import field_doc
from rft.config.rollout import BenchConfig, JudgeConfig, RolloutConfig, ServeConfig
from rft.config.run import MonitorConfig, RFTConfig, RunConfig, StageConfig, register_configs
from rft.config.trainer import LORA_TARGETS, LoRAConfig, TrainerConfig

__all__ = [
    "LORA_TARGETS", "LR_DECAYS", "VLLM_LORA_RANKS", "AlgorithmConfig", "ArithmeticTaskConfig", "BenchConfig",
    "BufferConfig", "ClusterConfig", "DataConfig", "EnvTasksConfig", "JudgeConfig", "JudgeDifficultyConfig",
    "LoRAConfig", "ModelConfig", "MonitorConfig", "RFTConfig", "ReplayConfig", "RolloutConfig", "RunConfig",
    "SelectorConfig", "ServeConfig", "ShapesTaskConfig", "StageConfig", "SyncConfig", "TinyModelConfig", "TrainerConfig",
    "adapter_sync", "buffer_dir", "config_error", "context_length", "field_doc", "generated_data", "hf_config_json",
    "judge_model", "judge_span", "needs_critic", "needs_rollouts", "operator_specs", "register_configs", "stage_configs",
    "sync_engine", "trains_lora", "vllm_lora_rank", "wire_dtype", "world_size",
]
