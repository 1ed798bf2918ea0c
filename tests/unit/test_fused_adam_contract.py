"""Contract test: rft's optimizer state against Transformer Engine's FusedAdam rule, which CPU CI
cannot import (TE is GPU-only) but megatron-core uses wherever TE imports. FusedAdam counts its step
in the param group and maps every per-parameter state key through `name_to_dtype_map` (exp_avg,
exp_avg_sq, master_param) in state_dict() and load_state_dict()
(transformer_engine/pytorch/optimizers/fused_adam.py: state_dict -> get_unscaled_state,
load_state_dict -> set_scaled_state). The stand-in below follows that rule; rft's
`start_adam_state`, which makes a checkpoint's optimizer entries before the first step and builds the
template a resume loads into, put torch's per-parameter "step" there, and every resume raised
KeyError: 'step'. The real check runs on a GPU with TE (tests marked gpu, `python -m rft.doctor`)."""

import io

import pytest
import torch

from rft.trainer.optimizer_contract import start_adam_state


class FusedAdamRule(torch.optim.Optimizer):
    """Adam with TE FusedAdam's state layout: the step per group, per-parameter keys from
    name_to_dtype_map only, checked by state_dict and load_state_dict as TE's do."""

    def __init__(self, params, lr: float = 0.1, betas=(0.9, 0.99), eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})
        self.name_to_dtype_map = {"exp_avg": torch.float32, "exp_avg_sq": torch.float32, "master_param": torch.float32}

    def _check(self, state: dict) -> None:
        for param_state in state.values():
            for name in param_state:
                self.name_to_dtype_map[name]  # TE: KeyError for any other key

    def state_dict(self):
        saved = super().state_dict()
        self._check(saved["state"])
        return saved

    def load_state_dict(self, state_dict):
        self._check(state_dict["state"])
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (beta1, beta2), t = group["betas"], group["step"]
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** t))


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return model, FusedAdamRule(model.parameters())


def _train(model, optimizer, steps: int) -> None:
    for i in range(steps):
        optimizer.zero_grad()
        model(torch.full((2, 4), float(i + 1))).pow(2).sum().backward()
        optimizer.step()


@pytest.mark.parametrize("steps_before_save", [0, 2])
def test_a_checkpoint_saves_and_resumes_before_and_after_the_first_step(steps_before_save):
    model, optimizer = _model_and_optimizer()
    _train(model, optimizer, steps_before_save)
    start_adam_state(optimizer)  # as rft does before a checkpoint's state dict is built
    checkpoint = io.BytesIO()  # as on disk: nothing shared with the running optimizer
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint)
    checkpoint.seek(0)
    saved_model, saved = torch.load(checkpoint).values()
    assert set(saved["state"][0]) == {"exp_avg", "exp_avg_sq"}
    assert saved["param_groups"][0].get("step", 0) == steps_before_save

    resumed_model, resumed = _model_and_optimizer(seed=1)
    resumed_model.load_state_dict(saved_model)
    start_adam_state(resumed)  # the template a resume loads into: a fresh optimizer's, whose
    resumed.state_dict()  # state_dict megatron-core's sharded_state_dict(is_loading=True) reads
    resumed.load_state_dict(saved)
    _train(model, optimizer, 2)
    _train(resumed_model, resumed, 2)
    for name, value in model.state_dict().items():
        assert torch.equal(value, resumed_model.state_dict()[name]), name  # the same run, resumed


def test_torch_adam_still_gets_its_step_at_zero():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    start_adam_state(optimizer)
    assert set(optimizer.state[model.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    assert float(optimizer.state[model.weight]["step"]) == 0.0
