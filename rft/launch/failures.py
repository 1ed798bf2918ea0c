"""Which rank of a job failed first, and why: a rank that raised, was killed, vanished without a
result or stopped responding; the root cause among the failures that follow one (peers of a dead
rank fail after it); lost engines that the run goes on without (rollout.on_engine_failure=continue)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rich.markup import escape

from rft.launch.console import console
from rft.launch.job_state import local_rank_alive, slurm_job_state, task_result
from rft.runtime.pulse import SILENT_S, cut_message, cut_off, pid_path, silent_s


@dataclass
class RankFailure:
    rank: int
    log_path: str
    reason: str

    @property
    def died(self) -> bool:
        """Killed by a signal or gone without a result (rft/runtime/supervisor.py's words), rather
        than raising: when one rank dies its peers raise soon after, and the dead one is the cause."""
        return " was killed by " in self.reason or "without a result" in self.reason

    @property
    def stopped(self) -> str | None:
        """What the rank said when it stopped on Slurm's signal with its checkpoint complete
        (rft/runtime/preemption.py's StoppedBySignal): not a failure; None otherwise."""
        return self.reason.removeprefix("StoppedBySignal: ") if self.reason.startswith("StoppedBySignal") else None


def _exception_line(trace: str) -> str:
    """The `SomeError: message` line of a traceback (messages may span several lines), without
    the exception's module path; a rank killed by a signal (rft/runtime/supervisor.py) is just
    the message."""
    lines = trace.strip().splitlines()
    for line in reversed(lines):
        found = re.match(r"^(?:[\w]+\.)*(\w+(?:Error|Exception|Interrupt|Exit)|StoppedBySignal)\b(.*)$", line)
        if found:
            name, rest = found.groups()
            return rest.lstrip(": ") if name == "RankKilledError" else name + rest
    return lines[-1] if lines else "(no traceback)"


def find_failures(run_dir: str, log_dir: str, job_id: str, world_size: int,
                  alive: Callable[[int], bool | None] | None = None, on_slurm: bool = False) -> list[RankFailure]:
    """The ranks that failed, the first first: one that raised or was killed (submitit's result
    pickle says error; rft/runtime/supervisor.py reports signals), or whose process vanished
    without a result. Ordered by their result files' times: when one rank dies the others often
    fail after it (a peer gone from a meeting), and the first is the cause."""
    alive = alive or local_rank_alive(run_dir)
    failures: list[tuple[float, RankFailure]] = []
    for rank in range(world_size):
        log = os.path.join(log_dir, f"{job_id}_{rank}_log.err")
        result = task_result(log_dir, job_id, rank)
        if result is not None and result[0] == "error":
            at = os.path.getmtime(os.path.join(log_dir, f"{job_id}_{rank}_result.pkl"))
            failures.append((at, RankFailure(rank, log, _exception_line(str(result[1])))))
        elif result is None and alive(rank) is False:
            time.sleep(1.0)  # the result file may land just after the process exits
            if task_result(log_dir, job_id, rank) is None:
                reason = "process exited without a result (killed?)"
                state = slurm_job_state(job_id) if on_slurm else None
                if state:
                    reason += f"; Slurm: job {job_id} {state}"
                if on_slurm and not os.path.exists(log) and not os.path.exists(log.replace("_log.err", "_log.out")):
                    reason += (f"; it wrote no log into {log_dir}: the job's nodes may not see run.output_dir "
                               f"({run_dir}). Put it on a filesystem this login node and every compute node "
                               "share (Lustre, GPFS, NFS), not on a node-local path such as /tmp")
                failures.append((time.time(), RankFailure(rank, log, reason)))
    return [f for _, f in sorted(failures, key=lambda f: f[0])]


def find_failure(run_dir: str, log_dir: str, job_id: str, world_size: int,
                 alive: Callable[[int], bool | None] | None = None, on_slurm: bool = False) -> RankFailure | None:
    """The rank that failed first (see find_failures), if any."""
    return next(iter(find_failures(run_dir, log_dir, job_id, world_size, alive, on_slurm)), None)


class EngineLosses:
    """rollout.on_engine_failure=continue: the failures of engine ranks (`engine_of`: rank ->
    engine index; empty when the job fails fast) are lost engines, said once each, not the job's
    end, unless no engine is left."""

    def __init__(self, engine_of: dict[int, int]):
        self.engine_of, self.lost = engine_of, set()

    @property
    def lost_ranks(self) -> set[int]:
        """Every rank of the engines lost so far."""
        return {rank for rank, engine in self.engine_of.items() if engine in self.lost}

    def rest_finished(self, log_dir: str, job_id: str, world_size: int) -> bool:
        """Every rank has ended but those of lost engines, which may never end by themselves (a
        crashed node's: Slurm keeps the job until it declares the node down): the run is over."""
        rest = set(range(world_size)) - self.lost_ranks
        return bool(self.lost) and all(task_result(log_dir, job_id, rank) is not None for rank in rest)

    def fatal(self, failures: list[RankFailure]) -> RankFailure | None:
        for failure in failures:
            engine = self.engine_of.get(failure.rank)
            if engine is not None and engine not in self.lost:
                self.lost.add(engine)
                console.print(f"[yellow]engine {engine} lost: rank {failure.rank} failed: {escape(failure.reason)}\n  log: "
                              f"{escape(failure.log_path)}\n  the run goes on without it (rollout.on_engine_failure=continue)",
                              soft_wrap=True)
        left = set(self.engine_of.values()) - self.lost
        return next((f for f in failures if f.rank not in self.engine_of or not left), None)


DEATH_REPORT_S = 20.0


def root_cause(first: RankFailure, losses: EngineLosses, run_dir: str, log_dir: str, job_id: str, world_size: int,
                alive: Callable[[int], bool | None], on_slurm: bool) -> RankFailure:
    """The failure to report, once `first` is seen. A rank killed by a signal reports after its
    supervisor cleaned up and told the job's store (seconds, when the store went down with rank
    0), and a peer's error ("connection reset") often lands first: wait, up to DEATH_REPORT_S,
    until a rank that died reports or every rank has ended, reported or gone silent; a death wins."""
    deadline = time.monotonic() + DEATH_REPORT_S

    def accounted(rank: int) -> bool:  # ended, reported, stopped (silent) or cut off: nothing more to come
        quiet = silent_s(pid_path(run_dir, rank))
        return alive(rank) is False or task_result(log_dir, job_id, rank) is not None or \
            (quiet is not None and quiet >= SILENT_S) or cut_off(pid_path(run_dir, rank)) is not None

    while True:
        failures = find_failures(run_dir, log_dir, job_id, world_size, alive, on_slurm)
        settled = all(accounted(rank) for rank in range(world_size))
        if any(f.died for f in failures) or settled or time.monotonic() > deadline:
            return losses.fatal(sorted(failures, key=lambda f: not f.died)) or first
        time.sleep(0.5)


def silent_rank(run_dir: str, log_dir: str, job_id: str, world_size: int, alive: Callable[[int], bool | None],
                silent_for_s: float, besides: Iterable[int] = (), among: Iterable[int] | None = None
                ) -> tuple[int, float] | None:
    """A rank (of `among`, not of `besides`) whose pulse (rft/runtime/pulse.py) stopped
    `silent_for_s` ago or more although its process has not ended, while another rank's pulse
    goes on: it is stopped (SIGSTOP, a debugger), hung, or its node is gone. (rank, seconds
    silent). Nobody beating means the job is not running (queued again after a requeue, or
    ending): no rank is blamed then."""
    quiet = {rank: silent_s(pid_path(run_dir, rank)) for rank in range(world_size)}
    if not any(q is not None and q < SILENT_S for q in quiet.values()):
        return None
    candidates = set(range(world_size) if among is None else among) - set(besides)
    for rank, q in quiet.items():
        if rank not in candidates or q is None or q < silent_for_s or alive(rank) is False:
            continue
        if task_result(log_dir, job_id, rank) is None:  # one that ended stops beating, too
            return rank, q
    return None


def cut_off_rank(run_dir: str, world_size: int, for_s: float, besides: Iterable[int] = ()) -> tuple[int, dict] | None:
    """A rank (not in `besides`: engines the run may lose) whose rank 0 has not answered it for
    `for_s` seconds or more, though its pulse goes on (rft/runtime/pulse.py): its node lost the
    network to rank 0's. (rank, what it recorded)."""
    for rank in sorted(set(range(1, world_size)) - set(besides)):
        cut = cut_off(pid_path(run_dir, rank))
        if cut is not None and cut["for_s"] >= for_s:
            return rank, cut
    return None


def cut_off_from_rank0(rank: int, cut: dict, log_dir: str, job_id: str, name_of: Callable[[int], str],
                       then: RankFailure | None = None) -> RankFailure:
    after = f"; rank {then.rank} then failed: {then.reason}" if then and then.rank != rank else ""
    return RankFailure(rank, os.path.join(log_dir, f"{job_id}_{rank}_log.err"),
                       f"{cut_message(name_of(rank), cut)} ({cut['error']}), while the rank runs on (a network "
                       f"partition: a link, switch or interface down between its node and rank 0's){after}")


_PLACED = re.compile(r"^rank (\d+)/\d+: .* on (\S+) \(([^)]*)\), rank 0 at ", re.MULTILINE)


def placement(log_dir: str, job_id: str, world_size: int) -> dict[int, tuple[str, str]]:
    """rank -> (node, address) as each rank logged it when it started (rft/runtime/task.py); a
    requeued job appends to its logs, and its last start is where it ran last."""
    placed = {}
    for rank in range(world_size):
        try:
            with open(os.path.join(log_dir, f"{job_id}_{rank}_log.out"), errors="replace") as f:
                starts = _PLACED.findall(f.read())
        except OSError:
            continue
        if starts:
            placed[int(starts[-1][0])] = starts[-1][1:]
    return placed


def last_lines(path: str, count: int = 5) -> list[str]:
    """The last `count` non-empty lines of a log (what a node that vanished managed to write)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if line.strip()][-count:]


def where_it_ran(failure: RankFailure, log_dir: str, job_id: str, world_size: int) -> list[str]:
    """Lines that place a failed rank of a Slurm job: its node and address, the other ranks on
    that node, and the last lines of its logs."""
    placed = placement(log_dir, job_id, world_size)
    if failure.rank not in placed:
        return []
    node, address = placed[failure.rank]
    by_node: dict[tuple[str, str], list[int]] = {}
    for rank, where in sorted(placed.items()):
        by_node.setdefault(where, []).append(rank)
    lines = [f"on node {node} ({address}), which ran rank(s) {', '.join(map(str, by_node[node, address]))}"]
    if len(by_node) > 1:  # a peer it names (a timeout's "rollout rank 1") may be on another node
        lines.append("the job's nodes: " + "; ".join(f"{n} ({a}): rank(s) {', '.join(map(str, ranks))}"
                                                    for (n, a), ranks in by_node.items()))
    for name in ("out", "err"):
        tail = last_lines(os.path.join(log_dir, f"{job_id}_{failure.rank}_log.{name}"))
        if tail:
            lines.append(f"last lines of its log.{name}:")
            lines += [f"  {line}" for line in tail]
    return lines


def stopped_responding(rank: int, quiet: float, log_dir: str, job_id: str, name_of: Callable[[int], str],
                       then: RankFailure | None = None) -> RankFailure:
    after = f"; rank {then.rank} then failed: {then.reason}" if then else ""
    return RankFailure(rank, os.path.join(log_dir, f"{job_id}_{rank}_log.err"),
                       f"{name_of(rank)} stopped responding: no heartbeat for {quiet:.0f} s (stopped by a signal or "
                       f"a debugger, hung, or its node is unreachable){after}")
