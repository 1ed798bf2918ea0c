"""Run a rank in a child process and say how it ended, even when it was killed.

A process killed by SIGKILL (the kernel's OOM killer, `kill -9`, a Slurm memory limit) leaves no
traceback and no result: its launcher used to report only "exited without a result". Only the
parent of a process learns its exit status, so each task of a job (the process submitit starts,
locally or under srun) forks the rank's real work into a child and waits for it, as torchrun's
elastic agent does for its workers:

    task process (this module, a few MB)      child (the rank: torch, Megatron or vLLM)
      fork ------------------------------------> runs the rank, sends back its result or error
      forwards SIGUSR2 / SIGTERM / SIGINT ----->
      waits; killed child -> RankKilledError("trainer rank 0 was killed by the kernel's OOM killer ...")

The child gets SIGKILL if the task process dies first (PR_SET_PDEATHSIG), so a cancelled job
leaves no orphan. The child leads a process group of its own, and whatever is left in it once the
child has ended (vLLM's engine process, reward or tool subprocesses of a rank killed by -9, which
would otherwise live on holding memory and cores) is killed with it. The message names the
signal, the child's peak memory and, where the cgroup's memory.events counts one, that the OOM
killer did it.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

_FORWARDED = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1


class RankKilledError(RuntimeError):
    """The rank's process ended by a signal (or exited) without returning or raising."""


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (the supervising task process) exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: a cancelled job may leave the child to finish on its own


def oom_kills() -> int | None:
    """How many processes of this cgroup the OOM killer has killed so far (cgroup v2
    memory.events, or v1 memory.oom_control), or None where the kernel does not say."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f if line.strip()]
    except OSError:
        return None
    candidates = []
    for _, controllers, path in lines:
        if controllers == "":  # v2
            candidates += [f"/sys/fs/cgroup{path}/memory.events", "/sys/fs/cgroup/memory.events"]
        elif "memory" in controllers.split(","):  # v1
            candidates += [f"/sys/fs/cgroup/memory{path}/memory.oom_control", "/sys/fs/cgroup/memory/memory.oom_control"]
    for candidate in candidates:
        try:
            with open(candidate) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def death_message(who: str, status: int, peak_gib: float, oom_before: int | None, oom_after: int | None) -> str:
    """What to tell the user about a child that ended with wait status `status` and no result."""
    if os.WIFEXITED(status):
        return (f"{who} exited with code {os.WEXITSTATUS(status)} without a result (peak memory {peak_gib:.1f} GiB); "
                "the end of its log says why")
    signum = os.WTERMSIG(status)
    name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else f"signal {signum}"
    memory = f"its memory peaked at {peak_gib:.1f} GiB"
    fix = ("lower trainer.micro_batch_size, model.max_seq_len or rollout.kv_cache_gb, or ask for more memory "
           "(cluster.mem_gb)")
    if oom_before is not None and oom_after is not None and oom_after > oom_before:
        return f"{who} was killed by the kernel's OOM killer ({name}; {memory}): out of memory; {fix}"
    if signum == signal.SIGKILL:
        return (f"{who} was killed by SIGKILL (signal 9; {memory}): by `kill -9`, by Slurm, or by the "
                f"kernel's OOM killer; if memory ran out: {fix}")
    return f"{who} was killed by {name} (signal {signum}; {memory})"


def run_supervised(work: Callable[[], Any], who: str, leftovers_grace_s: float = 0.0) -> Any:
    """Run `work()` in a forked child; return its result or re-raise its exception here (with the
    child's traceback attached), or raise RankKilledError naming how it died. What the child left
    in its process group is killed (after SIGTERM and `leftovers_grace_s` seconds, if given)."""
    # the outcome goes through a file, not a pipe: processes the rank forks (vLLM's) would inherit a
    # pipe's write end and hold it open after the rank died
    fd, outcome_path = tempfile.mkstemp(prefix="rft-rank-", suffix=".pkl")
    os.close(fd)
    oom_before = oom_kills()
    pid = os.fork()
    if pid == 0:  # the child: the rank itself
        _die_with_parent()
        os.setpgid(0, 0)  # its descendants share this group: see _kill_leftovers
        # until the rank installs its own handlers (rft/runtime/preemption.py): SIGUSR2's default would
        # kill it, and submitit's handler inherited from this process would requeue on its own
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os._exit(_run_and_record(work, outcome_path))

    try:
        os.setpgid(pid, pid)  # also here: whichever of parent and child runs first sets it
    except OSError:
        pass  # the child did already (and may have exec'd or ended)
    previous = {signum: signal.signal(signum, lambda s, _f: _forward(pid, s)) for signum in _FORWARDED}
    try:
        _, status, usage = os.wait4(pid, 0)  # a forwarded signal does not end the wait (PEP 475)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    _kill_leftovers(pid, leftovers_grace_s)
    try:
        with open(outcome_path, "rb") as f:
            payload = f.read()
    finally:
        os.remove(outcome_path)
    if payload:
        kind, value, trace = pickle.loads(payload)
        if kind == "ok":
            return pickle.loads(value)
        try:
            err = pickle.loads(value)
        except Exception:  # an exception class that cannot be rebuilt from its args: keep its text
            err = None
        if not isinstance(err, BaseException):
            raise RuntimeError(f"{who} failed:\n{trace}")
        err.add_note(f"in the rank's process:\n{trace}")
        raise err
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        # the rank left on purpose without a result: Slurm is requeueing the job (StopFlag in
        # rft/runtime/preemption.py); leave alike, so the launcher keeps following the requeued job
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    peak_gib = usage.ru_maxrss / 2**20  # KiB on Linux
    raise RankKilledError(death_message(who, status, peak_gib, oom_before, oom_kills()))


def _run_and_record(work: Callable[[], Any], outcome_path: str) -> int:
    """In the child: run `work`, write ("ok", pickled result, "") or ("error", pickled exception
    or None, its traceback) to `outcome_path` (temp file + rename: a half-written file never reads
    as an outcome). The inner pickles are separate so an exception that cannot be rebuilt in the
    parent still arrives as its traceback."""
    try:
        outcome = ("ok", pickle.dumps(work()), "")
    except BaseException as err:  # noqa: BLE001 - everything goes back to the parent
        trace = traceback.format_exc()
        try:
            outcome = ("error", pickle.dumps(err), trace)
        except Exception:
            outcome = ("error", None, trace)
    with open(outcome_path + ".tmp", "wb") as f:
        f.write(pickle.dumps(outcome))
    os.replace(outcome_path + ".tmp", outcome_path)
    sys.stdout.flush()  # os._exit skips the interpreter's flush
    sys.stderr.flush()
    return 0 if outcome[0] == "ok" else 1


def _kill_leftovers(group: int, grace_s: float = 0.0) -> None:
    """End what is left of a process group after its leader ended: SIGTERM first when given a
    grace period (a launcher then cancels its job and stops its ranks), SIGKILL for what remains."""
    if grace_s > 0:
        deadline = time.monotonic() + grace_s
        try:
            os.killpg(group, signal.SIGTERM)
            while time.monotonic() < deadline:
                time.sleep(0.1)
                os.killpg(group, 0)  # ProcessLookupError once the group is empty
        except (ProcessLookupError, PermissionError):
            return  # nothing left
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left


def run_tool(main: Callable[[], Any], name: str, grace_s: float = 15.0) -> None:
    """A tool's entry point (tools/*.py): `main()` runs supervised as a rank does, so whatever it
    started (vLLM's engine process, trainer processes, launches and their ranks) ends when it
    ends, on every path: a return, an exception, `sys.exit`, a Ctrl-C, a kill of the tool's child.
    Left running, vLLM's engine process would hold gigabytes and the tool's stdout, so that
    `python tools/x.py | tail -1` never returned. Exit status and exceptions are the tool's own."""
    try:
        run_supervised(main, name, leftovers_grace_s=grace_s)
    except RankKilledError as err:
        sys.exit(str(err))  # it names the tool and how it died


def _forward(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
