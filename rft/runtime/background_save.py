"""Checkpoints written while the trainer trains on (`trainer.async_save`).

A synchronous save stops every rank until the trainer's shards are on disk: for an 8B model with
its optimizer (over 100 GB) on a parallel filesystem, minutes per save. Here a save only plans
(megatron-core's dist_checkpointing, a collective of the trainer ranks) and copies this rank's
tensors to host memory (the GPU-to-host copy a GPU save makes anyway; on CPU a copy, since the
optimizer updates the tensors in place); a thread writes the copy while the trainer trains on.

    save at step N          steps N+1, N+2, ...               a control point after the write
    plan, copy (stall) ---> thread writes shards ---------->  every trainer rank done (the vote):
                                                              metadata, then each rank's file

The checkpoint is complete, as always, once every voting rank's file is there (rft/runtime/
checkpoint.py): trainer ranks write theirs only after their shards and the metadata, so a crash
during the write leaves the previous checkpoint the newest complete one. The next save, a stop on
Slurm's signal and the run's end wait for a write still going. The file writer is megatron-core's
(FileSystemWriterAsync, the writer Megatron-LM's --async-save uses); it runs in a thread rather
than in Megatron's forked workers (a fork's copy-on-write pages slow the optimizer steps that run
meanwhile: `_write_here`), and the finalization is a collective the rank's own loop runs.
"""

from __future__ import annotations

import copy
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any

from rft.lazy import lazy_module

torch = lazy_module("torch")


def _staged(buckets: list) -> list:
    """megatron-core's write buckets with every tensor copied to host memory. (Its own preload,
    FileSystemWriterAsync.preload_tensors, leaves a CPU tensor in place, which the optimizer then
    changes under the writer, and calls torch.cuda.synchronize, which a CPU build refuses.)"""
    cuda = torch.cuda.is_available()
    staged = []
    for file_name, storage_key, (bytes_data, tensor_data) in buckets:
        copies = [(item, tensor.detach().to("cpu", copy=True, non_blocking=cuda)) for item, tensor in tensor_data]
        staged.append((file_name, storage_key, (bytes_data, copies)))
    if cuda:
        torch.cuda.synchronize()
    return staged


def _write_here(async_fn, args: list) -> None:
    """megatron-core's write (`async_fn`: FileSystemWriterAsync.write_preloaded_data_multiproc with
    its transforms), in this thread instead of in processes it forks: a fork shares the trainer's
    memory copy-on-write, and pages the next optimizer step writes are then copied (SmolLM2-135M on
    2 CPU cores, its 9.5-10 s step during a write: 17.5-19.1 s with forked writers, 14.8-18.2 s here).
    Each bucket goes through its own per-file writer, and the results reach megatron-core's
    finalization through its queue as the forked writers' would."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if not (isinstance(async_fn, functools.partial) and async_fn.func is FileSystemWriterAsync.write_preloaded_data_multiproc):
        async_fn(*args)  # another writer: as megatron-core schedules it
        return
    transform_list, use_msc = async_fn.args
    _rank, buckets, results_queue = args
    results: dict[int, Any] | Exception = {}
    for index, bucket in enumerate(buckets):
        done, count = queue.Queue(), queue.Queue()
        count.put(index)  # the writer marks its task done on this queue
        FileSystemWriterAsync.write_preloaded_data(transform_list, index, bucket, done, count, True, use_msc=use_msc)
        _, written = done.get()
        if isinstance(written, Exception):
            results = written
            break
        results[index] = written
    results_queue.put(results)


class BackgroundSave:
    """One trainer rank's checkpoint `done` being written: `shards` (sharded components, through
    dist_checkpointing into `path`) and `state` (the rank file's other components, copied now)."""

    def __init__(self, path: str, done: int, shards: dict[str, Any], state: dict[str, Any],
                 own_digests: Callable[[], dict[str, dict[str, Any]]]):
        from megatron.core import dist_checkpointing

        self.done, self.path, self.shards = done, path, shards
        self.own_digests = own_digests  # size and sha256 of this rank's files, once written
        self.digests: dict[str, dict[str, Any]] = {}
        self.components = sorted(shards)
        self.state = copy.deepcopy(state)  # as it is now: the trainer goes on changing it
        self.request = dist_checkpointing.save(shards, path, async_sharded_save=True)  # a collective
        args = list(self.request.async_fn_args)
        if self.request.async_fn is not None:
            args[1] = _staged(args[1])  # the write buckets
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._write, args=(args,), name=f"rft-save-{done}", daemon=True)
        self._thread.start()

    def _write(self, args: list) -> None:
        try:
            if self.request.async_fn is not None:
                _write_here(self.request.async_fn, args)
            # checksums of this rank's own files here, not in the completion that every rank waits for
            self.digests = self.own_digests()
        except BaseException as err:  # raised on the rank's own thread by finish()
            self.error = err

    @property
    def writing(self) -> bool:
        return self._thread.is_alive()

    def finish(self) -> None:
        """Every trainer rank together (collectives): wait for this rank's write, agree that every
        rank's succeeded, then let megatron-core write the checkpoint's metadata. Raises the write's
        error (on the other ranks: that a peer's failed) with nothing finalized."""
        import torch.distributed as dist

        self._thread.join()
        failed = torch.tensor([1 if self.error is not None else 0])
        dist.all_reduce(failed)
        if self.error is not None:
            raise self.error
        if failed.item():
            raise RuntimeError(f"another trainer rank failed to write its shards of the checkpoint at step {self.done}")
        for finalize in self.request.finalize_fns:
            finalize()
