"""One episode of a model against an environment: what multi_turn and step_wise both play.

    observation = env.reset(task)
    repeat up to rollout.max_turns:
        action = the model's next turn            (trained: loss_mask 1)
        observation, reward, done = env.step(action)
        if done: stop
        observation -> the conversation           (not trained: loss_mask 0)

An observation may bring images (a vision-language model's: rft/explorer/envs/__init__.py); they
join the conversation where the observation does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rft.data.taskset import Task
from rft.explorer import envs
from rft.explorer.model_client import Conversation, ModelClient
from rft.explorer.workflows.registry import WorkflowContext


@dataclass
class Episode:
    convo: Conversation
    step_rewards: list[float] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)  # token index where each model turn begins
    tool_calls: int = 0
    answer: str | None = None  # the text the environment wants algorithm.reward to score
    metrics: dict[str, float] = field(default_factory=dict)
    finish_reason: str = "max_turns"

    @property
    def reward(self) -> float | None:
        """The sum of the step rewards, or None when the environment leaves scoring to algorithm.reward."""
        return None if self.answer is not None else sum(self.step_rewards)


async def play(task: Task, model: ModelClient, ctx: WorkflowContext) -> Episode:
    env = ctx.make_env()
    try:
        observation, _ = await envs.reset(env, task, ctx.seed)
        episode = Episode(convo=model.conversation([observation.message("user")], observation.images))
        for _ in range(ctx.max_turns):
            episode.turn_starts.append(len(episode.convo.token_ids))
            turn = await episode.convo.reply()
            if not turn.token_ids:  # no room left in the context
                episode.turn_starts.pop()
                episode.finish_reason = "context"
                break
            observation, reward, terminated, truncated, info = await envs.step(env, turn.text)
            episode.step_rewards.append(reward)
            episode.tool_calls += int(info.get("tool_calls", 0))
            episode.metrics.update({k: float(v) for k, v in (info.get("metrics") or {}).items()})
            if "answer" in info:
                episode.answer = str(info["answer"])
            if terminated or truncated:
                episode.finish_reason = "env_done" if terminated else "env_truncated"
                break
            episode.convo.add(observation.message(str(info.get("role", "user"))), images=observation.images)
            if episode.convo.room <= 0 or episode.convo.finish_reason == "context":  # cut (an image: before it)
                episode.finish_reason = "context"
                break
        return episode
    finally:
        env.close()
