"""`validate()`: every check of a composed config (rft/config/) before any process starts.

Each check raises the ValueError of `config_error`, naming the key, the bad value and the fix; the
launcher shows it without a traceback. Checks read files only where a value names one (tasksets,
the model's config.json), never load a model.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any, Optional

from omegaconf import ListConfig

from rft.config import plugin_checks
from rft.config.derived import (
    VLLM_LORA_RANKS,
    generated_data,
    judge_model,
    judge_span,
    needs_rollouts,
    stage_configs,
    vllm_lora_rank,
)
from rft.config.errors import config_error
from rft.config.model import context_length, hf_config_json
from rft.config.run import RFTConfig
from rft.config.trainer import LORA_TARGETS

ROUTING_REPLAY_MODES = ("none", "rollout")  # trainer.routing_replay (rft/trainer/routing_replay.py)
RECOMPUTE_MODES = ("none", "selective", "full")  # trainer.recompute (rft/trainer/model.py)
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")  # trainer.transformer_impl (rft/trainer/layer_spec.py)
# what build_gpt_model builds once for the whole run: a stage may not change them
RUN_WIDE_TRAINER_KEYS = ("recompute", "virtual_pipeline_stages", "sequence_parallel", "transformer_impl")


OVERLONG_POLICIES = ("skip", "truncate_left", "error")  # data.overlong (rft/data/context_fit.py)


_DTYPES = ("float32", "bfloat16", "float16")


def _check_file(key: str, path: Optional[str], generated: bool) -> None:
    if path is None or generated:
        return
    if not os.path.exists(path):
        config_error(key, path, "no such file; point it at a .jsonl or .parquet taskset "
                         f"(e.g. `{key}=../shared/data/gsm8k/train.jsonl`)")
    if not path.endswith((".jsonl", ".json", ".parquet")):
        config_error(key, path, "use a .jsonl or .parquet file")


def _model_shape(cfg: RFTConfig) -> Optional[tuple[int, int, int]]:
    """(attention heads, key/value heads, layers) of the model, read without loading it."""
    hf = hf_config_json(cfg.model)
    if hf is None:
        return None
    heads = hf.get("num_attention_heads", 1)
    return heads, hf.get("num_key_value_heads") or heads, hf.get("num_hidden_layers", 1)


def _check_model_family(cfg: RFTConfig) -> None:
    """The trainer knows the model's architecture and RoPE variant (rft/models/families.py); a
    model the run only samples from (mode=explore|serve|bench) needs neither."""
    from rft.models.families import check_rope, family, num_experts

    hf = hf_config_json(cfg.model)
    if hf is None or cfg.model.tiny is not None or cfg.mode not in ("both", "train"):
        return
    try:
        family(hf)
        check_rope(hf)
    except ValueError as err:
        config_error("model.path", cfg.model.path, f"its config.json: {err}")
    _check_experts(cfg, num_experts(hf))


def _check_experts(cfg: RFTConfig, experts: int) -> None:
    """Expert parallelism needs experts to split, in equal parts, over ranks of a pipeline stage;
    LoRA adapters cover dense layers only."""
    trainer = cfg.trainer
    ep, tp, pp = trainer.expert_parallel_size, trainer.tensor_parallel_size, trainer.pipeline_parallel_size
    if ep < 1:
        config_error("trainer.expert_parallel_size", ep, "use 1 or more")
    if ep > 1 and not experts:
        config_error("trainer.expert_parallel_size", ep, f"model.path={cfg.model.path!r} has no experts to split: use 1")
    if experts and experts % ep:
        config_error("trainer.expert_parallel_size", ep, f"must divide the model's {experts} experts")
    stage_ranks = cfg.cluster.trainer_ranks // max(pp, 1)
    if ep > 1 and stage_ranks % ep:
        config_error("trainer.expert_parallel_size", ep,
                     f"must divide the {stage_ranks} trainer ranks of a pipeline stage (cluster.trainer_ranks / "
                     f"trainer.pipeline_parallel_size = TP {tp} x DP {stage_ranks // max(tp, 1)})")
    if trainer.moe_aux_loss_coeff is not None and trainer.moe_aux_loss_coeff < 0:
        config_error("trainer.moe_aux_loss_coeff", trainer.moe_aux_loss_coeff, "use 0 (off) or more, or null")
    if trainer.routing_replay not in ROUTING_REPLAY_MODES:
        config_error("trainer.routing_replay", trainer.routing_replay, f"choose one of {ROUTING_REPLAY_MODES}")
    if trainer.routing_replay == "rollout" and not experts:
        config_error("trainer.routing_replay", "rollout",
                     f"model.path={cfg.model.path!r} has no experts to route: use none")
    if trainer.routing_replay == "rollout" and cfg.rollout.partial_rollout:
        config_error("rollout.partial_rollout", True, "a sample cut by a weight update goes on in a new request, whose "
                     "routed experts cover only its own tokens: use partial_rollout=false with "
                     "trainer.routing_replay=rollout")
    if trainer.routing_replay == "rollout" and trainer.recompute == "full":
        config_error("trainer.routing_replay", "rollout", "trainer.recompute=full re-runs the routers in backward, "
                     "after the replayed routes are released: use recompute=none or selective")
    if experts:
        for name, stage in stage_configs(cfg):
            prefix = f"stages[{name}]." if cfg.stages else ""
            if stage.trainer.lora.rank:
                config_error(f"{prefix}trainer.lora.rank", stage.trainer.lora.rank,
                             "LoRA adapters are not supported on mixture-of-experts models yet: set it to 0")


def _check_parallel_layout(cfg: RFTConfig) -> None:
    """TP must split whole heads and key/value groups, PP whole layers (trainer and vLLM alike)."""
    shape = _model_shape(cfg)
    if shape is None:
        return
    heads, kv_heads, layers = shape
    tp, pp = cfg.trainer.tensor_parallel_size, cfg.trainer.pipeline_parallel_size
    if heads % tp or kv_heads % tp:
        config_error("trainer.tensor_parallel_size", tp,
              f"must divide the model's {heads} attention heads and {kv_heads} key/value heads")
    if layers % pp:
        config_error("trainer.pipeline_parallel_size", pp, f"must divide the model's {layers} layers")
    vpp = cfg.trainer.virtual_pipeline_stages
    if vpp > 1 and layers % (pp * vpp):
        config_error("trainer.virtual_pipeline_stages", vpp,
                     f"pipeline_parallel_size x virtual_pipeline_stages = {pp} x {vpp} must divide the "
                     f"model's {layers} layers")
    rtp = cfg.rollout.tensor_parallel_size
    if heads % rtp:
        config_error("rollout.tensor_parallel_size", rtp, f"must divide the model's {heads} attention heads")


def _check_serve(cfg: RFTConfig) -> None:
    if not cfg.serve.step_s > 0:
        config_error("serve.step_s", cfg.serve.step_s, "use a positive number of seconds")
    if cfg.serve.duration_min is not None and not cfg.serve.duration_min > 0:
        config_error("serve.duration_min", cfg.serve.duration_min, "use a positive number of minutes, or null")


def _check_judge(cfg: RFTConfig) -> None:
    judges, span = cfg.cluster.judge_ranks, judge_span(cfg)
    if judges < 0 or (judges and cfg.mode not in ("both", "explore")):
        config_error("cluster.judge_ranks", judges, "use 0, or judge ranks in a run that explores (mode=both|explore)")
    if cfg.judge.tensor_parallel_size < 1:
        config_error("judge.tensor_parallel_size", cfg.judge.tensor_parallel_size, "use 1 or more")
    if judges % span:
        config_error("cluster.judge_ranks", judges, f"must be a multiple of judge.tensor_parallel_size={span}: "
                     "on GPU nodes a judge engine takes one task (one GPU) per TP rank")
    if cfg.judge.kind not in ("generate", "classify"):
        config_error("judge.kind", cfg.judge.kind, "use generate (an LLM judge) or classify (a reward model: an HF "
                     "sequence-classification model in judge.model)")
    if not cfg.judge.timeout_s > 0:
        config_error("judge.timeout_s", cfg.judge.timeout_s, "use a positive number of seconds")
    if cfg.judge.max_new_tokens < 1:
        config_error("judge.max_new_tokens", cfg.judge.max_new_tokens, "use 1 or more")
    for name, stage in stage_configs(cfg):
        kind = _judge_kind(stage.algorithm.reward)
        key = f"{f'stages[{name}].' if cfg.stages else ''}algorithm.reward"
        if kind and not judges:
            config_error(key, stage.algorithm.reward, f"asks a judge engine: add cluster.judge_ranks=1 and "
                         f"judge.kind={kind} (judge.model=<HF model directory>; default: the policy's starting weights)")
        if kind and cfg.judge.kind != kind:
            config_error(key, stage.algorithm.reward, f"needs judge.kind={kind} (judge.kind={cfg.judge.kind})")
        if stage.algorithm.reward == "relative_judge":
            _check_relative_judge(cfg)
    if judges and cfg.judge.model is not None and not os.path.isfile(os.path.join(cfg.judge.model, "config.json")):
        config_error("judge.model", cfg.judge.model, "not an HF model directory (no config.json); "
                     "or leave it unset to judge with the policy's starting weights (model.path)")
    _check_teacher(cfg)


def _judge_kind(reward: str) -> str | None:
    """The judge.kind a reward asks for (its registry entry's `judge_kind`, or a user reward's
    `rft_meta`); None for one that asks no judge, or a name the plugin checks will refuse."""
    from rft.explorer.rewards import REWARDS

    try:
        return REWARDS.meta(REWARDS.resolve(reward)).get("judge_kind")
    except ValueError:
        return None


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


def _check_teacher(cfg: RFTConfig) -> None:
    """On-policy distillation (an advantage registered needs_teacher): a generating judge engine
    serves the teacher, named explicitly, with the student's tokenizer."""
    from rft.explorer.teacher import check_same_tokenizer, needs_teacher

    if cfg.mode not in ("both", "explore"):  # a trainer job reads rows the explorer job had scored
        return
    for name, stage in stage_configs(cfg):
        if not needs_rollouts(stage) or not needs_teacher(stage.algorithm.advantage):
            continue
        key = f"{f'stages[{name}].' if cfg.stages else ''}algorithm.advantage"
        if not cfg.cluster.judge_ranks or cfg.judge.kind != "generate":
            config_error(key, stage.algorithm.advantage, "distils from a teacher served by a judge engine: add "
                         "cluster.judge_ranks=1, judge.kind=generate and judge.model=<the teacher's HF directory>")
        if cfg.judge.model is None:
            config_error("judge.model", None, f"{key}={stage.algorithm.advantage} needs a teacher: set judge.model "
                         "to its HF directory (unset, the judge would be the student's own starting weights)")
        if os.path.isfile(os.path.join(cfg.model.path or "", "config.json")):  # a tiny model is made at run time
            try:
                check_same_tokenizer(cfg.judge.model, cfg.model.path)
            except ValueError as err:
                config_error("judge.model", cfg.judge.model, str(err).split(": ", 1)[1])


def _check_relative_judge(cfg: RFTConfig) -> None:
    """The keys relative_judge reads (rft/explorer/relative_judge.py)."""
    from rft.explorer.relative_judge import looks_like_path

    judge = cfg.judge
    if judge.rubric is not None and not judge.rubric.strip():
        config_error("judge.rubric", judge.rubric, "give the grading standards as text or a text file's path, "
                     "or null for the built-in rubric")
    if judge.rubric and looks_like_path(judge.rubric) and not os.path.isfile(judge.rubric):
        config_error("judge.rubric", judge.rubric, "no such file: give the path of a text file holding the rubric "
                     "(on a filesystem every node sees), or the rubric's text itself")
    if judge.relative_max_new_tokens < 1:
        config_error("judge.relative_max_new_tokens", judge.relative_max_new_tokens, "use 1 or more")
    context = context_length(judge_model(cfg))
    if judge.relative_max_new_tokens >= context:
        config_error("judge.relative_max_new_tokens", judge.relative_max_new_tokens,
                     f"the judge's context holds {context} tokens, prompt and answer together (the group's answers, "
                     f"a rubric and a score per answer): use fewer, or a judge.model with a longer context")
    if judge.chat_template and judge.model is None and not cfg.model.chat_template:
        config_error("judge.chat_template", judge.chat_template, "the judge is the policy's model (judge.model unset), "
                     "which has no chat template (model.chat_template=false): set judge.chat_template=false (a "
                     "plain prompt) or judge.model=<an instruct model's HF directory>")


def _check_engine_failure(cfg: RFTConfig) -> None:
    policy, span = cfg.rollout.on_engine_failure, cfg.rollout.tensor_parallel_size if cfg.cluster.gpus_per_node else 1
    if policy not in ("fail", "continue"):
        config_error("rollout.on_engine_failure", policy, "use fail (a lost engine ends the job) or continue "
                     "(the other engines take its tasks)")
    if policy == "continue" and cfg.mode != "both":
        config_error("rollout.on_engine_failure", policy, f"continue needs a trainer to go on with (mode=both); "
                     f"mode={cfg.mode}'s engines host the job's meetings themselves")
    if policy == "continue" and cfg.cluster.rollout_ranks // max(span, 1) < 2:
        config_error("rollout.on_engine_failure", policy, "continue needs two engines or more "
                     f"(cluster.rollout_ranks={cfg.cluster.rollout_ranks} makes one): nothing could go on")


def _check_colocate(cfg: RFTConfig) -> None:
    """Colocated roles (rft/runtime/colocation.py) take turns with the GPUs they share."""
    c, level = cfg.cluster, cfg.rollout.sleep_level
    if level not in (1, 2):
        config_error("rollout.sleep_level", level, "use 1 (weights to host memory, KV cache dropped) or 2 (both dropped)")
    if not c.colocate:
        return
    why = "cluster.colocate=true: "
    if cfg.mode != "both":
        config_error("cluster.colocate", True, why + f"the trainer and the rollout ranks share GPUs; mode={cfg.mode} "
                     "runs one role only: use cluster.colocate=false")
    if cfg.sync.offset != 0:
        config_error("sync.offset", cfg.sync.offset, why + "the roles take turns with the GPUs, so the explorer cannot "
                     "run ahead of the trainer: use sync.offset=0")
    if c.rollout_ranks != c.trainer_ranks:
        config_error("cluster.rollout_ranks", c.rollout_ranks, why + "rollout rank T+i runs on trainer rank i's GPU: "
                     f"use cluster.rollout_ranks={c.trainer_ranks} (cluster.trainer_ranks)")
    if c.judge_ranks:
        config_error("cluster.judge_ranks", c.judge_ranks, why + "judge engines do not sleep; run them disjoint "
                     "(cluster.colocate=false) or use cluster.judge_ranks=0")
    if cfg.rollout.on_engine_failure != "fail":
        config_error("rollout.on_engine_failure", cfg.rollout.on_engine_failure, why + "an engine lost takes its "
                     "trainer rank's GPU with it: use rollout.on_engine_failure=fail")
    if cfg.sync.engine == "nccl":
        config_error("sync.engine", "nccl", why + "NCCL cannot join two processes on one GPU: use sync.engine=auto "
                     "(the checkpoint engine; sync.checkpoint_dir=/dev/shm/... keeps it in node memory)")
    if cfg.sync.lora == "adapter" and vllm_lora_rank(cfg):
        config_error("sync.lora", "adapter", why + "adapters travel over the weight groups, and colocated "
                     "weights through the checkpoint engine: use sync.lora=merged")


def _check_free_run(cfg: RFTConfig) -> None:
    """A free-running explorer (rft/runtime/free_run.py) is bounded by the staleness limit alone."""
    if not cfg.sync.free_run:
        return
    why = "sync.free_run=true: "
    _check_lead(cfg, why)
    if cfg.sync.offset:
        config_error("sync.offset", cfg.sync.offset, why + "the explorer's lead is buffer.max_staleness, not a "
                     "fixed offset: use sync.offset=0")
    if cfg.cluster.colocate:
        config_error("cluster.colocate", True, why + "colocated roles take turns with their GPUs, so neither runs "
                     "free: use one of the two")
    if cfg.rollout.on_engine_failure != "fail":
        config_error("rollout.on_engine_failure", cfg.rollout.on_engine_failure, why + "engines that may be lost "
                     "are not supported yet when running free: use rollout.on_engine_failure=fail")


def _check_lead(cfg: RFTConfig, why: str) -> None:
    """An explorer that runs free of the trainer is held back by the staleness bound alone."""
    lead = cfg.buffer.max_staleness
    if lead is None or lead < cfg.sync.interval - 1:
        config_error("buffer.max_staleness", lead, why + "the explorer runs ahead while its shards stay within "
                     f"this many trainer steps of their weights; use {max(1, cfg.sync.interval - 1)} or more "
                     f"(at least sync.interval - 1 = {cfg.sync.interval - 1}, or it would wait for weights "
                     "the trainer never sends)")


def _check_decoupled(cfg: RFTConfig) -> None:
    """Decoupled jobs (rft/runtime/decoupled.py) share a buffer and a weights directory only."""
    if not cfg.sync.decoupled:
        return
    why = "sync.decoupled=true: "
    if cfg.mode not in ("explore", "train"):
        config_error("mode", cfg.mode, why + "the explorer and the trainer run as two jobs: launch one with mode=explore "
                     "and one with mode=train, with the same run.output_dir (mode=both runs both in one job)")
    if cfg.sync.engine not in ("auto", "checkpoint"):
        config_error("sync.engine", cfg.sync.engine, why + "the jobs share no process group; weights go through "
                     "sync.checkpoint_dir: use sync.engine=auto")
    for key, value, fix in (("sync.free_run", cfg.sync.free_run, "decoupled exploration runs free already: drop it"),
                            ("sync.offset", cfg.sync.offset, "the explorer's lead is buffer.max_staleness: use 0"),
                            ("cluster.colocate", cfg.cluster.colocate, "two jobs have two allocations: use false"),
                            ("rollout.partial_rollout", cfg.rollout.partial_rollout, "not supported yet between jobs")):
        if value:
            config_error(key, value, why + fix)
    _check_lead(cfg, why)
    if cfg.run.resume == "never":
        config_error("run.resume", "never", why + "the two jobs share the run's experience and weights, so one cannot "
                     "start over alone: start a new run in a new run.output_dir instead")
    for name, stage in stage_configs(cfg):
        if not needs_rollouts(stage):
            config_error(f"{f'stages[{name}].' if cfg.stages else ''}algorithm.policy_loss", stage.algorithm.policy_loss,
                         why + "every stage learns from the explorer job's rollouts; run a dataset stage (sft, dpo) "
                         "as a mode=train job of its own first, and start both jobs from its export (model.path)")


def _check_bench(cfg: RFTConfig) -> None:
    b = cfg.bench
    if not b.checkpoints and not b.run_dir:
        config_error("bench.checkpoints", list(b.checkpoints), "mode=bench needs checkpoints: bench.checkpoints="
                     "[dir1,dir2] (HF directories) or bench.run_dir=<a run with trainer.save_hf=true>")
    for path in b.checkpoints:
        if not os.path.isdir(path):
            config_error("bench.checkpoints", path, "no such directory (an HF model directory)")
    if b.run_dir and not os.path.isdir(os.path.join(b.run_dir, "checkpoints", "hf")):
        config_error("bench.run_dir", b.run_dir, "has no checkpoints/hf/: run it with trainer.save_hf=true "
                     "and trainer.save_interval=N")
    if not b.k or min(b.k) < 1:
        config_error("bench.k", list(b.k), "use a list of positive k, e.g. [1,4]")
    if cfg.data.eval_path is None:
        config_error("data.eval_path", None, "mode=bench evaluates on the eval taskset; set data.eval_path")


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
        _check_bench(cfg)
    if cfg.mode == "serve":
        _check_serve(cfg)
    _check_engine_failure(cfg)
    _check_colocate(cfg)
    _check_free_run(cfg)
    _check_decoupled(cfg)
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
        if data.arithmetic is not None and data.eval_path is None:
            config_error(f"{prefix}data.eval_path", None, "data.arithmetic writes a held-out set there; "
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
    _check_model_family(cfg)
    _check_parallel_layout(cfg)
    _check_transformer_engine(cfg)
    _check_judge(cfg)
    if cfg.sync.engine not in ("auto", "nccl", "gloo", "checkpoint"):
        config_error("sync.engine", cfg.sync.engine, "choose auto, nccl, gloo or checkpoint")
    if cfg.sync.bucket_mb < 1:
        config_error("sync.bucket_mb", cfg.sync.bucket_mb, "use 1 or more MiB")
    _check_lora_sync(cfg)
    if cfg.sync.wire_dtype != "auto" and cfg.sync.wire_dtype not in _DTYPES:
        config_error("sync.wire_dtype", cfg.sync.wire_dtype, f"use auto or one of {_DTYPES}")
    if cfg.buffer.format not in ("parquet", "arrow"):
        config_error("buffer.format", cfg.buffer.format, "use `parquet` or `arrow`")


def _check_transformer_engine(cfg: RFTConfig) -> None:
    """Transformer Engine's layers run on GPUs only: refused before any rank starts without one.
    (Whether `transformer_engine` imports is the ranks' matter: a login node may lack it.)"""
    if cfg.trainer.transformer_impl != "transformer_engine":
        return
    fix = "or set trainer.transformer_impl=auto (Transformer Engine where it can run) or local"
    if cfg.cluster.kind == "slurm" and cfg.cluster.gpus_per_node == 0:
        config_error("trainer.transformer_impl", "transformer_engine", "Transformer Engine runs on GPUs and "
                     f"this job's nodes get none (cluster.gpus_per_node=0): pick a GPU partition, {fix}")
    if cfg.cluster.kind == "local":
        import torch

        if not torch.cuda.is_available():
            config_error("trainer.transformer_impl", "transformer_engine",
                         f"Transformer Engine runs on GPUs and this machine has none: run on a GPU node, {fix}")


def _check_lora_sync(cfg: RFTConfig) -> None:
    if cfg.sync.lora not in ("merged", "adapter"):
        config_error("sync.lora", cfg.sync.lora, "use merged (W + B A, every weight) or adapter (A and B only)")
    if cfg.sync.lora != "adapter" or not vllm_lora_rank(cfg):
        return
    if cfg.sync.engine == "checkpoint":
        config_error("sync.lora", cfg.sync.lora, "adapters travel over the weight groups (sync.engine=gloo/nccl/auto); "
                                                 "with the checkpoint engine use sync.lora=merged")
    if cfg.rollout.openai_api or cfg.mode == "serve":
        config_error("sync.lora", cfg.sync.lora, "the OpenAI endpoint serves the base weights without the adapter; "
                                                 "use sync.lora=merged with rollout.openai_api")
    if max(s.trainer.lora.rank for _, s in stage_configs(cfg)) > VLLM_LORA_RANKS[-1]:
        config_error("trainer.lora.rank", max(s.trainer.lora.rank for _, s in stage_configs(cfg)),
                     f"vLLM's LoRA takes ranks up to {VLLM_LORA_RANKS[-1]}; use sync.lora=merged for larger ones")