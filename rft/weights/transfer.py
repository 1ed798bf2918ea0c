"""The weight-sync wire protocol: a header, the parameter table, then flat buckets.

Per sync, group rank 0 broadcasts
  1. header int64[3] = [version, table_bytes, num_tensors]
  2. the table: pickled [(hf_name, shape, dtype_name)], as uint8
  3. the tensors, packed in order into flat buckets of at most `bucket_bytes` (a tensor larger
     than a bucket travels alone). Receivers derive the same split from the table.
Receivers hand each bucket's tensors to a `load_fn` (vLLM's `model.load_weights`) as soon as it
arrives, so no rank ever holds more than one bucket beyond the model itself.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterable

import torch

from rft.weights.group import WeightGroup

TensorTable = list[tuple[str, tuple[int, ...], str]]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def plan_buckets(table: TensorTable, bucket_bytes: int) -> list[list[int]]:
    """Split table indices into consecutive runs of at most `bucket_bytes` each."""
    buckets: list[list[int]] = [[]]
    used = 0
    for index, (_, shape, dtype) in enumerate(table):
        nbytes = _dtype(dtype).itemsize * int(torch.Size(shape).numel())
        if buckets[-1] and used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(index)
        used += nbytes
    return [b for b in buckets if b]


def _bucket_numel(table: TensorTable, indices: list[int]) -> int:
    return sum(int(torch.Size(table[i][1]).numel()) for i in indices)


def send_weights(group: WeightGroup, tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                 bucket_bytes: int, wire_dtype: torch.dtype) -> int:
    """Broadcast HF-named tensors from group rank 0; returns the number of payload bytes sent."""
    named = [(name, t.detach()) for name, t in tensors]
    table: TensorTable = [(n, tuple(t.shape), str(wire_dtype)) for n, t in named]
    blob = pickle.dumps(table)
    group.broadcast(torch.tensor([version, len(blob), len(table)], dtype=torch.int64), "header")
    group.broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8), "tensor table")
    sent = 0
    for indices in plan_buckets(table, bucket_bytes):
        flat = torch.cat([named[i][1].reshape(-1).to(wire_dtype) for i in indices])
        group.broadcast(flat, f"bucket starting at {named[indices[0]][0]}")
        sent += flat.numel() * flat.element_size()
    return sent


def receive_weights(group: WeightGroup, load_fn: Callable[[list[tuple[str, torch.Tensor]]], None],
                    bucket_bytes: int) -> tuple[int, float]:
    """Receive one sync from group rank 0, feeding each bucket to `load_fn`.

    Returns (version, seconds spent after the last bucket arrived): the part of a sync the
    sender does not see, because broadcasts complete on the sender before the receiver loads.
    """
    header = torch.zeros(3, dtype=torch.int64)
    group.broadcast(header, "header")
    version, table_bytes, num_tensors = (int(x) for x in header)
    raw = torch.zeros(table_bytes, dtype=torch.uint8)
    group.broadcast(raw, "tensor table")
    table: TensorTable = pickle.loads(raw.numpy().tobytes())
    assert len(table) == num_tensors, "tensor table does not match its header"
    for indices in plan_buckets(table, bucket_bytes):
        wire = _dtype(table[indices[0]][2])
        flat = torch.empty(_bucket_numel(table, indices), dtype=wire)
        group.broadcast(flat, f"bucket starting at {table[indices[0]][0]}")
        offset, loaded = 0, []
        for i in indices:
            name, shape, _ = table[i]
            numel = int(torch.Size(shape).numel())
            loaded.append((name, flat[offset: offset + numel].view(shape)))
            offset += numel
        tail_start = time.perf_counter()
        load_fn(loaded)
    return version, time.perf_counter() - tail_start
