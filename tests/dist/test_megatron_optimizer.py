"""megatron-core's DDP and optimizer behind rft's contract (rft/trainer/megatron_optimizer.py, the
trainer's GPU optimizer), with and without the distributed optimizer: bf16 training at lr 1e-4
tracks fp32 (the change of the weights, cosine > 0.99), fp16 with Megatron's dynamic loss scale as
well, and the optimizer's state round-trips through a checkpoint (one more step each, equal weights).
On one CPU gloo rank in CI (cpu_compat lets Megatron's optimizer run there), on one GPU where
`-m gpu` runs it (tools/gpu_truth.sh). The CPU trainer's own optimizer is tested alike in
tests/unit/test_mixed_precision.py; tests/dist/test_megatron_optimizer_layouts.py holds the two
to the same updates on every parallel layout."""

import io
import os

import pytest
import torch

from tests.unit.one_rank import init_one_rank, run_one_rank
from tests.unit.test_mixed_precision import PROMPTS, RESPONSES

STEPS, LR = 20, 1e-4


def _worker(rank: int, port: int, model_dir: str, out: str, distributed: bool) -> None:
    import torch.distributed as dist

    from rft.config import AlgorithmConfig
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.megatron_optimizer import MegatronOptimizer
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

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
        optimizer = MegatronOptimizer(model, LR, 0.0, (0.9, 0.99), None, distributed)
        start = flat(model)
        metrics = [train_step(model, optimizer, batch, algo, 2, 0) for _ in range(STEPS)]
        res[dtype] = {"delta": flat(model) - start, "optimizer": type(optimizer).__name__, "last": metrics[-1],
                      "skipped": sum(m["actor/step_skipped"] for m in metrics)}
        buf = io.BytesIO()  # a checkpoint, then one more step from it and without it
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        twin = model_in(dtype)
        twin.load_state_dict(saved["model"])
        twin_opt = MegatronOptimizer(twin, LR, 0.0, (0.9, 0.99), None, distributed)
        twin_opt.load_state_dict(saved["optimizer"])
        for m, o in ((model, optimizer), (twin, twin_opt)):
            train_step(m, o, batch, algo, 2, 0)
        res[dtype]["resumed"] = (flat(model), flat(twin))
    torch.save(res, out)
    dist.destroy_process_group()


@pytest.mark.parametrize("distributed", [False, True], ids=["optimizer", "distributed_optimizer"])
def test_megatron_optimizer_keeps_fp32_masters(tmp_path, distributed):
    on_gpu = torch.cuda.is_available()  # CI: one CPU gloo rank
    res = run_one_rank(_worker, str(tmp_path), distributed, gpu=on_gpu)
    reference = res["float32"]["delta"]
    cosines = {dtype: float(torch.nn.functional.cosine_similarity(res[dtype]["delta"], reference, dim=0))
               for dtype in ("bfloat16", "float16")}
    print(f"megatron optimizer (distributed={distributed}) on {torch.cuda.get_device_name() if on_gpu else 'cpu'}: "
          f"cosine to fp32 {cosines}, skipped steps { {dtype: res[dtype]['skipped'] for dtype in cosines} }")
    for dtype in ("bfloat16", "float16"):
        assert res[dtype]["optimizer"] == "MegatronOptimizer"
        assert cosines[dtype] > 0.99, dtype
        assert res[dtype]["skipped"] == 0, dtype  # Megatron's default 2^32 start skipped 16 fp16 steps
    assert res["float16"]["last"]["actor/loss_scale"] == 2.0 ** 16  # no overflow, not yet grown
    for dtype in ("float32", "bfloat16", "float16"):  # the step after a resume is the step without one
        continued, resumed = res[dtype]["resumed"]
        torch.testing.assert_close(resumed, continued, atol=0, rtol=0, msg=dtype)
