"""The experience record: one typed, versioned Arrow schema that every part of rft shares.

A workflow returns `Experience` objects, the explorer writes them as shard rows (`to_table`),
the trainer reads them back (`from_table`) into its batches, and the algorithms group them by
`group_id`. One row is one trajectory (or, for the `step_wise` workflow, one step of it):

    token_ids      the whole sequence the model saw and produced: prompt, model turns, tool and
                   environment messages, chat scaffolding
    loss_mask      1 on tokens the policy sampled (trained), 0 on everything else
    logprobs       vLLM's logprob of each sampled token (0.0 where loss_mask is 0)
    prompt_length  tokens before the first model turn (the trainer's "response" starts here)
    reward         the scalar the advantage estimators see
    step_rewards   optional per-step rewards of a multi-step trajectory; step_index: this row's step
    group_id       rows compared with each other (a task's samples); groups may be ragged
    trajectory_id  rows of one trajectory (step_wise writes one row per step)
    task_id, version (policy version that generated it), turns, tool_calls, finish_reason, error,
    metrics        workflow metrics (name -> number), response (the text the reward read)
    routed_experts optional, MoE policies with routing replay: the experts vLLM routed each token
                   to, [tokens, layers, k] (rft/trainer/routing_replay.py); absent in older shards
    token_versions optional, the weights version that sampled each token (-1 where the policy
                   sampled none): a weight update may cut a generation that then goes on with
                   newer weights (rollout.partial_rollout); null where the workflow recorded
                   none, and in older shards: every sampled token is then `version`'s
    teacher_logprobs optional, on-policy distillation: a frozen teacher's logprob of each token given
                   the tokens before it (0.0 at position 0; what matters is the sampled tokens'), as
                   the judge engine scored the row (rft/explorer/teacher.py); null where it was
                   not asked or did not answer
    images         optional, a vision-language trajectory's images as encoded bytes (PNG, JPEG: as
                   the taskset held them), in the order of their image tokens; the trainer's image
                   processor makes the same patches from them as vLLM's did

Why rows are whole trajectories with a mask rather than (prompt, response) pairs: a multi-turn
conversation interleaves sampled and non-sampled tokens, and the trainer must score exactly the
ids vLLM sampled, in the context vLLM saw them. Groups are named, not implied by row order, so a
failed sample or a filter can leave a group ragged without shifting every later group.

`SCHEMA_VERSION` is stored in the schema's metadata; a shard written with another version is
refused with a message rather than misread.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_VERSION = 1
OPTIONAL_COLUMNS = ("routed_experts", "token_versions", "teacher_logprobs", "images")  # added within version 1: a shard without them reads as None
_VERSION_KEY = b"rft.experience_schema"
_FLOAT32_MAX = float(np.finfo(np.float32).max)  # rewards are stored as float32: larger ones become inf

SCHEMA = pa.schema([
    pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
    pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
    pa.field("prompt_length", pa.int32(), nullable=False),
    pa.field("reward", pa.float32(), nullable=False),
    pa.field("step_rewards", pa.list_(pa.float32())),
    pa.field("step_index", pa.int32(), nullable=False),
    pa.field("group_id", pa.string(), nullable=False),
    pa.field("trajectory_id", pa.string(), nullable=False),
    pa.field("task_id", pa.string(), nullable=False),
    pa.field("version", pa.int64(), nullable=False),
    pa.field("turns", pa.int32(), nullable=False),
    pa.field("tool_calls", pa.int32(), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),
    pa.field("error", pa.string()),
    pa.field("metrics", pa.string(), nullable=False),  # JSON object name -> number (open-ended keys)
    pa.field("response", pa.string(), nullable=False),
    pa.field("routed_experts", pa.struct([("layers", pa.int32()), ("topk", pa.int32()),
                                          ("ids", pa.list_(pa.uint16()))])),
    pa.field("token_versions", pa.list_(pa.int64())),
    pa.field("teacher_logprobs", pa.list_(pa.float32())),
    pa.field("images", pa.list_(pa.binary())),
], metadata={_VERSION_KEY: str(SCHEMA_VERSION).encode()})


@dataclass
class Experience:
    """One trajectory (or one step of it) as the trainer will see it. Workflows build these
    through `rft.explorer.model_client.Conversation`; the runner fills in the ids and version."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_length: int
    reward: float | None = None  # None: the runner scores it with algorithm.reward
    step_rewards: list[float] | None = None
    step_index: int = 0
    group_id: str = ""
    trajectory_id: str = ""
    task_id: str = ""
    version: int = 0
    turns: int = 0
    tool_calls: int = 0
    finish_reason: str = ""
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    response: str = ""  # the text the reward function reads (last model turn, or an env's answer)
    routed_experts: np.ndarray | None = None  # [tokens, layers, k]: vLLM's routing, to replay
    token_versions: list[int] | None = None  # each token's sampling weights (-1: not sampled); None: all `version`'s
    teacher_logprobs: list[float] | None = None  # a frozen teacher's logprob per token (distillation); None: not scored
    images: list[bytes] | None = None  # a vision-language trajectory's images, encoded, in the order of their tokens

    def check(self) -> None:
        """ValueError naming what is inconsistent (a workflow's bug, caught before the buffer)."""
        n = len(self.token_ids)
        optional = {name: len(getattr(self, name)) for name in ("token_versions", "teacher_logprobs")
                    if getattr(self, name) is not None}
        if len(self.loss_mask) != n or len(self.logprobs) != n or any(length != n for length in optional.values()):
            others = "".join(f", {name} ({length})" for name, length in optional.items())
            raise ValueError(f"experience {self.trajectory_id or '?'}: token_ids ({n}), loss_mask "
                             f"({len(self.loss_mask)}), logprobs ({len(self.logprobs)}){others} differ in length")
        if not 0 <= self.prompt_length <= n:
            raise ValueError(f"experience {self.trajectory_id or '?'}: prompt_length {self.prompt_length} "
                             f"outside [0, {n}]")
        if any(self.loss_mask[: self.prompt_length]):
            raise ValueError(f"experience {self.trajectory_id or '?'}: loss_mask is 1 inside the prompt "
                             f"(first {self.prompt_length} tokens); only sampled tokens are trained")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"experience {self.trajectory_id or '?'}: loss_mask holds values other than 0 and 1")
        # A NaN, infinite or non-numeric reward (an environment's, a workflow's) must fail the task, not
        # reach the trainer; a finite one beyond float32's range would be stored as inf.
        for name, values in (("reward", [self.reward] if self.reward is not None else []),
                             ("step_rewards", self.step_rewards or [])):
            if not all(isinstance(v, numbers.Real) and math.isfinite(v) and abs(v) <= _FLOAT32_MAX for v in values):
                raise ValueError(f"experience {self.trajectory_id or '?'}: {name} {values!r:.80} must hold finite "
                                 "numbers (within float32's range)")

    @property
    def response_ids(self) -> list[int]:
        """Everything after the prompt: model turns and what came between them."""
        return self.token_ids[self.prompt_length:]

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)


def to_table(experiences: list[Experience]) -> pa.Table:
    """Rows in SCHEMA; every experience must be checked and scored (reward set)."""
    columns: dict[str, list] = {f.name: [] for f in fields(Experience)}
    for exp in experiences:
        if exp.reward is None:
            raise ValueError(f"experience {exp.trajectory_id or '?'} has no reward; score it before writing")
        for f in fields(Experience):
            columns[f.name].append(getattr(exp, f.name))
    columns["metrics"] = [json.dumps(m, sort_keys=True) for m in columns["metrics"]]
    columns["routed_experts"] = [None if r is None else {"layers": r.shape[1], "topk": r.shape[2], "ids": r.reshape(-1)}
                                 for r in columns["routed_experts"]]
    arrays = {}
    for name in SCHEMA.names:
        try:
            arrays[name] = pa.array(columns[name], type=SCHEMA.field(name).type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:  # name the field, not pyarrow
            raise ValueError(f"experience field {name!r} cannot be stored as {SCHEMA.field(name).type}: {e}") from None
    return pa.table(arrays, schema=SCHEMA)


def check_table(table: pa.Table, where: str) -> None:
    """ValueError unless `table` holds experience rows of this schema version."""
    version = (table.schema.metadata or {}).get(_VERSION_KEY)
    if version is None or int(version) != SCHEMA_VERSION:
        found = "no rft experience schema" if version is None else f"experience schema {int(version)}"
        raise ValueError(f"{where} has {found}; this rft reads schema {SCHEMA_VERSION}: it was written by "
                         "another rft version (train it with that version, or produce it again)")
    missing = [name for name in SCHEMA.names if name not in table.column_names and name not in OPTIONAL_COLUMNS]
    if missing:
        raise ValueError(f"{where} lacks experience columns {missing}")
    # A shard written by other code (or corrupted) with the right version tag must not be misread:
    # from_table would hand the trainer strings for rewards, or token_ids and masks of other lengths.
    for want in SCHEMA:
        if want.name not in table.column_names:
            continue
        column = table.column(want.name)
        if column.type != want.type:
            raise ValueError(f"{where}: experience column {want.name!r} has type {column.type}, expected {want.type}")
        if not want.nullable and column.null_count:
            raise ValueError(f"{where}: experience column {want.name!r} has {column.null_count} null value(s)")
    tokens, mask, logprobs = (pc.list_value_length(table.column(name)).to_numpy(zero_copy_only=False)
                              for name in ("token_ids", "loss_mask", "logprobs"))
    prompt = table.column("prompt_length").to_numpy()
    ragged = np.flatnonzero((mask != tokens) | (logprobs != tokens))
    if ragged.size:
        row = int(ragged[0])
        raise ValueError(f"{where}: experience columns 'token_ids' ({tokens[row]}), 'loss_mask' ({mask[row]}) and "
                         f"'logprobs' ({logprobs[row]}) differ in length in row {row}")
    outside = np.flatnonzero((prompt < 0) | (prompt > tokens))
    if outside.size:
        row = int(outside[0])
        raise ValueError(f"{where}: experience column 'prompt_length' is {prompt[row]} in row {row}, outside "
                         f"[0, {tokens[row]}] (len(token_ids))")


def from_table(table: pa.Table) -> list[Experience]:
    """The experiences of a shard (columns other than SCHEMA's, such as the writer's `step`, ignored)."""
    check_table(table, "experience table")
    names = [f.name for f in fields(Experience) if f.name not in OPTIONAL_COLUMNS]
    rows = table.select(names).to_pylist()
    routes = _routed_experts(table)
    versions, teacher, images = (table.column(name).to_pylist() if name in table.column_names
                                 else [None] * table.num_rows for name in ("token_versions", "teacher_logprobs", "images"))
    for row, routed, token_versions, teacher_logprobs, row_images in zip(rows, routes, versions, teacher, images):
        row["metrics"] = json.loads(row["metrics"])
        row["routed_experts"], row["token_versions"] = routed, token_versions
        row["teacher_logprobs"], row["images"] = teacher_logprobs, row_images
    return [Experience(**row) for row in rows]


def _routed_experts(table: pa.Table) -> list[np.ndarray | None]:
    """Each row's routed experts as a [tokens, layers, k] array, read through numpy: a row holds
    tokens x layers x k of them, too many for Python lists."""
    if "routed_experts" not in table.column_names:
        return [None] * table.num_rows
    column = table.column("routed_experts").combine_chunks()
    layers, topk, ids = column.flatten()  # children with the column's offset applied (a sliced table)
    offsets, values = ids.offsets.to_numpy(), ids.values.to_numpy(zero_copy_only=False)
    layers, topk = layers.to_numpy(zero_copy_only=False), topk.to_numpy(zero_copy_only=False)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i]: offsets[i + 1]].reshape(-1, int(layers[i]), int(topk[i])) if valid[i] else None
            for i in range(table.num_rows)]
