"""Move weights between an HF state dict and one TP x PP shard of a Megatron GPTModel.

`load_hf_weights` imports: every rank takes its pipeline stage's layers and its TP slice.
`hf_table` and `export_hf_weights` export: the table (names, shapes, wire dtype) comes from
parameter shapes alone, so a sender can announce a sync before gathering anything; the export
then yields one HF tensor at a time, all-gathering TP shards as it goes (a collective: every TP
rank of the stage iterates in lockstep). Nothing holds more than one full parameter at a time.
Pipeline stages (and virtual stages' chunks) number their layers from 0, and under expert
parallelism each rank numbers its slice of a layer's experts from 0; the mapping
(`hf_megatron.py`) uses global numbers. An export gathers every expert: the expert-parallel
ranks of the exporting DP replica iterate in lockstep too, all-gathering each expert weight.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.distributed as dist

from rft.weights.hf_megatron import (
    Geometry,
    expert_index,
    hf_to_megatron_full,
    local_spec_name,
    megatron_full_to_hf,
    renumber_expert,
    tp_split_dim,
)
from rft.weights.transfer import TensorTable

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _tp() -> tuple[int, int, object]:
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_group())


def _ep() -> tuple[int, int, object]:
    from megatron.core import parallel_state

    return (parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_rank(),
            parallel_state.get_expert_model_parallel_group())


def _global_expert(local: int, geo: Geometry, ep: int, ep_rank: int) -> int:
    """Expert parallelism gives EP rank r the experts [r E/EP, (r+1) E/EP), named from 0 there."""
    return ep_rank * (geo.num_experts // ep) + local


def _layer_offset(chunk) -> int:
    layers = chunk.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0  # layer_number is global and 1-based


def global_names(model, geo: Geometry) -> dict[str, str]:
    """This stage's parameter names -> names in the whole (unpipelined) model.

    A tied output layer on the last stage (PP > 1) is a copy of the first stage's embedding; it
    maps to the embedding's name. Under a virtual pipeline each chunk numbers its layers from 0.
    Transformer Engine's fused norms get the local layer spec's names. Experts get their number
    in the whole layer.
    """
    from rft.trainer.chunks import named_chunks

    ep, ep_rank, _ = _ep()
    out = {}
    for prefix, chunk in named_chunks(model):
        offset = _layer_offset(chunk)
        for name, _ in chunk.named_parameters():
            if _is_tied_output(name, geo):
                out[prefix + name] = "embedding.word_embeddings.weight"
                continue
            gname = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", local_spec_name(name))
            expert = expert_index(gname)
            if expert is not None and ep > 1:
                gname = renumber_expert(gname, _global_expert(expert, geo, ep, ep_rank))
            out[prefix + name] = gname
    return out


def _is_tied_output(name: str, geo: Geometry) -> bool:
    return geo.tied_embeddings and name.endswith("output_layer.weight")


def load_hf_weights(model, hf_state: dict[str, torch.Tensor], geo: Geometry) -> None:
    """Copy HF weights into this rank's TP x PP shard of `model`; every parameter must be covered."""
    tp, tp_rank, _ = _tp()
    full = hf_to_megatron_full(hf_state, geo, tp)
    names = global_names(model, geo)
    missing = sorted(n for n, g in names.items() if g not in full)
    if missing:
        raise KeyError(f"HF checkpoint does not cover Megatron parameters: {missing[:5]}")
    with torch.no_grad():
        for name, param in model.named_parameters():
            dim = tp_split_dim(name)
            src = full[names[name]]
            if dim is not None:
                src = src.chunk(tp, dim=dim)[tp_rank]
            if src.shape != param.shape:
                raise ValueError(f"{name}: HF-derived shape {tuple(src.shape)} != {tuple(param.shape)}")
            param.copy_(src.to(param.dtype))


def _exported_params(model, geo: Geometry) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """(local name, global name, parameter) for what this stage sends: a tied output layer copy
    is skipped, the first stage sends the embedding it mirrors."""
    names = global_names(model, geo)
    for name, param in model.named_parameters():
        if not _is_tied_output(name, geo):
            yield name, names[name], param


def hf_table(model, geo: Geometry, wire_dtype: torch.dtype) -> TensorTable:
    """The HF names and full shapes this stage exports, from shapes only (meta tensors)."""
    tp, _, _ = _tp()
    table: TensorTable = []
    for name, gname, param in _exported_params(model, geo):
        shape = list(param.shape)
        dim = tp_split_dim(name)
        if dim is not None:
            shape[dim] *= tp
        meta = torch.empty(shape, device="meta")
        table += [(hf_name, tuple(t.shape), str(wire_dtype)) for every_name in _every_expert(gname, geo)
                  for hf_name, t in megatron_full_to_hf(every_name, meta, geo, tp)]
    return table


def _every_expert(gname: str, geo: Geometry) -> list[str]:
    """The global names an export of this rank's parameter `gname` covers: under expert
    parallelism, an expert's weight and those of the same local expert on every EP rank (the
    all-gather's order); otherwise `gname` itself."""
    ep, ep_rank, _ = _ep()
    expert = expert_index(gname)
    if expert is None or ep == 1:
        return [gname]
    local = expert - _global_expert(0, geo, ep, ep_rank)
    return [renumber_expert(gname, _global_expert(local, geo, ep, r)) for r in range(ep)]


def export_hf_weights(model, geo: Geometry, deltas: dict[str, torch.Tensor] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield this stage's HF-named full tensors in `hf_table` order, gathering TP shards.
    `deltas` (by local parameter name, shaped like the shard): added first, in fp32 (LoRA's B A:
    a merged sync sends W + B A without touching W)."""
    tp, _, group = _tp()
    ep, _, ep_group = _ep()
    deltas = deltas or {}
    for name, gname, param in _exported_params(model, geo):
        dim = tp_split_dim(name)
        full = param.detach() if name not in deltas else param.detach().float() + deltas[name]
        if dim is not None and tp > 1:
            shards = [torch.empty_like(full) for _ in range(tp)]
            dist.all_gather(shards, full.contiguous(), group=group)
            full = torch.cat(shards, dim=dim)
        names = _every_expert(gname, geo)
        if len(names) > 1:  # one expert weight per EP rank
            per_rank = [torch.empty_like(full) for _ in range(ep)]
            dist.all_gather(per_rank, full.contiguous(), group=ep_group)
        else:
            per_rank = [full]
        for every_name, tensor in zip(names, per_rank):
            yield from megatron_full_to_hf(every_name, tensor, geo, tp)
