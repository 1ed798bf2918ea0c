"""Reads W&B's offline run files (`wandb/offline-run-*/run-<id>.wandb`): the history rows a run
wrote, to find where a resumed offline run goes on, and for tests to read back what was logged.

Written here because wandb 0.2x+ ships no Python reader for its own files (the old
`wandb.sdk.internal.datastore` is gone; `wandb sync` reads them in its Go core). The format is
LevelDB's log format around W&B's protobuf `Record` (`wandb.proto.wandb_internal_pb2`): a 7-byte
file header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte
header (CRC32, length, type: full, first, middle, last); a block's tail shorter than a header is
padding.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Iterator

BLOCK = 32768
HEADER = struct.Struct("<IHB")  # crc32, length, chunk type
FILE_HEADER = struct.Struct("<4sHB")  # ":W&B", magic, version
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> Iterator:
    """Every `Record` of one .wandb file, in order; a chunk cut by a crash ends the file."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    ident, magic, _ = FILE_HEADER.unpack_from(data)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path}: not a W&B run file")
    pos, pending = FILE_HEADER.size, b""
    while pos + HEADER.size <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER.size:  # padding at a block's end
            pos += room
            continue
        _, length, kind = HEADER.unpack_from(data, pos)
        if kind == 0 or pos + HEADER.size + length > len(data):  # zeroed rest of a block, or torn
            pos += room if kind == 0 else len(data)
            continue
        pending += data[pos + HEADER.size:pos + HEADER.size + length]
        pos += HEADER.size + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(wandb_dir: str, run_id: str) -> list[dict[str, float]]:
    """The history rows (`{"_step": n, key: value, ...}`) of every offline attempt of run `run_id`
    under `wandb_dir`, attempt after attempt (as `wandb sync` uploads them)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(wandb_dir, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb"))):
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                row = {"_step": record.history.step.num}
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        row[key] = json.loads(item.value_json)
                rows.append(row)
    return rows
