"""single_turn: one prompt, one reply per sample; the replies are scored by algorithm.reward."""

from __future__ import annotations

from rft.buffer.experience import Experience
from rft.data.prompts import prompt_messages
from rft.data.taskset import Task
from rft.explorer.model_client import ModelClient
from rft.explorer.workflows.registry import WORKFLOWS, WorkflowContext


@WORKFLOWS.register("single_turn", columns=("prompt",), per_task=True)
async def single_turn(task: Task, model: ModelClient, ctx: WorkflowContext) -> list[Experience]:
    """The task's messages (its system prompt, a messages prompt's turns, the prompt as the user
    turn: rft/data/prompts.py, as eval and SFT format them); `ctx.samples` replies, sampled in one request."""
    convo = model.conversation(prompt_messages(task), task.images)
    return [branch.experience() for branch in await convo.replies(ctx.samples)]
