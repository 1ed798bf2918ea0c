"""The checks of a composed config that need the extension registries: every name a config gives
(advantage, policy loss, reward, workflow, environment, selector, task and experience operators,
replay priority) resolves to a built-in or to a dotted path whose signature fits, and its options
are ones it takes. Run on the login node by `validate()` (checks.py), so a typo fails there.
Before that, `absolute_plugin_files` makes every file-path plugin ("rewards.py:fn") absolute, so the
ranks, which may start in another directory, import the file the launcher checked.

The registries live with their built-ins in the layers above this package (algorithms, explorer,
data, buffer), so each check imports its registry where it runs: config's schema modules stay
importable by every layer.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, MutableMapping, MutableSequence
from typing import Any

from rft.config.algorithm import LR_DECAYS, AlgorithmConfig
from rft.config.buffer import ReplayConfig
from rft.config.data import (
    CURRICULUM_PACINGS,
    DIFFICULTY_WEIGHTINGS,
    JudgeDifficultyConfig,
    SelectorConfig,
    operator_specs,
)
from rft.config.derived import needs_rollouts
from rft.config.errors import config_error
from rft.config.run import RFTConfig
from rft.registry import absolute_file_spec


def absolute_plugin_files(node: Any, cwd: str | None = None) -> None:
    """Every value of the config (stages' overrides and operator lists included) that is a
    file-path plugin "rel/path.py:name" becomes "/abs/path.py:name", in place, against `cwd`
    (default: the launcher's working directory): a relative path means the directory the user
    launched from, and a Slurm job's ranks start elsewhere. Any key, as every registry takes files."""
    if dataclasses.is_dataclass(node):
        items, put = [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)], lambda k, v: setattr(node, k, v)
    elif isinstance(node, (MutableMapping, MutableSequence)):  # also DictConfig, ListConfig
        items, put = list(node.items() if isinstance(node, Mapping) else enumerate(node)), node.__setitem__
    else:
        return
    for key, value in items:
        if not isinstance(value, str):
            absolute_plugin_files(value, cwd)
        elif absolute_file_spec(value, cwd) != value:  # only these: other strings stay as composed
            put(key, absolute_file_spec(value, cwd))


def check_algorithm(prefix: str, algo: AlgorithmConfig) -> None:
    """Every registry key names a built-in or a dotted path whose signature fits (checked here,
    before launch, so a typo fails on the login node)."""
    from rft.algorithms import registries

    for key, registry in registries().items():
        if key == "policy_loss" and algo.policy_loss == "dpo":
            continue  # pairs, not per-token losses: rft/trainer/dpo_step.py
        try:
            registry.resolve(getattr(algo, key))
        except ValueError as err:
            config_error(f"{prefix}algorithm.{key}", getattr(algo, key), str(err))
    if algo.critic_lr <= 0:
        config_error(f"{prefix}algorithm.critic_lr", algo.critic_lr, "the critic's learning rate must be positive")
    if algo.value_clip is not None and algo.value_clip <= 0:
        config_error(f"{prefix}algorithm.value_clip", algo.value_clip, "use a positive value, e.g. 0.2, or null (no clip)")
    if algo.name == "sft" and algo.policy_loss != "sft":
        config_error(f"{prefix}algorithm.policy_loss", algo.policy_loss,
                     "algorithm.name=sft trains on reference answers: set algorithm.policy_loss=sft too")
    if algo.lr_decay not in LR_DECAYS:
        config_error(f"{prefix}algorithm.lr_decay", algo.lr_decay, f"use one of {', '.join(LR_DECAYS)}")
    if not 0.0 <= algo.min_lr_ratio <= 1.0:
        config_error(f"{prefix}algorithm.min_lr_ratio", algo.min_lr_ratio, "use a share of lr from 0 to 1, e.g. 0.1")
    if algo.kl_mode not in ("loss", "reward"):
        config_error(f"{prefix}algorithm.kl_mode", algo.kl_mode, "use loss or reward")
    if algo.kl_mode == "reward" and algo.kl_coef > 0 and algo.advantage in ("grpo", "dr_grpo", "rloo", "grpo_per_turn"):
        config_error(f"{prefix}algorithm.kl_mode", algo.kl_mode,
                     f"advantage {algo.advantage} scores whole responses; a per-token KL reward needs "
                     "advantage=reinforce_pp or gae (or kl_mode=loss)")
    if algo.clip_eps_high is not None and algo.clip_eps_high <= 0:
        config_error(f"{prefix}algorithm.clip_eps_high", algo.clip_eps_high, "use a positive value, e.g. 0.28")
    if algo.dual_clip_c is not None and algo.dual_clip_c <= 1:
        config_error(f"{prefix}algorithm.dual_clip_c", algo.dual_clip_c, "must be > 1, e.g. 3.0")
    if algo.tis_cap is not None and algo.tis_cap <= 0:
        config_error(f"{prefix}algorithm.tis_cap", algo.tis_cap, "use a positive cap, e.g. 2.0")
    if algo.ppo_epochs < 1:
        config_error(f"{prefix}algorithm.ppo_epochs", algo.ppo_epochs, "use 1 or more passes over each batch")
    if algo.mini_batch_size < 0:
        config_error(f"{prefix}algorithm.mini_batch_size", algo.mini_batch_size,
                     "use 0 (the whole batch per optimizer step) or a number of rows")
    if algo.policy_loss == "dpo" and (algo.ppo_epochs > 1 or algo.mini_batch_size):
        config_error(f"{prefix}algorithm.ppo_epochs", algo.ppo_epochs,
                     "DPO takes one optimizer step per batch of pairs: leave ppo_epochs=1 and mini_batch_size=0")
    _check_offpolicy(prefix, algo)
    if not 0.0 < algo.jsd_beta < 1.0:
        config_error(f"{prefix}algorithm.jsd_beta", algo.jsd_beta, "the teacher's weight in the JSD's mixture lies "
                     "strictly between 0 and 1 (0.5: the symmetric JSD)")
    if not algo.distill_coef > 0:
        config_error(f"{prefix}algorithm.distill_coef", algo.distill_coef, "use a positive weight, e.g. 1.0")


def _check_offpolicy(prefix: str, algo: AlgorithmConfig) -> None:
    """The off-policy family's options (rft/algorithms/offpolicy.py) are in range, and the
    advantage estimator gets the data its registry entry says it needs."""
    from rft.algorithms import registries
    from rft.algorithms.offpolicy import option_problem

    problem = option_problem(algo)
    if problem is not None:
        config_error(f"{prefix}algorithm.{problem[0]}", problem[1], problem[2])
    advantages = registries()["advantage"]
    meta = advantages.meta(advantages.resolve(algo.advantage))
    if meta.get("needs_group") and algo.group_size < 2:
        config_error(f"{prefix}algorithm.group_size", algo.group_size,
                     f"advantage {algo.advantage} compares samples within a group; use 2 or more samples per task")
    if meta.get("per_response") and algo.kl_mode == "reward" and algo.kl_coef > 0:
        config_error(f"{prefix}algorithm.kl_mode", algo.kl_mode,
                     f"advantage {algo.advantage} scores whole responses; a per-token KL reward needs "
                     "advantage=reinforce_pp or gae (or kl_mode=loss)")


def check_env_tasks(prefix: str, stage: RFTConfig) -> None:
    """data.from_env needs an environment that can draw tasks (or demos) of its own."""
    from rft.explorer.envs import ENVIRONMENTS

    generate, env = stage.data.from_env, stage.rollout.env
    if generate.kind not in ("tasks", "demos"):
        config_error(f"{prefix}data.from_env.kind", generate.kind, "use tasks (rows to play) or demos (SFT conversations)")
    if env is None:
        config_error(f"{prefix}data.from_env", "set", "the tasks come from rollout.env, which is not set")
    method = "sample_demos" if generate.kind == "demos" else "sample_tasks"
    try:
        has = callable(getattr(ENVIRONMENTS.resolve(env), method, None))
    except ValueError as err:
        config_error(f"{prefix}rollout.env", env, str(err))
    if not has:
        config_error(f"{prefix}data.from_env.kind", generate.kind, f"environment {env} has no {method}(n, seed); "
                     "write the taskset yourself and set data.train_path")
    if generate.num_train < 1 or generate.num_eval < 0:
        config_error(f"{prefix}data.from_env.num_train", generate.num_train, "use 1 or more rows (num_eval 0 or more)")


def check_rollout_plugins(prefix: str, stage: RFTConfig) -> None:
    """The workflow, its environment and the reward: each a built-in or a dotted path whose
    signature fits, checked here so a typo fails on the login node; and the limits they run under."""
    from rft.explorer.envs import ENVIRONMENTS, make_env
    from rft.explorer.rewards import REWARDS
    from rft.explorer.workflows import WORKFLOWS

    rollout, algo = stage.rollout, stage.algorithm
    for key, registry, value in ((f"{prefix}algorithm.reward", REWARDS, algo.reward),
                                 (f"{prefix}rollout.workflow", WORKFLOWS, rollout.workflow),
                                 (f"{prefix}rollout.env", ENVIRONMENTS, rollout.env)):
        if value is None:
            continue
        try:
            registry.resolve(value)
        except ValueError as err:
            config_error(key, value, str(err))
    if algo.reward is not None and REWARDS.variant(REWARDS.resolve(algo.reward)) == "group" and algo.group_size < 2:
        config_error(f"{prefix}algorithm.group_size", algo.group_size, f"reward {algo.reward} ranks a task's samples "
                     "against each other (its form is fn(group, task)): use 2 or more samples per task")
    if WORKFLOWS.meta(WORKFLOWS.resolve(rollout.workflow)).get("needs_env"):
        if rollout.env is None:
            config_error(f"{prefix}rollout.env", None, f"rollout.workflow={rollout.workflow} plays an environment: "
                         f"choose one of {ENVIRONMENTS.names()} or a dotted path to a Gymnasium Env class")
        try:
            make_env(rollout.env, dict(rollout.env_args)).close()
        except Exception as err:  # the environment's own check of its arguments
            config_error(f"{prefix}rollout.env_args", dict(rollout.env_args), f"{type(err).__name__}: {err}")
    for key, value, least in (("max_turns", rollout.max_turns, 1), ("max_concurrent_tasks", rollout.max_concurrent_tasks, 1),
                              ("max_retries", rollout.max_retries, 0)):
        if value < least:
            config_error(f"{prefix}rollout.{key}", value, f"use {least} or more")
    if not rollout.task_timeout_s > 0:
        config_error(f"{prefix}rollout.task_timeout_s", rollout.task_timeout_s, "use a positive number of seconds")


def check_data_pipeline(prefix: str, stage: RFTConfig) -> None:
    """The stage's task selector and task operators, and the run's experience operators and replay
    (below): each a built-in or a dotted path, with arguments it takes."""
    from rft.buffer.operators import EXPERIENCE_OPERATORS
    from rft.data.task_operators import TASK_OPERATORS

    check_selector(prefix, stage.data.selector, needs_rollouts(stage))
    check_judge_difficulty(prefix, stage.data.judge_difficulty, needs_rollouts(stage), stage.cluster.judge_ranks,
                           stage.judge.kind)
    check_operators(f"{prefix}data.operators", stage.data.operators, TASK_OPERATORS)
    check_operators("buffer.operators", stage.buffer.operators, EXPERIENCE_OPERATORS)
    check_replay(stage.buffer.replay)


def check_operators(key: str, entries: Any, registry) -> None:
    """Each entry names an operator of `registry` (built-in or dotted path) and only arguments it takes."""

    for i, (name, options) in enumerate(operator_specs(entries)):
        where = f"{key}[{i}]"
        if not isinstance(name, str) or not name:
            config_error(where, name, "give an operator name or a mapping with `name:` and its arguments, "
                         f"e.g. {{name: {registry.names()[0]}}}")
        try:
            fn = registry.resolve(name)
        except ValueError as err:
            config_error(f"{where}.name", name, str(err))
        try:
            inspect.signature(fn).bind_partial(**options)
        except TypeError as err:
            accepted = [p for p in inspect.signature(fn).parameters if p not in registry.params]
            config_error(where, options, f"{name} takes {accepted}: {err}")


def check_selector(prefix: str, selector: SelectorConfig, rollouts: bool) -> None:
    from rft.data.selectors import SELECTORS

    key = f"{prefix}data.selector"
    try:
        cls = SELECTORS.resolve(selector.name)
    except ValueError as err:
        config_error(f"{key}.name", selector.name, str(err))
    if SELECTORS.meta(cls).get("needs_rewards") and not rollouts:
        config_error(f"{key}.name", selector.name, "it chooses by the rewards of rollouts, which this stage "
                     "has none of (SFT, DPO): use shuffle, sequential or curriculum")
    if selector.pacing not in CURRICULUM_PACINGS:
        config_error(f"{key}.pacing", selector.pacing, f"choose one of {CURRICULUM_PACINGS}")
    if selector.weighting not in DIFFICULTY_WEIGHTINGS:
        config_error(f"{key}.weighting", selector.weighting, f"choose one of {DIFFICULTY_WEIGHTINGS}")
    for name, value, low, high in (("start_fraction", selector.start_fraction, 0.0, 1.0),
                                   ("revisit", selector.revisit, 0.0, 1.0),
                                   ("target", selector.target, 0.0, 1.0), ("floor", selector.floor, 0.0, 1.0)):
        if not low <= value <= high:
            config_error(f"{key}.{name}", value, f"use a number in [{low}, {high}]")
    for name, value in (("pace_steps", selector.pace_steps), ("width", selector.width)):
        if not value > 0:
            config_error(f"{key}.{name}", value, "use a positive number")
    if selector.prior_samples < 0:
        config_error(f"{key}.prior_samples", selector.prior_samples, "use 0 or more")


def check_judge_difficulty(prefix: str, cfg: JudgeDifficultyConfig, rollouts: bool, judge_ranks: int,
                           judge_kind: str) -> None:
    from rft.data.judge_difficulty import check_template

    key = f"{prefix}data.judge_difficulty"
    if not cfg.enabled:
        return
    if not rollouts:
        config_error(f"{key}.enabled", True, "the scores rank the tasks a stage explores, and this stage explores "
                     "none (SFT, DPO): enable it on a GRPO/PPO stage")
    if judge_ranks < 1 or judge_kind != "generate":
        config_error(f"{key}.enabled", True, "the scores come from an LLM judge: set cluster.judge_ranks=1 (and "
                     "judge.model=<HF model directory>) with judge.kind=generate")
    if not cfg.key:
        config_error(f"{key}.key", cfg.key, "name the column the scores fill, e.g. difficulty")
    for name in ("max_new_tokens", "concurrency"):
        if getattr(cfg, name) < 1:
            config_error(f"{key}.{name}", getattr(cfg, name), "use 1 or more")
    try:
        check_template(cfg.prompt)
    except ValueError as err:
        config_error(f"{key}.prompt", cfg.prompt, str(err))


def check_replay(replay: ReplayConfig) -> None:
    from rft.buffer.replay import PRIORITIES

    for name, value in (("groups_per_step", replay.groups_per_step), ("cooldown", replay.cooldown)):
        if value < 0:
            config_error(f"buffer.replay.{name}", value, "use 0 or more")
    for name, value in (("max_uses", replay.max_uses), ("capacity", replay.capacity), ("half_life", replay.half_life)):
        if not value > 0:
            config_error(f"buffer.replay.{name}", value, "use a positive number")
    try:
        PRIORITIES.resolve(replay.priority)
    except ValueError as err:
        config_error("buffer.replay.priority", replay.priority, str(err))
