"""Activation recompute (trainer.recompute) on the tiny model with real megatron-core on one CPU
gloo rank (spawned): selective and full recompute give the same loss and gradients as none."""

import torch

from tests.unit.one_rank import init_one_rank, run_one_rank
from tests.unit.test_packing import MASKS, PROMPTS, RESPONSES, CapturingOptimizer


def _recompute_worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from rft.config import AlgorithmConfig
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    init_one_rank(port)
    hf, res = load_hf_state(model_dir), {}
    batch = StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES, response_mask=MASKS)
    for recompute in ("none", "selective", "full"):
        model, geo = build_gpt_model(model_dir, recompute=recompute)
        load_hf_weights(model, hf, geo)
        optimizer = CapturingOptimizer(model)
        res[recompute] = (train_step(model, optimizer, batch, AlgorithmConfig(name="sft"), 2, 0), optimizer.grads)
    torch.save(res, out)
    dist.destroy_process_group()


def test_activation_recompute_gives_the_same_gradients(tmp_path):
    res = run_one_rank(_recompute_worker, str(tmp_path))
    (metrics, grads) = res["none"]
    for recompute in ("selective", "full"):
        assert res[recompute][0]["loss/policy"] == metrics["loss/policy"]
        for name, grad in grads.items():
            torch.testing.assert_close(res[recompute][1][name], grad, atol=1e-6, rtol=1e-6, msg=name)
