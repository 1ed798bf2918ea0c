"""Loss aggregation: per-token losses [B, T] -> this microbatch's share of the batch loss.

Registry AGGREGATIONS, signature

    fn(per_token: Tensor [B, T], mask: Tensor [B, T], *, num_tokens: float, num_seqs: float,
       norm_len: int) -> Tensor (scalar)

Modes follow verl's `agg_loss` (verl/trainer/ppo/core_algos.py):

- "token-mean": every valid token weighs the same (DAPO's token-level loss).
- "seq-mean-token-sum": each sequence's token sum, averaged over sequences.
- "seq-mean-token-mean": each sequence's token mean, averaged over sequences (original GRPO).
- "seq-mean-token-sum-norm": each sequence's token sum divided by a constant `norm_len` (e.g. the
  maximum response length), averaged over sequences: Dr. GRPO's length-unbiased objective. verl
  divides the sum over all sequences by the horizon without the mean over sequences; ours is that
  value / num_seqs, the objective as written in the Dr. GRPO paper.

The partition contract. The trainer splits a batch into microbatches and data-parallel ranks and
sums what each piece returns (gradients are summed over microbatches and all-reduced over DP).
Every mode is a sum over sequences of a per-sequence term divided by a batch-wide constant, so
each piece returns its own sequences' terms divided by the FULL batch's counts:

    sum over pieces of fn(piece, num_tokens=N, num_seqs=S, norm_len=L) == fn(whole batch, N, S, L)

for the value and, because each piece's graph is separate, for the gradient. `num_tokens` is the
number of valid (mask = 1) tokens in the full batch; `num_seqs` the number of sequences with at
least one valid token in it (verl excludes fully masked sequences); `batch_counts` computes both.
A sequence must not be split across pieces for the seq-mean modes (its token mean needs all of it).

Also here, because every other module of the zoo reduces over masks the same way: `zero_padding`
and `masked_token_mean`.
"""

from __future__ import annotations

from rft.lazy import lazy_module
from rft.registry import Registry

# imported where first used: the launcher checks names here without torch (rft/lazy.py)
torch = lazy_module("torch")

AGGREGATIONS = Registry("loss aggregation", params=("per_token", "mask"),
                        keyword_only=("num_tokens", "num_seqs", "norm_len"),
                        returns="Tensor (this microbatch's share of the batch loss)")


def zero_padding(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` where mask is 1, exactly 0 elsewhere.

    `torch.where` rather than `values * mask`: padding may hold inf/NaN (e.g. -inf logprobs), and
    0 * inf is NaN. Gradients to masked positions are exactly 0.
    """
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over the valid tokens of this tensor only (0 when none): for metrics."""
    return zero_padding(values, mask).sum() / mask.bool().sum().clamp(min=1)


def batch_counts(mask: torch.Tensor) -> tuple[float, float]:
    """(num_tokens, num_seqs) of a full batch, as the aggregations expect them."""
    valid = mask.bool()
    return float(valid.sum()), float(valid.any(dim=-1).sum())


def _sequence_sums(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return zero_padding(per_token, mask).sum(dim=-1)


@AGGREGATIONS.register("token-mean")
def token_mean(per_token: torch.Tensor, mask: torch.Tensor, *, num_tokens: float, num_seqs: float,
               norm_len: int) -> torch.Tensor:
    """Sum of this piece's valid per-token losses / valid tokens in the full batch."""
    return zero_padding(per_token, mask).sum() / max(float(num_tokens), 1.0)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(per_token: torch.Tensor, mask: torch.Tensor, *, num_tokens: float,
                       num_seqs: float, norm_len: int) -> torch.Tensor:
    """Sum over this piece's sequences of their token sums / sequences in the full batch."""
    return _sequence_sums(per_token, mask).sum() / max(float(num_seqs), 1.0)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(per_token: torch.Tensor, mask: torch.Tensor, *, num_tokens: float,
                        num_seqs: float, norm_len: int) -> torch.Tensor:
    """Sum over this piece's sequences of their token means / sequences in the full batch.

    A fully masked sequence contributes 0 (its length is clamped to 1 to avoid 0/0).
    """
    lengths = mask.bool().sum(dim=-1).clamp(min=1)
    return (_sequence_sums(per_token, mask) / lengths).sum() / max(float(num_seqs), 1.0)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(per_token: torch.Tensor, mask: torch.Tensor, *, num_tokens: float,
                            num_seqs: float, norm_len: int) -> torch.Tensor:
    """Sum over this piece's sequences of token sum / norm_len, / sequences in the full batch.

    `norm_len` must stay constant through training (Dr. GRPO: the generation budget), otherwise
    the loss scale drifts with the batch's padding width.
    """
    if norm_len <= 0:
        raise ValueError(f"seq-mean-token-sum-norm needs norm_len > 0 (got {norm_len}); "
                         f"set it to the maximum response length")
    return _sequence_sums(per_token, mask).sum() / float(norm_len) / max(float(num_seqs), 1.0)
