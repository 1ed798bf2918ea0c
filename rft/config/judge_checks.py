"""The checks of the judge ranks and what asks them (rft/config/checks.py runs them): a reward's
judge kind (its registry metadata), relative judging's keys, a distillation teacher."""

from __future__ import annotations

import os

from rft.config.derived import judge_model, judge_span, needs_rollouts, stage_configs
from rft.config.errors import config_error
from rft.config.model import context_length
from rft.config.run import RFTConfig


def check_judge(cfg: RFTConfig) -> None:
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
    if cfg.judge.kv_cache_gb is not None and not cfg.judge.kv_cache_gb > 0:
        config_error("judge.kv_cache_gb", cfg.judge.kv_cache_gb, "use a positive number of GiB, or null")
    if cfg.judge.max_new_tokens < 1:
        config_error("judge.max_new_tokens", cfg.judge.max_new_tokens, "use 1 or more")
    for name, stage in stage_configs(cfg):
        kind = judge_kind(stage.algorithm.reward)
        key = f"{f'stages[{name}].' if cfg.stages else ''}algorithm.reward"
        if kind and not judges:
            config_error(key, stage.algorithm.reward, f"asks a judge engine: add cluster.judge_ranks=1 and "
                         f"judge.kind={kind} (judge.model=<HF model directory>; default: the policy's starting weights)")
        if kind and cfg.judge.kind != kind:
            config_error(key, stage.algorithm.reward, f"needs judge.kind={kind} (judge.kind={cfg.judge.kind})")
        if stage.algorithm.reward == "relative_judge":
            check_relative_judge(cfg)
    if judges and cfg.judge.model is not None and not os.path.isfile(os.path.join(cfg.judge.model, "config.json")):
        config_error("judge.model", cfg.judge.model, "not an HF model directory (no config.json); "
                     "or leave it unset to judge with the policy's starting weights (model.path)")
    check_teacher(cfg)


def judge_kind(reward: str) -> str | None:
    """The judge.kind a reward asks for (its registry entry's `judge_kind`, or a user reward's
    `rft_meta`); None for one that asks no judge, or a name the plugin checks will refuse."""
    from rft.explorer.rewards import REWARDS

    try:
        return REWARDS.meta(REWARDS.resolve(reward)).get("judge_kind")
    except ValueError:
        return None


def check_teacher(cfg: RFTConfig) -> None:
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


def check_relative_judge(cfg: RFTConfig) -> None:
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
