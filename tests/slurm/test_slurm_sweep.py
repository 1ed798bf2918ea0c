"""`python -m rft.launch -m ... seed=1,2` on a real Slurm: one job array, one task per run, each
run in its own output dir, both complete (checked with sacct, as a user would)."""

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e"))
from helpers import REPO  # noqa: E402

SFT_STEPS, GRPO_STEPS = 20, 3


def test_seed_sweep_is_one_array_with_a_dir_per_run(slurm, tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, "-m", "rft.launch", "-m", "+experiment=quickstart", "cluster=slurm", "cluster.wait=true",
         "seed=1,2", f"hydra.sweep.dir={sweep_dir}", "monitor.progress=false",
         f"stages.0.trainer.max_steps={SFT_STEPS}", f"stages.1.trainer.max_steps={GRPO_STEPS}"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    array_id = result.stdout.split("submitted array job ")[1].split()[0]
    assert "(2 runs x 2 tasks)" in result.stdout

    for index, seed in enumerate((1, 2)):
        run_dir = sweep_dir / str(index)
        config = (run_dir / "config.yaml").read_text()
        assert f"seed: {seed}\n" in config
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == SFT_STEPS + GRPO_STEPS
        # array task <index> ran this run's ranks
        assert "rank 0/2: trainer" in (sweep_dir / "logs" / f"{array_id}_{index}_0_log.out").read_text()

    # the launcher returned once Slurm no longer lists the jobs; slurmdbd records them just after
    for _ in range(30):
        states = subprocess.run(["sacct", "-j", array_id, "-X", "-n", "-P", "-o", "JobID,State"],
                                capture_output=True, text=True, check=True).stdout.split()
        if all("|COMPLETED" in s for s in states):
            break
        time.sleep(1)
    assert sorted(states) == [f"{array_id}_0|COMPLETED", f"{array_id}_1|COMPLETED"], states


def test_a_sweep_over_the_job_shape_fails_before_submit(slurm, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rft.launch", "-m", "+experiment=quickstart", "cluster=slurm",
         "cluster.cpus_per_task=1,2", f"hydra.sweep.dir={tmp_path}", "monitor.progress=false"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "cluster.cpus_per_task=2 is invalid" in result.stderr and "one Slurm array has one job shape" in result.stderr
    assert "submitted" not in result.stdout
