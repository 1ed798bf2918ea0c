"""The ranks as one step (`srun`) of the Slurm allocation the launcher runs in: a batch script that
calls the launcher, or salloc's shell (`cluster.allocation`, which cluster=auto sets there).

    set aside this allocation's files of an earlier launch into the same run
    -> pickle the rank function as submitit does -> srun with a submitted job's layout -> follow it

submitit submits only through sbatch (a new job, queued from inside the allocation it would wait
beside), so the step is started here: srun runs submitit's own task entry point
(`python -m submitit.core._submit <folder>`) in each task, which reads the pickle and writes each
rank's result and log under the job id, as in a submitted job. The launcher follows the ranks
through those files and the step through the srun process it started: the allocation itself stays
RUNNING after the step, so the queue cannot say that a rank died.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time

from rft.config import RFTConfig
from rft.launch.slurm import rank_python, setup_lines, srun_args, tasks_per_node


class StepJob:
    """The step's srun, in the shape of submitit's job that the launcher follows: `job_id` (the
    allocation's: the ranks' files are named by it), `done()`, `cancel()`."""

    def __init__(self, job_id: str, name: str, srun: subprocess.Popen, srun_log: str):
        self.job_id, self.name, self.srun, self.srun_log = job_id, name, srun, srun_log

    def done(self) -> bool:
        """The step is over: srun exits once every task has."""
        return self.srun.poll() is not None

    def alive(self, _rank: int) -> bool:
        """Whether a rank may still run: while the step does (a rank without a result after it died)."""
        return self.srun.poll() is None

    def cancel(self) -> None:
        """SIGTERM to srun, which passes it to every task: the ranks finish their step and save
        (rft/runtime/preemption.py), as on a scancel."""
        if self.srun.poll() is None:
            self.srun.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """End the step now: scancel's SIGKILL to its tasks (found by the step's name), then srun."""
        steps = subprocess.run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i|%j"], capture_output=True,
                               text=True, timeout=30).stdout.split()
        for step_id in (row.split("|")[0] for row in steps if row.endswith(f"|{self.name}")):
            subprocess.run(["scancel", "--signal=KILL", step_id], capture_output=True, timeout=30)
        self.srun.kill()
        self.srun.wait()

    def wait(self, timeout_s: float) -> bool:
        """Wait for the step's end; whether it came within `timeout_s`."""
        try:
            self.srun.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def srun_said(self) -> str:
        """What srun itself printed (its refusals: "Requested node configuration is not available")."""
        try:
            with open(self.srun_log) as f:
                return f.read().strip()
        except OSError:
            return ""


def step_script(cfg: RFTConfig, log_dir: str, name: str) -> str:
    """The shell script that starts the step: the site's setup lines, then srun with the layout a
    submitted job's sbatch lines would give (nodes, tasks, CPUs and GPUs per node, the time-limit
    signal); exec'd, so that the launcher's process is srun itself."""
    from submitit.core.utils import JobPaths

    c, paths = cfg.cluster, JobPaths(log_dir)
    per_node = tasks_per_node(cfg)
    srun = ["srun", f"--jobid={c.allocation}", f"--job-name={name}", f"--nodes={c.nodes}",
            f"--ntasks={c.nodes * per_node}", f"--ntasks-per-node={per_node}", f"--cpus-per-task={c.cpus_per_task or 1}",
            *([f"--gpus-per-node={c.gpus_per_node}"] if c.gpus_per_node else []),
            # inside an interactive step (`srun --pty bash`) a second step must share its resources
            *(["--overlap"] if os.environ.get("SLURM_STEP_ID") not in (None, "batch", "extern") else []),
            f"--signal=USR2@{c.signal_delay_s}", "--unbuffered", "--output", str(paths.stdout),
            "--error", str(paths.stderr), *srun_args(cfg)]
    command = " ".join([shlex.join(srun), rank_python(c), "-u -m submitit.core._submit", shlex.quote(log_dir)])
    return "\n".join(["#!/bin/bash", "set -e", *setup_lines(c), "export SUBMITIT_EXECUTOR=slurm", f"exec {command}", ""])


def set_aside_earlier(log_dir: str, job_id: str) -> str | None:
    """A launch again into the same run inside the same allocation reuses its job id, and so the
    names of the earlier launch's logs and results (which would read as this launch's ranks'
    results): they move to logs/<job id>-earlier-<k>/. Returns that directory, or None."""
    earlier = [f for f in os.listdir(log_dir) if f.startswith(f"{job_id}_")] if os.path.isdir(log_dir) else []
    if not earlier:
        return None
    k = 1
    while os.path.exists(aside := os.path.join(log_dir, f"{job_id}-earlier-{k}")):
        k += 1
    os.makedirs(aside)
    for f in earlier:
        os.replace(os.path.join(log_dir, f), os.path.join(aside, f))
    return aside


def submit_step(cfg: RFTConfig, config: dict, port: int, log_dir: str) -> StepJob:
    """Start the ranks as a step of allocation `cluster.allocation`, each running
    `run_rank(config, port)` as a submitted job's tasks do."""
    from submitit.core.utils import DelayedSubmission, JobPaths

    from rft.runtime.task import run_rank

    job_id = cfg.cluster.allocation
    os.makedirs(log_dir, exist_ok=True)
    set_aside_earlier(log_dir, job_id)
    delayed = DelayedSubmission(run_rank, config, port)
    delayed.set_timeout(cfg.cluster.timeout_min, 0)  # as submitit's executor pickles it; rft requeues itself
    delayed.dump(JobPaths(log_dir, job_id=job_id).submitted_pickle)
    name = f"{cfg.run.name}-{int(time.time())}"  # the step's name: how kill() finds it among the job's steps
    script, srun_log = os.path.join(log_dir, f"{job_id}_step.sh"), os.path.join(log_dir, f"{job_id}_srun.log")
    with open(script, "w") as f:
        f.write(step_script(cfg, log_dir, name))
    with open(srun_log, "w") as log:
        # a session of its own: a Ctrl-C at the launcher's terminal reaches srun only through cancel()
        srun = subprocess.Popen(["bash", script], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return StepJob(job_id, name, srun, srun_log)
