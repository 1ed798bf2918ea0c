"""A rank's torch threads follow the cores it may run on (its CPU set), not the node's count."""

import os

import pytest

from rft.config import RFTConfig
from rft.runtime.task import rank_threads


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU sets")
def test_threads_follow_the_process_cpu_set_halved_when_roles_run_at_once():
    cfg = RFTConfig()
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})  # a task confined to one core, as Slurm's cpus_per_task=1
        assert rank_threads(cfg) == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert rank_threads(cfg) == len(allowed)
    cfg.sync.offset = 1  # trainer and explorer at once share the cores
    assert rank_threads(cfg) == max(1, len(allowed) // 2)
    cfg.trainer.threads = 3
    assert rank_threads(cfg) == 3


def test_idle_openmp_threads_sleep_in_ranks_without_gpus_unless_the_user_set_a_policy(monkeypatch):
    from rft.launch.submit import _idle_threads_sleep

    cfg = RFTConfig()
    cfg.cluster.gpus_per_node = 0
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    _idle_threads_sleep(cfg)
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own choice stays
    _idle_threads_sleep(cfg)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    cfg.cluster.gpus_per_node = 4  # GPU ranks: their CPU threads mostly feed the GPU; left to OpenMP's default
    _idle_threads_sleep(cfg)
    assert "OMP_WAIT_POLICY" not in os.environ
