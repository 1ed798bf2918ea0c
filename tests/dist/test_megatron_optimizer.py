"""The CUDA optimizer path (rft/trainer/megatron_optimizer.py: megatron-core DDP and
get_megatron_optimizer, fp32 masters) on one GPU: bf16 training at lr 1e-4 tracks fp32 (the change
of the weights, cosine > 0.99), fp16 with Megatron's dynamic loss scale as well, and the optimizer's
state round-trips through a checkpoint (one more step each, equal weights). Skipped without CUDA:
CI has none; run it where a GPU is lent (the CPU path's twin is tests/unit/test_mixed_precision.py)."""

import io
import os

import pytest
import torch

from tests.unit.one_rank import init_one_rank, run_one_rank
from tests.unit.test_mixed_precision import PROMPTS, RESPONSES

STEPS, LR = 20, 1e-4


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from rft.config import AlgorithmConfig
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.train_step import StepBatch, train_step
    from rft.weights.convert import load_hf_weights

    # the resume check compares bits: CUDA's deterministic kernels where torch has them
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    init_one_rank(port)
    hf = load_hf_state(model_dir)
    batch = StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES)
    algo = AlgorithmConfig(name="sft", lr=LR, grad_clip=1.0)

    def model_in(dtype: str):
        model, geo = build_gpt_model(model_dir, dtype)
        load_hf_weights(model, hf, geo)
        return model

    def flat(model) -> torch.Tensor:
        return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])

    res = {}
    for dtype in ("float32", "bfloat16", "float16"):
        model = model_in(dtype)
        optimizer = build_optimizer(model, lr=LR)
        start = flat(model)
        metrics = [train_step(model, optimizer, batch, algo, 2, 0) for _ in range(STEPS)]
        res[dtype] = {"delta": flat(model) - start, "optimizer": type(optimizer).__name__, "last": metrics[-1],
                      "skipped": sum(m["actor/step_skipped"] for m in metrics)}
        if dtype == "bfloat16":
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=False)
            twin = model_in(dtype)
            twin.load_state_dict(saved["model"])
            twin_opt = build_optimizer(twin, lr=LR)
            twin_opt.load_state_dict(saved["optimizer"])
            for m, o in ((model, optimizer), (twin, twin_opt)):
                train_step(m, o, batch, algo, 2, 0)
            res["resumed"] = (flat(model), flat(twin))
    torch.save(res, out)
    dist.destroy_process_group()


@pytest.mark.gpu
def test_megatron_optimizer_keeps_fp32_masters_on_gpu(tmp_path):
    res = run_one_rank(_worker, str(tmp_path), gpu=True)
    reference = res["float32"]["delta"]
    cosines = {dtype: float(torch.nn.functional.cosine_similarity(res[dtype]["delta"], reference, dim=0))
               for dtype in ("bfloat16", "float16")}
    continued, resumed = res["resumed"]
    differ = resumed != continued
    print(f"megatron optimizer on {torch.cuda.get_device_name()}: cosine to fp32 {cosines}, skipped steps "
          f"{ {dtype: res[dtype]['skipped'] for dtype in cosines} }, resumed step "
          f"differs in {int(differ.sum())} of {differ.numel()} weights (max {float((resumed - continued).abs().max()):.3g})")
    for dtype in ("bfloat16", "float16"):
        assert res[dtype]["optimizer"] == "MegatronOptimizer"
        assert cosines[dtype] > 0.99, dtype
        assert res[dtype]["skipped"] == 0, dtype  # Megatron's default 2^32 start skipped 16 fp16 steps
    assert res["float16"]["last"]["actor/loss_scale"] == 2.0 ** 16  # no overflow, not yet grown
    torch.testing.assert_close(resumed, continued, atol=0, rtol=0)
