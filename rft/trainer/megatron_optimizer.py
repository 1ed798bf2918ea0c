"""The optimizer contract of rft/trainer/optimizer.py on CUDA: megatron-core's own machinery.

The trainer uses it on GPUs (run on an H200, see the README's Benchmarks); on CPU it steps
rft/trainer/master_weights.py instead. Every call also runs on CPU ranks over gloo, inside
cpu_compat's `cuda_tensors_on_cpu` (a no-op on GPUs), so the tests hold this path to the CPU
path's updates on every layout: DP with the distributed optimizer, TP, PP, virtual stages.

  - `DistributedDataParallel` gives every parameter an fp32 `main_grad` in contiguous buffers
    (`grad_reduce_in_fp32`) that its backward hooks accumulate into; `finalize_model_grads` sums
    them over DP (reduce-scatter with the distributed optimizer), over TP for q/k norms, and over
    the tied embedding's PP copies.
  - `get_megatron_optimizer` keeps fp32 masters of bf16/fp16 parameters (sharded over DP with
    `trainer.distributed_optimizer`), unscales, skips a step with inf/NaN gradients (found over
    the model-parallel group), clips by the global norm and runs Adam(W) on the masters, with no
    weight decay on biases and norms.

The model is used unwrapped everywhere else (forward, weight sync, checkpoints): DDP's hooks sit
on the parameters themselves, and without overlapped parameter gathering its forward only calls
the module's. Losses are normalised by the whole batch's token count (train_step.py), so the DP
reduction must sum, not average: build_gpt_model sets `calculate_per_token_loss`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from rft.trainer.cpu_compat import cuda_tensors_on_cpu
from rft.trainer.optimizer_contract import FP16_GROWTH_INTERVAL, FP16_INITIAL_SCALE, StepResult, start_adam_state

_WRAPPED: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


def _ddp(model, distributed: bool):
    """One DDP wrapper per model: a later stage's optimizer reuses its grad buffers and hooks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if model not in _WRAPPED:
        config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed)
        _WRAPPED[model] = DistributedDataParallel(model.config, config, model)
    return _WRAPPED[model]


class MegatronOptimizer:
    """Megatron DDP + `get_megatron_optimizer` behind rft's optimizer contract."""

    def __init__(self, model, lr: float, weight_decay: float, betas: tuple[float, float],
                 loss_scale: float | None, distributed: bool):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from rft.trainer.chunks import model_chunks

        with cuda_tensors_on_cpu():
            self.ddp = [_ddp(chunk, distributed) for chunk in model_chunks(model)]  # one per virtual stage
        self.distributed = distributed
        dtype = model.config.params_dtype
        config = OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=betas[0], adam_beta2=betas[1],
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
            # bf16 and fp32: a constant scale of 1, which still makes Megatron skip a non-finite step
            loss_scale=loss_scale if loss_scale is not None else (None if dtype == torch.float16 else 1.0),
            # the CPU path's dynamic scale (optimizer.LossScale): from 2^16, halved at each overflow.
            # Megatron's default start, 2^32, skipped the first 16 steps of an fp16 run on a GPU
            initial_loss_scale=FP16_INITIAL_SCALE, loss_scale_window=FP16_GROWTH_INTERVAL, hysteresis=1,
            use_distributed_optimizer=distributed, clip_grad=0.0)
        with cuda_tensors_on_cpu():
            self.optimizer = get_megatron_optimizer(config, self.ddp)
        for group in self.optimizer.param_groups:  # biases and norms: wd_mult 0, which Megatron-LM's
            group["weight_decay"] = weight_decay * group["wd_mult"]  # scheduler applies; rft's sets lr only

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        with cuda_tensors_on_cpu():
            for ddp in self.ddp:
                ddp.zero_grad_buffer()
            self.optimizer.zero_grad()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(loss)

    def step(self, grad_clip: float) -> StepResult:
        from megatron.core.distributed import finalize_model_grads

        scale = float(self.optimizer.get_loss_scale())
        for opt in self._parts():
            opt.config.clip_grad = grad_clip  # the stage's algorithm.grad_clip
        with cuda_tensors_on_cpu():
            finalize_model_grads(self.ddp)
            stepped, grad_norm, _ = self.optimizer.step()
        return StepResult(bool(stepped), float("nan") if grad_norm is None else float(grad_norm), scale)

    def _parts(self) -> list:
        """The optimizers get_megatron_optimizer chained (one per parameter kind)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def state_dict(self) -> dict[str, Any]:
        with cuda_tensors_on_cpu():
            state = {"optimizer": self.optimizer.state_dict()}
            if self.distributed:  # Adam's moments and the masters live in DP shards: gathered on DP rank 0
                state["param_state"] = [opt.get_parameter_state_dp_zero() for opt in self._parts()]
        return state

    def checkpoint_shards(self, prefix: str, loading: bool = False) -> dict[str, Any]:
        """Megatron's own sharded optimizer state (fp32 masters and Adam's moments in their
        parameters' places; the distributed optimizer's gathered to canonical tensors), so a checkpoint
        loads into another TP x PP x DP layout (rft/trainer/sharded_state.py). Megatron names the
        tensors `optimizer.state.<kind>.<parameter>` itself: `prefix` must be "optimizer."."""
        assert prefix == "optimizer.", f"Megatron's optimizer keys its tensors optimizer.*, not {prefix}*"
        model = {str(v): ddp.module.sharded_state_dict() for v, ddp in enumerate(self.ddp)}
        for part in self._parts():  # Megatron's state_dict needs Adam's step, which torch's Adam
            start_adam_state(part.optimizer)  # creates at the first step only
        with cuda_tensors_on_cpu():
            return {"megatron": self.optimizer.sharded_state_dict(
                model, is_loading=loading, metadata={"distrib_optim_sharding_type": "fully_reshardable",
                                                     "chained_optim_avoid_prefix": True})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # no_grad: with fp32 parameters the masters are views of them, which Megatron's loader
        # copies into in place (autograd refuses that on a view of a leaf that requires grad)
        if "megatron" in state:  # loaded through checkpoint_shards
            with cuda_tensors_on_cpu(), torch.no_grad(), contextlib.ExitStack() as stack:
                for part in self._parts():
                    if hasattr(part, "load_parameter_state_from_fully_reshardable"):  # the distributed optimizer
                        stack.enter_context(_steps_kept_by(part, "load_parameter_state_from_fully_reshardable"))
                self.optimizer.load_state_dict(state["megatron"])
            return
        with cuda_tensors_on_cpu(), torch.no_grad():
            self.optimizer.load_state_dict(state["optimizer"])
            if self.distributed:  # each rank passes its file's part; DP rank 0's holds the gathered state
                for opt, part in zip(self._parts(), state["param_state"]):
                    with _step_set_aside(opt.optimizer):
                        opt.load_parameter_state_from_dp_zero(part)


@contextlib.contextmanager
def _steps_kept_by(part, loader: str) -> Iterator[None]:
    """While the distributed optimizer `part` loads: its parameter-state `loader` runs with Adam's
    steps set aside (see _step_set_aside), inside Megatron's own load_state_dict, which has just
    restored them."""
    original = getattr(part, loader)

    def kept(*args, **kwargs):
        with _step_set_aside(part.optimizer):
            return original(*args, **kwargs)

    setattr(part, loader, kept)
    try:
        yield
    finally:
        delattr(part, loader)  # the class's method again


@contextlib.contextmanager
def _step_set_aside(inner: torch.optim.Optimizer) -> Iterator[None]:
    """Megatron 0.16's DP-rank-0 loader copies every key of the inner optimizer's per-parameter
    state from the checkpoint, which holds only the masters and Adam's moments. torch's Adam (what
    Megatron runs without Apex or Transformer Engine) also keeps its `step` there, which
    load_state_dict has just restored from the param groups: without this, a resume with the
    distributed optimizer failed with KeyError: 'step' (found running this path on CPU ranks).
    It comes back as one tensor per parameter: load_state_dict gives them all the same one, which
    torch's Adam then advanced once per parameter at each step (a resumed run's bias correction
    went wrong)."""
    steps = {param: state.pop("step") for param, state in inner.state.items() if "step" in state}
    try:
        yield
    finally:
        for param, step in steps.items():
            inner.state[param]["step"] = step.detach().clone()
