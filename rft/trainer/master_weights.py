"""The optimizer contract of rft/trainer/optimizer.py in plain torch, for CPU (gloo) ranks.

The CPU trainer's optimizer, on laptops and in CI (Megatron's DDP and optimizer run on CPU ranks
only inside cpu_compat's redirects, which the tests use to hold the two paths to the same
updates: tests/dist/test_megatron_optimizer_layouts.py). It does what Megatron's does on a GPU,
step for step:
  - fp32 gradient accumulation: a hook adds each bf16/fp16 gradient into the parameter's fp32
    `main_grad` as soon as backward has produced it (Megatron's DDP keeps the same attribute), so
    the sum over microbatches is taken in fp32;
  - gradients summed over DP replicas, over TP for q/k norms (replicated weights of which each TP
    rank sees only its own heads), and over the two copies of a tied embedding under PP;
  - unscale, a global norm over TP shards and PP stages, a skipped step when it is not finite
    (decided alike on every rank, since the norm is global), clipping;
  - the optimizer's step on fp32 master copies, then copied into the parameters; as Megatron's,
    without weight decay on biases and other one-dimensional parameters (norms).
fp32 parameters are their own masters: no copies, no hooks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from rft.trainer.devices import collective_device
from rft.trainer.optimizer_contract import LossScale, StepResult, start_adam_state
from rft.weights.hf_megatron import expert_index, tp_split_dim


def _accumulate_in_fp32(param: torch.Tensor) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


class MasterWeightsOptimizer:
    """A torch optimizer (AdamW in runs; tests also use SGD) on fp32 masters of `model`'s
    trainable parameters (see the module docstring). `make` builds it over the masters' two param
    groups: those decayed, and biases and norms (weight_decay 0)."""

    def __init__(self, model, make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
                 scaler: LossScale | None = None):
        self.model, self.scaler = model, scaler or LossScale(1.0, dynamic=False)
        self.params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.masters: dict[str, torch.Tensor] = {}
        self.copies: set[str] = set()  # parameters whose master is a copy (not fp32 themselves)
        for name, p in self.params:
            if p.dtype == torch.float32:
                self.masters[name] = p
                continue
            # a new stage's optimizer starts its masters from the parameters (AdamW starts afresh too)
            self.masters[name] = torch.nn.Parameter(p.detach().float().clone())
            self.copies.add(name)
            if not hasattr(p, "main_grad"):  # the model outlives stages: one hook per parameter
                p.register_post_accumulate_grad_hook(_accumulate_in_fp32)
            p.main_grad = torch.zeros_like(self.masters[name])
        self.undecayed = {name for name, p in self.params if p.dim() == 1 or name.endswith(".bias")}
        self.torch_optimizer = make([
            {"params": [m for name, m in self.masters.items() if name not in self.undecayed]},
            {"params": [m for name, m in self.masters.items() if name in self.undecayed], "weight_decay": 0.0}])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.torch_optimizer.param_groups

    def zero_grad(self) -> None:
        for _, p in self.params:
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler.scale != 1.0 else loss

    def _grads(self) -> dict[str, torch.Tensor]:
        """Each parameter's accumulated fp32 gradient (zeros where no loss reached it, so every
        rank takes part in the same sums)."""
        grads = {}
        for name, p in self.params:
            if not hasattr(p, "main_grad") and p.grad is None:  # no rows on this DP rank: it sums zeros
                p.grad = torch.zeros_like(p)
            grads[name] = p.main_grad if hasattr(p, "main_grad") else p.grad
        return grads

    @torch.no_grad()
    def step(self, grad_clip: float) -> StepResult:
        scale = self.scaler.scale
        grads = self._grads()
        sync_grads(self.model, grads)
        if scale != 1.0:
            for g in grads.values():
                g.div_(scale)
        norm = global_grad_norm(self.model, grads)
        if not math.isfinite(norm):  # the same norm on every rank: all skip together
            self.scaler.update(overflow=True)
            return StepResult(False, norm, scale)
        if grad_clip > 0 and norm > grad_clip:
            for g in grads.values():
                g.mul_(grad_clip / (norm + 1e-6))
        for name, master in self.masters.items():
            master.grad = grads.get(name)
        self.torch_optimizer.step()
        for name, p in self.params:
            if name in self.copies:
                p.copy_(self.masters[name])
        self.scaler.update(overflow=False)
        return StepResult(True, norm, scale)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.torch_optimizer.state_dict(),
                "masters": {name: self.masters[name].detach().clone() for name in sorted(self.copies)},
                "loss_scale": self.scaler.scale, "good_steps": self.scaler.good_steps}

    def checkpoint_shards(self, prefix: str, loading: bool = False) -> dict[str, Any] | None:
        """`state_dict()` with the masters and AdamW's moments in their parameters' places in the
        whole model (rft/trainer/sharded_state.py), so it loads into another TP x PP layout; AdamW's
        step, the same for every parameter, once. None for LoRA adapters and other optimizers."""
        from rft.trainer.sharded_state import in_place_of, local_only, sharded_parameters

        if not isinstance(self.torch_optimizer, torch.optim.AdamW) or not hasattr(self.model, "config"):
            return None
        start_adam_state(self.torch_optimizer)
        place = sharded_parameters(self.model)
        order = [name for name in self.masters if name not in self.undecayed] + \
                [name for name in self.masters if name in self.undecayed]  # the optimizer's parameter ids
        state = self.state_dict()
        optimizer = state["optimizer"]
        steps = {float(s["step"]) for s in optimizer["state"].values()}
        assert len(steps) <= 1, f"AdamW's parameters took different numbers of steps: {sorted(steps)}"
        optimizer["step"] = steps.pop() if steps else 0.0
        optimizer["state"] = {i: {kind: in_place_of(place[order[i]], s[kind], f"{prefix}{kind}")
                                  for kind in ("exp_avg", "exp_avg_sq")} for i, s in optimizer["state"].items()}
        for group in optimizer["param_groups"]:
            group["params"] = local_only(group["params"])  # this rank's parameter ids, whatever the layout
        state["masters"] = {name: in_place_of(place[name], master, f"{prefix}master")
                            for name, master in state["masters"].items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, saved in state["masters"].items():
                self.masters[name].copy_(saved)  # finer than the parameters the model file holds
        saved = state["optimizer"]
        if "step" in saved:  # loaded from checkpoint_shards: AdamW's per-parameter step again
            step = saved.pop("step")
            saved["state"] = {i: {**s, "step": torch.tensor(step)} for i, s in saved["state"].items()}
        self.torch_optimizer.load_state_dict(saved if len(saved["param_groups"]) == 2 else self._regrouped(saved))
        self.scaler.scale, self.scaler.good_steps = state["loss_scale"], state["good_steps"]

    def _regrouped(self, saved: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state saved in one param group (rft before biases and norms went
        undecayed), its parameters the masters in order, in today's two groups."""
        names = list(self.masters)
        groups = [[n for n in names if n not in self.undecayed], [n for n in names if n in self.undecayed]]
        index = {name: i for i, name in enumerate(groups[0] + groups[1])}
        group = saved["param_groups"][0]
        return {"state": {index[names[i]]: s for i, s in saved["state"].items()},
                "param_groups": [{**group, "params": [index[n] for n in groups[0]]},
                                 {**group, "weight_decay": 0.0, "params": [index[n] for n in groups[1]]}]}


def sync_grads(model, grads: dict[str, torch.Tensor]) -> None:
    """Sum gradients over DP replicas (an expert's: over the ranks holding the same experts); over
    TP for q/k norms (each TP rank saw its own heads) and, under sequence parallelism, for every
    parameter Megatron marks `sequence_parallel` (norms, routers: each TP rank saw its slice of the
    sequence); and over the two copies of a tied embedding under PP (in place)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        params = dict(model.named_parameters())
        for name, g in grads.items():
            if name.endswith(("q_layernorm.weight", "k_layernorm.weight")) or \
                    getattr(params.get(name), "sequence_parallel", False):
                dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
    replicas = {False: ps.get_data_parallel_group(), True: ps.get_expert_data_parallel_group()}
    for name, g in grads.items():  # an expert's replicas: the ranks outside its EP group (TP ranks too)
        group = replicas[expert_index(name) is not None]
        if dist.get_world_size(group) > 1:
            dist.all_reduce(g, group=group)
    if ps.get_pipeline_model_parallel_world_size() > 1 and _tied(model) and ps.is_rank_in_embedding_group():
        (tied,) = [n for n in grads if n.endswith(("embedding.word_embeddings.weight", "output_layer.weight"))]
        dist.all_reduce(grads[tied], group=ps.get_embedding_group())


def global_grad_norm(model, grads: dict[str, torch.Tensor]) -> float:
    """L2 norm of the whole model's gradient over TP shards, PP stages and the experts of every EP
    rank (replicated parameters and the last stage's mirror of a tied embedding counted once)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    mirror = pp > 1 and _tied(model) and not model.pre_process
    split_dim = getattr(model, "tp_split_dim", tp_split_dim)  # LoRA adapters say how theirs are split
    total, experts = torch.zeros(1, device=collective_device()), torch.zeros(1, device=collective_device())
    for name, g in _counted(grads, mirror):
        sq = g.float().pow(2).sum().to(total.device)
        if expert_index(name) is not None:  # whole on its rank, one EP rank's share of the experts
            experts += sq
        else:
            total += sq if (split_dim(name) is not None or tp == 1) else sq / tp
    if tp > 1:
        dist.all_reduce(total, group=ps.get_tensor_model_parallel_group())
    if ps.get_expert_model_parallel_world_size() > 1:
        dist.all_reduce(experts, group=ps.get_expert_model_parallel_group())
    total += experts
    if pp > 1:
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return float(total.sqrt())


def _tied(model) -> bool:
    """A GPTModel sharing its embedding with the output layer (LoRA adapters share nothing)."""
    return getattr(model, "share_embeddings_and_output_weights", False)


def _counted(grads: dict[str, torch.Tensor], mirror: bool) -> Iterable[tuple[str, torch.Tensor]]:
    return ((n, g) for n, g in grads.items() if not (mirror and n.endswith("output_layer.weight")))
