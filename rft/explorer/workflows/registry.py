"""The workflow registry and the context every workflow is called with, apart from the package
that fills the registry: the built-ins (single_turn.py, multi_turn.py, step_wise.py) register into
it, and rft/explorer/workflows/__init__.py imports them, so neither imports the other's importer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rft.registry import Registry

WORKFLOWS = Registry("workflow", params=("task", "model", "ctx"), asynchronous=True,
                     returns="Experience | list[Experience]")


@dataclass
class WorkflowContext:
    """What a workflow knows besides its task and its model."""

    sample: int = 0  # which sample of the task's group this is (0 .. group_size - 1)
    samples: int = 1  # how many samples this call returns: 1, or the whole group for per-task workflows
    seed: int = 0  # for the environment's reset and anything else random in the workflow
    evaluation: bool = False  # an eval run: greedy, one sample per task
    max_turns: int = 8  # rollout.max_turns: model turns per episode
    env: str | None = None  # rollout.env (a name or dotted path)
    env_args: dict[str, Any] = field(default_factory=dict)  # rollout.env_args

    def make_env(self) -> Any:
        """A fresh instance of rollout.env for this trajectory (close it when done)."""
        from rft.explorer.envs import make_env

        if self.env is None:
            raise ValueError("this workflow plays an environment but rollout.env is not set; e.g. "
                             "rollout.env=grid_world (see rft/explorer/envs/)")
        return make_env(self.env, self.env_args)


