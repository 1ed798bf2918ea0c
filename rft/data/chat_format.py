"""Messages -> token ids, so that a conversation grows by appending ids, never by re-tokenizing.

A multi-turn trajectory is: prompt ids, then for each turn the ids vLLM sampled, then the ids of
the messages that follow (tool output, an environment's observation) and the cue for the next
model turn. Rendering the whole conversation again and tokenizing it would turn the sampled ids
into text and back, which gives different ids often enough (6 of 16 SmolLM2 samples when
measured with vLLM 0.32 on CPU) that the trainer would score tokens vLLM never sampled. So the sampled ids are kept as
they are, and only the new messages are tokenized:

    TemplateFormat   models with a chat template (model.chat_template=true): the ids that close
                     the model's turn (what the template puts after an assistant message, less the
                     stop token the model already sampled) + the new messages as the template
                     renders them after an assistant turn, with the cue for the next one
    PlainFormat      no template (the tiny model): message contents are concatenated as they are

`prompt_ids` renders the first messages; single-turn prompts come out exactly as
`rft.data.prompts.format_prompt` + vLLM's tokenization made them before workflows existed.
"""

from __future__ import annotations

from typing import Protocol

Message = dict[str, str]  # {"role": "user" | "assistant" | "tool" | "system", "content": str}

_PLACEHOLDER = "\x00rft-turn\x00"  # assistant content whose end marks where the template closes the turn


class ChatFormat(Protocol):
    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The first prompt: `messages` and the cue for the model's reply."""
        ...

    def append_ids(self, messages: list[Message], model_turn: list[int]) -> list[int]:
        """Ids that follow a model turn (`model_turn`: the ids vLLM sampled): the rest of its
        closing scaffolding, `messages`, and the cue for the next model turn."""
        ...


class PlainFormat:
    """Contents concatenated as they are: what a model without a chat template sees."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        # add_special_tokens: as vLLM tokenizes a text prompt
        return self.tokenizer("".join(m["content"] for m in messages), add_special_tokens=True).input_ids

    def append_ids(self, messages: list[Message], model_turn: list[int]) -> list[int]:
        return self.tokenizer("".join(m["content"] for m in messages), add_special_tokens=False).input_ids


class TemplateFormat:
    """The tokenizer's chat template, rendered once per message batch and cut at the right place."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PLACEHOLDER}]
        self._base = tokenizer.apply_chat_template(base, tokenize=False)
        cut = self._base.rfind(_PLACEHOLDER)
        if cut < 0:
            raise ValueError("the tokenizer's chat template drops assistant messages; multi-turn "
                             "workflows need one that renders them (or set model.chat_template=false)")
        self._base_messages = base
        self.turn_end = self._base[cut + len(_PLACEHOLDER):]  # e.g. "<|im_end|>\n"

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def append_ids(self, messages: list[Message], model_turn: list[int]) -> list[int]:
        full = self.tokenizer.apply_chat_template(self._base_messages + list(messages), tokenize=False,
                                                  add_generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError("the chat template renders earlier messages differently once more follow; "
                             "rft cannot extend such a conversation without re-tokenizing it")
        closing = self.turn_end
        # the model usually sampled the start of the closing scaffolding itself (its stop token)
        sampled_tail = self.tokenizer.decode(model_turn[-1:]) if model_turn else ""
        if sampled_tail and closing.startswith(sampled_tail):
            closing = closing[len(sampled_tail):]
        return self.tokenizer(closing + full[len(self._base):], add_special_tokens=False).input_ids


def chat_format(tokenizer, chat_template: bool) -> ChatFormat:
    """The format for `model.chat_template`."""
    return TemplateFormat(tokenizer) if chat_template else PlainFormat(tokenizer)


def conversation_ids(fmt: ChatFormat, tokenizer, messages: list[Message]) -> tuple[list[int], list[int], int]:
    """A whole written conversation as the model would have produced it, for supervised training:
    (token ids, loss mask, prompt length). Assistant turns are their content plus the stop token
    (EOS), trained (mask 1); everything else is built exactly as a sampled conversation grows
    (PlainFormat / TemplateFormat.append_ids), not trained."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("a conversation to train on needs at least one message before the first assistant turn "
                         "and one assistant turn")
    ids = fmt.prompt_ids(messages[:first])
    mask, prompt_length, turn, pending = [0] * len(ids), len(ids), [], []
    for message in messages[first:]:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            more = fmt.append_ids(pending, turn)
            ids, mask, pending = ids + more, mask + [0] * len(more), []
        turn = tokenizer(message["content"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        ids, mask = ids + turn, mask + [1] * len(turn)
    return ids, mask, prompt_length
