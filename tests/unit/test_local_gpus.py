"""Which GPUs the launcher sees on a node without Slurm (rft/launch/local_gpus.py), and which each
rank of a layout takes."""

import pytest
from rft.config import ClusterConfig, RFTConfig
from rft.launch.local_gpus import rank_gpus, resolve_local_gpus, visible_gpus


@pytest.mark.parametrize("listed, seen", [("0,1,2", ["0", "1", "2"]), ("", []), ("-1", []),
                                          # CUDA stops at the first invalid entry
                                          ("2,-1,3", ["2"]), ("GPU-ab, MIG-cd", ["GPU-ab", "MIG-cd"])])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(monkeypatch, listed, seen):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
    assert visible_gpus() == seen


def _cfg(**cluster) -> RFTConfig:
    return RFTConfig(cluster=ClusterConfig(kind="local", **cluster))


def test_each_trainer_rank_engine_and_judge_takes_its_span(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,8,9,10")
    cfg = _cfg(trainer_ranks=2, rollout_ranks=4, judge_ranks=1)
    cfg.rollout.tensor_parallel_size = 2
    assert resolve_local_gpus(cfg) == "cluster.gpus_per_node=auto -> 7: GPUs 4,5,6,7,8,9,10 of the 7 this node shows, one per rank"
    assert rank_gpus(cfg) == [(0, "trainer", ["4"]), (1, "trainer", ["5"]), (2, "rollout", ["6", "7"]),
                              (4, "rollout", ["8", "9"]), (6, "judge", ["10"])]


def test_colocated_rollout_ranks_share_the_trainer_ranks_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    cfg = _cfg(trainer_ranks=2, rollout_ranks=2, colocate=True)
    resolve_local_gpus(cfg)
    assert (cfg.cluster.gpus_per_node, cfg.cluster.devices) == (2, ["0", "1"])
    assert rank_gpus(cfg) == [(0, "trainer", ["0"]), (1, "trainer", ["1"]), (2, "rollout", ["0"]), (3, "rollout", ["1"])]


def test_no_gpu_shown_or_zero_asked_runs_on_cpu_and_asking_for_gpus_without_any_is_refused(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cfg = _cfg()
    assert resolve_local_gpus(cfg) is None and (cfg.cluster.gpus_per_node, cfg.cluster.devices) == (0, [])
    with pytest.raises(ValueError, match=r"cluster\.gpus_per_node=2 is invalid: this machine shows no GPU"):
        resolve_local_gpus(_cfg(gpus_per_node=2))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    cfg = _cfg(gpus_per_node=0)
    assert resolve_local_gpus(cfg) is None and cfg.cluster.gpus_per_node == 0
    with pytest.raises(ValueError, match=r"cluster\.gpus_per_node=1 is invalid: the ranks take one GPU each, 2 GPUs"):
        resolve_local_gpus(_cfg(gpus_per_node=1))
