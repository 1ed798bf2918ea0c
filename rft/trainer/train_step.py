"""One optimizer step: GRPO on a batch of experience, or SFT on reference answers.

Both share the same shape: split the rows over data-parallel ranks, run microbatches, scale each
microbatch's token-sum loss by the global token count (so the result is the token-mean over the
whole batch on every DP layout), all-reduce gradients, clip, step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rft.algorithms.grpo import k3_kl, masked_mean, policy_loss, sft_loss
from rft.config import AlgorithmConfig
from rft.trainer.forward import Microbatch, forward_logprobs, pack_microbatch
from rft.weights.hf_megatron import tp_split_dim


@dataclass
class StepBatch:
    """Rows this step trains on. `advantages` and `old_logprobs` are None for SFT."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    advantages: list[float] | None = None
    old_logprobs: list[list[float]] | None = None


def _dp():
    from megatron.core import parallel_state

    return (parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
            parallel_state.get_data_parallel_group())


def _pad_rows(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def grad_norm_and_clip(model, max_norm: float) -> float:
    """Global grad L2 norm over TP shards (replicated params counted once); clips in place."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    total = torch.zeros(1)
    grads = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().float().pow(2).sum().cpu()
        total += sq if (tp_split_dim(name) is not None or tp == 1) else sq / tp
        grads.append(p.grad)
    if tp > 1:
        dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


def train_step(model, optimizer, batch: StepBatch, algo: AlgorithmConfig, micro_batch_size: int,
               pad_id: int, ref_model=None) -> dict[str, float]:
    """Forward/backward over microbatches, then one optimizer step. Returns scalar metrics."""
    dp_rank, dp_size, dp_group = _dp()
    rows = list(range(dp_rank, len(batch.prompt_ids), dp_size))
    device = next(model.parameters()).device
    global_tokens = torch.tensor([float(sum(len(batch.response_ids[i]) for i in rows))])
    if dp_size > 1:
        dist.all_reduce(global_tokens, group=dp_group)
    denom = float(global_tokens.clamp(min=1))
    sums = {"loss/policy": 0.0, "loss/kl": 0.0, "actor/entropy": 0.0, "actor/clipfrac": 0.0}
    is_rl = batch.advantages is not None
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, len(rows), micro_batch_size):
        idx = rows[start: start + micro_batch_size]
        mb: Microbatch = pack_microbatch([batch.prompt_ids[i] for i in idx],
                                         [batch.response_ids[i] for i in idx], pad_id, device)
        logprobs, entropy = forward_logprobs(model, mb)
        mask = mb.loss_mask
        tokens = mask.sum()
        if is_rl:
            width = mask.shape[1]
            # old logprobs are aligned to response tokens; place them at the response targets
            old = torch.zeros_like(logprobs)
            for row, i in enumerate(idx):
                p = len(batch.prompt_ids[i])
                resp = batch.old_logprobs[i]
                old[row, p - 1: p - 1 + len(resp)] = torch.tensor(resp[: width - p + 1])
            adv = torch.tensor([batch.advantages[i] for i in idx], device=device)
            pl, clipfrac = policy_loss(logprobs, old, adv, mask, algo.clip_eps)
            loss = pl
            if ref_model is not None and algo.kl_coef > 0:
                with torch.no_grad():
                    ref_logprobs, _ = forward_logprobs(ref_model, mb, with_entropy=False)
                kl = masked_mean(k3_kl(logprobs, ref_logprobs), mask)
                loss = loss + algo.kl_coef * kl
                sums["loss/kl"] += kl.item() * tokens.item()
            sums["actor/clipfrac"] += clipfrac.item() * tokens.item()
        else:
            pl = sft_loss(logprobs, mask)
            loss = pl
        ent = masked_mean(entropy, mask)
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * ent
        sums["loss/policy"] += pl.item() * tokens.item()
        sums["actor/entropy"] += ent.item() * tokens.item()
        # token-sum of this microbatch over the global token count = its share of the token-mean
        (loss * tokens / denom).backward()
    if dp_size > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=dp_group)
        stats = torch.tensor(list(sums.values()))
        dist.all_reduce(stats, group=dp_group)
        sums = dict(zip(sums, stats.tolist()))
    grad_norm = grad_norm_and_clip(model, algo.grad_clip)
    optimizer.step()
    metrics = {k: v / denom for k, v in sums.items()}
    metrics["actor/grad_norm"] = grad_norm
    metrics["train/tokens"] = denom
    if not is_rl:
        metrics["loss/sft"] = metrics["loss/policy"]
    return metrics
