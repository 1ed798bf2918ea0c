"""Colocated roles (`cluster.colocate=true`): rollout rank T+i runs on trainer rank i's GPU, and
the two take turns with it.

    rollout rank:  engine starts (vLLM sizes its KV cache) -> "started"
                   for each step: wake, generate, write the shard
                                  sleep         -> hands step t over ("asleep for t")
                                  meet at t; if weights are published: wake the weights, load
                                  them, wake the KV cache
    trainer rank:  wait for every engine's "started", then build the model
                   for each step t: wait for every engine's "asleep for t", train, give the
                                  freed blocks back to the device, meet at t, publish

vLLM's sleep frees the GPU for the train step: level 1 moves the weights to host memory and drops
the KV cache; level 2 drops both (the next sync brings every weight, so with level 2 a sync is
never skipped). The engines start first, so that vLLM sizes its KV cache before the trainer
allocates anything; the trainer lives in what `rollout.gpu_memory_utilization` leaves.

Weights move through the checkpoint engine (rft/weights/engines.py): NCCL cannot join two
processes on one GPU, and the pair is always on one node. On CPU vLLM's sleep frees nothing, but
the engines make the same calls (vLLM pauses and resumes its scheduler) in the same order, and
every phase is journaled the same way: `<run>/metrics/phases<rank>.jsonl`, one line per phase
with its start and end, which the tests read to check the order. An engine's sleep and wakes also
note what vLLM then says of itself (asleep, at which level; fully awake): on CPU that, not freed
memory, shows that they ran.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rft.config import RFTConfig
from rft.runtime.storage import append_jsonl
from rft.runtime.topology import Topology

STARTED = "colocate/started/{engine}"
ASLEEP = "colocate/asleep/{engine}/{step}"


def phases_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "metrics", f"phases{rank}.jsonl")


class PhaseJournal:
    """Each phase a colocated rank goes through, with its start and end (wall clock, like the
    metrics' `time`); sleeping, waking and waiting add up in the rank's progress totals, which
    the run summary shows."""

    def __init__(self, run_dir: str, rank: int, progress):
        self.path, self.progress = phases_path(run_dir, rank), progress
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    @contextmanager
    def phase(self, name: str, step: int, totals: tuple[str, ...] = (), **fields) -> Iterator[dict]:
        """Journal the phase `name` of step `step` (`fields`: more to note, e.g. the sleep level;
        the body may add to the dict it is given, e.g. what vLLM said); `totals`: the progress
        totals its seconds add to."""
        start = time.time()
        yield fields
        end = time.time()
        self.progress.add(**{total: end - start for total in totals})
        append_jsonl(self.path, {"phase": name, "step": step, "start": start, "end": end, **fields})


class Turns:
    """The hand-overs between the roles sharing GPUs, through the job's control store."""

    def __init__(self, store, engines: int, timeout_s: float):
        self.store, self.engines, self.timeout_s = store, engines, timeout_s

    def started(self, engine: int) -> None:
        self.store.set(STARTED.format(engine=engine), "1")

    def asleep(self, engine: int, step: int) -> None:
        self.store.set(ASLEEP.format(engine=engine, step=step), "1")

    def wait_started(self) -> None:
        self._wait([STARTED.format(engine=e) for e in range(self.engines)], "to start and go to sleep")

    def wait_asleep(self, step: int) -> None:
        self._wait([ASLEEP.format(engine=e, step=step) for e in range(self.engines)],
                   f"to go to sleep after generating step {step}")

    def _wait(self, keys: list[str], what: str) -> None:
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception as err:  # torch's store raises a bare RuntimeError/DistStoreError on timeout
            missing = [k for k in keys if not self.store.check([k])]
            raise TimeoutError(f"colocated trainer: waited {self.timeout_s:.0f} s (sync.timeout_s) for the engines "
                               f"{what}; not heard from: {', '.join(missing) or 'none'} ({err})") from None


def free_device_cache() -> None:
    """Give the blocks torch's caching allocator holds back to the GPU, for the engine sharing it
    to wake into (nothing to do on CPU)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class TrainerTurns:
    """The trainer's side of colocation: wait for the engines before building the model and
    before each train step; free the cached blocks after it and after each publish. Does
    nothing when the roles do not share GPUs."""

    def __init__(self, cfg: RFTConfig, topology: Topology, store):
        colocated = cfg.cluster.colocate
        self.turns = Turns(store, topology.engine_count, cfg.sync.timeout_s) if colocated else None
        self.run_dir, self.rank, self.journal = cfg.run.output_dir, topology.rank, None
        # an engine asleep at level 2 has dropped its weights: every sync must send them
        self.engines_drop_weights = colocated and cfg.rollout.sleep_level == 2

    def wait_started(self) -> None:
        if self.turns is not None:
            self.turns.wait_started()


    def track(self, progress) -> None:
        """Where the phases' seconds add up (the rank's progress totals: turn_wait_s)."""
        if self.turns is not None:
            self.journal = PhaseJournal(self.run_dir, self.rank, progress)

    @contextmanager
    def training(self, step: int, resumed: bool) -> Iterator[None]:
        """Around train step `step`; a resumed step (trained before the checkpoint) waits for nothing."""
        if self.turns is None or resumed:
            yield
            return
        with self.journal.phase("turn_wait", step, totals=("turn_wait_s",)):
            self.turns.wait_asleep(step)
        with self.journal.phase("train", step):
            yield
            free_device_cache()

    @contextmanager
    def publishing(self, step: int) -> Iterator[None]:
        if self.turns is None:
            yield
            return
        with self.journal.phase("publish", step):
            yield
            free_device_cache()


class EngineSleep:
    """The rollout rank's side of colocation: its engines sleep before the trainer's turn and
    wake when they must generate, evaluate or load new weights."""

    def __init__(self, cfg: RFTConfig, topology: Topology, engines: list, runtime):
        self.engines, self.engine, self.level = engines, topology.engine_index, cfg.rollout.sleep_level
        self.turns = Turns(runtime.group.store, topology.engine_count, cfg.sync.timeout_s)
        self.journal = PhaseJournal(cfg.run.output_dir, topology.rank, runtime.progress)
        self.asleep = False
        self.turns.started(self.engine)  # the engines sized their memory: the trainer may build its model

    def hand_over(self, versions: list[int]) -> None:
        """Sleep (unless asleep already) and tell the trainer it may train steps `versions`."""
        if not self.asleep and versions:
            with self.journal.phase("sleep", versions[0], totals=("sleep_s",), level=self.level) as noted:
                noted["vllm_levels"] = [engine.sleep(self.level) for engine in self.engines]  # None: not asleep
            self.asleep = True
        for version in versions:
            self.turns.asleep(self.engine, version)

    def wake(self, step: int) -> None:
        if self.asleep:
            with self.journal.phase("wake", step, totals=("wake_s",)) as noted:
                noted["vllm_awake"] = all([engine.wake() for engine in self.engines])
            self.asleep = False

    @contextmanager
    def loading(self, version: int) -> Iterator[None]:
        """Around a weight load: the weights wake first (level 1: back from host memory; level 2:
        fresh buffers), the KV cache once the new weights are in."""
        if not self.asleep:
            yield
            return
        in_sync = ("wake_s", "wake_in_sync_s")  # inside the explorer's sync wait: the summary shows them apart
        with self.journal.phase("wake_weights", version, totals=in_sync) as noted:
            # False: vLLM keeps its scheduler paused while the KV cache still sleeps
            noted["vllm_awake"] = any([engine.wake(["weights"]) for engine in self.engines])
        with self.journal.phase("load", version):
            yield
        with self.journal.phase("wake_kv_cache", version, totals=in_sync) as noted:
            noted["vllm_awake"] = all([engine.wake(["kv_cache"]) for engine in self.engines])
        self.asleep = False
