"""Turn a task into the messages it is sent and the exact prompt string the model sees (shared by
rollout, eval, SFT and context fitting, so that they can never disagree)."""

from __future__ import annotations

from rft.data.rows import Message
from rft.data.taskset import Task


def prompt_messages(task: Task) -> list[Message]:
    """The messages a task is sent: its system prompt (if any), a messages prompt's earlier turns,
    then the prompt text as the user turn the model answers."""
    if task.prompt is None:
        raise ValueError(f"task {task.task_id} has no prompt (data.prompt_key's column); a workflow that prompts "
                         "with it needs the column in every row")
    system = [{"role": "system", "content": task.system}] if task.system is not None else []
    return system + list(task.history) + [{"role": "user", "content": task.prompt}]


def format_prompt(task: Task, tokenizer, chat_template: bool) -> str:
    """The prompt text: with `chat_template`, the messages through the tokenizer's chat template plus
    the assistant cue; without, their contents joined as they are (rft/data/chat_format.py PlainFormat)."""
    messages = prompt_messages(task)
    if not chat_template:
        return "".join(m["content"] for m in messages)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def reference_response(answer: str, tokenizer) -> list[int]:
    """SFT target ids: the reference answer followed by EOS, so the model also learns to stop."""
    return tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
