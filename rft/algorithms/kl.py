"""Per-token estimators of KL(policy || reference) from the sampled tokens' logprobs.

Registry KL_ESTIMATORS, signature

    fn(logprobs [B, T], ref_logprobs [B, T]) -> per-token KL estimate [B, T]

Estimators are elementwise; the caller masks and aggregates them (as a loss term through
`aggregation.py`, or as a reward penalty through `kl_penalty_rewards`). Names and formulas follow
Schulman's "Approximating KL Divergence" and verl's `kl_penalty`, with d = logprobs - ref_logprobs
evaluated on tokens sampled from the policy:

- "k1": d. Unbiased, high variance, can be negative per token.
- "k2": d^2 / 2. Biased, low variance; its gradient is the KL gradient to first order.
- "k3": exp(-d) + d - 1. Unbiased and never negative (GRPO's KL term).
- "low_var_kl": k3 with -d clamped to [-20, 20] and the result to [-10, 10], as verl's
  low_var_kl, so one very unlikely token cannot produce inf or dominate the batch.
"""

from __future__ import annotations

from collections.abc import Callable

from rft.algorithms.aggregation import zero_padding
from rft.lazy import lazy_module
from rft.registry import Registry

# imported where first used: the launcher checks names here without torch (rft/lazy.py)
torch = lazy_module("torch")

KL_ESTIMATORS = Registry("KL estimator", params=("logprobs", "ref_logprobs"),
                         returns="per-token KL [B, T]")

KLEstimator = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]


@KL_ESTIMATORS.register("k1")
def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """log pi - log pi_ref."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(log pi - log pi_ref)^2 / 2."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """exp(r) - r - 1 with r = log pi_ref - log pi."""
    r = ref_logprobs - logprobs
    return torch.exp(r) - r - 1.0


@KL_ESTIMATORS.register("low_var_kl")
def low_var_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 with r clamped to [-20, 20] and the estimate to [-10, 10] (verl's low_var_kl)."""
    r = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.exp(r) - r - 1.0).clamp(-10.0, 10.0)


def kl_penalty_rewards(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
                       estimator: str | KLEstimator, coef: float) -> torch.Tensor:
    """Per-token reward -coef * KL estimate, 0 on padding, detached: for
    `AdvantageInputs.token_rewards` (KL in the reward, as PPO/REINFORCE++ in OpenRLHF and verl's
    use_kl_in_reward), as opposed to KL as a loss term. `estimator` is a name or a function."""
    fn = KL_ESTIMATORS.resolve(estimator)
    valid = mask.bool()
    kl = fn(zero_padding(logprobs.detach(), valid), zero_padding(ref_logprobs.detach(), valid))
    return zero_padding(-coef * kl, valid)
