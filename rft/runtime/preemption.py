"""Stopping a job cleanly before Slurm kills it, and requeueing it.

Two signals stop a run, and every rank saves first:
- SIGUSR2: the time limit is near (submitit's `--signal=USR2@120`; `scancel -s USR2 <job>` sends it by
  hand). After the checkpoint rank 0 asks Slurm to requeue the job (`scontrol requeue`) unless
  `cluster.max_requeues` is used up; the requeued job runs the same ranks again, which resume.
- SIGTERM: a preemption (PreemptMode REQUEUE or CANCEL sends it, then SIGKILL after GraceTime) or a
  `scancel` (SIGKILL after KillWait). After the checkpoint the ranks stop; Slurm requeues a preempted
  job itself (submitted with `--requeue`, `cluster.requeue`), and a cancelled one resumes when
  launched again. Without this a preemption lost everything since the last periodic save.
Any rank's handler only raises a flag. At every step's control point all ranks (trainer and rollout)
vote through the control store (rft/runtime/membership.py), so all of them stop at the same step,
save their checkpoint files (rft/runtime/checkpoint.py) and meet once more so the checkpoint is
complete. The step in progress when the signal comes is finished first: the save must fit in Slurm's
grace (the plan compares them: rft/launch/plan.py). Hard kills (node failure, preemption without a
signal) resume from the newest periodic checkpoint (`trainer.save_every_min`, `trainer.save_interval`).

Slurm signals every process of a task, not only the rank: vLLM's engine process would shut down on
SIGTERM (vllm/v1/engine/core.py installs a handler that drains and exits), and reward or tool
subprocesses would die, before the rank reached its checkpoint. So a rank blocks SIGTERM from
`install()` on: the processes it starts inherit the blocked signal and live until the rank ends
them (or Slurm's SIGKILL), and the rank itself takes SIGTERM from a thread waiting for it.

The control store listens on master_port + 2 (the trainer group uses master_port, the
weight groups master_port + 1), hosted by global rank 0.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import threading
import time

import torch.distributed as dist

from rft.config import ClusterConfig
from rft.runtime.topology import Topology


class StopFlag:
    """Raised by SIGUSR2 (`requested`) or SIGTERM (`requested` and `terminated`).
    `ignore_in_children()` keeps subprocesses started meanwhile (vLLM's workers) from dying of
    SIGUSR2: its default action is to terminate, and Slurm signals every process of a task."""

    def __init__(self) -> None:
        self.requested = False
        self.terminated = False  # SIGTERM: Slurm ends the job (or requeues it) itself; no requeue of ours
        self.awaiting_requeue = False
        self._waiter: threading.Thread | None = None

    def install(self) -> None:
        signal.signal(signal.SIGUSR2, self._on_usr2)
        signal.signal(signal.SIGTERM, self._on_term)  # where a thread that does not block it is chosen
        # multiprocessing starts its resource tracker with the first process it spawns (vLLM's engine
        # core) and then *unblocks* SIGINT and SIGTERM in the calling thread (multiprocessing/
        # resource_tracker.py, ensure_running): started here first, it leaves the mask alone later
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
        # threads started from here on inherit the block, and so do the processes they start (the
        # signal mask survives fork and exec)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait_for_term, name="rft-sigterm", daemon=True)
            self._waiter.start()

    def ignore_in_children(self) -> None:
        """Until `install()` again: SIG_IGN survives exec, so spawned workers ignore SIGUSR2; this
        rank misses a signal meanwhile, but every other rank's flag still reaches the vote."""
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)

    def _on_usr2(self, signum, frame) -> None:
        self.requested = True  # no print here: a handler that writes stdout mid-print raises

    def _wait_for_term(self) -> None:
        while True:
            self._on_term(signal.sigwait({signal.SIGTERM}), None)

    def _on_term(self, signum, frame) -> None:
        if self.awaiting_requeue:  # Slurm is requeueing us; the checkpoint is complete
            os._exit(0)
        self.terminated = self.requested = True


class StoppedBySignal(RuntimeError):
    """The run stopped on Slurm's signal with its checkpoint complete (not a failure of the run):
    the launcher shows the message as it is."""


class ControlGroup:
    """The ranks that vote (trainer ranks, engine leaders) meeting in the control store
    (rft/runtime/membership.py): the stop vote, the checkpoint barrier. With
    rollout.on_engine_failure=continue a lost engine leader is left out; any other lost member
    ends the meeting with an error naming it."""

    def __init__(self, topology: Topology, members: list[int], timeout_s: float, name_of=None,
                 tolerated: frozenset[int] = frozenset()):
        from rft.runtime.membership import Meeting

        self.topology, self.members, self.timeout = topology, members, datetime.timedelta(seconds=timeout_s)
        self.store = control_store(topology, self.timeout)
        self.meeting = Meeting(self.store, members, topology.rank, timeout_s, name_of or (lambda r: f"rank {r}"), tolerated,
                               host=0)
        self.rounds = 0
        self.vote()  # every member is up: nothing is taken before all ranks set up (rft/runtime/task.py)

    @property
    def present(self) -> list[int]:
        """The members at the last meeting (all agree): the lost ones are not among them."""
        return self.meeting.present

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any rank (a meeting: all ranks call it alike)."""
        return self.vote(flag)[0]

    def vote(self, *flags: bool) -> list[bool]:
        """Each flag True on every rank if it is True on any present rank: one meeting for several
        decisions (at a step's control point: stop? checkpoint now by time?). All ranks pass the
        same number of flags."""
        self.rounds += 1
        posted = self.meeting.post(f"rft-control/{self.rounds}", [bool(f) for f in flags])
        return [any(votes[i] for votes in posted.values()) for i in range(len(flags))]

    def finish(self) -> None:
        """Rank 0 at the end of the run: releases the GPU-holding tasks (`hold_until_finished`)."""
        self.store.set("rft-finished", "1")


def control_store(topology: Topology, timeout: datetime.timedelta, client: bool = False) -> dist.Store:
    """The job's key-value store, hosted by rank 0 (votes, the dealer's counters, judge URLs);
    `client`: another connection to it (rank 0's second thread)."""
    return dist.TCPStore(topology.master_addr, topology.control_port, None,
                         is_master=topology.rank == 0 and not client, timeout=timeout, wait_for_workers=False)


def hold_until_finished(topology: Topology, poll_s: float = 5.0) -> dict:
    """An engine follower's whole life: keep its GPU slot until rank 0 says the run is over or
    its store is gone (rank 0 ended or failed; Slurm then ends the job)."""
    print(f"rank {topology.rank}: holds its GPU for the vLLM engine of this rollout group", flush=True)
    try:
        store = control_store(topology, datetime.timedelta(seconds=600))
        while not store.check(["rft-finished"]):
            time.sleep(poll_s)
    except Exception:  # the store went away with rank 0
        pass
    return {"role": "engine follower", "rank": topology.rank}



def requeue_or_stop(control: ControlGroup, flag: StopFlag, run_dir: str, done: int, cluster: ClusterConfig) -> None:
    """After every rank saved at `done` steps: on SIGTERM every rank stops; on SIGUSR2 rank 0
    requeues the Slurm job if allowed, and every rank waits to be killed by the requeue, or stops.
    Raises StoppedBySignal saying how the run goes on."""
    from rft.runtime.checkpoint import record_requeue, requeue_count

    topology = control.topology
    job_id = os.environ.get("SLURM_JOB_ID")
    resume = f"launch again with run.output_dir={run_dir} to resume"
    if control.any(flag.terminated):  # any rank's SIGTERM: Slurm is ending the job on every node
        print(f"rft: stop requested (SIGTERM: preemption or scancel); saved at step {done}", flush=True)
        raise StoppedBySignal(f"stopped on SIGTERM (a preemption or scancel) at step {done}, checkpoint complete in "
                              f"{run_dir}/checkpoints: a preempted job that Slurm requeues resumes there by itself; "
                              f"otherwise {resume}")
    print(f"rft: stop requested (SIGUSR2: time limit or preemption); saved at step {done}", flush=True)
    will_requeue, reason = False, ""
    if topology.rank == 0:
        if job_id is None:
            reason = "not a Slurm job"
        elif not cluster.requeue:
            reason = "cluster.requeue=false"
        elif requeue_count(run_dir) >= cluster.max_requeues:
            reason = f"cluster.max_requeues={cluster.max_requeues} requeues used"
        else:
            record_requeue(run_dir, done)
            will_requeue = True
    if control.any(will_requeue):  # rank 0's decision, to everyone
        # every rank must expect Slurm's SIGTERM before rank 0 triggers it
        flag.awaiting_requeue = True
        control.any(False)
        if topology.rank == 0:
            out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
            if out.returncode != 0:
                raise StoppedBySignal(f"stopped on a signal at step {done} (checkpoint complete) but "
                                      f"`scontrol requeue {job_id}` failed: {out.stderr.strip()}; {resume}")
        print(f"rft: checkpoint at step {done} complete; job {job_id} requeued, waiting for Slurm "
              "to stop this task", flush=True)
        time.sleep(600)  # Slurm's SIGTERM ends us (see StopFlag); reaching the end is an error
        raise RuntimeError(f"requeued job {job_id} was not stopped by Slurm within 600 s")
    raise StoppedBySignal(f"stopped on a signal at step {done}, checkpoint in {run_dir}/checkpoints; not requeued "
                          f"({reason or 'see rank 0'}); {resume}")
