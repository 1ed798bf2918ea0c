"""The time-limit signal in the middle of a run on a real two-node Slurm (the trainer on one node,
the rollout rank on the other): the signal reaches the ranks of both nodes, every rank saves at
the same step, the job requeues itself, resumes wherever Slurm places it, and ends as an
uninterrupted run would: same step count, each experience shard consumed once, no gaps or
duplicates on TensorBoard's step axis."""

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e"))
from helpers import REPO, tensorboard_scalars  # noqa: E402

from rft.buffer.shards import ExperienceBuffer  # noqa: E402

SFT_STEPS, GRPO_STEPS = 60, 30


def _progress_step(run_dir) -> int:
    try:
        return json.loads((run_dir / "progress.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def test_signal_mid_run_saves_requeues_and_resumes(two_nodes, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rft.launch", "+experiment=quickstart", "cluster=slurm", "cluster.wait=true",
           "cluster.nodes=2", f"run.output_dir={run_dir}", "monitor.progress=false",
           f"stages.0.trainer.max_steps={SFT_STEPS}", f"stages.1.trainer.max_steps={GRPO_STEPS}",
           # the warm-up only has to make GRPO groups with a reward spread (every step must train):
           # 64 rows a step, the recipe's 256 are for learning carries
           "stages.0.trainer.sft_batch_size=64", "monitor.plots=false"]
    launcher = subprocess.Popen(cmd, cwd=REPO, env=two_nodes, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        deadline = time.time() + 600  # only bounds a hang
        while _progress_step(run_dir) < SFT_STEPS + 10:  # in the middle of GRPO
            assert launcher.poll() is None, launcher.communicate()  # (its output: only once it has ended)
            assert time.time() < deadline, f"step {_progress_step(run_dir)} after 600 s"
            time.sleep(0.5)
        job_id = (run_dir / "logs").glob("*_0_log.out").__next__().name.split("_")[0]
        # what Slurm sends `signal_delay_s` before the time limit
        subprocess.run(["scancel", "-s", "USR2", job_id], env=two_nodes, check=True)
        out, err = launcher.communicate(timeout=900)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out[-3000:] + err[-3000:]

    requeues = json.loads((run_dir / "checkpoints" / "requeues.json").read_text())
    assert requeues["requeues"] == 1
    stopped_at = requeues["last_at_step"]
    assert SFT_STEPS + 10 <= stopped_at < SFT_STEPS + GRPO_STEPS
    show = subprocess.run(["scontrol", "show", "job", job_id], env=two_nodes, capture_output=True, text=True).stdout
    assert "Restarts=1" in show, show
    nodes = set()
    for rank in (0, 1):
        log = (run_dir / "logs" / f"{job_id}_{rank}_log.out").read_text()
        assert f"resuming from {run_dir}/checkpoints/step{stopped_at:08d}" in log
        # the requeued attempt's ranks (its log is appended to the first attempt's)
        nodes.add(log.rsplit(f"rank {rank}/2: ", 1)[1].split(" on ", 1)[1].split()[0])
        summary = json.loads((run_dir / "metrics" / f"summary-rank{rank}.json").read_text())
        assert summary["steps"] == SFT_STEPS + GRPO_STEPS  # as an uninterrupted run
    assert nodes == {"node1", "node2"}  # the resumed job spans both nodes again

    # every GRPO step's experience consumed exactly once, nothing left over or set aside
    buffer = ExperienceBuffer(str(run_dir / "buffer"))
    assert buffer.consumed() == [f"step{s:08d}-p001.parquet" for s in range(SFT_STEPS, SFT_STEPS + GRPO_STEPS)]
    assert buffer.pending() == [] and not (run_dir / "buffer" / "rolled_back").exists()

    scalars = tensorboard_scalars(str(run_dir))
    train_steps = sorted(step for step, _ in scalars["loss/policy"])
    assert train_steps == list(range(1, SFT_STEPS + GRPO_STEPS + 1))
    rollout_steps = sorted(step for step, _ in scalars["timing/rollout_s"])
    assert rollout_steps == list(range(SFT_STEPS + 1, SFT_STEPS + GRPO_STEPS + 1))
