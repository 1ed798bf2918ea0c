"""single_turn: one prompt, one reply per sample; the replies are scored by algorithm.reward."""

from __future__ import annotations

from rft.buffer.experience import Experience
from rft.data.taskset import Task
from rft.explorer.model_client import ModelClient
from rft.explorer.workflows.registry import WORKFLOWS, WorkflowContext


@WORKFLOWS.register("single_turn", columns=("prompt",), per_task=True)
async def single_turn(task: Task, model: ModelClient, ctx: WorkflowContext) -> list[Experience]:
    """The task's prompt as one user message; `ctx.samples` replies, sampled in one request."""
    convo = model.conversation([{"role": "user", "content": task.prompt}])
    return [branch.experience() for branch in await convo.replies(ctx.samples)]
