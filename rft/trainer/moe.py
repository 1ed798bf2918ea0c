"""Mixture of experts in the trainer: megatron-core's MoE layers set up for an HF model
(Qwen3-MoE), the weight of their load-balancing loss, and what the routers did.

- `moe_config`: TransformerConfig's MoE keywords for a model's Geometry. Routing as transformers'
  Qwen3-MoE: softmax over the experts' logits, the top k, renormalised (`norm_topk_prob`) or not
  (Megatron's `moe_router_pre_softmax`). The router's logits in fp32, as peers train MoE with RL
  (a bf16 router flips near-tied experts between trainer and sampler). Tokens reach the experts
  by all-to-all, the dispatcher that takes microbatches of different lengths on different
  ranks (the all-gather one needs equal shapes); on CPU too (rft/trainer/cpu_compat.py).
- `set_aux_loss_scale`: Megatron attaches each router's load-balancing loss to its activations,
  times the tokens the router saw (`calculate_per_token_loss`) and a scale read in backward.
  The scale set here, 1 / the step's routed tokens over every microbatch and DP rank, makes
  the gradient that of `trainer.moe_aux_loss_coeff` x the load-balancing loss averaged over
  tokens, however the batch is cut and laid out, as the policy loss is
  (rft/trainer/train_step.py). Under sequence parallelism a TP rank's router sees 1/TP of the
  tokens and its loss covers the part of the sequence it holds; their gradients add up over TP.
- `RouterLoads`: tokens routed to each expert of each MoE layer during a step's training
  forwards, summed over DP and pipeline stages; `scalars` turns them into the logged
  `moe/load_max_over_mean` (per layer, and the worst layer) and the load-balancing loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from rft.trainer.devices import collective_device
from rft.weights.hf_megatron import Geometry


def moe_config(geo: Geometry, aux_loss_coeff: float, expert_parallel: int, transformer_impl: str) -> dict:
    """TransformerConfig keywords for the experts of `geo` ({} for a dense model)."""
    if not geo.num_experts:
        return {}
    allow_moe_without_transformer_engine()
    return dict(
        num_moe_experts=geo.num_experts,
        moe_layer_freq=[int(i in geo.moe_layers) for i in range(geo.num_layers)],
        moe_ffn_hidden_size=geo.moe_ffn_hidden_size,
        moe_router_topk=geo.moe_topk,
        moe_router_pre_softmax=not geo.moe_norm_topk,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=transformer_impl == "transformer_engine",
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=1,
        moe_enable_routing_replay=True,  # idle unless a forward replays routes (rft/trainer/routing_replay.py)
    )


def allow_moe_without_transformer_engine() -> None:
    """megatron-core 0.16's router calls `te_general_gemm` when it is not None, and binds that
    name only where Transformer Engine imports: without TE (every CPU rank, and GPU containers
    without it) the router fails with a NameError. Bound to None here, it takes its torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def forget_replay_registry() -> None:
    """megatron-core keeps every router's RouterReplay in a class-wide list, for setters that act
    on all routers ever built; rft addresses each model's own routers instead. Emptied after a
    build, so models built and dropped (a reference, tests) are not kept alive by it."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()


def routers(model) -> list[torch.nn.Module]:
    """The TopKRouters of this rank's model, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def set_aux_loss_scale(local_tokens: int, dp_group) -> None:
    """Weigh the routers' load-balancing losses by 1 / the step's routed tokens (see the module's
    doc); `local_tokens`: this rank's routers', summed over DP here (a collective)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    total = torch.tensor([float(local_tokens)], device=collective_device())
    if dist.get_world_size(dp_group) > 1:
        dist.all_reduce(total, group=dp_group)
    MoEAuxLossAutoScaler.set_loss_scale(1.0 / total.clamp(min=1.0))


@contextlib.contextmanager
def aux_loss_scale_kept(config) -> Iterator[None]:
    """While open, Megatron's pipeline schedule keeps the scale `set_aux_loss_scale` set: it sets
    the scale to `config.grad_scale_func(1)` before each microbatch's backward (1 without a
    function) and multiplies the last stage's loss by the same function, which rft's losses do not
    want. The function returns the set scale; the loss is divided by it first (`unscaled_loss`)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    if not config.num_moe_experts:
        yield
        return
    kept = MoEAuxLossAutoScaler.main_loss_backward_scale  # None before the first step set it
    scale = torch.ones(1) if kept is None else kept.clone()
    before = config.grad_scale_func
    config.grad_scale_func = lambda t: t * scale.to(t.device)
    try:
        yield
    finally:
        config.grad_scale_func = before


def unscaled_loss(loss: torch.Tensor, config) -> torch.Tensor:
    """The loss a pipeline's last stage hands Megatron's schedule under `aux_loss_scale_kept`."""
    if config.num_moe_experts and config.grad_scale_func is not None:
        return loss / config.grad_scale_func(torch.ones((), device=loss.device))
    return loss


class RouterLoads:
    """Tokens each expert of each MoE layer received in the forwards with gradient (training
    forwards; the no-grad scoring passes are left out), from the routers' routing maps."""

    def __init__(self, model, num_layers: int, num_experts: int):
        self.loads = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.aux = torch.zeros(num_layers, dtype=torch.float64)  # summed load-balancing losses
        self.calls = torch.zeros(num_layers, dtype=torch.float64)
        self.handles = [router.register_forward_hook(self._seen) for router in routers(model)]

    def _seen(self, router, _inputs, outputs) -> None:
        if not (router.training and torch.is_grad_enabled()):  # when Megatron computes the aux loss too
            return
        _probs, routing_map = outputs
        layer = router.layer_number - 1  # global, 1-based
        self.loads[layer] += routing_map.detach().sum(0).to(self.loads)
        self.calls[layer] += 1

    def scalars(self, dp_group, pp_group) -> dict[str, float]:
        """moe/load_max_over_mean/layer<i> (the busiest expert's tokens over the mean, 1 = perfectly
        balanced) for each MoE layer, their worst as moe/load_max_over_mean, and moe/aux_loss
        (Megatron's load-balancing loss without its coefficient, averaged over microbatches, DP
        ranks and MoE layers). A collective over DP and PP; every rank gets the same."""
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        if tracker is not None:  # this rank's sum over its microbatches, per (global) layer
            self.aux += tracker["values"].detach().double().cpu()[: len(self.aux)]
        clear_aux_losses_tracker()
        per_call = torch.where(self.calls > 0, self.aux / self.calls.clamp(min=1), torch.zeros_like(self.aux))
        packed = torch.cat([self.loads, per_call[:, None]], dim=1).to(collective_device(), torch.float64)
        if dist.get_world_size(pp_group) > 1:  # each layer lives on one stage
            dist.all_reduce(packed, group=pp_group)
        if dist.get_world_size(dp_group) > 1:
            dist.all_reduce(packed, group=dp_group)
            packed[:, -1] /= dist.get_world_size(dp_group)
        self.loads.zero_(), self.aux.zero_(), self.calls.zero_()
        loads, aux = packed[:, :-1].cpu(), packed[:, -1].cpu()
        out: dict[str, float] = {}
        active = [layer for layer in range(len(loads)) if loads[layer].sum() > 0]
        for layer in active:
            out[f"moe/load_max_over_mean/layer{layer}"] = float(loads[layer].max() / loads[layer].mean())
        if active:
            out["moe/load_max_over_mean"] = max(out[f"moe/load_max_over_mean/layer{layer}"] for layer in active)
            out["moe/aux_loss"] = float(aux[active].mean())
        return out
