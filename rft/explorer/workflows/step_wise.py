"""step_wise: an environment episode as one experience per model turn.

Step k's experience is the conversation up to and including turn k, trained on turn k only
(loss_mask 1 on its tokens, 0 before). Every step carries the trajectory's return as its reward
(and all step rewards in `step_rewards`, its own index in `step_index`), and all steps share one
`trajectory_id`: per-response estimators (grpo, rloo, ...) compare whole trajectories of a group
and credit each trajectory's advantage to each of its steps (rft/trainer/train_step.py), as
Trinity-RFT's step-wise GRPO does. Use it where trajectories outgrow what one sequence should
hold, or to train every decision in the context it was made in.
"""

from __future__ import annotations

from rft.buffer.experience import Experience
from rft.data.taskset import Task
from rft.explorer.model_client import ModelClient
from rft.explorer.workflows.episode import play
from rft.explorer.workflows.registry import WORKFLOWS, WorkflowContext


@WORKFLOWS.register("step_wise", needs_env=True)
async def step_wise(task: Task, model: ModelClient, ctx: WorkflowContext) -> list[Experience]:
    """Play rollout.env; one experience per model turn, each rewarded with the episode's return."""
    episode = await play(task, model, ctx)
    whole = episode.convo.experience(reward=episode.reward, step_rewards=episode.step_rewards,
                                     tool_calls=episode.tool_calls, metrics=episode.metrics,
                                     finish_reason=episode.finish_reason,
                                     **({"response": episode.answer} if episode.answer is not None else {}))
    if not episode.turn_starts:
        return [whole]
    convo = episode.convo
    ends = episode.turn_starts[1:] + [len(whole.token_ids)]
    steps = []
    for index, (start, end) in enumerate(zip(episode.turn_starts, ends)):
        # the turn's sampled tokens are the masked-in run at its start (observations follow it)
        mask = [0] * start + whole.loss_mask[start:end]
        stop = start + sum(whole.loss_mask[start:end])
        steps.append(Experience(token_ids=whole.token_ids[:stop], loss_mask=mask[:stop],
                                logprobs=[0.0] * start + whole.logprobs[start:stop], prompt_length=start,
                                reward=whole.reward, step_rewards=episode.step_rewards, step_index=index,
                                turns=index + 1, tool_calls=whole.tool_calls, finish_reason=whole.finish_reason,
                                metrics=whole.metrics, response=whole.response,
                                images=[image for image, (at, _) in zip(convo.images, convo.image_spans) if at < stop] or None,
                                routed_experts=None if whole.routed_experts is None else whole.routed_experts[:stop]))
    return steps
