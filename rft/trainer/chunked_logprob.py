"""The output layer, log-softmax, the sampled tokens' logprobs and the entropy in one pass over
chunks of positions, forward and backward, so the [positions, vocabulary] logits never exist
whole: at most [chunk, V/TP] at a time, recomputed in backward instead of kept.

Why: on Qwen2.5's 151,936-token vocabulary a 16k-token microbatch's logits are 10 GB in fp32,
and the log-softmax, the entropy and their gradients each hold another copy; at 8k tokens they
were about a third of the trainer's peak memory on an H100. Per chunk of 2,048 positions they
are 1.2 GB, once.

Why written here rather than taken from a kernel library: Liger's and cut-cross-entropy's fused
linear cross-entropy return a mean loss (cross-entropy to labels), not each token's logprob and
the entropy an RL loss needs, and neither splits the vocabulary over tensor-parallel ranks; verl's
fused kernel does both but is Triton-only (no CPU, where the tests run) and part of verl. This is
plain torch: matrix multiplies and reductions per chunk, the same arithmetic as
rft/trainer/forward.py's vocab_parallel_logprobs, so it runs wherever the trainer does.

Vocab-parallel: each TP rank holds V/TP rows of the output weight. Per chunk, the max, the sum
of exponentials, the picked logit and the entropy's expectation are all-reduced across the TP
group, as in vocab_parallel_logprobs; every TP rank then holds the same logprobs and entropy.
In backward each rank computes the gradient of its own logit columns: its weight's gradient is
complete, and its hidden-state gradient is its share (the caller all-reduces it, as Megatron's
column-parallel layer does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


class _ChunkedLogprobs(torch.autograd.Function):
    """(hidden [n, h], weight [V/tp, h], targets [n]) -> logprobs [n], entropy [n] (fp32)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start, real_vocab, group, chunk, with_entropy):
        n, local_vocab = hidden.shape[0], weight.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_zeros(n, dtype=torch.float32)
        shift = hidden.new_empty(n, dtype=torch.float32)  # each position's max logit (all TP ranks)
        log_z = hidden.new_empty(n, dtype=torch.float32)
        mean = hidden.new_zeros(n, dtype=torch.float32)  # E_p[shifted logit], for the entropy's gradient
        local = targets - vocab_start
        in_range = (local >= 0) & (local < local_vocab)
        local = local.clamp(0, local_vocab - 1)
        padding = _padding_columns(vocab_start, local_vocab, real_vocab, hidden.device)
        kept = None
        for start in range(0, n, chunk):
            rows = slice(start, min(start + chunk, n))
            shifted = _logits(hidden[rows], weight, padding)
            top = _all_reduce(shifted.max(dim=-1).values, group, dist.ReduceOp.MAX)
            shifted.sub_(top[:, None])
            exp = shifted.exp()
            sum_exp = _all_reduce(exp.sum(dim=-1), group)
            picked = _all_reduce(shifted.gather(-1, local[rows, None]).squeeze(-1) * in_range[rows], group)
            shift[rows], log_z[rows] = top, sum_exp.log()
            logprobs[rows] = picked - log_z[rows]
            if with_entropy:
                mean[rows] = _all_reduce(exp.mul_(shifted).sum(dim=-1), group) / sum_exp
                entropy[rows] = log_z[rows] - mean[rows]
            # one chunk holds every position: keep its logits for backward rather than compute
            # them again (the whole-logits memory, which a single chunk costs anyway)
            kept = shifted if n <= chunk else None
            del exp
        ctx.save_for_backward(hidden, weight, local, in_range, shift, log_z, mean)
        ctx.padding, ctx.chunk, ctx.with_entropy, ctx.kept = padding, chunk, with_entropy, kept
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local, in_range, shift, log_z, mean = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        n = hidden.shape[0]
        for start in range(0, n, ctx.chunk):
            rows = slice(start, min(start + ctx.chunk, n))
            if ctx.kept is not None:
                shifted, ctx.kept = ctx.kept, None
            else:
                shifted = _logits(hidden[rows], weight, ctx.padding).sub_(shift[rows, None])
            grad = (shifted - log_z[rows, None]).exp_()  # p_j
            if ctx.with_entropy and grad_entropy is not None:
                # H = log Z - E_p[z]  =>  d H / d z_j = -p_j (z_j - E_p[z]) (the shift cancels)
                entropy_part = shifted.sub_(mean[rows, None]).mul_(grad).mul_(grad_entropy[rows, None])
            else:
                entropy_part = None
            # d logp(t) / d z_j = [j = t] - p_j
            grad.mul_(-grad_logprobs[rows, None])
            grad.scatter_add_(-1, local[rows, None], (grad_logprobs[rows] * in_range[rows])[:, None])
            if entropy_part is not None:
                grad.sub_(entropy_part)
            del shifted, entropy_part
            grad = grad.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad @ weight
            if ctx.needs_input_grad[1]:
                part = grad.t() @ hidden[rows]
                if n > ctx.chunk:  # summed over chunks in fp32, as one matmul accumulates
                    part = part.float()
                grad_weight = part if grad_weight is None else grad_weight.add_(part)
            del grad
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _padding_columns(vocab_start: int, local_vocab: int, real_vocab: int | None, device) -> torch.Tensor | None:
    """This rank's columns past the model's real vocabulary (Megatron pads it to a multiple of TP)."""
    if real_vocab is None or vocab_start + local_vocab <= real_vocab:
        return None
    return torch.arange(vocab_start, vocab_start + local_vocab, device=device) >= real_vocab


def _logits(hidden: torch.Tensor, weight: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    # finite, as forward.model_forward's: exp() is 0 and 0 * logit stays 0 in the entropy
    return logits if padding is None else logits.masked_fill(padding, -1e9)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, vocab_start: int = 0,
                     real_vocab: int | None = None, group=None, chunk: int = 2048, with_entropy: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) [n] and entropy [n] (None unless `with_entropy`) of the logits
    hidden @ weight.T, `chunk` positions at a time; `weight` is this TP rank's rows of the output
    layer, starting at vocabulary id `vocab_start`; columns from `real_vocab` on are padding."""
    if chunk < 1:
        raise ValueError(f"chunk must be 1 or more positions, not {chunk}")
    logprobs, entropy = _ChunkedLogprobs.apply(hidden, weight, targets, vocab_start, real_vocab, group, chunk,
                                               with_entropy)
    return logprobs, entropy if with_entropy else None
