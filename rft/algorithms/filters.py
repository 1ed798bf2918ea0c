"""Sample filters: which responses of a batch to train on, decided per group.

Registry SAMPLE_FILTERS, signature

    fn(rewards: Tensor [B], group_size: int) -> keep: Tensor [B] bool

B = groups * group_size with groups contiguous; a filter keeps or drops whole groups, so the
group baselines (advantages.py) of what remains are unchanged. Built-ins: "none" (keep all) and
"zero_variance" (DAPO's dynamic sampling).
"""

from __future__ import annotations

import torch

from rft.algorithms.registry import Registry

SAMPLE_FILTERS = Registry("sample filter", params=("rewards", "group_size"),
                          returns="keep mask [B] bool")


def _grouped(rewards: torch.Tensor, group_size: int, name: str) -> torch.Tensor:
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{name}: rewards of shape {tuple(rewards.shape)} do not split into "
                         f"groups of {group_size}")
    return rewards.view(-1, group_size)


@SAMPLE_FILTERS.register("none")
def keep_all(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Keep every response."""
    _grouped(rewards, group_size, "none")
    return torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device)


@SAMPLE_FILTERS.register("zero_variance")
def zero_variance(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Drop groups whose rewards are all equal (DAPO dynamic sampling): their group-normalised
    advantages are 0, so they add no gradient but dilute the token-mean of the others.

    A group of one is kept, as verl's DAPO filter does (there is no variance to measure).
    """
    grouped = _grouped(rewards, group_size, "zero_variance")
    varied = grouped.amax(dim=1) > grouped.amin(dim=1)
    if group_size == 1:
        varied = torch.ones_like(varied)
    return varied.repeat_interleave(group_size)
