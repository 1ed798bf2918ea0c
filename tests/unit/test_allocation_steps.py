"""The launcher inside a Slurm allocation (rft/launch/steps.py): cluster=auto runs the ranks as a
step of it, the step's srun asks for what a submitted job's sbatch lines would (golden file), and a
launch again inside the same allocation sets the earlier launch's files aside. The step itself on
a real Slurm: tests/slurm/test_multinode.py."""

import os
import sys

from rft.config import RFTConfig
from rft.launch import slurm
from rft.launch.slurm import REPO, resolve_kind
from rft.launch.steps import set_aside_earlier, step_script

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "step_2x8_gpu_2_engines.sh")


def _in_job(monkeypatch, nodelist: str, nodes: int, here: str) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", nodelist)
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", str(nodes))
    monkeypatch.setenv("SLURM_JOB_PARTITION", "gpu")
    monkeypatch.setenv("SLURMD_NODENAME", here)
    monkeypatch.setattr(slurm, "_run", lambda cmd, timeout_s=15: None)  # scontrol: the list as written
    monkeypatch.setattr(slurm, "slurm_answers", lambda: True)


def test_auto_inside_an_allocation_of_two_nodes_runs_a_step_of_it(monkeypatch):
    _in_job(monkeypatch, "gpu1 gpu2", 2, "gpu1")  # a batch script on the first of its nodes
    cluster = RFTConfig().cluster
    kind, why = resolve_kind(cluster)
    assert (kind, cluster.allocation, cluster.partition) == ("slurm", "4242", "gpu")
    assert why == "inside Slurm job 4242 (2 node(s)): the ranks run as a step of its allocation (srun), not as a new job"


def test_auto_in_sallocs_shell_off_the_jobs_node_runs_a_step_and_on_a_one_node_job_runs_locally(monkeypatch):
    _in_job(monkeypatch, "gpu1", 1, "login1")  # salloc's shell on the login node
    cluster = RFTConfig().cluster
    assert resolve_kind(cluster)[0] == "slurm" and cluster.allocation == "4242"
    _in_job(monkeypatch, "gpu1", 1, "gpu1")  # a one-node batch script: its node runs the ranks as a local run
    cluster = RFTConfig().cluster
    assert resolve_kind(cluster)[0] == "local" and cluster.allocation is None
    cluster.kind = "slurm"  # set explicitly: a new job, as asked
    assert resolve_kind(cluster) == ("slurm", "set") and cluster.allocation is None


def test_the_steps_srun_asks_for_a_submitted_jobs_layout(tmp_path, monkeypatch):
    """2 nodes x 8 GPUs, two engines of TP 4 (tests/unit/test_slurm_layout.py's profile): the same
    tasks, CPUs, GPUs, time-limit signal and rank command as its golden sbatch script."""
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    cfg = RFTConfig()
    cfg.run.name, cfg.run.output_dir = "gsm8k", str(tmp_path)
    c = cfg.cluster
    c.kind, c.allocation, c.nodes, c.gpus_per_node, c.trainer_ranks, c.rollout_ranks = "slurm", "4242", 2, 8, 8, 8
    c.cpus_per_task, c.setup, c.env = 8, ["module load cuda/12.4"], {"NCCL_IB_HCA": "mlx5"}
    cfg.rollout.tensor_parallel_size = 4
    script = step_script(cfg, str(tmp_path / "logs"), "gsm8k-1").replace(str(tmp_path), "RUN")
    script = script.replace(sys.executable, "PYTHON").replace(REPO, "REPO")
    if os.environ.get("RFT_UPDATE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            f.write(script)
    with open(GOLDEN) as f:
        assert script == f.read(), "step script changed; rerun with RFT_UPDATE_GOLDEN=1 if intended"
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # inside `srun --pty bash`: the step shares that step's resources
    assert " --overlap " in step_script(cfg, str(tmp_path / "logs"), "gsm8k-1")


def test_a_launch_again_in_the_same_allocation_sets_the_earlier_launchs_files_aside(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    for name in ("4242_0_result.pkl", "4242_0_log.out", "4242_submitted.pkl", "4241_0_log.out"):
        (logs / name).write_text(name)
    aside = set_aside_earlier(str(logs), "4242")
    assert aside == str(logs / "4242-earlier-1")
    assert sorted(os.listdir(aside)) == ["4242_0_log.out", "4242_0_result.pkl", "4242_submitted.pkl"]
    assert sorted(p.name for p in logs.iterdir() if p.is_file()) == ["4241_0_log.out"]  # another job's: kept
    (logs / "4242_0_result.pkl").write_text("second")
    assert set_aside_earlier(str(logs), "4242") == str(logs / "4242-earlier-2")
    assert set_aside_earlier(str(logs), "4242") is None  # nothing left of this job
