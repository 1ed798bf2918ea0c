"""Transformer Engine's layers (trainer.transformer_impl=transformer_engine) against the local
spec's on one GPU: the same HF weights give the same logprobs, padded and packed (TE's THD
attention), the same loss and gradients (TE's fused norms named as the local norms), and the
export gives back the HF weights bit for bit; in bf16, Megatron's optimizer trains the TE model.

GPU and `transformer_engine` only: skipped elsewhere, CI included (run by tools/gpu_truth.sh). Its
CPU twin, the naming alone, is tests/unit/test_layer_spec.py."""

import pytest
import torch

from tests.unit.one_rank import init_one_rank, run_one_rank
from tests.unit.test_packing import BUDGET, GROUPS, MASKS, PROMPTS, RESPONSES, REWARDS, CapturingOptimizer


def _transformer_engine_missing() -> str | None:
    from rft.trainer.layer_spec import transformer_engine_missing

    return transformer_engine_missing()


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from rft.config import AlgorithmConfig
    from rft.trainer.forward import forward_logprobs, pack_microbatch
    from rft.trainer.hf_weights import export_hf_weights, load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step
    from rft.weights.hf_megatron import local_spec_name

    init_one_rank(port)
    hf, res, gpu = load_hf_state(model_dir), {}, torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(0)
    batch = StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES, response_mask=MASKS, rewards=REWARDS,
                      old_logprobs=[(-1.0 - torch.rand(len(r), generator=gen)).tolist() for r in RESPONSES],
                      group_ids=GROUPS)
    algo = AlgorithmConfig(advantage="grpo", policy_loss="ppo", entropy_coef=0.01)
    for impl in ("local", "transformer_engine"):
        model, geo = build_gpt_model(model_dir, transformer_impl=impl)
        load_hf_weights(model, hf, geo)
        out_impl = res[impl] = {"layers": type(model.decoder.layers[0].self_attention.linear_qkv).__name__}
        with torch.no_grad():
            for packed in (False, True):
                mb = pack_microbatch(PROMPTS, RESPONSES, 0, gpu, MASKS, packed=packed)
                out_impl[f"logprobs_{packed}"] = forward_logprobs(model, mb)[0].cpu()
        for budget in (0, BUDGET):
            optimizer = CapturingOptimizer(model)
            metrics = train_step(model, optimizer, batch, algo, 2, 0, max_tokens_per_microbatch=budget)
            out_impl[f"step_{budget}"] = (metrics["loss/policy"],
                                          {local_spec_name(n): g.cpu() for n, g in optimizer.grads.items()})
        out_impl["export"] = {n: t.cpu().clone() for n, t in export_hf_weights(model, geo)}
    model, geo = build_gpt_model(model_dir, "bfloat16", transformer_impl="transformer_engine")
    load_hf_weights(model, hf, geo)
    optimizer = build_optimizer(model, lr=1e-4)
    sft = StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES)
    res["bf16"] = {"optimizer": type(optimizer).__name__,
                   "losses": [train_step(model, optimizer, sft, AlgorithmConfig(name="sft", lr=1e-4), 2, 0,
                                         max_tokens_per_microbatch=BUDGET)["loss/policy"] for _ in range(10)]}
    torch.save(res, out)
    dist.destroy_process_group()


@pytest.mark.gpu
def test_transformer_engine_layers_compute_what_the_local_layers_do(tmp_path):
    missing = _transformer_engine_missing()
    if missing:
        pytest.skip(missing)
    res = run_one_rank(_worker, str(tmp_path), gpu=True)
    local, te = res["local"], res["transformer_engine"]
    assert te["layers"] == "TELayerNormColumnParallelLinear" and local["layers"] == "ColumnParallelLinear"
    for packed in (False, True):
        torch.testing.assert_close(te[f"logprobs_{packed}"], local[f"logprobs_{packed}"], atol=1e-4, rtol=1e-4)
    for budget in (0, BUDGET):
        (te_loss, te_grads), (loss, grads) = te[f"step_{budget}"], local[f"step_{budget}"]
        assert te_loss == pytest.approx(loss, abs=1e-5)
        assert sorted(te_grads) == sorted(grads)
        for name, grad in grads.items():
            torch.testing.assert_close(te_grads[name], grad, atol=1e-4, rtol=1e-3, msg=name)
    for name, tensor in local["export"].items():
        assert torch.equal(te["export"][name], tensor), name
    losses = res["bf16"]["losses"]
    print(f"transformer engine on {torch.cuda.get_device_name()}: bf16 SFT losses {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert res["bf16"]["optimizer"] == "MegatronOptimizer" and losses[-1] < 0.9 * losses[0]
