"""GRPO through `python -m rft.launch` with a tiny random model of each architecture the trainer
maps beyond the quickstart's Qwen2: Llama 3.1's scaled RoPE, Qwen2.5's YaRN, Qwen3 (q/k norms) and
Qwen3-MoE (experts), on two data-parallel trainer ranks. Run as one local sweep over `model.path`: each run
generates with vLLM, trains two steps (every row forwarded: random models score no reward, so
every group is alike) and syncs its weights into vLLM after each."""

import json
import math
import subprocess
import sys

from tests.dist.dist_models import create_family_model
from tests.e2e.helpers import REPO

# one sweep of four runs, 81 s on 2 cores: in CI on the second worker (tests/conftest.py); each
# family's weight mapping is also checked by tests/dist/test_hf_megatron.py

FAMILIES = ["llama3", "qwen2_yarn", "qwen3", "qwen3_moe"]
STEPS = 2


def test_each_architecture_runs_grpo_through_the_launcher(tmp_path):
    paths = [create_family_model(family, str(tmp_path / family)) for family in FAMILIES]
    result = subprocess.run(
        [sys.executable, "-m", "rft.launch", "-m", "+experiment=quickstart", "cluster=local", "model.tiny=null",
         f"model.path={','.join(paths)}", "stages=[{name:rl,trainer:{max_steps:%d}}]" % STEPS,
         "cluster.trainer_ranks=2", "trainer.expert_parallel_size=1", "rollout.tasks_per_step=8",
         "trainer.skip_zero_advantage_rows=false", "data.eval_limit=8", "monitor.progress=false",
         f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for index, family in enumerate(FAMILIES):
        run_dir = tmp_path / "sweep" / str(index)
        rows = [json.loads(line) for line in (run_dir / "metrics" / "trainer0.jsonl").read_text().splitlines()]
        rl = [r for r in rows if r["stage"] == "rl"]
        assert len(rl) == STEPS, family
        for row in rl:
            assert all(math.isfinite(row[key]) for key in ("loss/policy", "actor/grad_norm", "actor/entropy")), row
            assert row["train/tokens"] > 0, family  # every row was forwarded and backpropagated
            assert ("moe/load_max_over_mean" in row) == (family == "qwen3_moe"), family
        rollout = json.loads((run_dir / "metrics" / "summary-rank2.json").read_text())
        assert rollout["version"] == STEPS, family  # the engine took every step's weights
