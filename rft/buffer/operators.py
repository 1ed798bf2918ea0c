"""Experience operators: what happens to experience between the workflow and the buffer
(`buffer.operators`, applied in order to each generation round of a step; rft/config/data.py
shows the entry format).

Registry EXPERIENCE_OPERATORS, signature

    fn(experiences: list[Experience], **options) -> list[Experience]

An operator returns the experiences to keep, in order; it may drop rows (filters), change
rewards (shaping: return `dataclasses.replace(e, reward=...)` or set the field), or pass them on
after a side effect (`review`). An operator that takes a parameter `ctx` is given an
`OperatorContext` (the run directory, the step, a detokenizer). Every operator's dropped and
reshaped rows are counted and logged per step as `ops/<name>/dropped`, `ops/<name>/reshaped`.

Filters that drop part of a group leave it ragged, which every advantage estimator handles (groups
are named, rft/buffer/experience.py). Dropping whole groups keeps the others' baselines intact:
`group_std_filter` does, and with dynamic sampling (rollout.max_sampling_rounds) the explorer
generates more until the step's groups are full (rft/explorer/dynamic_sampling.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from typing import Any

from rft.buffer.experience import Experience
from rft.buffer.operator_registry import EXPERIENCE_OPERATORS, OperatorContext, groups_of

__all__ = ["EXPERIENCE_OPERATORS", "OperatorContext", "OperatorPipeline", "groups_of"]

# ---- filters -----------------------------------------------------------------------------------

@EXPERIENCE_OPERATORS.register("reward_filter")
def reward_filter(experiences: list[Experience], min_reward: float | None = None,
                  max_reward: float | None = None) -> list[Experience]:
    """Keep rows whose reward is within [min_reward, max_reward] (either bound may be left out)."""
    return [e for e in experiences
            if (min_reward is None or e.reward >= min_reward) and (max_reward is None or e.reward <= max_reward)]


@EXPERIENCE_OPERATORS.register("group_std_filter")
def group_std_filter(experiences: list[Experience], min_std: float = 0.0) -> list[Experience]:
    """Drop whole groups whose reward standard deviation is not above `min_std` (with 0: groups whose
    rewards are all equal, DAPO's dynamic-sampling filter, algorithm.sample_filter=zero_variance).
    A group of one is kept (there is no spread to measure), as verl's filter does."""
    kept = []
    for rows in groups_of(experiences).values():
        rewards = [float(e.reward) for e in rows]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        if len(rows) == 1 or std > min_std:
            kept += rows
    return kept


@EXPERIENCE_OPERATORS.register("length_filter")
def length_filter(experiences: list[Experience], min_tokens: int = 0, max_tokens: int | None = None,
                  drop_truncated: bool = False) -> list[Experience]:
    """Keep rows whose sampled tokens are within [min_tokens, max_tokens]; with `drop_truncated`,
    also drop rows the engine cut at rollout.max_new_tokens (finish_reason "length")."""
    return [e for e in experiences
            if min_tokens <= e.sampled_tokens and (max_tokens is None or e.sampled_tokens <= max_tokens)
            and not (drop_truncated and e.finish_reason == "length")]


@EXPERIENCE_OPERATORS.register("dedup")
def dedup(experiences: list[Experience], threshold: float = 1.0, scope: str = "group",
          num_perm: int = 128) -> list[Experience]:
    """Drop responses that repeat an earlier one: exactly (threshold 1.0, after lower-casing and
    collapsing whitespace) or nearly (MinHash estimate of Jaccard similarity >= threshold, with
    datasketch; rft/data/near_duplicates.py). `scope`: group (a task's samples, where repeats
    waste a GRPO group's slots) or batch (the whole round)."""
    from rft.data.near_duplicates import duplicate_of

    if scope not in ("group", "batch"):
        raise ValueError(f"dedup: scope={scope!r}; use group or batch")
    sets = groups_of(experiences).values() if scope == "group" else [experiences]
    keep: set[int] = set()
    for rows in sets:
        keep.update(id(e) for e, first in zip(rows, duplicate_of([e.response for e in rows], threshold, num_perm))
                    if first is None)
    return [e for e in experiences if id(e) in keep]


# ---- reward shaping ----------------------------------------------------------------------------

@EXPERIENCE_OPERATORS.register("length_penalty")
def length_penalty(experiences: list[Experience], max_tokens: int = 0, buffer_tokens: int = 0,
                   penalty: float = 1.0) -> list[Experience]:
    """DAPO's overlong reward shaping: a response longer than max_tokens - buffer_tokens loses
    reward linearly, up to `penalty` at max_tokens and beyond."""
    if max_tokens <= 0 or not 0 < buffer_tokens <= max_tokens:
        raise ValueError(f"length_penalty: max_tokens={max_tokens}, buffer_tokens={buffer_tokens}; use "
                         "0 < buffer_tokens <= max_tokens, e.g. max_tokens: 512, buffer_tokens: 128")
    free = max_tokens - buffer_tokens
    out = []
    for e in experiences:
        over = e.sampled_tokens - free
        out.append(dataclasses.replace(e, reward=e.reward - penalty * min(1.0, over / buffer_tokens))
                   if over > 0 else e)
    return out


@EXPERIENCE_OPERATORS.register("format_reward")
def format_reward(experiences: list[Experience], pattern: str = "", bonus: float = 0.1,
                  penalty: float = 0.0) -> list[Experience]:
    """Add `bonus` to rows whose response matches the regular expression `pattern` (re.search,
    DOTALL) and subtract `penalty` from those that do not (e.g. pattern '<answer>.*</answer>')."""
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise ValueError(f"format_reward: pattern={pattern!r} is not a regular expression ({err})") from None
    if not pattern:
        raise ValueError("format_reward: give `pattern`, the regular expression a well-formed response matches")
    return [dataclasses.replace(e, reward=e.reward + (bonus if regex.search(e.response) else -penalty))
            for e in experiences]


# ---- running them ------------------------------------------------------------------------------

def _key(e: Experience) -> tuple[str, int]:
    return e.trajectory_id, e.step_index


class OperatorPipeline:
    """`buffer.operators` (and a sample filter turned into one) resolved once, applied to each
    round's experiences, with per-operator counts kept until `take_scalars`."""

    def __init__(self, specs: list[tuple[str, dict[str, Any]]], ctx: OperatorContext | None = None):
        self.ctx = ctx or OperatorContext()
        self.steps = []
        for name, options in specs:
            fn = EXPERIENCE_OPERATORS.resolve(name)
            wants_ctx = "ctx" in inspect.signature(fn).parameters
            label = name.rsplit(".", 1)[-1]
            self.steps.append((label, fn, dict(options), wants_ctx))
        self.counts: dict[str, dict[str, int]] = {}

    def __bool__(self) -> bool:
        return bool(self.steps)

    def __call__(self, experiences: list[Experience]) -> list[Experience]:
        for label, fn, options, wants_ctx in self.steps:
            before = {_key(e): e.reward for e in experiences}
            out = fn(experiences, **options, **({"ctx": self.ctx} if wants_ctx else {}))
            if not isinstance(out, list) or not all(isinstance(e, Experience) for e in out):
                raise ValueError(f"experience operator {label} returned {type(out).__name__}, not a list of "
                                 "Experience: return the rows to keep")
            unknown = [e for e in out if _key(e) not in before]
            if unknown:
                raise ValueError(f"experience operator {label} returned a row it was not given "
                                 f"(trajectory {unknown[0].trajectory_id}): operators keep, drop or reshape rows")
            for e in out:
                try:
                    e.check()  # a shaped reward must still be a finite number
                except ValueError as err:
                    raise ValueError(f"experience operator {label} returned a row that is not valid: {err}") from None
            counts = self.counts.setdefault(label, {"dropped": 0, "reshaped": 0})
            counts["dropped"] += len(experiences) - len(out)
            counts["reshaped"] += sum(e.reward != before[_key(e)] for e in out)
            experiences = out
        return experiences

    def take_scalars(self) -> dict[str, float]:
        """ops/<name>/dropped and ops/<name>/reshaped since the last call (one step's)."""
        scalars = {f"ops/{label}/{what}": float(n) for label, counts in self.counts.items() for what, n in counts.items()}
        self.counts = {}
        return scalars


# the `review` operator lives with the rest of human review and registers itself when imported;
# importing it here gives every user of this module the whole registry
from rft.buffer import review as _review  # noqa: E402,F401
