"""LoRA (rft/trainer/lora.py) under TP=2, PP=2 and DP=2 on gloo ranks trains as on one rank.

Three GRPO steps with adapters on every target layer: the per-step losses, and the merged weights
a sync would send (HF-named, W + B A), must equal the single-rank run's; the model's own weights
do not move while the adapters train; folding the adapters in (merge) gives the same weights; the
optimizer holds state for the adapters only.
"""

import glob

import pytest
import torch
from dist_models import create_family_model, free_port, init_gloo, spawn

PROMPTS = [[1, 5, 6, 14, 7], [1, 12, 13], [1, 20, 21, 17, 30, 31], [1, 9]]
RESPONSES = [[8, 9, 2], [2, 4], [10, 11, 12, 13, 2], [4, 5]]
REWARDS = [1.0, 0.0, 1.0, 0.0]
STEPS = 3


def _worker(rank: int, world: int, tp: int, pp: int, port: int, model_dir: str, out: str, vpp: int = 1) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rft.config import AlgorithmConfig
    from rft.trainer.hf_weights import export_hf_weights, load_hf_weights
    from rft.trainer.lora import LoRA
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    init_gloo(rank, world, port, tp, pp, vpp)
    model, geo = build_gpt_model(model_dir)
    load_hf_weights(model, load_hf_state(model_dir), geo)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora = LoRA(model, geo, rank=4, alpha=8.0, dropout=0.0,
                targets=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], seed=0).attach()
    optimizer = build_optimizer(lora, lr=1e-2)
    batch = StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES, rewards=REWARDS,
                      old_logprobs=[[-2.0] * len(r) for r in RESPONSES], group_ids=[0, 0, 1, 1])
    algo = AlgorithmConfig(lr=1e-2)
    losses = [train_step(model, optimizer, batch, algo, 1, 0)["loss/policy"] for _ in range(STEPS)]
    result = {
        "losses": losses,
        "base_unchanged": all(torch.equal(p, base[n]) for n, p in model.named_parameters()),
        "optimizer_tensors": sum(t.numel() for s in optimizer.torch_optimizer.state.values() for t in s.values()
                                 if torch.is_tensor(t) and t.dim() > 0),
        "adapter_params": sum(p.numel() for p in lora.parameters()),
        "model_params": sum(p.numel() for p in model.parameters()),
    }
    result["sent"] = {n: t.clone() for n, t in export_hf_weights(model, geo, lora.delta_weights())}
    lora.merge()
    result["merged"] = {n: t.clone() for n, t in export_hf_weights(model, geo)}
    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save(result, f"{out}.stage{ps.get_pipeline_model_parallel_rank()}")
    dist.destroy_process_group()


def _run(world: int, tp: int, pp: int, model_dir: str, out: str, vpp: int = 1) -> dict:
    spawn(_worker, world, tp, pp, free_port(), model_dir, out, vpp)
    stages = [torch.load(f) for f in sorted(glob.glob(out + ".stage*"))]
    last = stages[-1]  # the last stage computes the losses
    return {"losses": last["losses"], "base_unchanged": all(s["base_unchanged"] for s in stages),
            "sent": {k: v for s in stages for k, v in s["sent"].items()},
            "merged": {k: v for s in stages for k, v in s["merged"].items()},
            "optimizer_tensors": stages[0]["optimizer_tensors"], "adapter_params": stages[0]["adapter_params"],
            "model_params": stages[0]["model_params"]}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {f: create_family_model(f, str(root / f)) for f in ("qwen2", "llama")}


@pytest.fixture(scope="module")
def one_rank(models, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("one_rank")
    return {f: _run(1, 1, 1, path, str(root / f"{f}.pt")) for f, path in models.items()}


def test_only_adapters_train_and_merging_gives_what_was_sent(one_rank):
    one = one_rank["qwen2"]
    assert one["base_unchanged"]
    assert one["losses"][-1] != one["losses"][0]  # the adapters moved the policy
    # AdamW's two moments, for adapter parameters only (the model is ~100x bigger)
    assert one["optimizer_tensors"] == 2 * one["adapter_params"] < one["model_params"] / 10
    assert one["sent"].keys() == one["merged"].keys()
    for name, tensor in one["sent"].items():
        torch.testing.assert_close(one["merged"][name], tensor, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("family, world, tp, pp, vpp", [("qwen2", 2, 2, 1, 1), ("llama", 2, 2, 1, 1),
                                                        ("qwen2", 2, 1, 2, 1), ("qwen2", 2, 1, 1, 1),
                                                        ("llama", 2, 1, 2, 2)],
                         ids=["qwen2-tp2", "llama-tp2", "qwen2-pp2", "qwen2-dp2", "llama-pp2-vpp2"])
def test_lora_under_parallelism_equals_one_rank(models, one_rank, tmp_path, family, world, tp, pp, vpp):
    one = one_rank[family]
    par = _run(world, tp, pp, models[family], str(tmp_path / "par.pt"), vpp)
    assert par["base_unchanged"]
    assert par["losses"] == pytest.approx(one["losses"], rel=1e-4, abs=1e-6)
    assert par["sent"].keys() == one["sent"].keys()
    for name, tensor in one["sent"].items():
        torch.testing.assert_close(par["sent"][name], tensor, atol=1e-5, rtol=1e-4, msg=name)
