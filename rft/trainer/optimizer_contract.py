"""What both optimizer implementations (megatron_optimizer.py on CUDA, master_weights.py on CPU)
keep to, and what they share: the `TrainerOptimizer` protocol the training steps call, the
`StepResult` of a step, and fp16's loss scale. Apart from optimizer.py, which picks one of them,
so neither implementation imports the module that imports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

FP16_INITIAL_SCALE = 2.0 ** 16  # torch's GradScaler default (Megatron's 2**32 wastes ~16 halvings)
FP16_GROWTH_INTERVAL = 1000  # steps without an overflow before the scale doubles (Megatron, torch)


@dataclass
class StepResult:
    stepped: bool  # False: a gradient was not finite and the step was skipped
    grad_norm: float  # global norm before clipping (unscaled; inf/NaN when skipped)
    loss_scale: float  # the scale the step's loss was multiplied by


class TrainerOptimizer(Protocol):
    """What the training steps (rft/trainer/train_step.py) need of an optimizer."""

    param_groups: list[dict[str, Any]]  # AdamW's groups: the schedule sets their "lr"

    def zero_grad(self) -> None: ...

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor: ...

    def step(self, grad_clip: float) -> StepResult: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class LossScale:
    """The loss scale of fp16 training: halved after a step with an overflow, doubled after
    `growth_interval` steps without one. Written here because Megatron's DynamicGradScaler
    allocates on CUDA and torch's GradScaler decides per rank, while a skip must be decided over
    every TP/PP shard at once (master_weights.py decides it from the global grad norm)."""

    scale: float
    dynamic: bool
    growth_interval: int = FP16_GROWTH_INTERVAL
    good_steps: int = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.scale, self.good_steps = max(self.scale / 2, 1.0), 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale, self.good_steps = self.scale * 2, 0


def keeps_step_per_group(optimizer: torch.optim.Optimizer) -> bool:
    """Transformer Engine's FusedAdam (megatron-core's Adam wherever TE imports) counts its step in
    the param group and keeps only the states its name_to_dtype_map names per parameter (exp_avg,
    exp_avg_sq, master_param): its state_dict() and load_state_dict() map every per-parameter key
    through that map, so torch's per-parameter "step" raises KeyError there
    (transformer_engine/pytorch/optimizers/fused_adam.py: state_dict -> get_unscaled_state,
    load_state_dict -> set_scaled_state)."""
    return hasattr(optimizer, "name_to_dtype_map")


def start_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Adam's per-parameter state as its first step creates it (zero moments, and step 0 where the
    optimizer counts steps per parameter, as torch's Adam does), on every parameter that has none
    yet: a checkpoint then holds the same entries before and after the first step, and a sharded
    checkpoint has tensors to load into. The maths is unchanged: Adam starts from exactly these."""
    per_parameter_step = not keeps_step_per_group(optimizer)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                state = {"exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                         "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
                optimizer.state[param] = {"step": torch.tensor(0.0), **state} if per_parameter_step else state
