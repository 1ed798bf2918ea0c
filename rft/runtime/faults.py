"""Faults injected on purpose, for the tests and tools/chaos.py: `RFT_FAULTS` in a rank's
environment names what to break, at which step, and optionally on which rank (`#<rank>`):

    RFT_FAULTS=corrupt_shard@35      the shard of step 35 reaches the disk with a flipped byte
    RFT_FAULTS=file_size_limit@45    ranks saving the checkpoint of step 45 first get a 1 MiB file
                                     size limit: the kernel refuses bigger files with EFBIG, as a
                                     full filesystem would with ENOSPC
    RFT_FAULTS=kill_train@37#1       rank 1 is SIGKILLed in the middle of trainer step 37
    RFT_FAULTS=stop_sync@41#0        rank 0 stops (SIGSTOP: a hang) in the middle of step 41's sync
    RFT_FAULTS=corrupt_shard@35,kill_save@40#2
    RFT_FAULTS=usr2_generating@14#1,kill_in_flight@14#1
                                     rank 1 gets Slurm's stop signal while it generates step 14, and
                                     is SIGKILLed once it recorded its requests in flight
    RFT_FAULTS=kill_engine@3,stop_engine@6
                                     the vLLM engine core of the rollout rank is SIGKILLed in step 3
                                     (a GPU's Xid error), and stopped (a hang) in step 6, each once
                                     the step's first request is answered and recorded

kill_*, stop_* and usr2_* (the time-limit signal, SIGUSR2) act at a point of a step (`step` as
checkpoints and logs count it: steps done once it ends): `generation` (an explorer, its rollouts
generated, not yet written), `generating` (an explorer, its step's first request about to be
sent to the engine), `in_flight` (an explorer, its requests in flight recorded in the step's
generation journal after a stop signal, rft/explorer/journal.py), `train` (a trainer, its update
made, its shard not yet committed), `sync` (a trainer, one weight sent or gathered of the step's
sync; where the step changed no weight and nothing is sent, at its sync point) and `save` (any
rank, its checkpoint file written, not yet renamed). kill_engine and stop_engine act on the rank's
vLLM engine core processes, not on the rank (rft/explorer/engine_restart.py restarts them).
Before acting, the rank appends what it does to `<run>/faults.jsonl` (tools/chaos.py times the
launcher's reaction from it). A fault fires at most once per process. Why not a mock: the run
under test is the real one, with real processes, signals and files.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

POINTS = ("generation", "generating", "in_flight", "train", "sync", "save")
ACTS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "usr2": signal.SIGUSR2}
ENGINE_ACTS = {"kill_engine": signal.SIGKILL, "stop_engine": signal.SIGSTOP}  # strike_engine()
KINDS = ("corrupt_shard",  # rft/buffer/shards.py: ExperienceBuffer.write
         "file_size_limit",  # rft/runtime/checkpoint.py: save_rank_state
         *(f"{act}_{point}" for act in ACTS for point in POINTS),  # strike()
         *ENGINE_ACTS)
_fired: set[tuple[str, int]] = set()


def parse(spec: str) -> list[tuple[str, int, int | None]]:
    """`RFT_FAULTS` as (kind, step, rank or None); ValueError naming a bad item."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        kind, _, where = item.partition("@")
        step, _, rank = where.partition("#")
        if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"RFT_FAULTS item {item!r} is not <fault>@<step>[#<rank>] with a fault among {list(KINDS)}")
        faults.append((kind, int(step), int(rank) if rank else None))
    return faults


def armed(kind: str, step: int, rank: int | None = None) -> bool:
    """True once if `RFT_FAULTS` asks for `kind` at `step` (on `rank`, or on any rank)."""
    spec = os.environ.get("RFT_FAULTS")
    if not spec or (kind, step) in _fired:
        return False
    if not any(k == kind and s == step and r in (None, rank) for k, s, r in parse(spec)):
        return False
    _fired.add((kind, step))
    return True


def strike(point: str, step: int, rank: int, run_dir: str) -> None:
    """At `point` of `step`: if a kill, a stop or a signal is armed here, record it and do it to this process."""
    for act, signum in ACTS.items():
        if armed(f"{act}_{point}", step, rank):
            _record(run_dir, f"{act}_{point}", step, rank, os.getpid())
            os.kill(os.getpid(), signum)


def strike_engine(step: int, rank: int, run_dir: str, pids: Callable[[], list[int]]) -> None:
    """Once a request of `step` is answered: if kill_engine or stop_engine is armed here, record
    it and do it to the engine core's processes (`pids()`)."""
    for kind, signum in ENGINE_ACTS.items():
        if armed(kind, step, rank):
            targets = pids()
            _record(run_dir, kind, step, rank, targets[0] if targets else -1)
            for pid in targets:
                os.kill(pid, signum)


def _record(run_dir: str, fault: str, step: int, rank: int, pid: int) -> None:
    with open(os.path.join(run_dir, "faults.jsonl"), "a") as f:
        f.write(json.dumps({"fault": fault, "step": step, "rank": rank, "pid": pid, "time": time.time()}) + "\n")


def limit_file_size(max_bytes: int = 1 << 20) -> None:
    """This process may write no file larger than `max_bytes` from now on (a soft limit: what
    `ulimit -f` sets; CPython ignores SIGXFSZ, so a write past it fails with EFBIG)."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, hard))
