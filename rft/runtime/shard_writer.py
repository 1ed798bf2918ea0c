"""The process that writes a trainer rank's background checkpoints (trainer.async_save), and the
shared memory its shards are staged in.

Why a process of its own, at the lowest CPU priority: megatron-core's writer serializes each tensor
with torch.save, which holds Python's GIL, so a writer thread in the trainer held up the training
step's own Python (SmolLM2-135M on 2 CPU cores: a 4.7-5.4 s step took 13-14 s during the write, at
any thread priority). A process has its own GIL, and at nice 19 it takes the cycles the trainer
leaves (the same step during the write: 7.5-8.5 s; what remains is the cores' memory bandwidth,
which the two share). It is spawned, not forked: a forked writer shares the trainer's memory
copy-on-write, and the pages the next optimizer steps write are copied.

Why one shared buffer (the arena) rather than each tensor shared on its own: torch shares a tensor
through a file descriptor the sender keeps open, one per tensor, and a checkpoint holds thousands.
The arena is laid out by the checkpoint's tensors (each at an aligned offset) and kept for the
next save while the layout stays the same, so its pages are faulted in once per run; it holds one
host copy of the rank's checkpoint for as long as the run saves in the background.

    trainer rank                                  writer process (nice 19)
    copy the tensors into the arena (the stall)
    send the buckets: names, bytes, offsets --->  per bucket: megatron-core's file writer, each
    train on                                      tensor over its slice; then the sha256 of the
    ... poll ...                          <---    files; the results
"""

from __future__ import annotations

import atexit
import io
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rft.lazy import lazy_module

torch = lazy_module("torch")

ALIGN = 64  # bytes: every tensor's slice starts here, so a view of any dtype is aligned


# Slurm signals every process of the job: a preemption's SIGTERM, the time limit's SIGUSR2, a
# Ctrl-C's SIGINT. The rank answers them with a checkpoint, which the writer must live to write
JOB_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2}


READY = "ready"  # the writer's first message


class WriterDiedError(RuntimeError):
    """The writer process ended before it answered (killed, out of memory)."""


def _nbytes(shape: tuple[int, ...], dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _layout(tensors: list) -> tuple[list[tuple[int, tuple[int, ...], Any]], int]:
    """(offset, shape, dtype) of each tensor in the arena, and the arena's size in bytes."""
    slots, size = [], 0
    for tensor in tensors:
        slots.append((size, tuple(tensor.shape), tensor.dtype))
        size += -(-_nbytes(tuple(tensor.shape), tensor.dtype) // ALIGN) * ALIGN
    return slots, size


def _view(arena, offset: int, shape: tuple[int, ...], dtype) -> Any:
    return arena[offset: offset + _nbytes(shape, dtype)].view(dtype).view(shape)


def _check_shared_memory(nbytes: int, where: str = "/dev/shm") -> None:
    """Refuse, saying what to do, when `where` (torch's shared memory on Linux) has less room than
    the arena: its pages would be taken only as they are first written, and one beyond the room
    kills the process with SIGBUS instead of raising (a container's /dev/shm is 64 MB by default)."""
    if not os.path.isdir(where):
        return
    stats = os.statvfs(where)
    free = stats.f_bavail * stats.f_frsize
    if free < nbytes:
        raise RuntimeError(f"trainer.async_save: this trainer rank stages its share of the checkpoint ({nbytes / 2**30:.1f} GiB) "
                           f"in shared memory, and {where} has {free / 2**30:.1f} GiB free; set trainer.async_save=false, "
                           "or give the job more shared memory (a container's --shm-size, fewer ranks per node)")


class ShardWriter:
    """A trainer rank's writer process (started with the rank when a stage saves in the background:
    rft/runtime/control.py)."""

    def __init__(self):
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, os.getpid()), name="rft-shard-writer", daemon=True)
        # started with the job's signals blocked (a spawned process keeps the mask) until it ignores them
        before = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
        try:
            self._process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        child.close()
        # before multiprocessing's own exit handler, which would wait for the writer (it ignores
        # SIGTERM, below) to end: a closed pipe ends it
        atexit.register(self.close)
        self._busy = False  # a write was handed over and not yet answered
        self._ready = False  # the writer said it has imported what it writes with
        self._arena = None
        self._slots: list = []
        self._sent_arena = None  # the arena the writer has mapped
        self._answer: Any = None

    def start(self, buckets: list, transform_list: list, use_msc: bool, digests: Callable[[], dict]) -> None:
        """Stage megatron-core's write `buckets` (file name, storage key, (bytes items, tensor
        items)) in the arena, then let the writer write them and take `digests()` after."""
        tensors = [tensor for _, _, (_, items) in buckets for _, tensor in items]
        slots, size = _layout(tensors)
        if self._arena is None or slots != self._slots:
            self._arena = self._sent_arena = None  # the old layout's memory goes before the new is taken
            _check_shared_memory(size)
            # made in shared memory directly: Tensor.share_memory_() allocates privately and copies
            # (0.7 s against 0.1 s for 1.6 GB on 2 CPU cores); torch.multiprocessing's own constructor
            self._arena = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(size))
            self._slots = slots
        cuda = torch.cuda.is_available()
        for (offset, shape, dtype), tensor in zip(slots, tensors):
            _view(self._arena, offset, shape, dtype).copy_(tensor.detach(), non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        jobs, slot = [], iter(slots)
        for file_name, storage_key, (bytes_items, tensor_items) in buckets:
            # BytesIO does not pickle: its bytes travel
            jobs.append((file_name, storage_key, [(item, data.getvalue()) for item, data in bytes_items],
                         [(item, next(slot)) for item, _ in tensor_items]))
        arena = self._arena if self._sent_arena is not self._arena else None  # mapped once per layout
        self._sent_arena, self._answer, self._busy = self._arena, None, True
        self._send((arena, jobs, transform_list, use_msc, digests))

    def _send(self, message: tuple) -> None:
        """Hand the staged write to the writer process (tests hold it back or spoil it here)."""
        self._conn.send(message)

    def ready(self, timeout_s: float | None = 0) -> bool:
        """Whether the writer has imported what it writes with (it says so once, first thing);
        waits up to `timeout_s` (None: until it says so or ends)."""
        if not self._ready and self._conn.poll(timeout_s):
            self._ready = self._conn.recv() == READY
        return self._ready

    @property
    def writing(self) -> bool:
        return self._busy and self._process.is_alive() and (not self.ready() or not self._conn.poll())

    def wait(self) -> tuple[dict[int, Any] | Exception, dict[str, dict[str, Any]]]:
        """The write's results by bucket (or the error it raised) and the digests of the files."""
        if self._busy:
            try:
                self.ready(None)
                self._answer, self._busy = self._conn.recv(), False
            except (EOFError, OSError) as err:
                self._busy = False
                self._process.join(timeout=5)
                raise WriterDiedError(f"the checkpoint writer process (pid {self._process.pid}) ended with exit code "
                                      f"{self._process.exitcode} before it finished; see the rank's log") from err
        return self._answer

    def close(self) -> None:
        """End the writer process (a write in progress is abandoned: wait() for it first)."""
        if not self._conn.closed:
            self._conn.close()  # the writer reads the end of its pipe and exits
        if self._process.is_alive():
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and not self._conn.closed


def _die_with(parent: int) -> None:
    """End this process when `parent` (the trainer rank) dies, on Linux: a writer left behind by a
    killed rank would go on writing into a checkpoint directory the restarted job writes anew."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1  # prctl(2)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _serve(conn, parent: int) -> None:
    """The writer process: write each job sent, answer with its results, until the pipe closes."""
    _die_with(parent)
    for signum in JOB_SIGNALS:  # ignored, pending ones dropped; then it may take them unblocked
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)
    if hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    import megatron.core.dist_checkpointing.strategies.filesystem_async  # noqa: F401 - what it writes with

    torch.set_num_threads(1)  # a core's worth at most, and only what the trainer leaves
    conn.send(READY)
    arena = None
    while True:
        try:
            sent_arena, jobs, transform_list, use_msc, digests = conn.recv()
        except EOFError:
            return
        arena = sent_arena if sent_arena is not None else arena
        try:
            results: dict[int, Any] | Exception = _write(arena, jobs, transform_list, use_msc)
            digested = digests() if not isinstance(results, Exception) else {}
        except Exception as err:  # noqa: BLE001 - it reaches the trainer, which raises it
            results, digested = err, {}
        conn.send((results, digested))


def _write(arena, jobs: list, transform_list: list, use_msc: bool) -> dict[int, Any] | Exception:
    """megatron-core's per-file writer (FileSystemWriterAsync.write_preloaded_data, what its forked
    workers run) on each job; the results by bucket as its finalization reads them."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    storage = arena.untyped_storage()
    results: dict[int, Any] = {}
    for index, (file_name, storage_key, bytes_items, tensor_items) in enumerate(jobs):
        def tensors(items=tensor_items) -> Iterator[tuple[Any, Any]]:
            # each over a storage of its own slice of the arena (a view of the same memory): torch.save
            # of a tensor view writes its whole storage, here the arena
            for item, (offset, shape, dtype) in items:
                yield item, torch.empty(0, dtype=dtype).set_(storage[offset: offset + _nbytes(shape, dtype)], 0, shape)

        bucket = (file_name, storage_key, ([(item, io.BytesIO(data)) for item, data in bytes_items], tensors()))
        done, count = queue.Queue(), queue.Queue()
        count.put(index)  # the writer marks its task done on this queue
        FileSystemWriterAsync.write_preloaded_data(transform_list, index, bucket, done, count, True, use_msc=use_msc)
        _, written = done.get()
        if isinstance(written, Exception):
            return written
        results[index] = written
    return results
