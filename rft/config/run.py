"""The root of the config tree, `RFTConfig`, with the small sections of its own (`run`, `monitor`,
`stages`). YAML under `conf/` only selects and overrides these dataclasses; an unknown key fails
at compose time (Hydra structured configs are in struct mode)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from rft.config.algorithm import AlgorithmConfig
from rft.config.buffer import BufferConfig
from rft.config.cluster import ClusterConfig, SyncConfig
from rft.config.data import DataConfig
from rft.config.model import ModelConfig
from rft.config.rollout import BenchConfig, JudgeConfig, RolloutConfig, ServeConfig
from rft.config.trainer import TrainerConfig


@dataclass
class RunConfig:
    name: str = "run"  # run name (output folder name)
    output_dir: str = MISSING  # where logs, buffer, checkpoints and TensorBoard files go
    resume: str = "auto"  # auto: from the newest complete checkpoint, else start over | require | never (rft/runtime/run_dir.py)


@dataclass
class WandbConfig:
    """Weights & Biases (monitor.loggers: [..., wandb]); rft/runtime/trackers/wandb_tracker.py."""

    project: str = "rft"  # W&B project
    entity: Optional[str] = None  # team or user (None: your default entity)
    mode: str = "offline"  # offline: files under <run dir>/wandb, `wandb sync` them later (compute nodes often have no internet) | online
    tags: list[str] = field(default_factory=list)  # added to every rank's W&B run


@dataclass
class MlflowConfig:
    """MLflow (monitor.loggers: [..., mlflow]); rft/runtime/trackers/mlflow_tracker.py."""

    tracking_uri: Optional[str] = None  # the server (http://host:5000) or store; None: $MLFLOW_TRACKING_URI, else sqlite in the run directory
    experiment: Optional[str] = None  # MLflow experiment (None: run.name, so a sweep's runs share one)
    tags: dict[str, str] = field(default_factory=dict)  # added to every rank's MLflow run


@dataclass
class MonitorConfig:
    eval_interval: int = 0  # eval every N steps (0: only at stage start and end)
    progress: bool = True  # live progress bar in the launcher
    loggers: list[str] = field(default_factory=lambda: ["tensorboard"])  # where scalars go besides metrics/*.jsonl: tensorboard | wandb | mlflow | a dotted path
    group: Optional[str] = None  # groups the tracked runs (W&B group, MLflow tag rft.group); None: the sweep's directory name in a sweep, else the run's
    plots: bool = True  # the launcher draws plots/<stage>.png and .svg from metrics/*.jsonl as stages end
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class StageConfig:
    """One stage of a multi-stage run: a name plus overrides of the top-level sections."""

    name: str = MISSING  # stage name (TensorBoard prefix-free; summary row)
    # empty rather than None, so `+stages.1.data.selector.name=difficulty` can add to a stage's section
    algorithm: dict[str, Any] = field(default_factory=dict)  # overrides of `algorithm`
    trainer: dict[str, Any] = field(default_factory=dict)  # overrides of `trainer`
    rollout: dict[str, Any] = field(default_factory=dict)  # overrides of `rollout`
    data: dict[str, Any] = field(default_factory=dict)  # overrides of `data`


@dataclass
class RFTConfig:
    mode: str = "both"  # both: explore + train | train: offline (SFT, DPO) | explore: rollouts only | serve: the OpenAI endpoint only | bench
    seed: int = 0  # seeds data order, sampling and init on every rank
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    stages: list[StageConfig] = field(default_factory=list)  # empty: one stage from the top level


def register_configs() -> None:
    """Register the schema so `conf/config.yaml` can use it as its base (`- rft_schema`)."""
    ConfigStore.instance().store(name="rft_schema", node=RFTConfig)
