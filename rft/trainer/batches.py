"""Where a trainer step's rows come from: experience shards (RL) or a dataset (SFT, DPO)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import torch
import torch.distributed as dist

from rft.buffer.experience import from_table
from rft.buffer.replay import ReplayPool
from rft.buffer.review import ReviewIntake
from rft.buffer.shards import ExperienceBuffer, ShardCorruptError
from rft.data.chat_format import chat_format, conversation_ids
from rft.data.prompts import format_prompt, reference_response
from rft.data.taskset import Task, TaskCursor
from rft.runtime.topology import Topology
from rft.trainer.step_batch import StepBatch


def experience_batch(table, replay_routes: bool = False) -> tuple[StepBatch, dict[str, float]]:
    """A policy-gradient batch (advantages are computed in the step) from a shard's experience
    rows, and reward/length statistics. `replay_routes` (trainer.routing_replay=rollout): with
    the rows' routed experts, which every forward of the step replays."""
    experiences = from_table(table)
    batch = StepBatch.from_experiences(experiences)
    if replay_routes:
        batch.with_expert_routes(experiences)
    rewards = torch.tensor(batch.rewards, dtype=torch.float32)
    lengths = torch.tensor([e.sampled_tokens for e in experiences], dtype=torch.float32)
    stats = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
             "response_length/mean": float(lengths.mean())}
    return batch, stats


class DatasetBatches:
    """SFT rows (prompt + reference answer, or a whole conversation in `data.messages_key`) or DPO
    pairs, drawn by a resumable cursor."""

    def __init__(self, cursor: TaskCursor, tokenizer, chat_template: bool, messages_key: str,
                 image_processor=None):
        self.cursor, self.tokenizer, self.chat_template = cursor, tokenizer, chat_template
        self.messages_key = messages_key
        self.format = chat_format(tokenizer, chat_template)
        self.image_processor = image_processor  # a vision-language model's (rft/data/images.py)

    def prompt_ids(self, task: Task) -> list[int]:
        ids = self.tokenizer(format_prompt(task, self.tokenizer, self.chat_template), add_special_tokens=False).input_ids
        if task.images:  # each image as the tokens the model runs on, as a rollout widens them
            from rft.data.images import IMAGE_PAD, widen

            ids = widen(ids, self.tokenizer.convert_tokens_to_ids(IMAGE_PAD), self.image_processor, list(task.images))
        return ids

    def sft(self, n: int) -> StepBatch:
        prompts, responses, masks, images = [], [], [], []
        for task in self.cursor.next_batch(n):
            images.append(list(task.images) or None)
            messages = task.row.get(self.messages_key)
            if messages is not None:  # a conversation: every assistant turn is trained
                ids, mask, cut = conversation_ids(self.format, self.tokenizer, messages)
                prompt, response, response_mask = ids[:cut], ids[cut:], mask[cut:]
            else:
                prompt, response = self.prompt_ids(task), reference_response(task.answer, self.tokenizer)
                response_mask = [1] * len(response)
            prompts.append(prompt)
            responses.append(response)
            masks.append(response_mask)
        return StepBatch(prompt_ids=prompts, response_ids=responses, response_mask=masks,
                         images=images if any(images) else None)

    def preferences(self, n: int) -> StepBatch:
        """`n` pairs as rows 2i (prompt + chosen) and 2i+1 (prompt + rejected), for DPO."""
        prompts, responses = [], []
        for task in self.cursor.next_batch(n):
            prompt = self.prompt_ids(task)
            prompts += [prompt, prompt]
            responses += [reference_response(task.answer, self.tokenizer),
                          reference_response(task.rejected, self.tokenizer)]
        return StepBatch(prompt_ids=prompts, response_ids=responses)


@dataclass
class StepRows:
    """A trainer step's experience: the step's fresh shards first, then reused rows (replayed
    groups, groups a person labelled) appended after them."""

    table: pa.Table
    fresh_rows: int  # rows [0, fresh_rows) came from this step's shards
    waited_s: float = 0.0  # seconds waited for the shards to appear
    io_s: float = 0.0  # seconds of buffer I/O
    scalars: dict[str, float] = field(default_factory=dict)  # replay/..., review/...

    @property
    def fresh(self) -> pa.Table:
        return self.table.slice(0, self.fresh_rows)


class ExperienceReader:
    """Trainer rank 0 claims each step's experience; every trainer rank gets its table (TP/DP
    split the rows). With `producers` (the job's engines, each writing one shard per step) a step
    is their shards of it together; without (experience from elsewhere), one shard at a time.
    With `replay` (buffer.replay) and `review` (a `review` operator), rank 0 adds groups trained
    before and groups a person labelled (rft/buffer/replay.py, rft/buffer/review.py)."""

    def __init__(self, buffer: ExperienceBuffer, topology: Topology, wait_timeout_s: float, poll_s: float,
                 producers: list[int] | None = None, lost: Callable[[list[int]], object] | None = None,
                 replay: ReplayPool | None = None, review: ReviewIntake | None = None):
        self.buffer, self.topology, self.wait_timeout_s, self.poll_s = buffer, topology, wait_timeout_s, poll_s
        self.producers, self.lost = producers, lost  # lost(missing): producers gone for good (engines lost)
        self.replay, self.review = replay, review
        self.claims: list = []
        self.corrupt = 0  # shards quarantined for a bad checksum

    def next_table(self, step: int) -> StepRows:
        """Trainer step `step`'s rows (every trainer rank gets the same)."""
        start = time.time()
        payload = [None]
        if self.topology.rank == 0:
            self.claims = self._claim(step - 1)  # the explorer's step `step` wrote shard step - 1
            fresh = pa.concat_tables([c.table for c in self.claims])
            tables, scalars = [fresh], {}
            for source in (self.replay, self.review):
                if source is not None:
                    table, counts = source.take(step)
                    tables += [table] if table is not None else []
                    scalars.update(counts)
            table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else fresh
            payload = [(table, fresh.num_rows, scalars)]
        if self.topology.trainer_ranks > 1:
            dist.broadcast_object_list(payload, src=0)
        table, fresh_rows, scalars = payload[0]
        waited = self.claims[0].waited_s if self.claims else 0.0
        return StepRows(table, fresh_rows, waited, time.time() - start - waited, scalars)

    def _claim(self, shard: int) -> list:
        """The claims of shard step `shard`. A shard that fails its checksum is quarantined
        (rft/buffer/shards.py) and waited for: the job's explorer that wrote it writes it again
        from its copy, and the next step's shards, ready meanwhile, wait their turn."""
        while True:
            try:
                if self.producers:
                    return self.buffer.claim_step(0, self.producers, self.wait_timeout_s, self.poll_s, self.lost,
                                                  step=shard)
                return [self.buffer.claim(consumer=0, timeout_s=self.wait_timeout_s, poll_s=self.poll_s)]
            except ShardCorruptError as err:
                self.corrupt += 1
                then = "waiting for its explorer to write it again" if self.producers else \
                    "skipped: no explorer of this job can write it again"
                print(f"rft: {err}; {then}", flush=True)

    def commit(self, step: int, stale: bool = False) -> float:
        """Mark the step's shards consumed (replay candidates from now on), or with `stale` set
        them aside untrained."""
        start = time.time()
        for claim in self.claims:
            (self.buffer.set_aside_stale if stale else self.buffer.commit)(claim)
        if self.replay is not None and self.claims and not stale:
            self.replay.add(step, [(c.name, c.table) for c in self.claims])
        self.claims = []
        return time.time() - start
