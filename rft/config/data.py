"""The `data` section: the tasksets, how their rows are read and fitted, which tasks each step
explores (selector), the task operators run before a stage and the judge's difficulty scores.

An operator entry in `data.operators` or `buffer.operators` is a name or a mapping with `name`
and the operator's keyword arguments:

    buffer:
      operators:
        - group_std_filter
        - {name: length_penalty, max_tokens: 512, buffer_tokens: 128}
        - {name: my_pkg.ops.drop_refusals, words: [sorry]}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

CURRICULUM_PACINGS = ("linear", "root", "step")  # data.selector.pacing (rft/data/selectors.py)


DIFFICULTY_WEIGHTINGS = ("gaussian", "variance")  # data.selector.weighting (rft/data/selectors.py)


@dataclass
class SelectorConfig:
    """Which tasks each rollout step explores (rft/data/selectors.py)."""

    name: str = "shuffle"  # shuffle | sequential | curriculum | difficulty | a selector class: file.py:Class or a dotted path
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

    enabled: bool = False  # score the stage's training tasks with the judge before the stage starts
    key: str = "difficulty"  # the column the scores fill (the curriculum selector's difficulty_key)
    prompt: str = ("How hard is this problem? Answer with one number from 1 (very easy) to 10 (very hard).\n\n"
                   "Problem: {prompt}\n\nDifficulty:")  # {prompt}: the task's prompt; {answer}: its reference answer
    chat: bool = True  # ask through the judge's chat template (judge.chat); false: plain completion (any model)
    max_new_tokens: int = 8  # length of the judge's answer
    concurrency: int = 64  # calls in flight at once (vLLM batches them)


@dataclass
class ArithmeticTaskConfig:
    """Synthetic `a+b=` problems written to jsonl with a fixed seed before launch."""

    num_train: int = 2000  # training problems
    num_eval: int = 200  # held-out problems (disjoint from train)
    max_operand: int = 99  # operands are drawn from [0, max_operand]


@dataclass
class ShapesTaskConfig:
    """Synthetic pictures of one coloured shape and the question of its colour (rft/data/shapes.py),
    for vision-language models, written with a fixed seed before launch."""

    num_train: int = 2000  # training pictures
    num_eval: int = 200  # held-out pictures
    image_size: int = 56  # pixels per side (the tiny vision-language model: 56 x 56 is 4 image tokens)


@dataclass
class EnvTasksConfig:
    """Tasksets drawn by the environment itself (its `sample_tasks`, or `sample_demos` for SFT
    conversations), written to data.train_path / data.eval_path before launch."""

    kind: str = "tasks"  # tasks: rows the environment plays | demos: conversations to train on (SFT)
    num_train: int = 400  # rows in train_path
    num_eval: int = 100  # rows in eval_path (tasks, disjoint from train; demos: none)
    args: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments of sample_tasks/sample_demos


@dataclass
class DataConfig:
    train_path: str = MISSING  # taskset for training: .jsonl(.gz), .json(.gz), .parquet, a folder or glob of a Hub dataset's shards, or a save_to_disk folder; `path@split` picks a split
    eval_path: Optional[str] = None  # held-out taskset for eval/accuracy, as train_path, e.g. /data/gsm8k@test (None: no eval)
    expert_path: Optional[str] = None  # CHORD (algorithm.expert_rows): demonstrations, rows as SFT's (None: train_path's answers)
    prompt_key: str = "question"  # column holding the prompt: text, or chat messages ending with a user turn; a dotted key reads a nested field
    answer_key: str = "answer"  # column holding the reference answer; dotted for a nested field, e.g. reward_model.ground_truth
    id_key: Optional[str] = None  # column holding a task id, dotted for a nested field, e.g. extra_info.index (None: the row's index)
    chosen_key: str = "chosen"  # preference data (DPO): the preferred response
    rejected_key: str = "rejected"  # preference data (DPO): the dispreferred response
    prompt_template: str = "{prompt}"  # format string applied to the prompt text (a messages prompt: to its last user turn)
    system_prompt: Optional[str] = None  # system message sent before every prompt (None: none); a row's system_key value or own system turn wins
    system_key: Optional[str] = None  # column holding a row's system prompt, wins over system_prompt (None: no such column; null or blank: system_prompt)
    image_key: Optional[str] = None  # vision-language models: column holding a row's image(s), each a path (relative to the taskset's folder), bytes or an HF Image feature; the prompt's <image> marks (or {"type": "image"} parts) say where (rft/data/images.py)
    eval_limit: Optional[int] = None  # evaluate on the first N eval rows (None: all)
    overlong: str = "skip"  # rows longer than the context: skip (counted) | truncate_left (cut the prompt's start) | error
    arithmetic: Optional[ArithmeticTaskConfig] = None  # if set, generate train/eval files before launch
    shapes: Optional[ShapesTaskConfig] = None  # if set, generate coloured-shape pictures and their train/eval files before launch (vision-language models)
    from_env: Optional[EnvTasksConfig] = None  # if set, rollout.env writes train/eval files before launch
    messages_key: str = "messages"  # SFT rows: a column of chat messages trains every assistant turn
    selector: SelectorConfig = field(default_factory=SelectorConfig)  # which tasks each step explores
    operators: list[Any] = field(default_factory=list)  # task operators run on train_path before the stage (rft/data/task_operators.py)
    judge_difficulty: JudgeDifficultyConfig = field(default_factory=JudgeDifficultyConfig)  # judges score each train task (rft/data/judge_difficulty.py)


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
