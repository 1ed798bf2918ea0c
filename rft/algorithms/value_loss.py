"""PPO's clipped value loss: what the critic (rft/trainer/critic.py) minimises.

verl's `compute_value_loss` (and OpenRLHF's ValueLoss) per token:

    0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)

V: the critic's values now, V_old: its values when the batch was scored (the ones GAE used),
R: the returns (GAE advantages + V_old, before whitening). The clipped term keeps one update from
moving a value more than `eps` away from V_old unless that lowers the loss anyway, the critic's
counterpart of the policy's ratio clip. With eps None the loss is plain 0.5 * (V - R)^2.
One function, not a registry: PPO has one value loss and no preset varies it.

The per-token loss is 0 on padding (which may hold anything, inf/NaN included, without touching
the result or its gradient) and is reduced by an aggregation (`aggregation.py`), like a policy
loss, so the same partition contract over microbatches and DP ranks holds.
"""

from __future__ import annotations

from rft.algorithms.aggregation import masked_token_mean, zero_padding
from rft.lazy import lazy_module

# imported where first used: the launcher checks names here without torch (rft/lazy.py)
torch = lazy_module("torch")


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       mask: torch.Tensor, clip_eps: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss [B, T] (0 on padding) and metrics: vf_clipfrac, the share of valid tokens
    where the clipped term is the larger (it binds), as verl counts it.

    values: [B, T] with gradient; old_values, returns: [B, T], detached here.
    """
    if clip_eps is not None and clip_eps <= 0:
        raise ValueError(f"value clip must be > 0 (got {clip_eps}); e.g. 0.2, or None for no clipping")
    valid = mask.bool()
    # padding may hold NaN: zero it before any arithmetic whose gradient could reach it
    values = zero_padding(values, valid)
    old_values = zero_padding(old_values.detach(), valid)
    returns = zero_padding(returns.detach(), valid)
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return zero_padding(0.5 * unclipped, valid), {"vf_clipfrac": torch.zeros(())}
    clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return zero_padding(loss, valid), {"vf_clipfrac": masked_token_mean((clipped > unclipped).float(), valid).detach()}
