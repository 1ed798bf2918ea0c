"""What a new user meets on a real Slurm: `cluster=auto` takes the GPUs (and, on GPU nodes, the
CPUs) per node from sinfo and never submits a GPU model without GPUs, a cluster without accounting
does not flood the terminal, and a run directory owned by a live Slurm job is not launched into
again."""

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e"))
from helpers import launch  # noqa: E402

SHORT = ["+experiment=quickstart", "stages.0.trainer.max_steps=20", "stages.1.trainer.max_steps=2",
         "stages.0.trainer.sft_batch_size=64"]  # what is tested is before and around the run, not learning


def test_gpu_model_is_refused_on_a_cpu_partition(slurm, tmp_path):
    result = launch(*SHORT, "cluster=auto", "model.needs_gpu=true", f"run.output_dir={tmp_path}/run")
    assert result.returncode == 2
    assert "cluster=auto -> slurm" in result.stdout
    assert "cluster.gpus_per_node=None is invalid" in result.stderr
    assert "needs GPUs (model.needs_gpu=true) but the nodes of partition debug have none" in result.stderr
    assert "cluster.partition=NAME" in result.stderr


def test_gpus_per_node_from_sinfo_and_accounting_warnings_not_repeated(gpu_slurm_env, tmp_path):
    run_dir = tmp_path / "run"
    result = launch(*SHORT, "cluster=auto", "cluster.wait=true", "model.needs_gpu=true", f"run.output_dir={run_dir}",
                    env=gpu_slurm_env, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "cluster.gpus_per_node=auto -> 2 (one GPU per rank; the nodes of partition debug have 2)" in result.stdout
    job_id = result.stdout.split("submitted job ")[1].split()[0]
    script = (run_dir / "logs" / f"{job_id}_submission.sh").read_text()
    assert "--gpus-per-node=2" in script and "--ntasks-per-node=2" in script
    # the node advertises 4 CPUs (tools/slurm_local.sh's floor): 2 per task, not 1 for a vLLM engine and its rewards
    assert "cluster.cpus_per_task=auto -> 2 (the nodes of partition debug have 4 CPUs, 2 tasks per node)" in result.stdout
    assert "--cpus-per-task=2" in script
    assert output.count("accounting storage is disabled") <= 1
    assert "rft run summary" in result.stdout


def test_more_ranks_than_the_nodes_have_gpus_names_the_fix(gpu_slurm_env, tmp_path):
    result = launch(*SHORT, "cluster=slurm", "cluster.trainer_ranks=2", "cluster.rollout_ranks=1",
                    f"run.output_dir={tmp_path}/run", env=gpu_slurm_env, timeout=120)
    assert result.returncode == 2
    assert "the 3 ranks on cluster.nodes=1 need 3 GPUs per node (one per rank) but the nodes of partition debug " \
           "have 2; raise cluster.nodes" in result.stderr


def test_more_cpus_than_a_node_has_names_the_key(slurm, tmp_path):
    # CPU nodes keep 1 CPU per task unless asked (small jobs share a node); asked for too many, the launch
    # stops before submit: 2 tasks x 3 CPUs on a node of 4
    result = launch(*SHORT, "cluster=slurm", "cluster.cpus_per_task=3", f"run.output_dir={tmp_path}/run", timeout=120)
    assert result.returncode == 2
    assert "cluster.cpus_per_task=3 is invalid: 2 tasks per node x 3 CPUs is more than the 4 CPUs of the nodes of " \
           "partition debug" in result.stderr


def test_a_directory_owned_by_a_live_job_is_refused_then_taken_over(slurm, tmp_path):
    run_dir = tmp_path / "run"
    held = launch(*SHORT, "cluster=slurm", f"run.output_dir={run_dir}", "+cluster.sbatch_extra.hold=true")
    assert held.returncode == 0, held.stdout[-2000:] + held.stderr[-2000:]
    job_id = held.stdout.split("submitted job ")[1].split()[0]
    try:
        second = launch(*SHORT, "cluster=slurm", f"run.output_dir={run_dir}")
        assert second.returncode == 2
        assert f"is in use by Slurm job {job_id}" in second.stderr and f"scancel {job_id}" in second.stderr
    finally:
        subprocess.run(["scancel", job_id])
    deadline = time.time() + 60
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip():
        assert time.time() < deadline, "the cancelled job stayed in the queue"
        time.sleep(1)
    third = launch(*SHORT, "cluster=slurm", f"run.output_dir={run_dir}", "+cluster.sbatch_extra.hold=true")
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-2000:]
    assert f"took over {run_dir} from Slurm job {job_id}" in " ".join(third.stdout.split())
    subprocess.run(["scancel", third.stdout.split("submitted job ")[1].split()[0]])
