"""Who owns a run directory, and what happens to an earlier attempt in it.

**Ownership.** Two launches writing one run directory corrupt each other (both explorers write
the buffer, both trainers claim from it). So one live launch owns it: `<run>/owner.json` names the
launcher (host, pid, start time) and, once submitted, its Slurm job. It is created with O_EXCL,
which is atomic on local filesystems, NFS and Lustre alike. A second launch reads it and stops,
naming the owner, while the owner lives: a Slurm job as long as `squeue` lists it (pending,
running or requeued), a local launch while its process lives (same host: the pid with the same
start time; another host: while it refreshes the file, every `HEARTBEAT_S`). A dead owner's file
is taken over (renamed aside first, so two launches cannot both take it). A requeued Slurm job
finds its own job id there and goes on.

**Earlier attempts.** A run launched again resumes from its newest complete checkpoint. Without one
(`run.resume=auto`; `never` always) it starts over, and whatever the earlier attempt left (buffer,
metrics, TensorBoard, partial checkpoints, weights, progress) moves to `<run>/attempts/<n>/` first:
kept for inspection, out of the new attempt's way. Generated inputs (tiny model, synthetic data),
logs (named by job id), config.yaml and the owner file stay.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
from dataclasses import asdict, dataclass

OWNER_FILE = "owner.json"
HEARTBEAT_S = 30.0  # a local launcher refreshes owner.json this often while it follows its job
_STALE_HEARTBEAT_S = 4 * HEARTBEAT_S
# what an attempt leaves that a new attempt would trip over or mix with its own
ATTEMPT_FILES = ("buffer", "metrics", "tensorboard", "checkpoints", "weights", "progress.json", "summary.json",
                 "bench.csv", "bench.md")


class RunDirBusy(ValueError):
    """Another live launch or job owns the run directory (a config-level error: exit code 2)."""


@dataclass
class Owner:
    host: str
    pid: int
    pid_start: str  # the process's start time in clock ticks since boot (/proc): tells a reused pid apart
    started: str  # when the launch claimed the directory, local time
    cluster: str  # local | slurm
    job_id: str | None = None  # the Slurm job (array task: <array>_<index>) once submitted

    def describe(self) -> str:
        who = f"Slurm job {self.job_id}" if self.job_id else f"the launch with pid {self.pid}"
        return f"{who} (started {self.started} on {self.host}, launcher pid {self.pid})"

    def how_to_stop(self) -> str:
        if self.job_id:
            return f"follow it with `squeue -j {self.job_id}`, cancel it with `scancel {self.job_id.split('_')[0]}`"
        return f"wait for it to finish or stop it (`kill {self.pid}` on {self.host})"


def _pid_start(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name
    except (OSError, IndexError):
        return ""


def this_launch(cluster: str) -> Owner:
    pid = os.getpid()
    return Owner(host=socket.gethostname(), pid=pid, pid_start=_pid_start(pid),
                 started=datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"), cluster=cluster)


def _read(path: str) -> Owner | None:
    try:
        with open(path) as f:
            return Owner(**json.load(f))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):  # torn or foreign: nobody can be named, nobody is alive
        return Owner(host="?", pid=0, pid_start="", started="?", cluster="?")


def _write(path: str, owner: Owner) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(asdict(owner), f)
    os.replace(tmp, path)


def slurm_job_listed(job_id: str) -> bool | None:
    """Whether squeue lists the job (any state), None when the controller does not answer."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return False if "Invalid job id" in out.stderr else None
    return bool(out.stdout.strip())


def owner_alive(owner: Owner, path: str) -> bool:
    """Whether `owner` still uses the directory. When it cannot be told (Slurm does not answer),
    alive: refusing a launch is safe, corrupting a run is not."""
    if owner.job_id:
        listed = slurm_job_listed(owner.job_id)
        if listed is not False:
            return True
    if owner.pid <= 0:
        return False
    if owner.host == socket.gethostname():
        return bool(owner.pid_start) and _pid_start(owner.pid) == owner.pid_start
    try:  # a launcher on another host: alive while it refreshes the file
        age = datetime.datetime.now().timestamp() - os.stat(path).st_mtime
    except FileNotFoundError:
        return False
    return age < _STALE_HEARTBEAT_S


def claim(run_dir: str, me: Owner) -> str | None:
    """Make `me` the owner of `run_dir`; raise RunDirBusy naming the live owner. Returns a line
    about a dead owner taken over, or None."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, OWNER_FILE)
    taken_over = None
    for _ in range(5):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            other = _read(path)
            if other is None:
                continue  # removed meanwhile: try again
            if (other.host, other.pid) == (me.host, me.pid):
                raise RunDirBusy(f"run.output_dir={run_dir} is already taken by another run of this launch (sweep "
                                 "runs sharing it?); leave run.output_dir unset in sweeps (each run gets <sweep "
                                 "dir>/<n>) or make it name the swept key, e.g. run.output_dir=out/seed${seed}")
            if owner_alive(other, path):
                raise RunDirBusy(f"run.output_dir={run_dir} is in use by {other.describe()}; "
                                 f"{other.how_to_stop()}, or launch into another run.output_dir")
            try:  # only one of several launches that found the same dead owner wins this rename
                os.rename(path, f"{path}.dead-{other.pid}-{os.getpid()}")
            except FileNotFoundError:
                continue
            os.remove(f"{path}.dead-{other.pid}-{os.getpid()}")
            taken_over = f"took over {run_dir} from {other.describe()}, which is no longer running"
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(me), f)
        return taken_over
    raise RunDirBusy(f"could not claim run.output_dir={run_dir}: {path} keeps changing; is another launch "
                     "starting into it?")


def set_job(run_dir: str, me: Owner, job_id: str) -> None:
    """Record the submitted Slurm job: from now on it owns the directory (also after the launcher exits)."""
    me.job_id = job_id
    _write(os.path.join(run_dir, OWNER_FILE), me)


def heartbeat(run_dir: str) -> None:
    """A following launcher's sign of life for launches on other hosts (see owner_alive)."""
    try:
        os.utime(os.path.join(run_dir, OWNER_FILE))
    except FileNotFoundError:
        pass


def release(run_dir: str, me: Owner) -> None:
    """Give the directory up, if it is still ours."""
    path = os.path.join(run_dir, OWNER_FILE)
    current = _read(path)
    if current is not None and (current.host, current.pid, current.started) == (me.host, me.pid, me.started):
        os.remove(path)


def check_job_owns(run_dir: str, job_id: str) -> None:
    """In rank 0 of a Slurm job (first start or a requeue): the directory must be this job's, or
    free; another live owner makes the rank stop before it writes anything."""
    path = os.path.join(run_dir, OWNER_FILE)
    owner = _read(path)
    if owner is None:
        _write(path, Owner(host=socket.gethostname(), pid=0, pid_start="", started="?", cluster="slurm",
                           job_id=job_id))
        return
    if owner.job_id == job_id or owner.job_id is None and owner.cluster == "slurm":
        return  # ours (a requeue), or our launcher's before it recorded the job id
    if owner_alive(owner, path):
        raise RunDirBusy(f"run directory {run_dir} belongs to {owner.describe()}, not to this job ({job_id}); "
                         "this job stops without writing to it")
    owner.job_id = job_id
    _write(path, owner)


def has_earlier_attempt(run_dir: str) -> bool:
    return any(os.path.exists(os.path.join(run_dir, name)) for name in ATTEMPT_FILES)


def finished(run_dir: str) -> bool:
    """The run ended: its launcher wrote the summary."""
    return os.path.exists(os.path.join(run_dir, "summary.json"))


def next_attempt_dir(run_dir: str) -> str:
    root = os.path.join(run_dir, "attempts")
    taken = [int(n) for n in os.listdir(root) if n.isdigit()] if os.path.isdir(root) else []
    return os.path.join(root, str(max(taken, default=0) + 1))


def set_aside_attempt(run_dir: str) -> str | None:
    """Move what an earlier attempt left into `<run>/attempts/<n>/`; returns that directory, or
    None if there was nothing."""
    present = [name for name in ATTEMPT_FILES if os.path.exists(os.path.join(run_dir, name))]
    if not present:
        return None
    target = next_attempt_dir(run_dir)
    os.makedirs(target)
    for name in present:
        os.rename(os.path.join(run_dir, name), os.path.join(target, name))
    return target
