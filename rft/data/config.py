"""The data pipeline's config sections (task selection, task and experience operators, replay) and
their checks, kept apart from rft/config.py's tree, which includes them.

An operator entry in `data.operators` or `buffer.operators` is a name or a mapping with `name`
and the operator's keyword arguments:

    buffer:
      operators:
        - group_std_filter
        - {name: length_penalty, max_tokens: 512, buffer_tokens: 128}
        - {name: my_pkg.ops.drop_refusals, words: [sorry]}
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

CURRICULUM_PACINGS = ("linear", "root", "step")  # data.selector.pacing (rft/data/selectors.py)
DIFFICULTY_WEIGHTINGS = ("gaussian", "variance")  # data.selector.weighting (rft/data/selectors.py)


@dataclass
class SelectorConfig:
    """Which tasks each rollout step explores (rft/data/selectors.py)."""

    name: str = "shuffle"  # shuffle | sequential | curriculum | difficulty | dotted path to a selector class
    difficulty_key: str = "difficulty"  # curriculum: the column ranking tasks, low = easy
    start_fraction: float = 0.25  # curriculum: share of the easiest tasks open at the first batch
    pace_steps: int = 50  # curriculum: batches after which every task is open
    pacing: str = "linear"  # curriculum: linear | root (opens fast, then slower) | step (halfway, then all)
    revisit: float = 0.5  # difficulty: share of each batch that goes back to tasks drawn before (the rest: new tasks)
    weighting: str = "gaussian"  # difficulty: gaussian (near target, by width) | variance (4 p (1 - p), 0 only at p = 0 and 1)
    target: float = 0.5  # difficulty, gaussian: the pass rate preferred most (GRPO learns most near 0.5)
    width: float = 0.2  # difficulty, gaussian: how fast preference falls away from target (a Gaussian's sd)
    floor: float = 0.02  # difficulty: weight left to tasks always or never solved
    prior_samples: float = 2.0  # difficulty: a task's pass rate starts at the run's, worth this many samples
    group_key: Optional[str] = None  # difficulty: a column grouping tasks (e.g. their source); new tasks come from groups by their pooled pass rate's weight
    success_reward: float = 1.0  # difficulty: a sample with reward >= this counts as solved
    args: dict[str, Any] = field(default_factory=dict)  # a user selector's options (its config.args)


@dataclass
class JudgeDifficultyConfig:
    """Ask the judge engines how hard each training task is (rft/data/judge_difficulty.py)."""

    enabled: bool = False
    key: str = "difficulty"  # the column the scores fill (the curriculum selector's difficulty_key)
    prompt: str = ("How hard is this problem? Answer with one number from 1 (very easy) to 10 (very hard).\n\n"
                   "Problem: {prompt}\n\nDifficulty:")  # {prompt}: the task's prompt; {answer}: its reference answer
    chat: bool = True  # ask through the judge's chat template (judge.chat); false: plain completion (any model)
    max_new_tokens: int = 8  # length of the judge's answer
    concurrency: int = 64  # calls in flight at once (vLLM batches them)


@dataclass
class ReplayConfig:
    """Experience trained on again (rft/buffer/replay.py). Off by default (groups_per_step 0)."""

    groups_per_step: int = 0  # groups of earlier steps added to each step's batch (0: no replay)
    priority: str = "age"  # age | reward_std | dotted path fn(entry, step) -> float (0: not eligible)
    half_life: float = 4.0  # age, reward_std: priority halves every this many steps of age
    max_uses: int = 1  # times one group may be trained again
    cooldown: int = 1  # steps between two trainings of one group
    capacity: int = 1024  # candidate groups kept (the oldest leave first)


def operator_specs(entries: Any) -> list[tuple[str, dict[str, Any]]]:
    """`data.operators` / `buffer.operators` entries as (name, keyword arguments)."""
    specs = []
    for entry in entries or []:
        if isinstance(entry, (DictConfig, Mapping)):
            options = OmegaConf.to_container(entry) if isinstance(entry, DictConfig) else dict(entry)
            name = options.pop("name", None)
            specs.append((name, options))
        else:
            specs.append((entry, {}))
    return specs


def check_operators(key: str, entries: Any, registry) -> None:
    """Each entry names an operator of `registry` (built-in or dotted path) and only arguments it takes."""
    from rft.config import config_error

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
    from rft.config import config_error
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
    from rft.config import config_error
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
    from rft.config import config_error

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
