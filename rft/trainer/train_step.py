"""One optimizer step: GRPO on a batch of experience, or SFT on reference answers.

Both share the same shape: split the rows over data-parallel ranks, run microbatches (through the
pipeline stages, rft/trainer/pipeline.py), scale each microbatch's token-sum loss by the global
token count (so the result is the token-mean over the whole batch on every DP layout), all-reduce
gradients, clip, step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rft.algorithms.grpo import k3_kl, masked_mean, policy_loss, sft_loss
from rft.config import AlgorithmConfig
from rft.trainer.forward import Microbatch, pack_microbatch
from rft.trainer.pipeline import forward_backward, forward_logprobs_pipelined
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
    """Global grad L2 norm over TP shards and PP stages (replicated params counted once); clips in place."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    # under PP a tied output layer on the last stage mirrors the embedding: count that one once
    mirror = pp > 1 and model.share_embeddings_and_output_weights and not model.pre_process
    total = torch.zeros(1)
    grads = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        if mirror and name == "output_layer.weight":
            continue
        sq = p.grad.detach().float().pow(2).sum().cpu()
        total += sq if (tp_split_dim(name) is not None or tp == 1) else sq / tp
    if tp > 1:
        dist.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
    if pp > 1:
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


def _old_logprobs(batch: StepBatch, idx: list[int], like: torch.Tensor) -> torch.Tensor:
    """vLLM's logprobs (aligned to response tokens) placed at the response targets of a microbatch."""
    width = like.shape[1]
    old = torch.zeros_like(like)
    for row, i in enumerate(idx):
        p = len(batch.prompt_ids[i])
        resp = batch.old_logprobs[i]
        old[row, p - 1: p - 1 + len(resp)] = torch.tensor(resp[: width - p + 1])
    return old


def _sync_grads(model) -> None:
    """Sum gradients over DP replicas, over the two copies of a tied embedding under PP, and
    over TP for q/k norms (replicated weights, but each TP rank normalises only its own heads)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        for name, p in model.named_parameters():
            if p.grad is not None and name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    dp_rank, dp_size, dp_group = _dp()
    if dp_size > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=dp_group)
    if ps.get_pipeline_model_parallel_world_size() > 1 and model.share_embeddings_and_output_weights \
            and ps.is_rank_in_embedding_group():
        weight = model.shared_embedding_or_output_weight()
        dist.all_reduce(weight.grad, group=ps.get_embedding_group())


def train_step(model, optimizer, batch: StepBatch, algo: AlgorithmConfig, micro_batch_size: int,
               pad_id: int, ref_model=None) -> dict[str, float]:
    """Forward/backward over microbatches (pipelined when PP > 1), then one optimizer step."""
    from megatron.core import parallel_state as ps

    dp_rank, dp_size, dp_group = _dp()
    rows = list(range(dp_rank, len(batch.prompt_ids), dp_size))
    device = next(model.parameters()).device
    global_tokens = torch.tensor([float(sum(len(batch.response_ids[i]) for i in rows))])
    if dp_size > 1:
        dist.all_reduce(global_tokens, group=dp_group)
    denom = float(global_tokens.clamp(min=1))
    sums = {"loss/policy": 0.0, "loss/kl": 0.0, "actor/entropy": 0.0, "actor/clipfrac": 0.0}
    is_rl = batch.advantages is not None
    chunks = [rows[s: s + micro_batch_size] for s in range(0, len(rows), micro_batch_size)]
    mbs = [pack_microbatch([batch.prompt_ids[i] for i in idx], [batch.response_ids[i] for i in idx],
                           pad_id, device) for idx in chunks]
    use_kl = is_rl and ref_model is not None and algo.kl_coef > 0
    ref_logprobs = forward_logprobs_pipelined(ref_model, mbs) if use_kl else None

    def loss_fn(m: int, mb: Microbatch, logprobs: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        mask = mb.loss_mask
        tokens = mask.sum().item()
        if is_rl:
            adv = torch.tensor([batch.advantages[i] for i in chunks[m]], device=device)
            pl, clipfrac = policy_loss(logprobs, _old_logprobs(batch, chunks[m], logprobs), adv, mask,
                                       algo.clip_eps)
            loss = pl
            if use_kl:
                kl = masked_mean(k3_kl(logprobs, ref_logprobs[m]), mask)
                loss = loss + algo.kl_coef * kl
                sums["loss/kl"] += kl.item() * tokens
            sums["actor/clipfrac"] += clipfrac.item() * tokens
        else:
            pl = sft_loss(logprobs, mask)
            loss = pl
        ent = masked_mean(entropy, mask)
        if algo.entropy_coef:
            loss = loss - algo.entropy_coef * ent
        sums["loss/policy"] += pl.item() * tokens
        sums["actor/entropy"] += ent.item() * tokens
        # token-sum of this microbatch over the global token count = its share of the token-mean
        return loss * tokens / denom

    model.train()
    optimizer.zero_grad(set_to_none=True)
    forward_backward(model, mbs, loss_fn)
    _sync_grads(model)
    stats = torch.tensor(list(sums.values()))
    if dp_size > 1:
        dist.all_reduce(stats, group=dp_group)
    if ps.get_pipeline_model_parallel_world_size() > 1:  # only the last stage computed losses
        dist.all_reduce(stats, group=ps.get_pipeline_model_parallel_group())
    sums = dict(zip(sums, stats.tolist()))
    grad_norm = grad_norm_and_clip(model, algo.grad_clip)
    optimizer.step()
    metrics = {k: v / denom for k, v in sums.items()}
    metrics["actor/grad_norm"] = grad_norm
    metrics["train/tokens"] = denom
    if not is_rl:
        metrics["loss/sft"] = metrics["loss/policy"]
    return metrics
