"""Whether a submitted job's ranks live, and how the job ended: the ranks' result files, pid
files and process groups on this machine; squeue, sacct and scontrol on Slurm. Also stopping a
local job's ranks for good. Read by the launcher (rft/launch/report.py, rft/launch/failures.py, rft/launch/__main__.py)."""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections.abc import Callable

from rich.markup import escape

from rft.launch.console import console


def task_result(log_dir: str, job_id: str, rank: int) -> tuple[str, object] | None:
    path = os.path.join(log_dir, f"{job_id}_{rank}_result.pkl")
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception:  # being written right now
        return None


def _pid_alive(pid_file: str) -> bool | None:
    if not os.path.exists(pid_file):
        return None
    try:
        os.kill(int(open(pid_file).read().strip()), 0)
        return True
    except (ProcessLookupError, ValueError):
        return False


def local_rank_alive(run_dir: str) -> Callable[[int], bool | None]:
    """Liveness from the pid files the ranks and their supervising tasks write (only meaningful on
    the launcher's machine): alive while either process is."""
    from rft.runtime.pulse import pid_path

    def alive(rank: int) -> bool | None:
        states = [_pid_alive(pid_path(run_dir, rank)), _pid_alive(pid_path(run_dir, rank, supervisor=True))]
        return True if True in states else (None if states == [None, None] else False)

    return alive


def local_rank_processes(run_dir: str, log_dir: str, world_size: int) -> list[tuple[int, int, bool]]:
    """(rank, pid, leads a group) of every live rank process of a local job and of its supervising
    task, from their pid files. Only processes whose command line names this job's log directory
    count, so a pid file left from an earlier attempt never names an unrelated process that reuses
    its number. Taken while the ranks live: a rank's process group (vLLM's engine process, reward
    and tool subprocesses) outlives its leader."""
    from rft.runtime.pulse import pid_path

    found = []
    for rank in range(world_size):
        for path, leads in ((pid_path(run_dir, rank), True), (pid_path(run_dir, rank, supervisor=True), False)):
            try:
                with open(path) as f:
                    pid = int(f.read().strip())
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if os.path.abspath(log_dir).encode() in f.read():
                        found.append((rank, pid, leads))
            except (OSError, ValueError):
                continue  # gone already, or never started
    return found


def stop_local_ranks(processes: list[tuple[int, int, bool]], wait_s: float = 30.0) -> list[int]:
    """After a local job failed or was interrupted: SIGKILL every rank's process group (the rank
    and what it started, vLLM's engine process included: rft/runtime/supervisor.py) and its
    supervising task, and wait until they are gone. submitit's cancel alone left ranks running (a
    rank takes SIGTERM as a request to save after its step: rft/runtime/preemption.py): a trainer
    of the failed launch lived on for half a minute and trained on experience the next launch into
    the same directory had written; and where submitit killed a task, its rank's vLLM engine lived
    on. Returns the ranks stopped."""
    stopped, pids = set(), []
    for rank, pid, leads in processes:
        try:
            if leads:
                os.killpg(pid, signal.SIGKILL)  # the group outlives its leader: kill it by its id
            else:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            continue  # the whole group is gone
        pids.append(pid)
        stopped.add(rank)
    deadline = time.monotonic() + wait_s
    while any(process_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(stopped)


def process_running(pid: int) -> bool:
    """Alive and not a zombie (a killed process its parent has not reaped yet has died)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_WARNED: set[str] = set()


def warn_once(text: str) -> None:
    """Print a Slurm tool's warning the first time only (the launcher polls them every few seconds)."""
    text = text.strip()
    if text and text not in _WARNED:
        _WARNED.add(text)
        console.print(f"[yellow]slurm: {escape(text)}", soft_wrap=True)


def _squeue_state(job_id: str) -> str | None:
    """The job's state as squeue shows it ("" once Slurm no longer lists it), None when the
    controller does not answer."""
    import subprocess

    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode == 0 or "Invalid job id" in out.stderr:
        if out.returncode == 0:
            warn_once(out.stderr)
        return out.stdout.strip()
    warn_once(out.stderr)
    return None


def slurm_job_alive(job_id: str) -> Callable[[int], bool | None]:
    """Liveness from the queue: once Slurm no longer lists the job, a rank without a result died.
    (submitit reads job states from sacct, which clusters without accounting lack.)"""
    last: dict[str, float | bool | None] = {"at": -1e9, "verdict": None}

    def alive(_rank: int) -> bool | None:
        if time.monotonic() - last["at"] < 10:  # one squeue per 10 s, not one per rank per poll
            return last["verdict"]
        state = _squeue_state(job_id)
        last.update(at=time.monotonic(), verdict=None if state is None else bool(state))
        return last["verdict"]

    return alive


def slurm_job_state(job_id: str) -> str | None:
    """How Slurm says the job ended, e.g. "OUT_OF_MEMORY, exit code 0:125": from sacct where
    accounting is on, else from scontrol while the controller still remembers the job."""
    import subprocess

    def run(cmd: list[str]) -> str | None:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    acct = run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode"])
    if acct and acct.strip():
        state, _, code = acct.strip().splitlines()[0].partition("|")
        return f"{state}, exit code {code}"
    shown = run(["scontrol", "-o", "show", "job", job_id])
    if shown:
        fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
        if "JobState" in fields:
            reason = f" ({fields['Reason']})" if fields.get("Reason", "None") != "None" else ""
            return f"{fields['JobState']}{reason}, exit code {fields.get('ExitCode', '?')}"
    return None


def job_watch(job, on_slurm: bool, run_dir: str, log_dir: str, world_size: int
              ) -> tuple[Callable[[], bool], Callable[[int], bool | None]]:
    """(done(), alive(rank)) for a submitted job. On Slurm both come from result files and squeue:
    submitit's own `job.done()` runs sacct, which warns on every poll where accounting is off."""
    if not on_slurm:
        return job.done, local_rank_alive(run_dir)
    # a step of an allocation (rft/launch/steps.py) lives as long as its srun; the allocation's queue
    # entry outlives it
    from rft.launch.steps import StepJob

    alive = job.alive if isinstance(job, StepJob) else slurm_job_alive(job.job_id)

    def done() -> bool:
        if all(task_result(log_dir, job.job_id, r) is not None for r in range(world_size)):
            return True
        return alive(0) is False

    return done, alive


def wait_for_saving_ranks(job_id: str, log_dir: str, ranks: list[int], timeout_s: float,
                          gone: Callable[[], bool] | None = None) -> bool:
    """After the launcher cancelled a Slurm job: the ranks take scancel's SIGTERM as a request to
    finish their step, save and stop (rft/runtime/preemption.py). Wait until each of `ranks` has
    written its result or Slurm no longer lists the job (`gone()`, when given, says instead), at most
    `timeout_s` (Slurm's KillWait, after which it kills them). A launch again into the same
    directory must not start while the old ranks still write their checkpoint: it would resume from the one before, and the two jobs would
    write one run. True when they all stopped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(task_result(log_dir, job_id, r) is not None for r in ranks) or (
                gone() if gone is not None else _squeue_state(job_id) == ""):
            return True
        time.sleep(1.0)  # one squeue a second at most, as wait_until_gone
    return False


def wait_until_gone(job_id: str, timeout_s: float = 120.0) -> bool:
    """After the ranks returned: wait until Slurm has finished the job too (its epilogue, the
    accounting record), so `cluster.wait=true` exits when `sacct` shows the job ended."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _squeue_state(job_id) == "":
            return True
        time.sleep(1.0)
    return False
