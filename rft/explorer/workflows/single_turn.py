"""single_turn: one prompt, one reply; the reply is scored by algorithm.reward."""

from __future__ import annotations

from rft.buffer.experience import Experience
from rft.buffer.taskset import Task
from rft.explorer.model_client import ModelClient
from rft.explorer.workflows import WORKFLOWS, WorkflowContext


@WORKFLOWS.register("single_turn", columns=("prompt",))
async def single_turn(task: Task, model: ModelClient, ctx: WorkflowContext) -> Experience:
    """The task's prompt as one user message; the model's reply is the whole response."""
    convo = model.conversation([{"role": "user", "content": task.prompt}])
    await convo.reply()
    return convo.experience()
