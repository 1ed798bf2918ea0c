"""The Slurm side without a cluster: rank/role/rendezvous from a multi-node Slurm environment, the
sbatch script for a 4-node x 8-GPU profile (golden file), and request checks that name the key."""

import os

import pytest

from rft.cluster import rank_info_from_env
from rft.config import ClusterConfig, RFTConfig
from rft.slurm import check_request, make_executor, port_for_job, tasks_per_node

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "sbatch_4x8_gpu.sh")


def _slurm_env(monkeypatch, procid: int, nodeid: int, localid: int, ntasks: int = 32) -> None:
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    for key, value in {"SLURM_JOB_ID": "123457", "SLURM_NTASKS": ntasks, "SLURM_JOB_NUM_NODES": 4,
                       "SLURM_NODEID": nodeid, "SLURM_JOB_NODELIST": "gpu-a[017-018],gpu-b[003,009]",
                       "SLURM_PROCID": procid, "SLURM_LOCALID": localid}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.delenv("LOCAL_RANK", raising=False)


@pytest.mark.parametrize("procid, nodeid, localid, role, role_rank", [
    (0, 0, 0, "trainer", 0), (9, 1, 1, "trainer", 9), (23, 2, 7, "trainer", 23),
    (24, 3, 0, "rollout", 0), (31, 3, 7, "rollout", 7)])
def test_ranks_roles_and_rendezvous_from_a_4_node_job(monkeypatch, procid, nodeid, localid, role, role_rank):
    _slurm_env(monkeypatch, procid, nodeid, localid)
    cluster = ClusterConfig(kind="slurm", trainer_ranks=24, rollout_ranks=8, nodes=4, gpus_per_node=8)
    info = rank_info_from_env(cluster, master_port=0)
    assert (info.rank, info.world_size, info.role, info.role_rank) == (procid, 32, role, role_rank)
    assert info.master_addr == "gpu-a017"  # first node of the allocation, where rank 0 runs
    assert info.master_port == port_for_job("123457") == 20000 + 3457 * 3
    assert info.weight_port == info.master_port + 1
    assert os.environ["LOCAL_RANK"] == str(localid)  # which GPU of its node the rank takes


def test_task_count_must_match_the_config(monkeypatch):
    _slurm_env(monkeypatch, 0, 0, 0, ntasks=16)
    with pytest.raises(RuntimeError, match="16 tasks"):
        rank_info_from_env(ClusterConfig(kind="slurm", trainer_ranks=24, rollout_ranks=8), master_port=0)


def _gpu_profile(tmp_path) -> RFTConfig:
    cfg = RFTConfig()
    cfg.run.name, cfg.run.output_dir = "gsm8k", str(tmp_path)
    c = cfg.cluster
    c.kind, c.nodes, c.gpus_per_node, c.trainer_ranks, c.rollout_ranks = "slurm", 4, 8, 24, 8
    c.partition, c.account, c.qos, c.constraint = "gpu", "proj123", "normal", "a100&ib"
    c.cpus_per_task, c.mem_gb, c.timeout_min = 8, 480, 720
    c.setup = ["module load cuda/12.4"]
    c.env = {"NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": "ib0"}
    c.sbatch_extra = {"reservation": "rl"}
    c.container_image, c.container_binds = str(tmp_path / "rft.sif"), ["/scratch", "/datasets"]
    return cfg


def test_sbatch_script_for_4_nodes_x_8_gpus_matches_golden(tmp_path, monkeypatch):
    # submitit's executor refuses to exist where `srun` is not on PATH; writing the script needs none
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    cfg = _gpu_profile(tmp_path)
    executor = make_executor(cfg, str(tmp_path / "logs"))
    script = executor._make_submission_file_text(executor._submitit_command_str, "JOBID")
    from rft.slurm import REPO

    script = script.replace(str(tmp_path), "RUN").replace(REPO, "REPO")
    if os.environ.get("RFT_UPDATE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            f.write(script)
    with open(GOLDEN) as f:
        assert script == f.read(), "sbatch script changed; rerun with RFT_UPDATE_GOLDEN=1 if intended"
    assert tasks_per_node(cfg.cluster) == 8


@pytest.mark.parametrize("change, key", [
    ({"trainer_ranks": 20}, "cluster.trainer_ranks + cluster.rollout_ranks"),
    ({"container_image": "/nope/rft.sif"}, "cluster.container_image"),
    ({"gpus_per_node": 0, "nodes": 3}, "cluster.nodes"),
])
def test_bad_requests_name_the_key(tmp_path, change, key):
    cfg = _gpu_profile(tmp_path)
    (tmp_path / "rft.sif").write_text("")
    for k, v in change.items():
        setattr(cfg.cluster, k, v)
    with pytest.raises(ValueError, match=key.replace(".", r"\.").replace("+", r"\+")):
        check_request(cfg)
