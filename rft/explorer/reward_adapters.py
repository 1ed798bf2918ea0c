"""Reward signatures of other frameworks, adapted to rft's `fn(trajectory, task)`.

REWARDS (rft/explorer/rewards.py) tells a form by its parameter names and, for a form listed here,
wraps the user's function in rft's adapter when it resolves it: the function stays the user's, the
call is rft's, and everything downstream (the forked scorer, its time limit, metadata checks) sees
an ordinary reward.

verl: `compute_score(data_source, solution_str, ground_truth, extra_info)`, the signature of
verl's `custom_reward_function` and of its `default_compute_score`
(verl/utils/reward_score/__init__.py), called by keyword as verl's reward managers do:

    data_source   the row's `data_source` column (None if the taskset has none)
    solution_str  the response text (`trajectory.response`)
    ground_truth  the task's answer (`task.answer`: data.answer_key, e.g. reward_model.ground_truth)
    extra_info    the row's `extra_info` column ({} if none, as verl passes)

It may return a number, or a dict with "score" (the reward) and other values: RewardScorer takes
"score" and keeps the other numeric ones as the trajectory's metrics (logged per step as
rollout/<key>, eval/<key>), as verl logs them as reward_extra_info.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from rft.buffer.experience import Experience
    from rft.data.taskset import Task

VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")


def verl_arguments(trajectory: Experience, task: Task) -> dict[str, Any]:
    """The keyword arguments verl's reward managers pass, from rft's trajectory and task."""
    row = task.row or {}
    extra = row.get("extra_info")
    return {"data_source": row.get("data_source"), "solution_str": trajectory.response,
            "ground_truth": task.answer,
            # a copy: the function may add keys (verl's managers add num_turns), the row is shared
            "extra_info": dict(extra) if isinstance(extra, Mapping) else ({} if extra is None else extra)}


def from_verl(compute_score: Callable[..., Any]) -> Callable[..., Any]:
    """rft's `fn(trajectory, task)` around verl's `compute_score` (`async def` if it is)."""
    if inspect.iscoroutinefunction(compute_score):
        async def reward(trajectory: Experience, task: Task) -> Any:
            return await compute_score(**verl_arguments(trajectory, task))
    else:
        def reward(trajectory: Experience, task: Task) -> Any:
            return compute_score(**verl_arguments(trajectory, task))
    # not functools.wraps: its __wrapped__ would make inspect.signature report verl's signature
    reward.__qualname__ = reward.__name__ = getattr(compute_score, "__qualname__", "compute_score")
    reward.__module__ = getattr(compute_score, "__module__", __name__)
    reward.__doc__ = compute_score.__doc__
    reward.rft_adapted = compute_score  # type: ignore[attr-defined]
    # ground_truth is the task's answer, so tasks need one (the launch checks the column)
    reward.rft_meta = {"needs_answer": True, **getattr(compute_score, "rft_meta", {})}  # type: ignore[attr-defined]
    return reward
