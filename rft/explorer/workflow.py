"""The single-turn workflow: tasks -> prompts -> `n` samples each -> rewards -> experience rows."""

from __future__ import annotations

from rft.buffer.taskset import Task
from rft.explorer.prompts import format_prompt
from rft.explorer.rewards import RewardScorer
from rft.explorer.vllm_engine import RolloutEngine


def run_single_turn(engine: RolloutEngine, tasks: list[Task], n: int, scorer: RewardScorer,
                    max_new_tokens: int, temperature: float, top_p: float, stop: list[str],
                    seed: int, chat_template: bool) -> dict[str, list]:
    """Generate and score; returns experience columns (one row per sample, groups contiguous)."""
    prompts = [format_prompt(t, engine.tokenizer, chat_template) for t in tasks]
    groups = engine.generate(prompts, n, max_new_tokens, temperature, top_p, stop, seed)
    samples = [s for group in groups for s in group]
    answers = [t.answer for t in tasks for _ in range(n)]
    rewards = scorer.score([s.text for s in samples], answers)
    return {
        "task_index": [t.index for t in tasks for _ in range(n)],
        "prompt_ids": [s.prompt_ids for s in samples],
        "response_ids": [s.response_ids for s in samples],
        "response_logprobs": [s.response_logprobs for s in samples],
        "reward": rewards,
        "finished": [s.finished for s in samples],
    }


def evaluate(engine: RolloutEngine, tasks: list[Task], scorer: RewardScorer, max_new_tokens: int,
             temperature: float, stop: list[str], seed: int, chat_template: bool) -> float:
    """Accuracy (mean reward of one sample per task; greedy when temperature is 0)."""
    prompts = [format_prompt(t, engine.tokenizer, chat_template) for t in tasks]
    groups = engine.generate(prompts, 1, max_new_tokens, temperature, 1.0, stop, seed)
    rewards = scorer.score([g[0].text for g in groups], [t.answer for t in tasks])
    return sum(rewards) / max(len(rewards), 1)
