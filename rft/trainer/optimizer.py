"""The trainer's optimizer: AdamW on fp32 master weights, whatever dtype the model computes in.

One optimizer step, on every device:

    zero the gradients
    forward/backward every microbatch on loss * loss_scale   # gradients accumulate in fp32
    sum gradients over DP replicas (and tied or replicated copies)
    unscale; if any gradient is inf/NaN on any rank: skip the step, lower the scale (fp16)
    clip by the global norm; AdamW on the fp32 masters; copy them into the bf16/fp16 parameters

With `model.dtype=bfloat16` an update of lr 1e-6 is far below a bf16 weight's resolution (about
1/256 of its size) and rounds away if AdamW updates the parameters themselves; the fp32 masters
keep it. fp16 also needs the loss scale, or small gradients underflow.

Two implementations of one contract (`TrainerOptimizer`): on CUDA megatron-core's own DDP and
`get_megatron_optimizer` (distributed optimizer optional, rft/trainer/megatron_optimizer.py); on
CPU, where those assert CUDA tensors, the same steps in plain torch (rft/trainer/master_weights.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rft.config import LR_DECAYS
from rft.trainer.optimizer_contract import FP16_INITIAL_SCALE, LossScale, StepResult, TrainerOptimizer  # noqa: F401  (re-exported)


def build_optimizer(model, lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.99),
                    loss_scale: float | None = None, distributed: bool = False) -> TrainerOptimizer:
    """AdamW over `model`'s trainable parameters (a GPTModel, or a stage's LoRA adapters) with fp32
    masters. `loss_scale`: a constant scale, or None for dynamic scaling with fp16 parameters (1
    otherwise). `distributed`: shard the masters and AdamW's state over DP ranks (Megatron's
    distributed optimizer; CUDA only, ignored on CPU)."""
    from rft.trainer.lora import LoRA

    dtype = next(model.parameters()).dtype
    # LoRA adapters (fp32, outside the model's Megatron DDP buffers, a few MB) take the plain path everywhere
    if torch.cuda.is_available() and not isinstance(model, LoRA):
        from rft.trainer.megatron_optimizer import MegatronOptimizer

        return MegatronOptimizer(model, lr, weight_decay, betas, loss_scale, distributed)
    from rft.trainer.master_weights import MasterWeightsOptimizer

    if loss_scale is not None:
        scaler = LossScale(loss_scale, dynamic=False)
    else:
        scaler = LossScale(FP16_INITIAL_SCALE if dtype == torch.float16 else 1.0, dynamic=dtype == torch.float16)
    return MasterWeightsOptimizer(model, lambda masters: torch.optim.AdamW(masters, lr=lr, weight_decay=weight_decay,
                                                                           betas=betas), scaler)


class LRSchedule:
    """Linear learning-rate warm-up to `lr` over `warmup_steps` trainer steps, then `decay` from `lr`
    to `min_lr_ratio * lr` at the stage's last step (`total_steps`): constant, linear or cosine.
    Works on either optimizer (torch's LR schedulers accept only torch optimizers)."""

    def __init__(self, optimizer: TrainerOptimizer, lr: float, warmup_steps: int, decay: str = "constant",
                 total_steps: int = 0, min_lr_ratio: float = 0.0):
        assert decay in LR_DECAYS, decay
        self.optimizer, self.lr, self.warmup = optimizer, lr, max(warmup_steps, 1)
        self.decay, self.total, self.min_ratio = decay, total_steps, min_lr_ratio
        self.steps = 0
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_last_lr()[0]

    def get_last_lr(self) -> list[float]:
        step = self.steps + 1  # the rate of the coming trainer step (all its optimizer steps)
        if step < self.warmup or self.decay == "constant":
            return [self.lr * min(1.0, step / self.warmup)]
        done = min(1.0, (step - self.warmup) / max(self.total - self.warmup, 1))
        factor = 1.0 - done if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
        return [self.lr * (self.min_ratio + (1.0 - self.min_ratio) * factor)]

    def step(self) -> None:
        self.steps += 1
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]
        self._apply()
