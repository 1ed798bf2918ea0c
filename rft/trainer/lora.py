"""LoRA adapters on Megatron's tensor-parallel linear layers (`trainer.lora`, per stage).

For each target layer W (frozen) the adapter adds  y += (alpha / rank) * B A x,  A [rank, in] and
B [out, rank] in fp32, B starting at zero so a stage starts from exactly the model it was given.
The adapters live beside the model, not inside it: forward hooks on the target layers add their
output, so the model's own parameters, names and checkpoint stay what they were, and at the end of
the stage the product B A is merged into W (the next stage starts from the merged model).

Tensor parallelism (no sequence parallelism), following the layer's own split:
  - column-parallel W (linear_qkv, linear_fc1: each rank holds rows of the output): A replicated,
    B split by rows like W. Every rank computes A x; its gradient is the sum over ranks of what
    each rank's B rows send back, so A x passes Megatron's copy-to-TP region (identity forward,
    all-reduce backward) and A's gradient is complete on every rank;
  - row-parallel W (linear_proj, linear_fc2: each rank holds columns of the input): A split by
    columns like W, B replicated. Each rank's A_i x_i is summed over ranks (reduce-from-TP region:
    all-reduce forward, identity backward) before B, as the layer sums its own output.
A of a column layer is drawn from one generator seeded by the layer's global name, and a row
layer's A is that full draw's column shard, so any TP x PP layout starts from the same adapters
(TP=2 equals TP=1). Why not PEFT: it wraps torch.nn.Linear, and Megatron's parallel layers are
not; Megatron-Bridge's LoRA needs a newer megatron-core than 0.16, the newest for Python 3.11.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.nn.functional as F

from rft.config import LORA_TARGETS as TARGETS

COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")  # the others are row-parallel


class Adapter(torch.nn.Module):
    """One target layer's A and B (this TP rank's shards)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, column: bool):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(a), torch.nn.Parameter(b)
        self.column = column


class LoRA(torch.nn.Module):
    """Adapters on `model`'s target layers; `attach()` hooks them in, `merge()` folds them into W."""

    def __init__(self, model, geo, rank: int, alpha: float, dropout: float, targets: list[str], seed: int):
        from megatron.core import parallel_state as ps

        from rft.trainer.hf_weights import global_names

        super().__init__()
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise ValueError(f"trainer.lora.target_modules: {unknown} are not LoRA targets; "
                             f"use some of {list(TARGETS)}")
        self.rank, self.scale, self.dropout, self.geo = rank, alpha / rank, dropout, geo
        object.__setattr__(self, "model", model)  # beside the model, not a submodule: its state stays its own
        self.hooks: list = []
        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        names = global_names(model, geo)
        self.adapters = torch.nn.ModuleDict()
        self.layers: dict[str, torch.nn.Module] = {}
        for name, module in model.named_modules():
            kind = name.rsplit(".", 1)[-1]
            if kind not in targets:
                continue
            weight = module.weight
            column = kind in COLUMN_PARALLEL
            full_in = weight.shape[1] * (1 if column else tp)
            # kaiming-uniform A (PEFT's init), the same full draw on every layout
            gen = torch.Generator().manual_seed(seed + zlib.crc32(names[name + ".weight"].encode()))
            bound = 1 / math.sqrt(full_in)
            a = (torch.rand(rank, full_in, generator=gen) * 2 - 1) * bound
            if not column:
                a = a.chunk(tp, dim=1)[tp_rank]
            out = weight.shape[0]
            key = name.replace(".", "__")
            self.adapters[key] = Adapter(a.to(weight.device).contiguous(), torch.zeros(out, rank, device=weight.device),
                                         column)
            self.layers[key] = module

    def checkpoint_shards(self, prefix: str, loading: bool = False) -> dict[str, Any]:
        """The adapters as layout-free checkpoint entries (rft/trainer/sharded_state.py), keyed by
        their layer's name in the whole model and split as the layer splits them (a column layer's
        B by rows, a row layer's A by columns; the other replicated over TP), so a LoRA stage
        resumes into another TP x PP layout and `python -m rft.export` merges them in one process."""
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        from rft.trainer.hf_weights import global_names

        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        names = global_names(self.model, self.geo)
        out: dict[str, Any] = {}
        for key, adapter in self.adapters.items():
            layer = names[key.replace("__", ".") + ".weight"].removesuffix(".weight")
            # an expert's adapters are replicated over the expert-DP ranks, the others over DP
            dp_rank = ps.get_expert_data_parallel_rank() if ".experts." in layer else ps.get_data_parallel_rank()
            for which, split_axis in (("a", None if adapter.column else 1), ("b", 0 if adapter.column else None)):
                tensor = getattr(adapter, which).data
                offsets = [(split_axis, tp_rank, tp)] if split_axis is not None else []
                out[f"adapters.{key}.{which}"] = ShardedTensor.from_rank_offsets(
                    f"{prefix}{layer}.lora_{which}", tensor, *offsets,
                    replica_id=(0 if split_axis is not None else tp_rank, dp_rank))
        return out

    def attach(self) -> "LoRA":
        """Freeze the model and add the adapters' outputs to their layers'."""
        self.model.requires_grad_(False)
        for key, module in self.layers.items():
            self.hooks.append(module.register_forward_hook(self._hook(self.adapters[key])))
        return self

    def _hook(self, adapter: Adapter):
        def add_adapter(module, inputs, output):
            out, bias = output
            return out + self.delta(adapter, inputs[0]).to(out.dtype), bias
        return add_adapter

    def delta(self, adapter: Adapter, x: torch.Tensor) -> torch.Tensor:
        """(alpha / rank) B A x for the layer's input `x` ([s, b, in] or this rank's columns of it)."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        x = x.float()
        if self.dropout and self.model.training and torch.is_grad_enabled():  # not in scoring passes
            x = F.dropout(x, self.dropout)
        h = x @ adapter.a.t()
        if ps.get_tensor_model_parallel_world_size() > 1:
            # column: all-reduce A's gradient in backward; row: sum the ranks' A_i x_i in forward
            h = (copy_to_tensor_model_parallel_region if adapter.column else reduce_from_tensor_model_parallel_region)(h)
        return (h @ adapter.b.t()) * self.scale

    def delta_weights(self) -> dict[str, torch.Tensor]:
        """Each target's (alpha / rank) B A, shaped like this rank's shard of its weight, by the
        weight's local parameter name (what a merged weight sync adds)."""
        return {key.replace("__", ".") + ".weight": (adapter.b @ adapter.a).detach() * self.scale
                for key, adapter in self.adapters.items()}

    @torch.no_grad()
    def adapter_tensors(self, geo) -> list[tuple[str, torch.Tensor]]:
        """This pipeline stage's adapters, TP shards gathered, named as a PEFT checkpoint of the HF
        model names them (what vLLM's LoRA loads: sync.lora=adapter). A fused layer's adapter
        becomes one per HF projection: q, k, v (gate, up) each get the shared A and their rows of
        B. A collective over the TP group: every TP rank calls it."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from rft.trainer.hf_weights import global_names
        from rft.weights.hf_megatron import megatron_full_to_hf

        tp = ps.get_tensor_model_parallel_world_size()
        names = global_names(self.model, geo)
        out = []
        for key, adapter in self.adapters.items():
            a, b = adapter.a.detach(), adapter.b.detach()
            if tp > 1:  # the split one: B's rows (column layers), A's columns (row layers)
                split, dim = (b, 0) if adapter.column else (a, 1)
                shards = [torch.empty_like(split) for _ in range(tp)]
                dist.all_gather(shards, split.contiguous(), group=ps.get_tensor_model_parallel_group())
                a, b = (a, torch.cat(shards, 0)) if adapter.column else (torch.cat(shards, 1), b)
            for hf_name, b_part in megatron_full_to_hf(names[key.replace("__", ".") + ".weight"], b, geo, tp):
                module = "base_model.model." + hf_name.removesuffix(".weight")
                out += [(module + ".lora_A.weight", a), (module + ".lora_B.weight", b_part.contiguous())]
        return out

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the adapters into the model's weights, unhook them and unfreeze the model."""
        deltas = self.delta_weights()
        for name, param in self.model.named_parameters():
            if name in deltas:
                param.copy_((param.float() + deltas[name]).to(param.dtype))
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.model.requires_grad_(True)

    def tp_split_dim(self, name: str) -> int | None:
        """How an adapter parameter is split over TP ranks (the optimizer's grad norm counts a
        replicated one once): a column layer's B by rows, a row layer's A by columns."""
        key, which = name.rsplit(".", 1)[0].replace("adapters.", "", 1), name.rsplit(".", 1)[1]
        column = self.adapters[key].column
        if which == "b" and column:
            return 0
        if which == "a" and not column:
            return 1
        return None
