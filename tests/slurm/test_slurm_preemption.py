"""A `scancel` on a real Slurm, as a preemption does it: SIGTERM to every process of every task (the
vLLM engine's too), SIGKILL after KillWait. Every rank finishes its step and saves, the launcher says
the job stopped and how it goes on, and launching again resumes from that checkpoint: nothing
trained since the last periodic save is lost, every experience is trained exactly once, every step
logged once (tools/chaos.py's `term` kind and checks). The bit-for-bit comparison with an
uninterrupted run of the same rank code is tests/e2e/test_chaos.py's (SIGTERM to every rank)."""

import json
import os
import re
import subprocess
import sys

from tests.e2e.helpers import REPO


def test_a_cancelled_job_saves_on_sigterm_and_launching_again_resumes_where_it_stopped(patient_slurm_env, tmp_path):
    out = subprocess.run([sys.executable, "tools/chaos.py", "--slurm", "--faults", "1", "--kinds", "term", "--seed", "0",
                          "--no-reference", "--out", str(tmp_path)], cwd=REPO, env=patient_slurm_env,
                         capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["experience_lost"] == 0 and summary["experience_extra"] == 0 and summary["metric_gaps"] == 0
    cancelled, resumed = summary["launch_records"]
    assert cancelled["rc"] != 0 and "stopped on SIGTERM (a preemption or scancel) at step" in cancelled["failure"], cancelled
    stopped_at = int(re.search(r"at step (\d+)", cancelled["failure"]).group(1))
    # the cancel came once `acted_step` steps were done: saved after the step in progress (or the next,
    # when the signal came after that step's vote), so no step done is trained again
    assert cancelled["acted_step"] < stopped_at <= cancelled["acted_step"] + 2, cancelled
    assert resumed["rc"] == 0 and resumed["resumed_from"] == cancelled["checkpoint_after"] == stopped_at, resumed

    log = (tmp_path / "launch00.log").read_text()
    job = re.search(r"submitted job (\d+)", log).group(1)
    plan = " ".join(log.replace("│", " ").split())
    # the plan sets the save against what this Slurm allows (KillWait 30 s, GraceTime 60 s)
    assert "Slurm kills 30 s after a scancel, 90 s after a preemption (KillWait, partition GraceTime)" in plan, plan[:4000]
    # the rollout rank's engine lived through the SIGTERM to its step's end: its rank saved and said so
    rollout_log = (tmp_path / "run" / "logs" / f"{job}_2_log.out").read_text()
    assert f"saved at step {stopped_at}" in rollout_log, rollout_log[-3000:]
    # submitted with --requeue, so that a preemption requeues it (cluster.requeue)
    show = subprocess.run(["scontrol", "show", "job", job], env=patient_slurm_env, capture_output=True, text=True)
    assert "Requeue=1" in show.stdout, show.stdout + show.stderr
    assert os.path.exists(tmp_path / "run" / "summary.json")
