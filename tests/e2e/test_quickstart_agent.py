"""`python -m rft.launch +experiment=quickstart_agent` as a new user runs it: the tiny model learns a
multi-turn game on CPU. The metric is the grid world's success rate, sampled as the policy samples
(rollout.eval_temperature=1) on 100 held-out tasks, and the turns an episode takes.

Why these margins: after the SFT warm-up (demonstrations that take a shortest-path move half of
the time) the policy reaches the goal within 8 moves in 60-70% of held-out episodes; GRPO on
whole episodes brought that to 99-100% and the turns from 5.6-5.7 to 3.5 (the shortest paths
average 3.5) in the runs measured (seeds 0 and 1), and GRPO with per-turn credit (the recipe's
since) to 98% and 3.5 turns (seed 0; seeds 1-3 in docs/guides/agents.md, 99-100%). Eval noise on
100 episodes at 60% is about +-10 points (2 sigma), so +15 points and -0.5 turns are improvements
no noisy eval of an unchanged policy shows. The run also checks per-turn credit on its own rows:
the moves of one episode get different advantages."""

import json
import os
import time

import pytest
import yaml

from tests.e2e.helpers import launch, tensorboard_scalars

# the whole agent recipe (about 5 min); multi-turn workflows and per-turn credit also run in test_workflows and tests/unit
pytestmark = pytest.mark.heavy


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
    # per-turn credit (advantage=grpo_per_turn) on the run's own rows: the moves of one episode are
    # credited apart, each by what followed it, not all with the episode's return
    rl = yaml.safe_load((tmp_path / "config.yaml").read_text())["stages"][1]["algorithm"]
    assert rl["advantage"] == "grpo_per_turn"
    spreads = turn_spreads(str(tmp_path / "buffer"), rl["gamma"])
    assert max(spreads) > 0.1, spreads


def turn_spreads(buffer_dir: str, gamma: float) -> list[float]:
    """Per episode of the first trained shard: max - min of its turns' advantages, as the trainer
    computes them."""
    import glob

    import pyarrow.parquet as pq
    import torch

    from rft.algorithms.turn_credit import turn_tensors
    from rft.buffer.experience import from_table
    from rft.config import AlgorithmConfig
    from rft.trainer.step_batch import StepBatch, batch_advantages

    shard = sorted(glob.glob(os.path.join(buffer_dir, "step*.parquet*")))[0]
    batch = StepBatch.from_experiences(from_table(pq.read_table(shard)))
    advantages = batch_advantages(batch, AlgorithmConfig(advantage="grpo_per_turn", gamma=gamma), None).advantages
    width = advantages.shape[1]
    mask = torch.tensor([m + [0] * (width - len(m)) for m in batch.response_mask])
    turn_ids, _ = turn_tensors(mask, batch.rewards, batch.step_rewards, batch.step_index, batch.turns)
    spreads = []
    for row in range(len(batch.rewards)):
        per_turn = {int(t): float(a) for t, a in zip(turn_ids[row], advantages[row]) if t >= 0}
        spreads.append(max(per_turn.values()) - min(per_turn.values()) if per_turn else 0.0)
    return spreads
