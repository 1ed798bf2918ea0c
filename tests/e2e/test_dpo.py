"""`mode=train` with DPO on a small preference set (the sum preferred over the operands written
side by side, a typical wrong answer): trainer ranks only, and the DPO loss falls from ln 2
(policy = reference at the start)."""

import json
import math
import random

from tests.e2e.helpers import launch

STEPS = 30


def test_dpo_on_preference_pairs_lowers_its_loss(tmp_path):
    rng = random.Random(0)
    pairs = tmp_path / "pairs.jsonl"
    with pairs.open("w") as f:
        for _ in range(400):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"question": f"{a}+{b}=", "chosen": str(a + b), "rejected": f"{a}{b}"}) + "\n")
    run_dir = tmp_path / "run"
    result = launch("+experiment=quickstart", "mode=train", f"run.output_dir={run_dir}",
                    f"stages=[{{name:dpo,algorithm:{{name:dpo,policy_loss:dpo,dpo_beta:0.5,lr:3.0e-3}},"
                    f"data:{{train_path:{pairs}}},trainer:{{max_steps:{STEPS},sft_batch_size:32}}}}]")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "(1 tasks)" in result.stdout  # the trainer alone: no rollout rank in mode=train
    rows = [json.loads(line) for line in (run_dir / "metrics" / "trainer0.jsonl").read_text().splitlines()]
    losses = [r["loss/dpo"] for r in rows]
    assert len(losses) == STEPS
    assert abs(losses[0] - math.log(2)) < 1e-4  # margin 0 before the first update
    assert sum(losses[-5:]) / 5 < losses[0] - 0.1, losses
    assert rows[-1]["dpo/accuracy"] > 0.5
