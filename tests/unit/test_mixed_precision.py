"""fp32 master weights on the CPU path (rft/trainer/master_weights.py) with real megatron-core on one
gloo rank (spawned, so Megatron's parallel state stays out of this process).

The tiny model is trained by SFT at lr 1e-6 (the GSM8K recipe's) three ways from the same weights:
fp32; bf16 parameters with fp32 masters (rft's optimizer); bf16 parameters updated by AdamW itself
(what rft did before). The masters' change must track the fp32 run's; plain bf16 must visibly not
move (its updates are below a bf16 weight's resolution). fp16 with a dynamic loss scale tracks
fp32 too; a non-finite gradient skips the step and halves the scale; the optimizer's state carries
the masters through a checkpoint."""

import io

import pytest
import torch

from rft.trainer.optimizer import LossScale, LRSchedule
from tests.unit.one_rank import init_one_rank, run_one_rank

STEPS, LR = 30, 1e-6
# The change each run made to the weights, against the fp32 run's, as a relative L2 error. Measured
# (2-core CPU, this test): bf16 masters 0.097 (cosine 0.995), fp16 masters 0.013, plain bf16 0.99 with
# 2.2% of weights moved at all. bf16's 8-bit mantissa makes the forward/backward noisy and AdamW's
# normalised update turns that into sign flips of tiny gradients; fp16 has 11 bits.
BF16_TOLERANCE, FP16_TOLERANCE = 0.15, 0.05
PROMPTS = [[1, 5, 6, 14, 7], [1, 12, 13], [1, 20, 21, 17, 30, 31], [1, 9]]
RESPONSES = [[8, 9, 2], [2, 7, 7, 8], [10, 11, 12, 13, 2], [4, 5]]


class PlainAdamW:
    """What the trainer did before fp32 masters: torch AdamW updating the bf16 parameters."""

    def __init__(self, model, lr: float):
        self.adamw = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99))
        self.param_groups = self.adamw.param_groups

    def zero_grad(self) -> None:
        self.adamw.zero_grad(set_to_none=True)

    def scale_loss(self, loss):
        return loss

    def step(self, grad_clip: float):
        from rft.trainer.optimizer import StepResult

        self.adamw.step()
        return StepResult(True, 0.0, 1.0)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def _worker(rank: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from rft.config import AlgorithmConfig
    from rft.trainer.hf_weights import load_hf_weights
    from rft.trainer.model import build_gpt_model, load_hf_state
    from rft.trainer.optimizer import build_optimizer
    from rft.trainer.step_batch import StepBatch
    from rft.trainer.train_step import train_step

    init_one_rank(port)
    hf = load_hf_state(model_dir)
    batch = StepBatch(prompt_ids=PROMPTS, response_ids=RESPONSES)
    algo = AlgorithmConfig(name="sft", lr=LR, grad_clip=0.0)

    def model_in(dtype: str):
        model, geo = build_gpt_model(model_dir, dtype)
        load_hf_weights(model, hf, geo)
        return model

    res = {}
    for name, dtype, plain in (("fp32", "float32", False), ("bf16_masters", "bfloat16", False),
                               ("bf16_plain", "bfloat16", True), ("fp16_masters", "float16", False)):
        torch.manual_seed(0)
        model = model_in(dtype)
        optimizer = PlainAdamW(model, LR) if plain else build_optimizer(model, lr=LR)
        start = _flat(model.parameters())
        metrics = [train_step(model, optimizer, batch, algo, 2, 0) for _ in range(STEPS)]
        weights = model.parameters() if plain else optimizer.masters.values()
        res[name] = {"start": start, "delta": _flat(weights) - start, "metrics": metrics[-1],
                     "params_delta": _flat(model.parameters()) - start}
        if name == "bf16_masters":  # checkpoint round trip: both take one more step
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf)
            twin = model_in(dtype)
            twin.load_state_dict(saved["model"])
            twin_opt = build_optimizer(twin, lr=LR)
            twin_opt.load_state_dict(saved["optimizer"])
            for m, o in ((model, optimizer), (twin, twin_opt)):
                train_step(m, o, batch, algo, 2, 0)
            res["resumed"] = (_flat(optimizer.masters.values()), _flat(twin_opt.masters.values()))
        if name == "fp16_masters":  # an inf gradient: the step is skipped and the scale halved
            before, scale = _flat(optimizer.masters.values()), optimizer.scaler.scale
            optimizer.zero_grad()
            next(p for p in model.parameters()).main_grad.fill_(float("inf"))
            result = optimizer.step(grad_clip=1.0)
            res["overflow"] = {"stepped": result.stepped, "scale_before": scale, "scale_after": optimizer.scaler.scale,
                               "unchanged": torch.equal(before, _flat(optimizer.masters.values()))}
    torch.save(res, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return run_one_rank(_worker, str(tmp_path_factory.mktemp("mixed_precision")))


def _relative_error(delta: torch.Tensor, reference: torch.Tensor) -> float:
    return float((delta - reference).norm() / reference.norm())


def test_bf16_with_fp32_masters_tracks_fp32_and_plain_bf16_does_not(run):
    reference = run["fp32"]["delta"]
    assert reference.norm() > 0
    # the bf16 run starts from the fp32 weights rounded to bf16: compare the changes each run made
    masters = run["bf16_masters"]["delta"]
    assert _relative_error(masters, reference) < BF16_TOLERANCE
    assert torch.nn.functional.cosine_similarity(masters, reference, dim=0) > 0.99
    plain = run["bf16_plain"]["delta"]
    assert _relative_error(plain, reference) > 0.9, "plain bf16 AdamW should lose lr 1e-6 updates to rounding"
    assert (plain != 0).float().mean() < 0.05  # almost no bf16 weight moved at all (those near 0 did)
    # the masters' bf16 copies (what vLLM gets) have moved where the masters crossed a bf16 step
    assert (run["bf16_masters"]["params_delta"] != 0).any()


def test_fp16_with_dynamic_loss_scale_tracks_fp32(run):
    fp16 = run["fp16_masters"]
    assert _relative_error(fp16["delta"], run["fp32"]["delta"]) < FP16_TOLERANCE
    assert fp16["metrics"]["actor/loss_scale"] == 2.0 ** 16  # no overflow in 30 steps: not yet grown either
    assert fp16["metrics"]["actor/step_skipped"] == 0.0


def test_a_non_finite_gradient_skips_the_step_and_halves_the_scale(run):
    overflow = run["overflow"]
    assert not overflow["stepped"] and overflow["unchanged"]
    assert overflow["scale_after"] == overflow["scale_before"] / 2


def test_masters_survive_a_checkpoint(run):
    continued, resumed = run["resumed"]
    assert torch.equal(continued, resumed)


def test_loss_scale_grows_after_an_interval_without_overflow():
    scale = LossScale(8.0, dynamic=True, growth_interval=3)
    for _ in range(2):
        scale.update(overflow=False)
    assert scale.scale == 8.0
    scale.update(overflow=False)
    assert scale.scale == 16.0
    scale.update(overflow=True)
    assert (scale.scale, scale.good_steps) == (8.0, 0)
    fixed = LossScale(1.0, dynamic=False)
    fixed.update(overflow=True)
    assert fixed.scale == 1.0


@pytest.mark.parametrize("decay, middle", [("constant", 1.0), ("linear", 0.55), ("cosine", 0.55)])
def test_lr_warms_up_then_decays_to_its_floor_at_the_stages_last_step(decay, middle):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.0)
    schedule = LRSchedule(optimizer, lr=2.0, warmup_steps=4, decay=decay, total_steps=24, min_lr_ratio=0.1)
    rates = []
    for _ in range(24):  # the rate each of the stage's 24 optimizer steps takes
        rates.append(optimizer.param_groups[0]["lr"])
        schedule.step()
    assert rates[:4] == [0.5, 1.0, 1.5, 2.0]  # warm-up
    assert rates[13] == pytest.approx(2.0 * middle)  # half way from the end of warm-up (step 4) to the last (24)
    assert rates[-1] == pytest.approx(2.0 if decay == "constant" else 0.2)
    assert all(a >= b for a, b in zip(rates[3:], rates[4:]))  # never rises after warm-up
    resumed = LRSchedule(optimizer, lr=2.0, warmup_steps=4, decay=decay, total_steps=24, min_lr_ratio=0.1)
    resumed.load_state_dict({"steps": 13})
    assert optimizer.param_groups[0]["lr"] == rates[13]  # a resumed stage goes on from its step


def test_biases_and_norms_are_not_decayed_and_a_single_group_state_still_loads():
    """As Megatron's optimizer (the GPU path) groups them; a state saved by rft before that, in one
    param group over the masters in order, resumes with each master's moments."""
    from rft.trainer.master_weights import MasterWeightsOptimizer

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    optimizer = MasterWeightsOptimizer(model, lambda groups: torch.optim.AdamW(groups, lr=0.1, weight_decay=0.5))
    decayed, undecayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.5 and [tuple(p.shape) for p in decayed["params"]] == [(4, 3), (2, 4)]
    assert undecayed["weight_decay"] == 0.0 and [tuple(p.shape) for p in undecayed["params"]] == [(4,)] * 3 + [(2,)]
    before = torch.optim.AdamW(list(optimizer.masters.values()), lr=0.1, weight_decay=0.5)
    for master in optimizer.masters.values():
        master.grad = torch.randn_like(master)
    before.step()
    optimizer.load_state_dict({"optimizer": before.state_dict(), "masters": {}, "loss_scale": 1.0, "good_steps": 0})
    for master in optimizer.masters.values():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizer.torch_optimizer.state[master][key], before.state[master][key])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.5, 0.0]
