"""`python -m rft.launch +experiment=quickstart_agent` as a new user runs it: the tiny model learns a
multi-turn game on CPU. The metric is the grid world's success rate, sampled as the policy samples
(rollout.eval_temperature=1) on 100 held-out tasks, and the turns an episode takes.

Why these margins: after the SFT warm-up (demonstrations that take a shortest-path move half of
the time) the policy reaches the goal within 8 moves in 60-70% of held-out episodes; GRPO on
whole episodes brought that to 99-100% and the turns from 5.6-5.7 to 3.5 (the shortest paths
average 3.5) in the runs measured (seeds 0 and 1). Eval noise on 100 episodes at 60% is about +-10 points (2 sigma), so
+15 points and -0.5 turns are improvements no noisy eval of an unchanged policy shows."""

import json
import os
import time

import pytest

from tests.e2e.helpers import launch, tensorboard_scalars


@pytest.mark.slow
def test_quickstart_agent_learns_the_grid_world(tmp_path):
    start = time.monotonic()
    result = launch("+experiment=quickstart_agent", f"run.output_dir={tmp_path}")
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert elapsed < 15 * 60, f"quickstart_agent took {elapsed / 60:.1f} min"
    evals = {(row["stage"], row["when"]): row for row in map(json.loads, open(tmp_path / "metrics" / "eval.jsonl"))}
    before, after = evals[("grpo", "start")]["metrics"], evals[("grpo", "end")]["metrics"]
    assert evals[("sft", "end")]["metrics"]["success"] > evals[("sft", "start")]["metrics"]["success"] + 0.2
    assert after["success"] >= before["success"] + 0.15, (before, after)
    assert after["turns"] <= before["turns"] - 0.5, (before, after)
    # the summary a user reads names the metric and its change
    assert "success" in result.stdout and "turns" in result.stdout
    # multi-turn experience on disk: observations between the model's moves are not trained
    scalars = tensorboard_scalars(str(tmp_path))
    assert max(v for _, v in scalars["rollout/turns"]) > 1 and "eval/success" in scalars
    assert not os.path.exists(tmp_path / "buffer" / "failed.jsonl")
