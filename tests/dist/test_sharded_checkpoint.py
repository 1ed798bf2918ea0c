"""Megatron's optimizer (the trainer's GPU optimizer, run on CPU gloo ranks as in
tests/dist/test_megatron_optimizer.py) saved layout-free through its own sharded state dict and
loaded into another layout: the step after the load moves the weights as the step after the save
does in the saving layout. The CPU trainer's optimizer is held to the same by
tests/e2e/test_reshard.py through the launcher."""

import os

import pytest
import torch
from dist_models import create_family_model, free_port, init_gloo, spawn

from rft.trainer.step_batch import StepBatch
from tests.unit.test_mixed_precision import PROMPTS, RESPONSES


def _worker(rank: int, world: int, tp: int, pp: int, port: int, model_dir: str, ckpt: str, out: str,
            phase: str, distributed: bool, rows: StepBatch) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from rft.config import AlgorithmConfig
    from rft.trainer.hf_weights import export_hf_weights, load_hf_weights
    from rft.trainer.megatron_optimizer import MegatronOptimizer
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.sharded_state import ShardedModel
    from rft.trainer.train_step import train_step

    init_gloo(rank, world, port, tp, pp)
    model, geo = build_gpt_model(model_dir, "bfloat16")  # fp32 masters of bf16 weights: both must move
    load_hf_weights(model, load_hf_state(model_dir), geo)
    optimizer = MegatronOptimizer(model, 1e-3, 0.0, (0.9, 0.99), None, distributed)
    batch = rows
    algo = AlgorithmConfig(name="sft", lr=1e-3, grad_clip=1.0)

    def shards(loading: bool) -> dict:
        return {"model": ShardedModel(model).checkpoint_shards("model.", loading),
                "optimizer": optimizer.checkpoint_shards("optimizer.", loading)}

    if phase == "save":
        for _ in range(3):
            train_step(model, optimizer, batch, algo, 2, 0)
        if rank == 0:
            os.makedirs(ckpt)
        dist.barrier()
        dist_checkpointing.save(shards(False), ckpt)
    else:
        loaded = dist_checkpointing.load(shards(True), ckpt)
        ShardedModel(model).load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
    before = {n: t.float().clone() for n, t in export_hf_weights(model, geo)}
    train_step(model, optimizer, batch, algo, 2, 0)  # the step after the checkpoint
    after = {n: t.float().clone() for n, t in export_hf_weights(model, geo)}
    torch.save({"before": before, "after": after}, f"{out}.rank{rank}.pt")
    dist.destroy_process_group()


def _run(phase: str, layout: tuple[int, int, int], model_dir: str, ckpt: str, out: str, distributed: bool,
         rows: StepBatch) -> dict:
    tp, pp, dp = layout
    spawn(_worker, tp * pp * dp, tp, pp, free_port(), model_dir, ckpt, out, phase, distributed, rows)
    merged: dict = {"before": {}, "after": {}}
    for rank in range(tp * pp * dp):
        part = torch.load(f"{out}.rank{rank}.pt")
        for key in merged:
            merged[key].update(part[key])
    return merged


@pytest.mark.parametrize("model, distributed, saved, loaded", [
    ("qwen2", False, (2, 1, 1), (1, 2, 1)),  # TP=2 -> PP=2
    ("qwen2", True, (1, 1, 2), (2, 1, 1)),  # the distributed optimizer's DP shards -> TP=2
    ("tiny Qwen2.5-VL", False, (2, 1, 1), (1, 2, 1)),  # the vision tower, whole on each TP rank -> stage 1's
], ids=["tp2_to_pp2", "distributed_dp2_to_tp2", "vision_language_tp2_to_pp2"])
def test_megatron_optimizer_resumes_in_another_layout(tmp_path, model, distributed, saved, loaded):
    if model == "qwen2":
        model_dir = create_family_model("qwen2", str(tmp_path / "hf"))
        rows = StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES)
    else:  # image rows: the step after the load trains the vision tower too
        from rft.config import TinyModelConfig
        from rft.models.tiny import create_tiny_model
        from tests.unit.test_vision_language import _encoded, _sequences

        model_dir = create_tiny_model(TinyModelConfig(vision=True), str(tmp_path / "hf"), seed=0)
        prompts, responses, _, pictures = _sequences(model_dir, with_pictures=True)
        rows = StepBatch(prompt_ids=prompts, response_ids=responses, images=_encoded(pictures))
    ckpt = str(tmp_path / "ckpt")
    reference = _run("save", saved, model_dir, ckpt, str(tmp_path / "saved"), distributed, rows)
    resumed = _run("load", loaded, model_dir, ckpt, str(tmp_path / "loaded"), distributed, rows)
    assert reference["before"].keys() == resumed["before"].keys()
    if model != "qwen2":
        assert any(name.startswith("visual.") for name in reference["before"])
    for name, want in reference["before"].items():
        assert torch.equal(resumed["before"][name], want), f"{name} loaded other weights"
    moved = 0.0
    for name, want in reference["after"].items():
        step = want - reference["before"][name]
        moved = max(moved, step.abs().max().item())
        # bf16 weights from fp32 masters: the same update to a bf16 rounding of the weight
        torch.testing.assert_close(resumed["after"][name], want, rtol=1e-2, atol=1e-3, msg=name)
        if step.dim() == 2:  # and the update itself (Adam's moments resumed, not fresh): matrices, whose
            # bf16 rounding averages out (a 32-element bias measured through bf16 is mostly rounding)
            cosine = torch.nn.functional.cosine_similarity(resumed["after"][name].flatten() -
                                                           resumed["before"][name].flatten(), step.flatten(), dim=0)
            assert cosine > 0.99, (name, float(cosine))
    assert moved > 1e-3
