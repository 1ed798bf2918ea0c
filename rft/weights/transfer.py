"""The broadcast wire protocol (gloo and nccl engines): a header, the tensor table, then buckets.

Per sync and per weight group (one group per pipeline stage), group rank 0 broadcasts
  1. header int64[3] = [version, table_bytes, num_tensors]
  2. the table: pickled [(hf_name, shape, wire_dtype_name)], as uint8
  3. the tensors, packed in table order into flat buckets of at most `bucket_bytes` (a tensor
     larger than a bucket travels alone). Receivers derive the same split from the table.
Both sides are double-buffered: the sender packs bucket k+1 (which includes the TP all-gathers)
while bucket k is on the wire; a receiver posts the receive of bucket k+1 before it hands bucket
k to `load_fn` (vLLM's `model.load_weights`). No rank holds more than two buckets beyond its
model, and the table is built from shapes alone (`rft/trainer/hf_weights.py`), never from a copy.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from rft.weights.group import Pending, WeightGroup

TensorTable = list[tuple[str, tuple[int, ...], str]]
LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _nbytes(entry: tuple[str, tuple[int, ...], str]) -> int:
    return dtype_from_name(entry[2]).itemsize * int(torch.Size(entry[1]).numel())


def plan_buckets(table: TensorTable, bucket_bytes: int) -> list[list[int]]:
    """Split table indices into consecutive runs of at most `bucket_bytes` and one dtype each."""
    buckets: list[list[int]] = [[]]
    used = 0
    for index, entry in enumerate(table):
        nbytes = _nbytes(entry)
        current = buckets[-1]
        if current and (used + nbytes > bucket_bytes or table[current[0]][2] != entry[2]):
            buckets.append([])
            used = 0
        buckets[-1].append(index)
        used += nbytes
    return [b for b in buckets if b]


def describe_bucket(table: TensorTable, plan: list[list[int]], k: int) -> str:
    """Names the parameters in flight, for errors: 'bucket 3/9 (model.layers.1.mlp... .. ...)'."""
    first, last = table[plan[k][0]][0], table[plan[k][-1]][0]
    span = first if first == last else f"{first} .. {last}"
    return f"bucket {k + 1}/{len(plan)} ({span})"


def table_bytes(table: TensorTable) -> int:
    return sum(_nbytes(e) for e in table)


def send_weights(group: WeightGroup, table: TensorTable, tensors: Iterable[tuple[str, torch.Tensor]],
                 version: int, bucket_bytes: int) -> int:
    """Broadcast the tensors `table` announces (yielded by `tensors` in table order) from group
    rank 0; returns the payload bytes sent."""
    blob = pickle.dumps(table)
    group.broadcast(torch.tensor([version, len(blob), len(table)], dtype=torch.int64).to(group.device),
                    "header")
    group.broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(group.device), "tensor table")
    plan = plan_buckets(table, bucket_bytes)
    source: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
    pending: Pending | None = None
    in_flight: torch.Tensor | None = None
    sent = 0
    for k, indices in enumerate(plan):
        parts = []
        for i in indices:
            name, tensor = next(source)
            expected_name, shape, wire = table[i]
            if name != expected_name or tuple(tensor.shape) != shape:
                raise RuntimeError(f"weight source yielded {name} {tuple(tensor.shape)} where the table "
                                   f"announced {expected_name} {shape}")
            parts.append(tensor.detach().reshape(-1).to(device=group.device, dtype=dtype_from_name(wire)))
        flat = torch.cat(parts)  # packed while the previous bucket is on the wire
        if pending is not None:
            pending.wait()
        pending, in_flight = group.broadcast_async(flat, describe_bucket(table, plan, k)), flat
        sent += flat.numel() * flat.element_size()
    if pending is not None:
        pending.wait()
    del in_flight
    leftover = next(source, None)
    if leftover is not None:
        raise RuntimeError(f"weight source yielded {leftover[0]} beyond the announced table")
    return sent


def receive_weights(group: WeightGroup, load_fn: LoadFn, bucket_bytes: int) -> tuple[int, float]:
    """Receive one sync from group rank 0, feeding each bucket to `load_fn` as it arrives.

    Returns (version, seconds spent after the last bucket arrived): the part of a sync the
    sender does not see, because broadcasts complete on the sender before the receiver loads.
    """
    header = torch.zeros(3, dtype=torch.int64, device=group.device)
    group.broadcast(header, "header")
    version, blob_bytes, num_tensors = (int(x) for x in header.cpu())
    raw = torch.zeros(blob_bytes, dtype=torch.uint8, device=group.device)
    group.broadcast(raw, "tensor table")
    table: TensorTable = pickle.loads(raw.cpu().numpy().tobytes())
    assert len(table) == num_tensors, "tensor table does not match its header"
    plan = plan_buckets(table, bucket_bytes)

    def post(k: int) -> tuple[torch.Tensor, Pending]:
        numel = sum(int(torch.Size(table[i][1]).numel()) for i in plan[k])
        flat = torch.empty(numel, dtype=dtype_from_name(table[plan[k][0]][2]), device=group.device)
        return flat, group.broadcast_async(flat, describe_bucket(table, plan, k))

    tail_start = time.perf_counter()
    upcoming = post(0) if plan else None
    for k, indices in enumerate(plan):
        flat, pending = upcoming
        pending.wait()
        upcoming = post(k + 1) if k + 1 < len(plan) else None  # on the wire while we load bucket k
        tail_start = time.perf_counter()
        offset, loaded = 0, []
        for i in indices:
            name, shape, _ = table[i]
            numel = int(torch.Size(shape).numel())
            loaded.append((name, flat[offset: offset + numel].view(shape)))
            offset += numel
        load_fn(loaded)
    return version, time.perf_counter() - tail_start
