"""Forward passes for training: padded microbatches in, per-token logprobs and entropy out.

Logits stay vocab-parallel (each TP rank holds V/TP columns); logprob and entropy are reduced
across the TP group with autograd-aware all-reduces, so nothing ever materialises [b, s, V] on one
rank when TP > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn


@dataclass
class Microbatch:
    """Right-padded sequences. `loss_mask[i, t]` is 1 where token t+1 of row i is a response token."""

    input_ids: torch.Tensor  # [b, s] int64
    loss_mask: torch.Tensor  # [b, s-1] float: scores targets input_ids[:, 1:]
    position_ids: torch.Tensor  # [b, s]


def pack_microbatch(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                    device: torch.device) -> Microbatch:
    """Concatenate prompt+response per row, right-pad, and mark response targets in the mask."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = max(lengths)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width - 1), dtype=torch.float32)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        ids[row, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.int64)
        # target index t predicts token t+1; response tokens sit at [len(p), len(p)+len(r))
        mask[row, len(p) - 1: len(p) + len(r) - 1] = 1.0
    positions = torch.arange(width, dtype=torch.int64).unsqueeze(0).expand(len(prompts), -1)
    return Microbatch(ids.to(device), mask.to(device), positions.contiguous().to(device))


def causal_mask(width: int, device: torch.device) -> torch.Tensor:
    """Megatron's mask convention: True where attention is *not* allowed. Right padding needs no
    more than causality, since padded positions come after every real token."""
    return torch.triu(torch.ones(width, width, dtype=torch.bool, device=device), diagonal=1)[None, None]


def _tp_all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return t
    return dist_fn.all_reduce(t, op=op, group=group)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp_group,
                            vocab_start: int, with_entropy: bool = True
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and entropy per position from vocab-parallel logits [b, s, V/tp]."""
    logits = logits.float()
    local_max = logits.max(dim=-1, keepdim=True).values.detach()
    global_max = _tp_all_reduce(local_max, dist.ReduceOp.MAX, tp_group) if tp_group else local_max
    shifted = logits - global_max
    exp = shifted.exp()
    sum_exp = _tp_all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, tp_group)
    log_z = sum_exp.log()
    local = targets - vocab_start
    in_range = (local >= 0) & (local < logits.shape[-1])
    picked = torch.gather(shifted, -1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    picked = _tp_all_reduce(picked * in_range, dist.ReduceOp.SUM, tp_group)
    logprobs = picked - log_z
    entropy = None
    if with_entropy:
        # H = log Z - E_p[shifted logit]
        expected = _tp_all_reduce((exp * shifted).sum(dim=-1), dist.ReduceOp.SUM, tp_group)
        entropy = log_z - expected / sum_exp
    return logprobs, entropy


def forward_logprobs(model, mb: Microbatch, with_entropy: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-target logprobs [b, s-1] (and entropy) of `mb` under `model`."""
    from megatron.core import parallel_state

    width = mb.input_ids.shape[1]
    logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids,
                   attention_mask=causal_mask(width, mb.input_ids.device))
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    vocab_start = parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]
    return vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], group, vocab_start,
                                   with_entropy)
