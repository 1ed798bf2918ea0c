"""Rows longer than the model's context never reach vLLM or Megatron.

A task needs `prompt tokens + response tokens` positions: for rollouts and eval the response is
`rollout.max_new_tokens` long at most, for SFT it is the reference answer, for DPO the longer of
the two answers. A row that needs more than the context (`model.max_seq_len`, capped by the
model's `max_position_embeddings`) is handled by `data.overlong`:

    skip           dropped and counted (the run summary and TensorBoard's `data/overlong_skipped`)
    truncate_left  the prompt loses its beginning, whole tokens, until the row fits (the answer,
                   the template's suffix, the chat scaffolding, the system prompt and a messages
                   prompt's earlier turns stay: only the last user turn is cut); counted as truncated
    error          the run stops, naming the row, its length and the context

A vision-language row's images count as the tokens the model's image processor cuts them into
(rft/data/images.py); such a row is skipped rather than truncated under truncate_left (cutting
its text could cut an image's placeholder).

Why it matters: one overlong row padded into a microbatch makes attention quadratic in its length
(a 20x longer row took a trainer rank to 23 GB), and vLLM refuses a prompt longer than its
max_model_len. With every row within the context, a trainer microbatch holds at most
`trainer.micro_batch_size x context` tokens, whatever the data holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from rft.data.prompts import format_prompt, reference_response
from rft.data.taskset import Task

_EXAMPLES = 3  # overlong rows named in the rank's log per taskset
_CHUNK = 1024  # rows tokenized per call: bounded memory on large tasksets


def row_label(path: str, index: int) -> str:
    """Where a row is: a jsonl file's by line number, others by 0-based row (of the split, for a
    folder or glob of shards: rft/data/sources.py)."""
    return f"line {index + 1}" if path.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")) else f"row {index}"


@dataclass
class ContextFit:
    """Fits one rank's tasksets into `context` tokens with `policy`. Each call adds what it did to
    `rows[path]` (`overlong_skipped`, `truncated`), the run's per-file row counts."""

    tokenizer: object
    chat_template: bool
    context: int
    policy: str = "skip"
    image_processor: object | None = None  # a vision-language model's: how many tokens each image takes

    def for_rollouts(self, tasks: list[Task], path: str, max_new_tokens: int,
                     rows: dict[str, dict[str, int]]) -> list[Task]:
        """Tasks whose prompt (as vLLM tokenizes it) plus `max_new_tokens` fit."""
        return self._fit(tasks, path, lambda t: max_new_tokens, True, rows)

    def for_references(self, tasks: list[Task], path: str, rows: dict[str, dict[str, int]],
                       preferences: bool = False, messages_key: str | None = None) -> list[Task]:
        """SFT rows (prompt + reference answer + EOS, or a whole conversation in `messages_key`,
        which is skipped when too long: it has no single prompt to cut) or DPO pairs (prompt +
        the longer answer)."""
        conversations = [t for t in tasks if messages_key is not None and messages_key in t.row]
        if conversations:
            return self._fit_conversations(tasks, path, rows, messages_key)

        def answer_tokens(task: Task) -> int:
            answers = [task.answer] + ([task.rejected] if preferences and task.rejected is not None else [])
            return max(len(reference_response(a, self.tokenizer)) for a in answers)

        return self._fit(tasks, path, answer_tokens, False, rows)

    def _fit_conversations(self, tasks: list[Task], path: str, rows: dict[str, dict[str, int]],
                           messages_key: str) -> list[Task]:
        from rft.data.chat_format import chat_format, conversation_ids

        fmt = chat_format(self.tokenizer, self.chat_template)
        kept, skipped, examples = [], 0, []
        for task in tasks:
            if messages_key not in task.row:
                kept.append(task)
                continue
            length = len(conversation_ids(fmt, self.tokenizer, task.row[messages_key])[0])
            if length <= self.context:
                kept.append(task)
                continue
            if self.policy == "error":
                raise ValueError(f"{row_label(path, task.index)} of {path} is a conversation of {length} tokens, more "
                                 f"than the model's context of {self.context} and data.overlong=error; shorten it or "
                                 "set data.overlong=skip")
            skipped += 1
            if len(examples) < _EXAMPLES:
                examples.append(f"{row_label(path, task.index)} needs {length} tokens")
        if examples:
            print(f"{path}: {skipped} conversation(s) longer than the context of {self.context} tokens skipped; e.g. "
                  + "; ".join(examples), flush=True)
        rows.setdefault(path, {}).update({"overlong_skipped": skipped, "truncated": 0})
        if tasks and not kept:
            raise ValueError(f"every row of {path} is longer than the model's context of {self.context} tokens")
        return kept

    def _prompt_lengths(self, tasks: list[Task], special_tokens: bool) -> list[int]:
        lengths: list[int] = []
        for start in range(0, len(tasks), _CHUNK):
            texts = [format_prompt(t, self.tokenizer, self.chat_template) for t in tasks[start:start + _CHUNK]]
            ids = self.tokenizer(texts, add_special_tokens=special_tokens)["input_ids"]
            lengths += [len(x) + self._image_tokens(t) for x, t in zip(ids, tasks[start:start + _CHUNK])]
        return lengths

    def _image_tokens(self, task: Task) -> int:
        """The tokens a task's images add to its prompt's text: each image's placeholder holds one."""
        if not task.images or self.image_processor is None:
            return 0
        from rft.data.images import image_tokens

        return sum(image_tokens(self.image_processor, image) - 1 for image in task.images)

    def _fit(self, tasks: list[Task], path: str, response_tokens: Callable[[Task], int],
             special_tokens: bool, rows: dict[str, dict[str, int]]) -> list[Task]:
        kept: list[Task] = []
        counts = {"overlong_skipped": 0, "truncated": 0}
        examples: list[str] = []
        for task, prompt_len in zip(tasks, self._prompt_lengths(tasks, special_tokens)):
            answer_len = response_tokens(task)
            if prompt_len + answer_len <= self.context:
                kept.append(task)
                continue
            where = f"{row_label(path, task.index)} of {path}"
            need = f"needs {prompt_len + answer_len} tokens (prompt {prompt_len} + response {answer_len})"
            if self.policy == "error":
                raise ValueError(
                    f"{where} {need}, more than the model's context of {self.context} "
                    "(model.max_seq_len, capped by max_position_embeddings) and data.overlong=error; "
                    "set data.overlong=skip or truncate_left, raise model.max_seq_len if the model allows, "
                    "or shorten the row")
            fitted = None
            if self.policy == "truncate_left" and not task.images:
                fitted = self._truncate_left(task, prompt_len, self.context - answer_len, special_tokens)
            if fitted is None:
                counts["overlong_skipped"] += 1
            else:
                counts["truncated"] += 1
                kept.append(fitted)
            if len(examples) < _EXAMPLES:
                examples.append(f"{row_label(path, task.index)} {need}")
        if examples:
            print(f"{path}: {counts['overlong_skipped']} row(s) longer than the context of {self.context} tokens "
                  f"skipped, {counts['truncated']} truncated (data.overlong={self.policy}); e.g. "
                  + "; ".join(examples), flush=True)
        rows.setdefault(path, {}).update(counts)
        if tasks and not kept:
            raise ValueError(
                f"every row of {path} is longer than the model's context of {self.context} tokens "
                f"(e.g. {examples[0]}); raise model.max_seq_len if the model allows, lower "
                "rollout.max_new_tokens, or set data.overlong=truncate_left")
        return kept

    def _truncate_left(self, task: Task, prompt_len: int, prompt_budget: int, special_tokens: bool) -> Task | None:
        """The task with the start of its prompt text cut, whole tokens at a time, until the
        formatted prompt (now `prompt_len` tokens) takes at most `prompt_budget`; None if even one
        token of prompt text leaves no room."""
        ids = self.tokenizer(task.prompt, add_special_tokens=False)["input_ids"]
        drop = prompt_len - prompt_budget
        while drop < len(ids):
            candidate = replace(task, prompt=self.tokenizer.decode(ids[drop:]))
            excess = self._prompt_lengths([candidate], special_tokens)[0] - prompt_budget
            if excess <= 0:
                return candidate
            # decoding and re-encoding can merge tokens at the cut: step by what is still over
            drop += excess
        return None
