"""Run checkpoints: every rank writes its own state file for the same step; a checkpoint is
complete when all ranks' files exist at the size they were written. A (re)started job resumes from
the newest complete one; a file whose bytes then fail their sha256 sets its checkpoint aside
(`step00000123.corrupt`) and stops the job, so that launching again resumes from the one before.

    <run>/checkpoints/step00000123/rank0.pt ... rank<W-1>.pt   (trainer ranks, engine leaders)
    <run>/checkpoints/step00000123/rank0.pt.sha256.json ...    (each file's size and sha256)
    <run>/checkpoints/requeues.json                            (how often the job requeued itself)

`step00000123` means 123 steps are done and the weight sync of the 123rd is still to come: ranks
save after agreeing at a step's control point, before that step's sync (rft/runtime/preemption.py), so a
resumed job starts with that sync. Trainer files hold the Megatron shard, optimizer, scheduler,
RNG, taskset cursor and the step's pending log line; rollout files hold the step, the rollout
taskset cursor and its weights version.

The trainer's tensors (model, reference, optimizer: components with `checkpoint_shards`) are not
in the rank files: the trainer ranks save them together with megatron-core's dist_checkpointing,
each tensor keyed by its place in the whole model, so a checkpoint loads into another TP x PP x DP
layout (rft/trainer/sharded_state.py). Each trainer rank's file records the size and sha256 of the
files it wrote there, so completeness and torn files are told as for rank files:

    <run>/checkpoints/step00000123/sharded/...                 (dist_checkpointing's files)
    <run>/checkpoints/step00000123/layout.json                 (who saved: which rank file is whose)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import random
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rft.lazy import lazy_module
from rft.runtime import faults
from rft.runtime.storage import written_whole_or_not_at_all

if TYPE_CHECKING:
    from rft.runtime.background_save import BackgroundSave
    from rft.runtime.shard_writer import ShardWriter

# imported where first used: the launcher reads checkpoints' metadata (newest_complete) without torch
torch = lazy_module("torch")

_STEP_DIR = re.compile(r"^step(\d{8,})$")


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def _rank_file(step_dir: str, rank: int) -> str:
    return os.path.join(step_dir, f"rank{rank}.pt")


def _digest_file(rank_file: str) -> str:
    """The rank file's size and sha256, written before the file itself is renamed into place."""
    return f"{rank_file}.sha256.json"


class _HashingWriter:
    """A file that hashes what torch.save writes to it: the checksum costs no second read."""

    def __init__(self, f) -> None:
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.bytes += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_rank_state(run_dir: str, done: int, rank: int, state: dict[str, Any]) -> str:
    """Write this rank's state for `done` completed steps atomically (temp file + rename), with its
    size and sha256 beside it: a file torn by a failing disk or filesystem is then told apart."""
    from rft.runtime.monitor import write_json_atomic

    step_dir = os.path.join(checkpoint_root(run_dir), f"step{done:08d}")
    os.makedirs(step_dir, exist_ok=True)
    final = _rank_file(step_dir, rank)
    tmp = f"{final}.tmp{os.getpid()}"
    if faults.armed("file_size_limit", done):
        faults.limit_file_size()
    with written_whole_or_not_at_all(tmp, f"the checkpoint of rank {rank} at step {done}"):
        with open(tmp, "wb") as f:
            writer = _HashingWriter(f)
            torch.save(state, writer)
            f.flush()
            os.fsync(f.fileno())
        write_json_atomic(_digest_file(final), {"bytes": writer.bytes, "sha256": writer.sha.hexdigest()})
        faults.strike("save", done, rank, run_dir)
        os.replace(tmp, final)
    return final


def _intact_size(rank_file: str) -> bool:
    """The file is there and as long as when it was written (no record: a checkpoint from before
    records were kept, trusted as it is)."""
    try:
        size = os.path.getsize(rank_file)
        with open(_digest_file(rank_file)) as f:
            return size == json.load(f)["bytes"]
    except FileNotFoundError:
        return os.path.exists(rank_file)
    except (OSError, ValueError, KeyError, TypeError):  # a torn record
        return False


def _sha256(path: str) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            sha.update(chunk)
    return sha.hexdigest()


class CorruptCheckpointError(RuntimeError):
    """A rank file's bytes do not match the sha256 recorded when it was written."""


def _step_dirs(run_dir: str) -> list[tuple[int, str]]:
    root = checkpoint_root(run_dir)
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root)
             if (m := _STEP_DIR.match(name))]
    return sorted(found)


def _stand_ins(step_dir: str) -> dict[int, int]:
    """Ranks lost before this checkpoint (rollout.on_engine_failure=continue) -> the engine whose
    state a restarted one takes (engines' states differ only in their own totals)."""
    try:
        with open(os.path.join(step_dir, "stand_ins.json")) as f:
            return {int(k): v for k, v in json.load(f).items()}
    except FileNotFoundError:
        return {}


def record_stand_ins(run_dir: str, done: int, stand_ins: dict[int, int]) -> None:
    """Rank 0, once the present ranks saved at `done`: the lost ones count as saved by stand-ins."""
    from rft.runtime.monitor import write_json_atomic

    write_json_atomic(os.path.join(checkpoint_root(run_dir), f"step{done:08d}", "stand_ins.json"), stand_ins)


def record_layout(run_dir: str, done: int, layout: dict[str, Any]) -> None:
    """Rank 0, before its own file: which ranks save checkpoint `done` and in which roles
    (`trainer_ranks`, `voting_ranks`), so a job of another layout finds each rank's file."""
    from rft.runtime.monitor import write_json_atomic

    step_dir = os.path.join(checkpoint_root(run_dir), f"step{done:08d}")
    os.makedirs(step_dir, exist_ok=True)  # a rollout rank 0 (mode=explore) saves no shards that would make it
    write_json_atomic(os.path.join(step_dir, "layout.json"), layout)


def saved_layout(step_dir: str) -> dict[str, Any] | None:
    """What record_layout wrote (None: a checkpoint from before layouts were recorded)."""
    try:
        with open(os.path.join(step_dir, "layout.json")) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def sharded_dir(step_dir: str) -> str:
    return os.path.join(step_dir, "sharded")


def _fresh_sharded_dir(run_dir: str, done: int) -> str:
    """Checkpoint `done`'s sharded directory, emptied by trainer rank 0 of what an attempt that died
    saving left (a barrier of the trainer ranks follows)."""
    import torch.distributed as dist

    path = sharded_dir(os.path.join(checkpoint_root(run_dir), f"step{done:08d}"))
    if faults.armed("file_size_limit", done):
        faults.limit_file_size()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()
    return path


def shard_digests(path: str, rank: int, own: bool = True, shared: bool = True) -> dict[str, dict[str, Any]]:
    """The size and sha256 of each file of the sharded directory this rank wrote: its own shards
    (`own`), and on trainer rank 0 the shared metadata (`shared`)."""
    mine = sorted(f for f in os.listdir(path) if (own and f.startswith(f"__{rank}_"))
                  or (shared and rank == 0 and not f.startswith("__")))
    return {f: {"bytes": os.path.getsize(os.path.join(path, f)), "sha256": _sha256(os.path.join(path, f))}
            for f in mine}


@contextlib.contextmanager
def _shards_written_whole(path: str, shards: dict[str, Any], rank: int, done: int):
    """Nothing half-written stays when a shard write fails; a full disk is said as such."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as err:  # torch's CheckpointException is a BaseException
        shutil.rmtree(path, ignore_errors=True)  # (the rank files are not written)
        _raise_if_no_room(path, _local_bytes(shards), f"the checkpoint of rank {rank} at step {done}")
        raise err


def save_shards(run_dir: str, done: int, shards: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every trainer rank at once (a collective over the trainer group): the trainer's sharded
    components of checkpoint `done` through megatron.core.dist_checkpointing. Returns the size and
    sha256 of each file this rank wrote (trainer rank 0 also writes the shared metadata)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path, rank = _fresh_sharded_dir(run_dir, done), dist.get_rank()
    with _shards_written_whole(path, shards, rank, done):
        dist_checkpointing.save(shards, path)
    return shard_digests(path, rank)


def start_shards(run_dir: str, done: int, shards: dict[str, Any], state: dict[str, Any],
                 writer: ShardWriter) -> BackgroundSave:
    """As save_shards, but `writer`, the rank's writer process, writes them in the background
    (rft/runtime/background_save.py); `finish_shards` completes it."""
    import torch.distributed as dist

    from rft.runtime.background_save import BackgroundSave

    path, rank = _fresh_sharded_dir(run_dir, done), dist.get_rank()
    with _shards_written_whole(path, shards, rank, done):
        # the writer process takes the digests once the files are written: a function it can unpickle
        digests = functools.partial(shard_digests, path, rank, shared=False)
        return BackgroundSave(path, done, shards, state, digests, writer)


def finish_shards(pending: BackgroundSave) -> dict[str, dict[str, Any]]:
    """Every trainer rank at once, once all wrote: the metadata of a background save; the size and
    sha256 of the files this rank wrote."""
    import torch.distributed as dist

    rank = dist.get_rank()
    with _shards_written_whole(pending.path, pending.shards, rank, pending.done):
        pending.finish()
    return {**pending.digests, **shard_digests(pending.path, rank, own=False)}


def whole_shards(step_dir: str) -> dict[str, dict[str, Any]]:
    """A checkpoint's sharded components as whole tensors, read in one process (no process group),
    for comparing two runs: {component: its tensors by key (each the whole model's), and the
    values trainer rank 0 saved once}."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = sharded_dir(step_dir)
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(path, os.path.join(scratch, "whole.pt"))
        tensors = torch.load(os.path.join(scratch, "whole.pt"), weights_only=False)
    common = torch.load(os.path.join(path, "common.pt"), weights_only=False)
    found: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        name, _, rest = key.partition(".")
        found.setdefault(name, {"tensors": {}, "common": common.get(name)})["tensors"][rest] = tensor
    return found


def _local_bytes(shards: dict[str, Any]) -> int:
    """What this rank writes for `shards`: its part of every sharded tensor."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return sum(value.data.numel() * value.data.element_size() for value in nested_values(shards)
               if isinstance(getattr(value, "data", None), torch.Tensor))


def _raise_if_no_room(directory: str, nbytes: int, what: str) -> None:
    """After dist_checkpointing failed to write (its writer reports a full disk as a bare position
    mismatch): StorageFullError, as for a rank file, if `nbytes` do not fit in `directory` (a full
    filesystem, a quota, `ulimit -f`); else return and let the caller raise the original error."""
    # beside `directory`, not in it: every trainer rank that failed the write probes at once, and
    # each removes the sharded directory (seen: rank 1's probe removed under it by rank 0, and a
    # FileNotFoundError said instead of why its write failed)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    probe = os.path.join(parent, f"room-probe.{os.getpid()}")
    try:
        with written_whole_or_not_at_all(probe, what):
            with open(probe, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, max(nbytes, 1))
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)


def _complete(step_dir: str, ranks: Sequence[int]) -> bool:
    """Every rank that saved this checkpoint wrote its file whole: the voting ranks its
    layout.json names (a checkpoint from before layouts were recorded: `ranks`)."""
    stand_ins = _stand_ins(step_dir)
    saved = (saved_layout(step_dir) or {}).get("voting_ranks", ranks)
    return all(_intact_size(_rank_file(step_dir, stand_ins.get(r, r))) for r in saved)


@dataclass(frozen=True)
class Resume:
    """Where a restarted job picks up: `done` steps complete, their files in `step_dir`."""

    done: int
    step_dir: str

    def source_rank(self, rank: int, role: str, role_rank: int, trainer_ranks: int) -> int:
        """Whose file a rank of this job loads. In the layout that saved the checkpoint, its own;
        with another number of trainer ranks (mode=train resharded: no rollout ranks), a trainer
        rank loads the file of its trainer rank there, or rank 0's (the files the trainer ranks
        keep besides their shards are alike); a rollout rank keeps its place among the rollout ranks."""
        layout = saved_layout(self.step_dir)
        if layout is None:
            return rank
        before = layout["trainer_ranks"]
        if role == "trainer":
            return role_rank if role_rank < before else 0
        return before + role_rank

    def load_shards(self, template: dict[str, Any], files_of: Sequence[dict[str, dict[str, Any]]]) -> dict[str, Any]:
        """Load sharded components into this rank's layout (`template`: their checkpoint_shards),
        after checking the files whose records `files_of` holds against their sha256; collective
        over the trainer group."""
        from megatron.core import dist_checkpointing

        path = sharded_dir(self.step_dir)
        for records in files_of:
            for name, record in records.items():
                file = os.path.join(path, name)
                if not os.path.exists(file) or os.path.getsize(file) != record["bytes"] or _sha256(file) != record["sha256"]:
                    self._set_aside(file)
        return dist_checkpointing.load(template, path)

    def _set_aside(self, file: str) -> None:
        """Set the checkpoint aside (the rename is atomic, and a name newest_complete skips), so
        that launching again resumes from the one before; every rank of this job fails."""
        aside = f"{self.step_dir}.corrupt"
        try:
            os.replace(self.step_dir, aside)
        except OSError:
            pass  # another rank set it aside first
        raise CorruptCheckpointError(
            f"checkpoint file {file} does not match the sha256 recorded when it was written (a disk or "
            f"filesystem error); the checkpoint is set aside as {aside}: launch again with the same "
            "run.output_dir to resume from the checkpoint before it")

    def load(self, rank: int) -> dict[str, Any]:
        own = _rank_file(self.step_dir, rank)
        if not os.path.exists(own):  # lost before this checkpoint: restart as the engine standing in
            own = _rank_file(self.step_dir, _stand_ins(self.step_dir).get(rank, rank))
        try:
            with open(_digest_file(own)) as f:
                recorded = json.load(f)["sha256"]
        except FileNotFoundError:
            recorded = None  # written before checksums were kept
        if recorded is not None and _sha256(own) != recorded:
            self._set_aside(own)
        return torch.load(own, weights_only=False)  # a second read, from the page cache: no 2x memory


def newest_complete(run_dir: str, ranks: Sequence[int]) -> Resume | None:
    """The newest checkpoint every rank that saved it finished writing (a crash mid-save leaves
    an incomplete one, which is skipped); `ranks`: this job's voting ranks (Topology.voting_ranks)."""
    for done, step_dir in reversed(_step_dirs(run_dir)):
        if _complete(step_dir, ranks):
            return Resume(done, step_dir)
    return None


def prune(run_dir: str, ranks: Sequence[int], keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (and incomplete ones older than them)."""
    complete = [(d, p) for d, p in _step_dirs(run_dir) if _complete(p, ranks)]
    if len(complete) <= keep:
        return
    oldest_kept = complete[-keep][0]
    for done, path in _step_dirs(run_dir):
        if done < oldest_kept:
            shutil.rmtree(path, ignore_errors=True)


def seed_all(seed: int) -> None:
    """Seed every global RNG a rank's state holds (`rng_state`): Python's `random` and NumPy's
    global generator included, which a user's reward or workflow may draw from; unseeded, each
    launch started them from the OS, and a run and its resumed twin held different states."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["megatron_cuda"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_cuda"])


class SaveClock:
    """`trainer.save_every_min`: a checkpoint is due when this many minutes passed since the last
    one (or the start). Each rank keeps its own clock and votes at the step's control point; the
    vote's OR makes every rank save at the same step (rft/runtime/preemption.py)."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60.0
        self.last = time.monotonic()

    def due(self) -> bool:
        return self.seconds > 0 and time.monotonic() - self.last >= self.seconds

    def saved(self) -> None:
        self.last = time.monotonic()


def _requeues_path(run_dir: str) -> str:
    return os.path.join(checkpoint_root(run_dir), "requeues.json")


def requeue_count(run_dir: str) -> int:
    try:
        with open(_requeues_path(run_dir)) as f:
            return int(json.load(f)["requeues"])
    except FileNotFoundError:
        return 0


def record_requeue(run_dir: str, done: int) -> int:
    """Count one more requeue (written before asking Slurm, so a crash cannot undercount)."""
    from rft.runtime.monitor import write_json_atomic

    count = requeue_count(run_dir) + 1
    os.makedirs(checkpoint_root(run_dir), exist_ok=True)
    write_json_atomic(_requeues_path(run_dir), {"requeues": count, "last_at_step": done})
    return count


def _save_timing_path(run_dir: str) -> str:
    return os.path.join(checkpoint_root(run_dir), "save_timing.json")


def record_save_timing(run_dir: str, done: int, save_s: float, step_s: float | None) -> None:
    """Rank 0, once every rank has saved checkpoint `done` (a background save: begun it): how long
    the ranks waited for the save and how long the step before it took, which is what must fit
    between Slurm's SIGTERM and its SIGKILL (the launcher's plan compares them with KillWait and
    GraceTime; a stop saves in the foreground)."""
    from rft.runtime.monitor import write_json_atomic

    os.makedirs(checkpoint_root(run_dir), exist_ok=True)
    write_json_atomic(_save_timing_path(run_dir), {"step": done, "save_s": round(save_s, 3),
                                                    "step_s": None if step_s is None else round(step_s, 3)})


def save_timing(run_dir: str) -> dict[str, Any] | None:
    """The newest record_save_timing of the run, or None before its first checkpoint."""
    try:
        with open(_save_timing_path(run_dir)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
