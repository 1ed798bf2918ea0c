"""A local run on a GPU node without Slurm (rft/launch/local_gpus.py): the launcher counts the GPUs
its environment shows, and each rank takes its own, as the plan says; a layout that needs more GPUs
than the node shows is refused before anything starts, naming the keys.

On this CPU machine the device list is only names (CUDA_VISIBLE_DEVICES in the launcher's
environment, UUIDs as `nvidia-smi -L` prints them): torch finds no GPU behind them, so the ranks
still compute on CPU, while what each rank was given is what a GPU node's ranks would use."""

import os
import re

from tests.e2e.helpers import launch

GPUS = ["GPU-1a2b", "GPU-3c4d", "GPU-5e6f"]
SHORT = ["stages.0.trainer.max_steps=1", "stages.1.trainer.max_steps=1", "data.eval_limit=8"]


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_each_rank_takes_its_own_gpu_of_those_the_launcher_sees(tmp_path):
    run_dir = tmp_path / "run"
    result = launch("+experiment=quickstart", f"run.output_dir={run_dir}", *SHORT,
                    env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(GPUS)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    said = _flat(result.stdout)
    assert "cluster.gpus_per_node=auto -> 2: GPUs GPU-1a2b,GPU-3c4d of the 3 this node shows, one per rank" in said
    assert "GPUs rank 0 (trainer): GPU GPU-1a2b rank 1 (rollout): GPU GPU-3c4d" in said, said[:3000]
    # the quickstart sizes its cache (rollout.kv_cache_gb=0.25): on GPUs too, within vLLM's share of each GPU
    assert "KV cache 0.25 GiB per GPU (rollout.kv_cache_gb), in rollout.gpu_memory_utilization=0.85 of each GPU" in said
    job_id = result.stdout.split("submitted job ")[1].split()[0]
    for rank, gpu in ((0, "GPU-1a2b"), (1, "GPU-3c4d")):
        log = (run_dir / "logs" / f"{job_id}_{rank}_log.out").read_text()
        line = next(line for line in log.splitlines() if line.startswith(f"rank {rank}/2:"))
        assert line.endswith(f", GPU {gpu}"), line


def test_a_layout_that_needs_more_gpus_than_the_node_shows_is_refused_before_start(tmp_path):
    run_dir = tmp_path / "run"
    result = launch("+experiment=quickstart", f"run.output_dir={run_dir}", "cluster.rollout_ranks=2", *SHORT,
                    env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"})
    said = _flat(result.stderr)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"cluster\.gpus_per_node=None is invalid: the ranks take one GPU each, 3 GPUs "
                     r"\(cluster\.trainer_ranks=1 \+ cluster\.rollout_ranks=2 in mode=both\), and this node shows "
                     r"2 \(0,1\)", said), said
    assert not (run_dir / "logs").exists()  # nothing was submitted
