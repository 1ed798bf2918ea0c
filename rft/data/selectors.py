"""Task selectors: which tasks each rollout step explores (`data.selector`).

Registry SELECTORS; an entry is a class built as `cls(tasks, seed, config)` (`config`: the stage's
rft.config.data.SelectorConfig; a user's selector reads its options from `config.args`) with

    next_batch(n) -> list[Task]              the next n tasks (called once per generation round)
    observe(task_ids, rewards) -> None       every sampled trajectory's reward, as the explorer sees it
    scalars() -> dict[str, float]            selection statistics for TensorBoard (selector/...)
    state_dict() / load_state_dict(state)    everything a resumed run needs to select the same tasks

A selector is checkpointed with the explorer (it replaces the plain cursor), and draws its random
numbers from `default_rng([seed, batches drawn])`, so a resumed run selects exactly what the
uninterrupted one would. With several engines every engine holds an identical selector: each
observes every engine's rewards of a round (rft/explorer/explorer.py gathers them), so all draw
the same batch and the dealer can name a task by its index in it.

Built-ins:
    shuffle     every task once per epoch, epoch e in `default_rng(seed + e)` order (the default)
    sequential  file order, wrapping around
    curriculum  easy to hard by a difficulty column: batches come from the easiest share of the
                tasks, a share that grows from start_fraction to all by pace_steps batches
    difficulty  online: part of each batch (`revisit`) goes back to tasks whose observed pass rate
                is informative (`weighting`: near `target`, or by the reward variance p (1 - p);
                GRPO's advantages are zero for a group that is all right or all wrong); tasks
                always or never solved keep a small weight (`floor`), so they come back rarely;
                the rest of the batch meets new tasks (with `group_key`, drawn from the groups,
                e.g. sources, whose pooled pass rate weighs most)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from rft.config import SelectorConfig
from rft.data.taskset import Task, TaskCursor
from rft.registry import Registry

SELECTORS = Registry("task selector", params=("next_batch", "observe", "scalars", "state_dict", "load_state_dict"),
                     is_class=True)


def build_selector(tasks: list[Task], seed: int, config: SelectorConfig):
    """The stage's selector over `tasks` (config.name: a built-in or a dotted path to a class)."""
    return SELECTORS.resolve(config.name)(tasks, seed, config)


def _check_size(state: dict, tasks: int, seed: int, name: str) -> None:
    """A checkpoint of another taskset or seed would select other tasks: refuse it with the fix."""
    for key, mine in (("num_tasks", tasks), ("seed", seed)):
        if key in state and int(state[key]) != mine:
            raise ValueError(f"{name} selector checkpoint has {key}={state[key]} but this run has {key}={mine}; "
                             "resuming would select other tasks: use the same taskset and seed, or start a fresh run")


@SELECTORS.register("shuffle", ignores_rewards=True)
class Shuffle(TaskCursor):
    """Today's cursor: a new permutation each epoch; rewards are not looked at."""

    def __init__(self, tasks: list[Task], seed: int, config: SelectorConfig | None = None):
        super().__init__(tasks, seed)

    def observe(self, task_ids: Sequence[str], rewards: Sequence[float]) -> None:
        pass

    def scalars(self) -> dict[str, float]:
        return {"selector/epoch": float(self.epoch)}


@SELECTORS.register("sequential", ignores_rewards=True)
class Sequential(Shuffle):
    """The taskset in file order, over and over (e.g. a file already sorted by hand)."""

    def _permutation(self) -> np.ndarray:
        if self._perm.size != len(self._tasks):
            self._perm = np.arange(len(self._tasks))
        return self._perm


def _difficulties(tasks: list[Task], key: str) -> np.ndarray:
    values = []
    for task in tasks:
        value = task.row.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"data.selector.name=curriculum ranks tasks by the column data.selector.difficulty_key="
                             f"{key!r}, but task {task.task_id} (row {task.index}) has {value!r}; give every row a "
                             "number there (low = easy)")
        values.append(float(value))
    return np.asarray(values)


@SELECTORS.register("curriculum", ignores_rewards=True)
class Curriculum:
    """Easy to hard: batch b is drawn from the easiest `open_fraction(b)` of the tasks."""

    def __init__(self, tasks: list[Task], seed: int, config: SelectorConfig):
        if not tasks:
            raise ValueError("the curriculum selector needs at least one task")
        difficulty = _difficulties(tasks, config.difficulty_key)
        order = np.argsort(difficulty, kind="stable")  # ties keep file order
        self.tasks = [tasks[i] for i in order]
        self.difficulty = difficulty[order]
        self.seed, self.config = int(seed), config
        self.batches = 0
        self.last_mean = 0.0

    def open_fraction(self, batch: int) -> float:
        cfg = self.config
        progress = min(1.0, batch / cfg.pace_steps)
        if cfg.pacing == "root":
            progress = math.sqrt(progress)
        elif cfg.pacing == "step":
            progress = float(progress >= 1.0)
        return cfg.start_fraction + (1.0 - cfg.start_fraction) * progress

    def next_batch(self, n: int) -> list[Task]:
        if n <= 0:
            raise ValueError(f"batch size must be positive, got {n}")
        open_tasks = max(1, math.ceil(len(self.tasks) * self.open_fraction(self.batches)))
        rng = np.random.default_rng([self.seed, self.batches])
        chosen = rng.choice(open_tasks, size=n, replace=n > open_tasks)
        self.batches += 1
        self.last_mean = float(self.difficulty[chosen].mean())
        return [self.tasks[i] for i in chosen]

    def observe(self, task_ids: Sequence[str], rewards: Sequence[float]) -> None:
        pass

    def scalars(self) -> dict[str, float]:
        return {"selector/open_fraction": self.open_fraction(max(self.batches - 1, 0)),
                "selector/batch_difficulty": self.last_mean}

    def state_dict(self) -> dict:
        return {"batches": self.batches, "num_tasks": len(self.tasks), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        _check_size(state, len(self.tasks), self.seed, "curriculum")
        self.batches = int(state["batches"])


_GROUPS_LOGGED = 16  # with group_key, each group's share of a batch's new tasks goes to TensorBoard up to this many groups


def _groups(tasks: list[Task], key: str | None) -> tuple[list[str], np.ndarray | None]:
    """The group names (sorted) and each task's group index, by the column `key` (None: no groups)."""
    if not key:
        return [], None
    labels = [str(task.row.get(key)) for task in tasks]
    if all(task.row.get(key) is None for task in tasks):
        raise ValueError(f"data.selector.group_key={key!r} names a column no task has; name the column that "
                         f"groups tasks (e.g. their source), or leave it unset (the first row has: "
                         f"{', '.join(sorted(map(str, tasks[0].row))[:12])})")
    names = sorted(set(labels))
    index = {name: i for i, name in enumerate(names)}
    return names, np.array([index[label] for label in labels], dtype=np.int64)


@SELECTORS.register("difficulty", needs_rewards=True)
class Difficulty:
    """Revisit tasks whose pass rate is informative; meet the rest of the taskset meanwhile.

    Each batch has two parts. New tasks, a `1 - revisit` share, come in a seeded shuffled order,
    each once, like `shuffle`'s first epoch. The other share revisits tasks drawn before, without
    replacement and in proportion to a weight of the task's pass rate p: floor + (1 - floor) w(p),
    w = exp(-(p - target)^2 / 2 width^2) (weighting=gaussian) or 4 p (1 - p) (weighting=variance),
    so tasks near the target come back and tasks always solved or never solved rarely do. Once
    every task was drawn, whole batches are drawn by weight.

    Why two parts rather than one weighted draw over the whole taskset: within an epoch almost
    every task is unseen, and unseen tasks outnumber the informative ones so far that even a small
    weight each gives them most draws, and little is revisited (measured on the quickstart: 2055
    distinct tasks in the first 2912 draws, the batch's expected pass rate 0.79-0.85 against the
    run's 0.84). p is smoothed, (solved + m g) / (tried + m), where
    g is the pass rate of every sample so far and m = prior_samples, so one lucky group does not
    make a task look ideal.

    With `group_key` (a column such as the task's source) new tasks are not taken blindly in the
    seeded order: each comes from a group drawn by the weight of the group's pooled pass rate, so a
    source whose tasks are never solved (broken labels) or always solved stops taking new-task
    slots once its first tasks were seen, while every draw is still a task not met before.
    """

    def __init__(self, tasks: list[Task], seed: int, config: SelectorConfig):
        if not tasks:
            raise ValueError("the difficulty selector needs at least one task")
        self.tasks, self.seed, self.config = list(tasks), int(seed), config
        self.position = {t.task_id: i for i, t in enumerate(tasks)}
        self.order = np.random.default_rng(self.seed).permutation(len(tasks))  # new tasks come in this order
        self.met = np.zeros(len(tasks), dtype=bool)  # drawn as a new task already
        self.solved = np.zeros(len(tasks))
        self.tried = np.zeros(len(tasks))
        self.group_names, self.group_of = _groups(tasks, config.group_key)
        self.batches = 0
        self.last: dict[str, float] = {"expected": 0.0, "revisited": 0.0}

    @property
    def drawn(self) -> int:
        """Tasks met so far (drawn as new tasks)."""
        return int(self.met.sum())

    def _smoothed(self, solved: np.ndarray, tried: np.ndarray) -> np.ndarray:
        cfg, total = self.config, self.tried.sum()
        overall = self.solved.sum() / total if total else cfg.target
        m = cfg.prior_samples
        with np.errstate(invalid="ignore", divide="ignore"):
            rates = (solved + m * overall) / (tried + m)
        return np.where(tried + m > 0, rates, overall)

    def _weight(self, rates: np.ndarray) -> np.ndarray:
        cfg = self.config
        if cfg.weighting == "variance":
            # the reward variance of the task's group, which GRPO's advantages scale with: it is 0
            # only for tasks always or never solved, so a task solved once in 8 (informative) keeps
            # 0.44 where a Gaussian of width 0.2 about 0.5 would give it 0.17 and a never-solved one 0.04
            informative = 4.0 * rates * (1.0 - rates)
        else:
            informative = np.exp(-((rates - cfg.target) ** 2) / (2 * cfg.width ** 2))
        return cfg.floor + (1.0 - cfg.floor) * informative

    def pass_rates(self) -> np.ndarray:
        return self._smoothed(self.solved, self.tried)

    def weights(self) -> np.ndarray:
        return self._weight(self.pass_rates())

    def group_weights(self) -> np.ndarray:
        """The weight of each group's pooled pass rate (group_key set)."""
        count = len(self.group_names)
        solved = np.bincount(self.group_of, weights=self.solved, minlength=count)
        tried = np.bincount(self.group_of, weights=self.tried, minlength=count)
        return self._weight(self._smoothed(solved, tried))

    def _new_tasks(self, k: int, rng: np.random.Generator) -> np.ndarray:
        """The next k tasks not met yet, in the seeded order; with group_key, each comes from a
        group drawn in proportion to its weight (a source whose tasks are never solved, or always,
        gives few), taking that group's next task in the order."""
        unseen = self.order[~self.met[self.order]]
        if self.group_of is None or k <= 0:
            return unseen[:max(k, 0)]
        queues = [unseen[self.group_of[unseen] == g] for g in range(len(self.group_names))]
        sizes = np.array([q.size for q in queues])
        taken = np.zeros(len(queues), dtype=np.int64)  # each group's queue is taken from its front
        weights = self.group_weights()
        picked = []
        for _ in range(min(k, unseen.size)):
            live = weights * (taken < sizes)
            group = rng.choice(len(queues), p=live / live.sum())
            picked.append(queues[group][taken[group]])
            taken[group] += 1
        return np.asarray(picked, dtype=np.int64)

    def next_batch(self, n: int) -> list[Task]:
        if n <= 0:
            raise ValueError(f"batch size must be positive, got {n}")
        rng = np.random.default_rng([self.seed, self.batches])
        before = self.order[self.met[self.order]]  # the tasks a revisit may choose, in the seeded order
        revisits = min(round(n * self.config.revisit), before.size)
        new = self._new_tasks(n - revisits, rng)
        self.met[new] = True
        revisits = n - new.size  # every task drawn: the rest by weight too
        chosen = new
        if revisits:
            weights = self.weights()[before]
            distinct = min(revisits, before.size)
            again = rng.choice(before, size=distinct, replace=False, p=weights / weights.sum())
            if revisits > distinct:  # a batch larger than the taskset repeats tasks
                again = np.concatenate([again, rng.choice(before, size=revisits - distinct, p=weights / weights.sum())])
            chosen = np.concatenate([new, again])
        self.batches += 1
        self.last = {"expected": float(self.pass_rates()[chosen].mean()), "revisited": revisits / n}
        if self.group_of is not None and len(self.group_names) <= _GROUPS_LOGGED:
            shares = np.bincount(self.group_of[new], minlength=len(self.group_names)) / max(new.size, 1)
            self.last.update({f"new_from/{name}": float(v) for name, v in zip(self.group_names, shares)})
        return [self.tasks[i] for i in chosen]

    def observe(self, task_ids: Sequence[str], rewards: Sequence[float]) -> None:
        """Count each trajectory as solved when its reward reaches config.success_reward; rewards
        of tasks not in this taskset (an endpoint's sessions) are ignored."""
        for task_id, reward in zip(task_ids, rewards):
            i = self.position.get(task_id)
            if i is not None:
                self.tried[i] += 1
                self.solved[i] += float(reward) >= self.config.success_reward

    def scalars(self) -> dict[str, float]:
        seen = self.tried > 0
        if not seen.any():
            return {"selector/tasks_seen": 0.0}
        rate = self.solved[seen] / self.tried[seen]
        return {"selector/tasks_seen": float(seen.sum()),
                "selector/pass_rate_seen": float(rate.mean()),
                "selector/always_solved": float((rate == 1).mean()),
                "selector/never_solved": float((rate == 0).mean()),
                "selector/batch_expected_pass_rate": self.last["expected"],
                "selector/revisited": self.last["revisited"],
                **{f"selector/{k}": v for k, v in self.last.items() if k.startswith("new_from/")}}

    def state_dict(self) -> dict:
        return {"solved": self.solved.tolist(), "tried": self.tried.tolist(), "batches": self.batches,
                "met": np.flatnonzero(self.met).tolist(), "num_tasks": len(self.tasks), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        _check_size(state, len(self.tasks), self.seed, "difficulty")
        self.solved = np.asarray(state["solved"], dtype=float)
        self.tried = np.asarray(state["tried"], dtype=float)
        self.batches = int(state["batches"])
        self.met[:] = False
        # checkpoints from before group_key met tasks in the seeded order alone: order[:drawn]
        self.met[np.asarray(state["met"], dtype=np.int64) if "met" in state else self.order[: int(state["drawn"])]] = True
