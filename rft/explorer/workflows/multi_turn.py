"""multi_turn: a whole environment episode as one experience (model turns trained, the rest masked)."""

from __future__ import annotations

from rft.buffer.experience import Experience
from rft.data.taskset import Task
from rft.explorer.model_client import ModelClient
from rft.explorer.workflows.episode import play
from rft.explorer.workflows.registry import WORKFLOWS, WorkflowContext


@WORKFLOWS.register("multi_turn", needs_env=True)
async def multi_turn(task: Task, model: ModelClient, ctx: WorkflowContext) -> Experience:
    """Play rollout.env for up to rollout.max_turns model turns; the reward is the episode's summed
    step rewards (or algorithm.reward on the environment's `answer`)."""
    episode = await play(task, model, ctx)
    return episode.convo.experience(reward=episode.reward, step_rewards=episode.step_rewards,
                                    tool_calls=episode.tool_calls, metrics=episode.metrics,
                                    finish_reason=episode.finish_reason,
                                    **({"response": episode.answer} if episode.answer is not None else {}))
