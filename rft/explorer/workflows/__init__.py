"""Workflows: how a task becomes experience. One registry, WORKFLOWS, signature

    async def fn(task: Task, model: ModelClient, ctx: WorkflowContext) -> Experience | list[Experience]

`rollout.workflow` takes a built-in name or a dotted path to your own `async def` (signature
checked at launch). The runner calls it once per sample (`algorithm.group_size` times per task,
`ctx.sample` says which), many at once, each try bounded by `rollout.task_timeout_s` and retried
up to `rollout.max_retries` times if it raises; the samples of a task form one group.

A workflow talks to the policy through `model` (rft/explorer/model_client.py): `model.chat`,
`model.generate`, or a `model.conversation(...)` that grows turn by turn and returns the
experience record (rft/buffer/experience.py). An experience whose `reward` is None is scored
by `algorithm.reward` (rft/explorer/rewards.py) after the workflow returns.

Built-ins:
    single_turn   one prompt (the task's prompt column), one reply, scored by algorithm.reward
    multi_turn    an environment episode (rollout.env) as one experience: model turns trained,
                  observations and tool output masked out
    step_wise     the same episode as one experience per model turn (each with the conversation
                  so far as its prompt); every step carries the trajectory's return, and the
                  trainer's group baselines compare whole trajectories (rft/trainer/train_step.py)

Registry metadata (`register(name, needs_env=..., columns=...)`, or an `rft_meta` attribute on a
user's function): `needs_env` (the workflow plays rollout.env), `columns` (the taskset roles it
reads: "prompt", "answer"; rows without them are skipped and counted), `per_task` (called once per
task with `ctx.samples` = group_size, it returns one experience per sample: single_turn samples
them in one vLLM request, so the prompt is processed once).
"""

from __future__ import annotations

from rft.explorer.workflows.registry import WORKFLOWS, WorkflowContext

__all__ = ["WORKFLOWS", "WorkflowContext", "required_columns"]


def required_columns(workflow: str, env: str | None, reward: str) -> tuple[str, ...]:
    """What every taskset row needs for this workflow, environment and reward: the roles
    "prompt"/"answer" (data.prompt_key/answer_key) and any other column by name."""
    from rft.explorer.envs import required_columns as env_columns
    from rft.explorer.rewards import REWARDS

    meta = WORKFLOWS.meta(WORKFLOWS.resolve(workflow))
    columns = list(meta.get("columns", ()))
    if meta.get("needs_env"):
        columns += env_columns(env)  # the environment knows what its rows hold
    elif REWARDS.meta(REWARDS.resolve(reward)).get("needs_answer"):
        columns.append("answer")  # the reward compares the reply with the reference answer
    return tuple(dict.fromkeys(columns))


# the built-ins register themselves in WORKFLOWS when imported; importing them here makes every
# user of this package see them
from rft.explorer.workflows import multi_turn, single_turn, step_wise  # noqa: E402,F401
