"""`python -m rft.launch ... cluster=slurm` on a real Slurm: one job, ranks from the Slurm
environment, the same result as a local run; errors before submit name the key."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e"))
from helpers import launch  # noqa: E402

GRPO_STEPS = 40


def test_quickstart_with_two_engines_runs_and_learns_on_slurm(slurm, exported_sft_model, tmp_path):
    """One trainer and two vLLM engines as three tasks of one Slurm job; GRPO from the quickstart's
    SFT warm-up (exported by a local run) learns as a local run does, and Slurm's accounting shows
    the three tasks."""
    import subprocess
    import time

    run_dir = tmp_path / "run"
    # the warm-up itself is not rerun here: its SFT steps beside two idle engines on 2 cores took
    # 10 to over 20 minutes, most of CI's budget
    result = launch("+experiment=quickstart", "cluster=slurm", "cluster.wait=true", f"run.output_dir={run_dir}",
                    "cluster.rollout_ranks=2", "model.tiny=null", f"model.path={exported_sft_model}",
                    "stages=[{name: grpo, algorithm: {name: grpo, lr: 3.0e-4, clip_eps: 0.2}, "
                    f"trainer: {{max_steps: {GRPO_STEPS}}}}}]")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "submitted job" in result.stdout and "tensorboard --logdir" in result.stdout
    assert "engine 1: rank 2 on node 0 of 1" in " ".join(result.stdout.replace("│", " ").split())
    job_id = result.stdout.split("submitted job ")[1].split()[0]
    # every rank ran as a task of that Slurm job (submitit's per-task logs), on the Slurm node
    for rank in (0, 1, 2):
        log = (run_dir / "logs" / f"{job_id}_{rank}_log.out").read_text()
        assert f"rank {rank}/3" in log
    evals = [json.loads(line) for line in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
    start = [e["accuracy"] for e in evals if e["when"] == "start"][0]
    end = [e["accuracy"] for e in evals if e["when"] == "end"][0]
    assert start >= 0.15, f"the exported SFT model scores only {start:.2f}"
    assert end >= start + 0.05, f"GRPO did not raise accuracy on Slurm: {start:.3f} -> {end:.3f}"
    for _ in range(120):  # slurmdbd records the job just after Slurm stops listing it (120 tries: only a hang bound)
        steps = subprocess.run(["sacct", "-j", job_id, "-n", "-P", "-o", "JobID,NTasks,State"],
                               capture_output=True, text=True, check=True).stdout.split()
        if f"{job_id}.0|3|COMPLETED" in steps:
            break
        time.sleep(1)
    assert f"{job_id}.0|3|COMPLETED" in steps, steps  # the job's step: three tasks, completed


def test_submit_without_wait_returns_the_job_id(slurm, tmp_path):
    import subprocess

    result = launch("+experiment=quickstart", "cluster=slurm", f"run.output_dir={tmp_path}",
                    "stages.0.trainer.max_steps=2", "stages.1.trainer.max_steps=1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    job_id = result.stdout.split("submitted job ")[1].split()[0]
    assert f"scancel {job_id}" in result.stdout
    subprocess.run(["scancel", job_id])


def test_unknown_partition_fails_before_submit(slurm, tmp_path):
    result = launch("+experiment=quickstart", "cluster=slurm", "cluster.partition=nope", f"run.output_dir={tmp_path}")
    assert result.returncode == 2
    assert "cluster.partition='nope'" in result.stderr and "debug" in result.stderr


def test_more_gpus_than_the_nodes_have_fails_before_submit(slurm, tmp_path):
    result = launch("+experiment=quickstart", "cluster=slurm", "cluster.gpus_per_node=2", f"run.output_dir={tmp_path}")
    assert result.returncode == 2
    assert "cluster.gpus_per_node=2" in result.stderr and "at most 0 GPUs" in result.stderr


def test_auto_picks_slurm_when_a_controller_answers(slurm, tmp_path):
    import subprocess

    result = launch("+experiment=quickstart", "cluster=auto", f"run.output_dir={tmp_path}",
                    "stages.0.trainer.max_steps=2", "stages.1.trainer.max_steps=1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "cluster=auto -> slurm" in result.stdout
    subprocess.run(["scancel", result.stdout.split("submitted job ")[1].split()[0]])


def test_the_launcher_inside_a_batch_job_runs_the_ranks_in_that_job(slurm, tmp_path):
    """`python -m rft.launch` as a batch script's command: cluster=auto sees it runs on the node of a
    one-node job and runs the ranks there, in that allocation, instead of queueing a second job."""
    import subprocess
    import time

    from helpers import REPO

    run_dir, log = tmp_path / "run", tmp_path / "job.out"
    command = (f"{sys.executable} -m rft.launch +experiment=quickstart run.output_dir={run_dir} monitor.progress=false "
               "monitor.plots=false stages.0.trainer.max_steps=2 stages.1.trainer.max_steps=1 data.eval_limit=8")
    job = subprocess.run(["sbatch", "--parsable", "-N1", "-c", "2", "-o", str(log), f"--chdir={REPO}", "--wrap", command],
                         capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    deadline = time.monotonic() + 600  # only bounds a hang
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no output"
        time.sleep(1)
    said = log.read_text()
    assert f"cluster=auto -> local (inside Slurm job {job}, on its node: the ranks run here, in its allocation)" in said
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3, said[-3000:]  # the whole run, in this job
    assert "follow it with `squeue" not in said  # no second job was queued
