"""Checkpoints written while the trainer trains on (`trainer.async_save`).

A synchronous save stops every rank until the trainer's shards are on disk: for an 8B model with
its optimizer (over 100 GB) on a parallel filesystem, minutes per save. Here a save only plans
(megatron-core's dist_checkpointing, a collective of the trainer ranks) and copies this rank's
tensors to shared host memory; the rank's writer process (rft/runtime/shard_writer.py) writes them
while the trainer trains on.

    save at step N          steps N+1, N+2, ...               a control point after the write
    plan, copy (stall) ---> the writer process writes ------> every trainer rank done (the vote):
                                                              metadata, then each rank's file

The checkpoint is complete, as always, once every voting rank's file is there (rft/runtime/
checkpoint.py): trainer ranks write theirs only after their shards and the metadata, so a crash
during the write leaves the previous checkpoint the newest complete one. The next save, a stop on
Slurm's signal and the run's end wait for a write still going. The file writer is megatron-core's
(FileSystemWriterAsync, the writer Megatron-LM's --async-save uses), run by the writer process
rather than by the processes megatron-core forks (a fork's copy-on-write pages slow the optimizer
steps that run meanwhile), and the finalization is a collective the rank's own loop runs.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

from rft.runtime.shard_writer import ShardWriter


class BackgroundSave:
    """One trainer rank's checkpoint `done` being written: `shards` (sharded components, through
    dist_checkpointing into `path`) and `state` (the rank file's other components, copied now)."""

    def __init__(self, path: str, done: int, shards: dict[str, Any], state: dict[str, Any],
                 own_digests: Callable[[], dict[str, dict[str, Any]]], writer: ShardWriter):
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        self.done, self.path, self.shards, self.writer = done, path, shards, writer
        self.digests: dict[str, dict[str, Any]] = {}
        self.components = sorted(shards)
        self.state = copy.deepcopy(state)  # as it is now: the trainer goes on changing it
        self.request = dist_checkpointing.save(shards, path, async_sharded_save=True)  # a collective
        write = self.request.async_fn
        self.own_digests = own_digests
        self.writes = write is not None  # megatron-core planned files of this rank's
        if not self.writes:
            return
        if not (isinstance(write, functools.partial) and write.func is FileSystemWriterAsync.write_preloaded_data_multiproc):
            raise RuntimeError(f"megatron-core planned the background save with {write!r}, which rft's writer "
                               "process does not run; set trainer.async_save=false")
        transform_list, use_msc = write.args
        _rank, buckets, _results_queue = self.request.async_fn_args
        writer.start(buckets, transform_list, use_msc, own_digests)

    @property
    def writing(self) -> bool:
        return self.writes and self.writer.writing

    def _wait(self) -> BaseException | None:
        """This rank's write done: its error, or None (the digests of its files then kept)."""
        if not self.writes:
            self.digests = self.own_digests()
            return None
        try:
            results, self.digests = self.writer.wait()
        except Exception as err:  # noqa: BLE001 - the writer process died: this rank's write failed
            return err
        if isinstance(results, Exception):
            return results
        self.request.async_fn_args[2].put(results)  # where megatron-core's finalization reads them
        return None

    def finish(self) -> None:
        """Every trainer rank together (collectives): wait for this rank's write, agree that every
        rank's succeeded, then let megatron-core write the checkpoint's metadata. Raises the write's
        error (on the other ranks: that a peer's failed) with nothing finalized."""
        import torch
        import torch.distributed as dist

        error = self._wait()
        failed = torch.tensor([1 if error is not None else 0])
        dist.all_reduce(failed)
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError(f"another trainer rank failed to write its shards of the checkpoint at step {self.done}")
        for finalize in self.request.finalize_fns:
            finalize()
