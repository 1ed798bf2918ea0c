"""trainer.skip_zero_advantage_rows under data and pipeline parallelism (gloo ranks): each rank
leaves out its own rows of advantage 0, a rank may have none left in an optimizer step while its
DP peer has some, and every stage of a pipeline leaves out the same rows; the weights after the
step equal those of the run that trains every row."""

import os

import pytest
import torch
from dist_models import create_family_model, free_port, init_gloo, spawn

PROMPTS = [[1, 5, 6], [1, 12, 13, 14], [1, 20], [1, 9, 9, 4], [1, 7], [1, 3, 30, 31]]
RESPONSES = [[8, 9, 2], [2, 7], [10, 11, 12, 2], [4, 5], [6, 6, 2], [3, 2]]
# two groups of three: the middle row of each scores the group's mean, so its advantage is 0.
# DP=2 deals rows 0, 2, 4 and 1, 3, 5; mini-batches of 2 rows make optimizer steps of rows
# (0, 1), (2, 3), (4, 5): in the first, rank 1's only row is left out while rank 0 trains its own
REWARDS = [1.0, 0.5, 0.0, 1.0, 0.5, 0.0]
GROUPS = [0, 0, 0, 1, 1, 1]


def _worker(rank: int, world: int, tp: int, pp: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from rft.config import AlgorithmConfig
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.master_weights import MasterWeightsOptimizer
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    init_gloo(rank, world, port, tp, pp)
    batch = StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES, rewards=REWARDS, group_ids=GROUPS,
                      old_logprobs=[[-1.5] * len(r) for r in RESPONSES])
    algo = AlgorithmConfig(advantage="grpo", policy_loss="ppo", loss_agg="token-mean", mini_batch_size=2,
                           grad_clip=0.0)
    result = {}
    for skip in (False, True):
        model, geo = build_gpt_model(model_dir)
        load_hf_weights(model, load_hf_state(model_dir), geo)
        start = [p.detach().clone() for p in model.parameters()]
        optimizer = MasterWeightsOptimizer(model, lambda masters: torch.optim.SGD(masters, lr=0.5))
        metrics = train_step(model, optimizer, batch, algo, 1, 0, skip_zero_advantage=skip)
        result[skip] = {"weights": [p.detach().clone() for p in model.parameters()], "start": start,
                        "metrics": metrics}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2)], ids=["dp2", "pp2"])
def test_skipping_rows_of_zero_advantage_keeps_the_update_over_ranks(tmp_path, tp, pp):
    model_dir = create_family_model("qwen2", str(tmp_path / "hf"))
    spawn(_worker, 2, tp, pp, free_port(), model_dir, str(tmp_path))
    for rank in range(2):
        res = torch.load(os.path.join(tmp_path, f"rank{rank}.pt"))
        full, skipping = res[False], res[True]
        assert skipping["metrics"]["train/rows_skipped"] == 2 and "train/rows_skipped" not in full["metrics"]
        assert skipping["metrics"]["train/optimizer_steps"] == full["metrics"]["train/optimizer_steps"] == 3
        moved = sum(float((w - s).abs().sum()) for w, s in zip(full["weights"], full["start"]))
        assert moved > 0
        for a, b in zip(skipping["weights"], full["weights"]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
