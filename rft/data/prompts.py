"""Turn a task into the exact prompt string the model sees (shared by rollout, eval and SFT)."""

from __future__ import annotations

from rft.data.taskset import Task


def format_prompt(task: Task, tokenizer, chat_template: bool) -> str:
    """The prompt text; with `chat_template` it is wrapped as one user turn plus the assistant cue."""
    if not chat_template:
        return task.prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": task.prompt}],
                                         tokenize=False, add_generation_prompt=True)


def reference_response(answer: str, tokenizer) -> list[int]:
    """SFT target ids: the reference answer followed by EOS, so the model also learns to stop."""
    return tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
