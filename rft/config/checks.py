"""`validate()`: every check of a composed config (rft/config/) before any process starts.

Each check raises the ValueError of `config_error`, naming the key, the bad value and the fix; the
launcher shows it without a traceback. Checks read files only where a value names one (tasksets,
the model's config.json), never load a model. Here: the run's and each stage's own keys; beside it,
the model's layout (layout_checks.py), the roles' modes (mode_checks.py), the judge ranks and what
asks them (judge_checks.py), and every name a registry resolves (plugin_checks.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any, Optional

from omegaconf import ListConfig

from rft.config import judge_checks, layout_checks, mode_checks, plugin_checks
from rft.config.derived import generated_data, needs_rollouts, stage_configs
from rft.config.errors import config_error
from rft.config.memory_checks import check_colocated_memory
from rft.config.model import context_length, hf_config_json
from rft.config.run import RFTConfig
from rft.config.trainer import LORA_TARGETS

RECOMPUTE_MODES = ("none", "selective", "full")  # trainer.recompute (rft/trainer/model.py)
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")  # trainer.transformer_impl (rft/trainer/layer_spec.py)
# what build_gpt_model builds once for the whole run: a stage may not change them
RUN_WIDE_TRAINER_KEYS = ("recompute", "virtual_pipeline_stages", "sequence_parallel", "transformer_impl")


OVERLONG_POLICIES = ("skip", "truncate_left", "error")  # data.overlong (rft/data/context_fit.py)


_DTYPES = ("float32", "bfloat16", "float16")


def _check_file(key: str, path: Optional[str], generated: bool) -> None:
    """A taskset path names files rft reads, and one split of a folder or glob with several
    (rft/data/sources.py: only the folder is listed, no row is read)."""
    from rft.data.sources import resolve

    if path is None or generated:
        return
    try:
        resolve(path)
    except ValueError as err:
        fix = (f"; point it at a .jsonl or .parquet taskset (e.g. `{key}=../shared/data/gsm8k/train.jsonl`), "
               f"a folder of a dataset's files, or `{key}=FOLDER@SPLIT`") if "does not exist" in str(err) else ""
        config_error(key, path, f"{err}{fix}")


def _check_expert_rows(prefix: str, stage: RFTConfig) -> None:
    """CHORD (algorithm.expert_rows, RL stages): demonstrations to draw them from, a valid mu."""
    from rft.algorithms.chord import check_chord

    algo = stage.algorithm
    check_chord(prefix, algo.expert_rows, algo.chord_mu_warmup_steps, algo.chord_mu_decay_steps,
                algo.chord_mu_peak, algo.chord_mu_valley)
    if not algo.expert_rows or not needs_rollouts(stage):  # a dataset stage (sft, dpo) inherits it unused
        return
    if stage.trainer.routing_replay == "rollout":
        config_error(f"{prefix}algorithm.expert_rows", algo.expert_rows, "expert rows have no routes to replay: use "
                     "trainer.routing_replay=none with CHORD")
    if stage.data.expert_path is not None:
        _check_file(f"{prefix}data.expert_path", stage.data.expert_path, False)


def _check_finite(node: Any, prefix: str = "") -> None:
    """No number of the config may be NaN or infinite: NaN passes every `value <= 0` check (all
    comparisons with it are false), and an infinite rate or size is no setting."""
    if dataclasses.is_dataclass(node):
        items = ((f.name, getattr(node, f.name)) for f in dataclasses.fields(node))
    elif isinstance(node, Mapping):  # also a stage's overrides, which stay DictConfigs
        items = node.items()
    elif isinstance(node, (list, tuple, ListConfig)):
        items = ((f"[{i}]", v) for i, v in enumerate(node))
    else:
        if isinstance(node, float) and not math.isfinite(node):
            config_error(prefix, node, "set a finite number")
        return
    for name, value in items:
        _check_finite(value, f"{prefix}{name}" if name.startswith("[") or not prefix else f"{prefix}.{name}")


def validate(cfg: RFTConfig) -> None:
    """Check values and paths before launch; raise ValueError naming the key and the fix."""
    _check_finite(cfg)
    if cfg.mode not in ("both", "train", "explore", "serve", "bench"):
        config_error("mode", cfg.mode, "use both (explore + train), train (offline: SFT, DPO), explore "
                     "(rollouts only), serve (the OpenAI endpoint only) or bench")
    if cfg.mode == "bench":
        mode_checks.check_bench(cfg)
    if cfg.mode == "serve":
        mode_checks.check_serve(cfg)
    mode_checks.check_engine_failure(cfg)
    mode_checks.check_colocate(cfg)
    check_colocated_memory(cfg, cfg.cluster.gpu_memory_gb)
    mode_checks.check_free_run(cfg)
    mode_checks.check_decoupled(cfg)
    from rft.runtime.trackers import check_trackers

    check_trackers(cfg)
    if cfg.run.resume not in ("auto", "require", "never"):
        config_error("run.resume", cfg.run.resume, "use auto (resume, else start over), require (resume only) or never")
    if cfg.cluster.kind not in ("auto", "local", "slurm"):
        config_error("cluster.kind", cfg.cluster.kind, "use `cluster=auto`, `cluster=local` or `cluster=slurm`")
    if cfg.cluster.trainer_ranks < 1:
        config_error("cluster.trainer_ranks", cfg.cluster.trainer_ranks, "need at least 1 trainer rank")
    for key, value, least in (("trainer.save_interval", cfg.trainer.save_interval, 0),
                              ("trainer.keep_checkpoints", cfg.trainer.keep_checkpoints, 1),
                              ("trainer.keep_hf_exports", cfg.trainer.keep_hf_exports, 0),
                              ("cluster.max_requeues", cfg.cluster.max_requeues, 0),
                              ("cluster.signal_delay_s", cfg.cluster.signal_delay_s, 0)):
        if value < least:
            config_error(key, value, f"must be >= {least}")
    rtp, gpus = cfg.rollout.tensor_parallel_size, cfg.cluster.gpus_per_node
    span = rtp if gpus else 1  # tasks per vLLM engine (Topology.engine_span)
    if cfg.mode in ("both", "explore", "serve") and rtp >= 1 and cfg.cluster.rollout_ranks % span:
        config_error("cluster.rollout_ranks", cfg.cluster.rollout_ranks,
                     f"must be a multiple of rollout.tensor_parallel_size={rtp}: on GPU nodes a vLLM engine "
                     "takes one task (one GPU) per TP rank")
    if cfg.mode in ("both", "explore", "serve") and cfg.cluster.rollout_ranks < max(span, 1):
        config_error("cluster.rollout_ranks", cfg.cluster.rollout_ranks,
                     f"need at least one vLLM engine: {max(span, 1)} rank(s) here")
    if cfg.model.max_seq_len < 2:
        config_error("model.max_seq_len", cfg.model.max_seq_len, "use the longest prompt + response to allow, e.g. 4096")
    if cfg.model.dtype not in _DTYPES:
        config_error("model.dtype", cfg.model.dtype, f"choose one of {_DTYPES}")
    model_generated = cfg.model.tiny is not None
    if not model_generated and not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        config_error("model.path", cfg.model.path,
              "not an HF model directory (no config.json); for SmolLM2-135M run "
              "`python tools/prepare_smollm2.py` and pass `model=smollm2_135m`, or set "
              "`model.path=/path/to/hf_model`")
    written = {path for section in generated_data(cfg) for path in (section.data.train_path, section.data.eval_path)}
    for name, stage in stage_configs(cfg) if cfg.mode != "serve" else ():  # serving reads no tasksets
        prefix = f"stages[{name}]." if cfg.stages else ""
        algo, trainer, rollout, data = stage.algorithm, stage.trainer, stage.rollout, stage.data
        for generator in ("arithmetic", "shapes"):
            if getattr(data, generator) is not None and data.eval_path is None:
                config_error(f"{prefix}data.eval_path", None, f"data.{generator} writes a held-out set there; "
                                                       "set it to a .jsonl path")
        if data.from_env is not None:
            plugin_checks.check_env_tasks(prefix, stage)
        _check_file(f"{prefix}data.train_path", data.train_path, data.train_path in written)
        _check_file(f"{prefix}data.eval_path", data.eval_path, data.eval_path in written)
        plugin_checks.check_algorithm(prefix, algo)
        _check_expert_rows(prefix, stage)
        if cfg.mode == "train" and algo.policy_loss not in ("sft", "dpo") and not cfg.sync.decoupled:
            config_error(f"{prefix}algorithm.policy_loss", algo.policy_loss,
                         "mode=train learns from datasets only: use sft or dpo, mode=both for RL, or sync.decoupled=true "
                         "for a trainer job beside a mode=explore job")
        if cfg.mode == "explore" and not needs_rollouts(stage):
            config_error(f"{prefix}algorithm.policy_loss", algo.policy_loss,
                         "mode=explore only generates rollouts: a dataset stage (sft, dpo) has nothing to do")
        if cfg.mode == "both" and algo.policy_loss == "dpo":
            config_error(f"{prefix}algorithm.policy_loss", algo.policy_loss,
                         "DPO trains offline on preference pairs: run it with mode=train")
        plugin_checks.check_rollout_plugins(prefix, stage)
        plugin_checks.check_data_pipeline(prefix, stage)
        if not 0 < algo.clip_eps < 1:
            config_error(f"{prefix}algorithm.clip_eps", algo.clip_eps, "use a value in (0, 1), e.g. 0.2")
        if algo.lr <= 0:
            config_error(f"{prefix}algorithm.lr", algo.lr, "learning rate must be positive")
        if trainer.max_steps < 0:
            config_error(f"{prefix}trainer.max_steps", trainer.max_steps, "use 0 or more steps")
        if trainer.micro_batch_size < 1:
            config_error(f"{prefix}trainer.micro_batch_size", trainer.micro_batch_size, "use 1 or more")
        if trainer.max_tokens_per_microbatch < 0:
            config_error(f"{prefix}trainer.max_tokens_per_microbatch", trainer.max_tokens_per_microbatch,
                         "use 0 (microbatches of trainer.micro_batch_size padded rows) or a token budget, e.g. 4096")
        if trainer.logprob_chunk < 0:
            config_error(f"{prefix}trainer.logprob_chunk", trainer.logprob_chunk,
                         "use 0 (whole logits) or positions per chunk of the fused output layer, e.g. 2048")
        if trainer.lora.rank < 0:
            config_error(f"{prefix}trainer.lora.rank", trainer.lora.rank, "use 0 (no adapters) or a rank, e.g. 16")
        if trainer.lora.rank:
            unknown = sorted(set(trainer.lora.target_modules) - set(LORA_TARGETS))
            if unknown or not trainer.lora.target_modules:
                config_error(f"{prefix}trainer.lora.target_modules", trainer.lora.target_modules,
                             f"use some of {list(LORA_TARGETS)}")
            if not 0 <= trainer.lora.dropout < 1:
                config_error(f"{prefix}trainer.lora.dropout", trainer.lora.dropout, "use a value in [0, 1)")
        if trainer.freeze_vision:
            _check_freeze_vision(cfg, prefix, trainer)
        if trainer.loss_scale is not None and trainer.loss_scale <= 0:
            config_error(f"{prefix}trainer.loss_scale", trainer.loss_scale,
                         "use a positive scale, or null for dynamic scaling with fp16 (1 with bf16/fp32)")
        tp = trainer.tensor_parallel_size
        if cfg.cluster.trainer_ranks % tp:
            config_error(f"{prefix}trainer.tensor_parallel_size", tp,
                  f"must divide cluster.trainer_ranks={cfg.cluster.trainer_ranks}")
        pp = trainer.pipeline_parallel_size
        if pp < 1 or cfg.cluster.trainer_ranks % (tp * pp):
            config_error(f"{prefix}trainer.pipeline_parallel_size", pp,
                  f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} must divide "
                  f"cluster.trainer_ranks={cfg.cluster.trainer_ranks}")
        if rollout.max_sampling_rounds < 1:
            config_error(f"{prefix}rollout.max_sampling_rounds", rollout.max_sampling_rounds, "use 1 or more")
        if rollout.tasks_per_step < 1:
            config_error(f"{prefix}rollout.tasks_per_step", rollout.tasks_per_step, "use 1 or more")
        if rollout.max_new_tokens < 1:
            config_error(f"{prefix}rollout.max_new_tokens", rollout.max_new_tokens, "use 1 or more")
        context = context_length(cfg.model)
        if (needs_rollouts(stage) or data.eval_path) and rollout.max_new_tokens >= context:
            config_error(f"{prefix}rollout.max_new_tokens", rollout.max_new_tokens,
                         f"leaves no room for a prompt in the model's context of {context} tokens "
                         "(model.max_seq_len, capped by max_position_embeddings); lower it")
        if data.overlong not in OVERLONG_POLICIES:
            config_error(f"{prefix}data.overlong", data.overlong, f"choose one of {OVERLONG_POLICIES}")
        if rollout.tensor_parallel_size < 1:
            config_error(f"{prefix}rollout.tensor_parallel_size", rollout.tensor_parallel_size, "use 1 or more")
        if rollout.kv_cache_gb is not None and not rollout.kv_cache_gb > 0:
            config_error(f"{prefix}rollout.kv_cache_gb", rollout.kv_cache_gb,
                         "use a positive number of GiB, or null (CPU: 1 GiB; GPUs: rollout.gpu_memory_utilization)")
        if rollout.tensor_parallel_size != cfg.rollout.tensor_parallel_size:
            config_error(f"{prefix}rollout.tensor_parallel_size", rollout.tensor_parallel_size,
                  "the vLLM engine lives for the whole run; set rollout.tensor_parallel_size globally")
        if (tp, pp) != (cfg.trainer.tensor_parallel_size, cfg.trainer.pipeline_parallel_size):
            config_error(f"{prefix}trainer.tensor_parallel_size/pipeline_parallel_size", (tp, pp),
                  "the trainer's model layout lives for the whole run; set it globally")
        if trainer.recompute not in RECOMPUTE_MODES:
            config_error(f"{prefix}trainer.recompute", trainer.recompute, f"choose one of {RECOMPUTE_MODES}")
        for key in RUN_WIDE_TRAINER_KEYS:
            if getattr(trainer, key) != getattr(cfg.trainer, key):
                config_error(f"{prefix}trainer.{key}", getattr(trainer, key),
                             f"the trainer's model is built once for the run; set trainer.{key} globally")
        vpp = trainer.virtual_pipeline_stages
        if vpp < 1 or (vpp > 1 and pp < 2):
            config_error(f"{prefix}trainer.virtual_pipeline_stages", vpp,
                         "use 1, or 2 or more model chunks per stage with trainer.pipeline_parallel_size >= 2")
        if trainer.sequence_parallel and tp < 2:
            config_error(f"{prefix}trainer.sequence_parallel", True,
                         "splits the sequence over tensor-parallel ranks: set trainer.tensor_parallel_size "
                         "to 2 or more, or sequence_parallel=false")
        if trainer.sequence_parallel and trainer.lora.rank:
            config_error(f"{prefix}trainer.sequence_parallel", True,
                         "LoRA adapters see the layers' inputs before Megatron gathers the sequence: "
                         "set trainer.sequence_parallel=false with trainer.lora.rank > 0")
        if trainer.transformer_impl not in TRANSFORMER_IMPLS:
            config_error(f"{prefix}trainer.transformer_impl", trainer.transformer_impl,
                         f"choose one of {TRANSFORMER_IMPLS}")
        if trainer.lora.rank and cfg.trainer.transformer_impl == "transformer_engine":
            config_error("trainer.transformer_impl", "transformer_engine",
                         f"{prefix}trainer.lora.rank > 0 needs the local layers: Transformer Engine fuses "
                         "each norm into the linear an adapter wraps, which would see the input before "
                         "its norm. Set trainer.transformer_impl=auto or local")
    if cfg.sync.interval < 1:
        config_error("sync.interval", cfg.sync.interval, "use 1 (a sync after every step) or more")
    if cfg.sync.offset < 0:
        config_error("sync.offset", cfg.sync.offset, "use 0 (synchronous) or more steps ahead")
    if cfg.buffer.max_staleness is not None and cfg.buffer.max_staleness < 0:
        config_error("buffer.max_staleness", cfg.buffer.max_staleness, "use 0 or more trainer steps, or null")
    if cfg.buffer.stale not in ("drop", "reweight"):
        config_error("buffer.stale", cfg.buffer.stale, "use drop or reweight")
    layout_checks.check_model_family(cfg)
    layout_checks.check_parallel_layout(cfg)
    layout_checks.check_transformer_engine(cfg)
    judge_checks.check_judge(cfg)
    if cfg.sync.engine not in ("auto", "nccl", "gloo", "checkpoint"):
        config_error("sync.engine", cfg.sync.engine, "choose auto, nccl, gloo or checkpoint")
    if cfg.sync.bucket_mb < 1:
        config_error("sync.bucket_mb", cfg.sync.bucket_mb, "use 1 or more MiB")
    layout_checks.check_lora_sync(cfg)
    if cfg.sync.wire_dtype != "auto" and cfg.sync.wire_dtype not in _DTYPES:
        config_error("sync.wire_dtype", cfg.sync.wire_dtype, f"use auto or one of {_DTYPES}")
    if cfg.buffer.format not in ("parquet", "arrow"):
        config_error("buffer.format", cfg.buffer.format, "use `parquet` or `arrow`")


def _check_freeze_vision(cfg: RFTConfig, prefix: str, trainer) -> None:
    """trainer.freeze_vision needs a vision tower, and is for full training (LoRA trains adapters
    on the language model's layers only, the vision tower already untouched)."""
    from rft.models.families import is_vision_language

    tiny = cfg.model.tiny
    if not (tiny.vision if tiny is not None else is_vision_language(hf_config_json(cfg.model) or {})):
        config_error(f"{prefix}trainer.freeze_vision", True, f"model {cfg.model.name} has no vision tower; drop it")
    if prefix and not cfg.trainer.freeze_vision:
        config_error(f"{prefix}trainer.freeze_vision", True, "it holds for the whole run: set trainer.freeze_vision "
                     "at the top level, not in one stage")
    if trainer.lora.rank:
        config_error(f"{prefix}trainer.freeze_vision", True, "a LoRA stage trains adapters on the language model "
                     "only: the vision tower keeps its weights already; drop trainer.freeze_vision")
