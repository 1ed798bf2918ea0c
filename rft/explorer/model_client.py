"""What a workflow talks to: the policy being trained, served by vLLM's async engine.

    completion = await model.chat([{"role": "user", "content": "2+3="}])   # one call
    completion = await model.generate(token_ids)                           # ids in, ids out
    convo = model.conversation([{"role": "user", "content": question}])    # a trajectory
    turn = await convo.reply()              # sampled ids appended, loss_mask 1
    convo.add({"role": "tool", "content": "= 42"})   # ids appended, loss_mask 0
    return convo.experience(reward=1.0)

Every call returns the token ids vLLM sampled and their logprobs. A conversation only ever
appends ids (rft/data/chat_format.py), so the trainer scores exactly what vLLM sampled, and
a conversation stays on one engine (its prefix cache holds the conversation so far).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from rft.buffer.experience import Experience
from rft.data.chat_format import ChatFormat, Message
from rft.explorer.vllm_engine import Completion, RolloutEngine


@dataclass(frozen=True)
class Sampling:
    """How the policy samples (rollout.temperature, top_p, max_new_tokens, stop); a workflow may
    override any of them per call, e.g. `await convo.reply(max_new_tokens=16)`."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()


class ModelClient:
    """The policy for one trajectory: sampling settings, a seed and one engine (sticky).

    Seeds: request k of this client samples with `seed + k`, so a trajectory is reproducible
    and no two requests of a step share a random stream.
    """

    def __init__(self, engine: RolloutEngine, fmt: ChatFormat, sampling: Sampling, seed: int):
        self.engine, self.format, self.sampling, self.seed = engine, fmt, sampling, seed
        self.requests = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def context(self) -> int:
        """Tokens of prompt + response the engine accepts (model.max_seq_len, capped by the model)."""
        return self.engine.max_model_len

    async def generate(self, token_ids: list[int], n: int = 1, images: list[bytes] | None = None,
                       **overrides) -> list[Completion] | Completion:
        """Sample a continuation of `token_ids` (one Completion; a list of `n` when n > 1). With no
        room left in the context the completion is empty, finish_reason "context". `images` (a
        vision-language model's, encoded): `token_ids` hold each one's tokens (`Conversation`)."""
        from vllm import SamplingParams

        s = replace(self.sampling, **overrides) if overrides else self.sampling
        room = self.context - len(token_ids)
        if room < 1:
            empty = Completion(token_ids=[], logprobs=[], text="", finish_reason="context")
            return [empty] * n if n > 1 else empty
        # a vision-language model never samples the image token: vLLM and the trainer fill image
        # tokens with images in order, so one sampled before an environment's later image would
        # take that image's place. vLLM reports raw logprobs (before the bias), as the trainer scores.
        pad = getattr(self.engine, "image_pad", None)
        params = SamplingParams(n=n, max_tokens=min(s.max_new_tokens, room), temperature=s.temperature,
                                top_p=s.top_p, stop=list(s.stop) or None, seed=self.seed + self.requests,
                                logit_bias={pad: -100.0} if pad is not None else None)
        self.requests += 1
        if images:  # vLLM is given one <|image_pad|> per image and widens it itself
            from rft.data.images import narrow

            completions = await self.engine.generate(narrow(token_ids, self.engine.image_pad, len(images)), params,
                                                     images)
        else:
            completions = await self.engine.generate(token_ids, params)
        return completions if n > 1 else completions[0]

    async def chat(self, messages: list[Message], **overrides) -> Completion:
        """One reply to `messages` (rendered with the model's chat format)."""
        return await self.generate(self.format.prompt_ids(messages), **overrides)

    def conversation(self, messages: list[Message], images: tuple[bytes, ...] = ()) -> Conversation:
        """Start a trajectory from `messages` (the prompt: never trained); `images`: a
        vision-language task's (Task.images), one placeholder each in the messages."""
        return Conversation(self, messages, images)


class Conversation:
    """A trajectory being built: token ids with their loss mask and logprobs.

    `reply()` appends what the model samples (mask 1, vLLM's logprobs); `add()` appends messages
    the model did not write (mask 0). `turns` counts model turns; `messages` keeps the text of
    the conversation for rewards and logs.
    """

    def __init__(self, client: ModelClient, messages: list[Message], images: tuple[bytes, ...] = ()):
        self.client = client
        self.messages: list[Message] = list(messages)
        self.images: list[bytes] = []
        self.image_spans: list[tuple[int, int]] = []  # each image's tokens in token_ids: (start, how many)
        self.token_ids: list[int] = self._with_images(client.format.prompt_ids(self.messages), images)
        self.prompt_length = len(self.token_ids)
        self.loss_mask = [0] * self.prompt_length
        self.logprobs = [0.0] * self.prompt_length
        self.versions = [-1] * self.prompt_length  # the weights version that sampled each token (-1: none)
        self.turns = 0
        self.last: Completion | None = None
        self.finish_reason = ""
        self.routed_experts = None  # the last turn's routing (MoE routing replay), [tokens, layers, k]

    @property
    def room(self) -> int:
        """Tokens left in the model's context."""
        return self.client.context - len(self.token_ids)

    async def reply(self, **overrides) -> Completion:
        """Sample the model's next turn and append it. An empty completion (finish_reason
        "context") means the context is full: end the trajectory."""
        turn = await self.client.generate(self.token_ids, images=self.images, **overrides)
        self._append(turn)
        return turn

    async def replies(self, n: int, **overrides) -> list[Conversation]:
        """`n` continuations of this conversation, each one more model turn, sampled in one request
        (vLLM processes the shared prefix once)."""
        turns = await self.client.generate(self.token_ids, n=n, images=self.images, **overrides)
        branches = []
        for turn in turns if n > 1 else [turns]:
            branch = copy.copy(self)
            branch.token_ids, branch.loss_mask = list(self.token_ids), list(self.loss_mask)
            branch.logprobs, branch.messages = list(self.logprobs), list(self.messages)
            branch.versions = list(self.versions)
            branch.images, branch.image_spans = list(self.images), list(self.image_spans)
            branch._append(turn)
            branches.append(branch)
        return branches

    def _append(self, turn: Completion) -> None:
        if turn.routed_experts is not None:  # covers the whole conversation before this turn too
            self.routed_experts = turn.routed_experts
        self.token_ids += turn.token_ids
        self.loss_mask += [1] * len(turn.token_ids)
        self.logprobs += turn.logprobs
        self.versions += turn.versions or [-1] * len(turn.token_ids)
        self.messages.append({"role": "assistant", "content": turn.text})
        self.turns += bool(turn.token_ids)
        self.last, self.finish_reason = turn, turn.finish_reason

    def add(self, *messages: Message, images: tuple[bytes, ...] = ()) -> None:
        """Append messages the model did not write (tool results, observations), and the cue for
        its next turn. They are never trained (loss_mask 0). What does not fit in the context is
        cut off (finish_reason "context"; `room` is then 0 and the next reply is empty); an image
        goes whole or not at all. `images`: encoded, one placeholder each in the messages."""
        ids = self.client.format.append_ids(list(messages), self.last.token_ids if self.last else [])
        before = len(self.images)
        ids = self._with_images(ids, images, offset=len(self.token_ids))
        if len(ids) > self.room:  # never longer than the context: the trainer's memory bound holds
            cut = max(self.room, 0) + len(self.token_ids)
            # an image cut in two would leave tokens without their features: cut before it instead
            kept = before + sum(at + width <= cut for at, width in self.image_spans[before:])
            if kept < len(self.image_spans):
                cut = self.image_spans[kept][0]
            del self.images[kept:], self.image_spans[kept:]
            ids, self.finish_reason = ids[: cut - len(self.token_ids)], "context"
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.messages += messages

    def _with_images(self, ids: list[int], images: tuple[bytes, ...], offset: int = 0) -> list[int]:
        """`ids` (placeholders for `images`) as the model runs on them, each image widened to its
        tokens (rft/data/images.py); the images join the conversation's."""
        if not images:
            return ids
        engine = self.client.engine
        if not getattr(engine, "images", False):
            raise ValueError(f"{len(images)} image(s) for a model that reads none: images need a "
                             "vision-language model as model.path (docs/guides/vision.md)")
        if len(self.images) + len(images) > engine.images_per_prompt:
            raise ValueError(f"a conversation of {len(self.images) + len(images)} images, more than "
                             f"rollout.images_per_prompt={engine.images_per_prompt}: raise it to the most "
                             "images one trajectory holds (an environment's observations add up)")
        from rft.data.images import image_runs, widen

        wide = widen(ids, engine.image_pad, engine.image_processor, list(images))
        self.images += images
        self.image_spans += [(offset + at, width) for at, width in image_runs(wide, engine.image_pad, len(images))]
        return wide

    def experience(self, reward: float | None = None, **fields) -> Experience:
        """The trajectory as an experience record; `reward=None` leaves scoring to algorithm.reward.
        `fields`: other Experience fields (tool_calls, metrics, response, finish_reason, ...)."""
        fields.setdefault("response", self.last.text if self.last else "")
        fields.setdefault("finish_reason", self.finish_reason)
        return Experience(token_ids=list(self.token_ids), loss_mask=list(self.loss_mask),
                          logprobs=list(self.logprobs), prompt_length=self.prompt_length, reward=reward,
                          turns=self.turns, routed_experts=self.routed_experts, token_versions=list(self.versions),
                          images=list(self.images) or None, **fields)
