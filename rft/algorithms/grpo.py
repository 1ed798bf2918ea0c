"""GRPO: group-normalised advantages and the clipped-ratio policy loss, plus the k3 KL term.

All losses are token-mean over response tokens (mask = 1 on response tokens, 0 on prompt/padding).
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantage: reward minus its group's mean, divided by the group's std if asked.

    `rewards` is [num_groups * group_size], groups contiguous. A group whose rewards are all equal
    gets advantage 0 for every sample (nothing to learn from it).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size).float()
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_by_std:
        # unbiased std, as in the GRPO paper and verl/TRL
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean: average of `values` where `mask` is 1 (0 if the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate, token-mean. Returns (loss, clip fraction).

    logprobs/old_logprobs/mask are [batch, tokens]; advantages is [batch] (one per sequence,
    broadcast over its tokens).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.unsqueeze(-1)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return loss, clipfrac.detach()


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(r) - r - 1 with r = ref - policy.

    Non-negative and unbiased (Schulman, "Approximating KL divergence"); used by GRPO and verl's
    `low_var_kl` (which additionally clamps; we clamp r to keep exp finite).
    """
    r = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return torch.exp(r) - r - 1.0


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of the target tokens, token-mean."""
    return -masked_mean(logprobs, mask)
