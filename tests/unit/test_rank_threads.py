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
