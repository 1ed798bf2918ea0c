"""Sample filters: which responses of a batch to train on, decided per group.

Registry SAMPLE_FILTERS, signature

    fn(rewards: Tensor [B], group_ids: Tensor [B] int64) -> keep: Tensor [B] bool

`group_ids` name each response's group (0..G-1, any order, groups may be ragged); a filter keeps or
drops whole groups, so the group baselines (advantages.py) of what remains are unchanged.
Built-ins: "none" (keep all) and "zero_variance" (DAPO's dynamic sampling).
"""

from __future__ import annotations

from rft.lazy import lazy_module
from rft.registry import Registry

# imported where first used: the launcher checks names here without torch (rft/lazy.py)
torch = lazy_module("torch")

SAMPLE_FILTERS = Registry("sample filter", params=("rewards", "group_ids"),
                          returns="keep mask [B] bool")


def _check(rewards: torch.Tensor, group_ids: torch.Tensor, name: str) -> None:
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"{name}: rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} "
                         "must both be [B]")


@SAMPLE_FILTERS.register("none")
def keep_all(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Keep every response."""
    _check(rewards, group_ids, "none")
    return torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device)


@SAMPLE_FILTERS.register("zero_variance")
def zero_variance(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Drop groups whose rewards are all equal (DAPO dynamic sampling): their group-normalised
    advantages are 0, so they add no gradient but dilute the token-mean of the others.

    A group of one is kept, as verl's DAPO filter does (there is no variance to measure).
    """
    _check(rewards, group_ids, "zero_variance")
    groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    high = torch.full((groups,), -torch.inf).scatter_reduce(0, group_ids, rewards.float(), "amax")
    low = torch.full((groups,), torch.inf).scatter_reduce(0, group_ids, rewards.float(), "amin")
    size = torch.zeros(groups).index_add_(0, group_ids, torch.ones_like(rewards, dtype=torch.float32))
    varied = (high > low) | (size == 1)
    return varied[group_ids]
