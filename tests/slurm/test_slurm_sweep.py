"""Sweeps on a real Slurm that are refused before submit. A sweep that runs (one job array, a
directory per run, its runs on different nodes) is in test_multinode.py."""

import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e"))
from helpers import REPO  # noqa: E402


def test_a_sweep_over_the_job_shape_fails_before_submit(slurm, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rft.launch", "-m", "+experiment=quickstart", "cluster=slurm",
         "cluster.cpus_per_task=1,2", f"hydra.sweep.dir={tmp_path}", "monitor.progress=false"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "cluster.cpus_per_task=2 is invalid" in result.stderr and "one Slurm array has one job shape" in result.stderr
    assert "submitted" not in result.stdout
