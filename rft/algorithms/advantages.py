"""Advantage estimators: rewards (and optionally critic values) -> per-token advantages.

Registry ADVANTAGES, signature

    fn(inputs: AdvantageInputs, cfg) -> AdvantageOutputs

`cfg` is any object (or None); built-ins read these attributes with defaults:
    norm_adv_by_std: bool = True   grpo: divide by the group's std
    gamma: float = 1.0             reinforce_pp, gae: discount per valid token
    lam: float = 1.0               gae: GAE lambda
    eps: float = 1e-6              grpo: added to the group std

Built-ins: "grpo", "dr_grpo", "rloo" (group baselines over `group_ids`, one advantage per
response broadcast over its tokens; registered with `per_response=True`, which lets the trainer
score a multi-row trajectory once, rft/trainer/train_step.py), "reinforce_pp" and "gae" (per-token
returns, whitened over the batch's valid tokens). "grpo_per_turn" (rft/algorithms/turn_credit.py,
registered with `per_turn=True`: the trainer passes each token's turn and each turn's reward)
credits each model turn of a multi-step trajectory with its own discounted return.
Padding (mask = 0) never influences a result and gets advantage 0. Estimators that whiten over the
batch (reinforce_pp, gae) must see the whole batch, not one data-parallel shard of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rft.algorithms.aggregation import zero_padding
from rft.lazy import lazy_module
from rft.registry import Registry

# imported where first used: the launcher checks names here without torch (rft/lazy.py)
torch = lazy_module("torch")

ADVANTAGES = Registry("advantage estimator", params=("inputs", "cfg"), returns="AdvantageOutputs")

# Whitening divides by sqrt(max(var, floor)), as OpenRLHF does (var.clamp(min=1e-8).rsqrt()), so
# a batch whose returns are all equal yields advantage 0 instead of 0/0.
WHITEN_VAR_FLOOR = 1e-8


@dataclass
class AdvantageInputs:
    """What an estimator sees: B responses (experience rows), in any order.

    rewards: [B] one scalar reward per response.
    group_ids: [B] int64, the group of each response (0..G-1): samples of one task, compared with
        each other by the group-baseline estimators. Groups may be ragged (7 of 8 samples after a
        failure) and need not be contiguous.
    mask: [B, T] 1 on response tokens to train, 0 on padding and on tokens the policy did not
        sample (tool output, environment observations, chat scaffolding).
    values: [B, T] critic values, or None (needed by "gae").
    token_rewards: [B, T] per-token reward shaping (e.g. `kl.kl_penalty_rewards`), or None; added
        to the sequence reward, which sits on each response's last valid token.
    turn_ids: [B, T] int64, the model turn (0, 1, ... within its trajectory) of each token, -1
        outside any turn; turn_rewards: [B, K] each row's per-turn rewards (0 past its turns).
        Filled for estimators registered with `per_turn=True` (rft/algorithms/turn_credit.py),
        else None.
    old_logprobs, teacher_logprobs: [B, T] the student's sampling logprobs and a frozen teacher's,
        and teacher_scored: [B] 1 where the teacher scored the row, 0 where it did not answer.
        Filled for estimators registered with `needs_teacher=True` (rft/algorithms/distillation.py),
        else None.
    """

    rewards: torch.Tensor
    group_ids: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None
    turn_ids: torch.Tensor | None = None
    turn_rewards: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    teacher_scored: torch.Tensor | None = None


@dataclass
class AdvantageOutputs:
    """advantages: [B, T], 0 where mask is 0. returns: [B, T] critic targets, or None."""

    advantages: torch.Tensor
    returns: torch.Tensor | None = None


def _check_inputs(inputs: AdvantageInputs, name: str) -> None:
    mask = inputs.mask
    if mask.dim() != 2:
        raise ValueError(f"{name}: mask must be [B, T], got shape {tuple(mask.shape)}")
    for field in ("rewards", "group_ids"):
        if getattr(inputs, field).shape != (mask.shape[0],):
            raise ValueError(f"{name}: {field} must be [B] = [{mask.shape[0]}] to match the mask, "
                             f"got shape {tuple(getattr(inputs, field).shape)}")
    for field in ("values", "token_rewards"):
        t = getattr(inputs, field)
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name}: {field} must have the mask's shape {tuple(mask.shape)}, "
                             f"got {tuple(t.shape)}")
    if inputs.group_ids.numel() and int(inputs.group_ids.min()) < 0:
        raise ValueError(f"{name}: group_ids must be >= 0 (see rft.algorithms.advantages.group_index)")


def group_index(keys: list) -> torch.Tensor:
    """Group ids 0..G-1 [B] from any hashable per-row keys (experience `group_id` strings), in
    order of first appearance."""
    index: dict = {}
    return torch.tensor([index.setdefault(k, len(index)) for k in keys], dtype=torch.int64)


def group_stats(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: (its group's size, sum, unbiased std) of `values` [B]; std is 0 for a group of one."""
    groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    count = torch.zeros(groups).index_add_(0, group_ids, torch.ones_like(values))
    total = torch.zeros(groups).index_add_(0, group_ids, values)
    mean = total / count
    squares = torch.zeros(groups).index_add_(0, group_ids, (values - mean[group_ids]) ** 2)
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    return count[group_ids], total[group_ids], std[group_ids]


def _group_rewards(inputs: AdvantageInputs, name: str) -> torch.Tensor:
    """Rewards [B] for the group-baseline estimators."""
    _check_inputs(inputs, name)
    if inputs.token_rewards is not None:
        # silently dropping a KL-in-reward penalty would train a different objective than asked
        raise ValueError(f"{name} uses one reward per response and would ignore token_rewards; "
                         f"use reinforce_pp or gae for per-token rewards, or a KL loss term")
    return inputs.rewards.detach().float()


def _broadcast(per_response: torch.Tensor, mask: torch.Tensor) -> AdvantageOutputs:
    """One advantage per response -> the same value on each of its valid tokens."""
    expanded = per_response.reshape(-1, 1).expand(mask.shape)
    return AdvantageOutputs(advantages=zero_padding(expanded, mask))


@ADVANTAGES.register("grpo", per_response=True, needs_group=True)
def grpo(inputs: AdvantageInputs, cfg: Any) -> AdvantageOutputs:
    """GRPO (DeepSeekMath): (r - group mean) / (unbiased group std + eps), or only centred when
    cfg.norm_adv_by_std is False. A group whose rewards are all equal, or a group of one sample,
    gets 0 (as verl, TRL)."""
    rewards = _group_rewards(inputs, "grpo")
    count, total, std = group_stats(rewards, inputs.group_ids)
    centred = rewards - total / count
    if getattr(cfg, "norm_adv_by_std", True):
        centred = centred / (std + getattr(cfg, "eps", 1e-6))
    return _broadcast(centred, inputs.mask)


@ADVANTAGES.register("dr_grpo", per_response=True, needs_group=True)
def dr_grpo(inputs: AdvantageInputs, cfg: Any) -> AdvantageOutputs:
    """Dr. GRPO (Liu et al., "Understanding R1-Zero-Like Training"): r - group mean, never
    divided by the std, which over-weights groups that are nearly all right or all wrong."""
    rewards = _group_rewards(inputs, "dr_grpo")
    count, total, _ = group_stats(rewards, inputs.group_ids)
    return _broadcast(rewards - total / count, inputs.mask)


@ADVANTAGES.register("rloo", per_response=True, needs_group=True)
def rloo(inputs: AdvantageInputs, cfg: Any) -> AdvantageOutputs:
    """RLOO (Ahmadian et al.; verl/OpenRLHF "rloo"): r_i minus the mean of the group's other
    rewards, an unbiased baseline because it does not depend on sample i. A group of one sample
    has no other rewards: advantage 0."""
    rewards = _group_rewards(inputs, "rloo")
    count, total, _ = group_stats(rewards, inputs.group_ids)
    others_mean = (total - rewards) / (count - 1).clamp(min=1)
    return _broadcast(torch.where(count > 1, rewards - others_mean, torch.zeros_like(rewards)), inputs.mask)


def token_level_rewards(inputs: AdvantageInputs) -> torch.Tensor:
    """[B, T]: the response reward on its last valid token, plus token_rewards on valid tokens.

    "Last valid" is found from the mask itself (position where the running count of valid tokens
    reaches the row's total), so right padding and masked holes are both handled; a row with no
    valid token gets nothing.
    """
    valid = inputs.mask.bool()
    last = valid & (valid.cumsum(dim=1) == valid.sum(dim=1, keepdim=True))
    rewards = inputs.rewards.detach().float().reshape(-1, 1).expand(valid.shape)
    out = zero_padding(rewards, last)
    if inputs.token_rewards is not None:
        out = out + zero_padding(inputs.token_rewards.detach().float(), valid)
    return out


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_next, where "next" is the next VALID token (padding is skipped, not
    counted as a step); 0 on padding. OpenRLHF's get_cumulative_returns for right padding."""
    valid = mask.bool()
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        out[:, t] = running
    return zero_padding(out, valid)


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std over the valid tokens of the whole tensor; 0 on padding.

    Biased variance and a variance floor, as OpenRLHF normalises REINFORCE++ and GAE advantages.
    """
    valid = mask.bool()
    count = valid.sum().clamp(min=1)
    mean = zero_padding(values, valid).sum() / count
    var = zero_padding((values - mean) ** 2, valid).sum() / count
    return zero_padding((values - mean) * torch.rsqrt(var.clamp(min=WHITEN_VAR_FLOOR)), valid)


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp(inputs: AdvantageInputs, cfg: Any) -> AdvantageOutputs:
    """REINFORCE++ (Hu, OpenRLHF): discounted per-token returns of the token-level rewards,
    whitened over the whole batch's valid tokens (the batch, not the group, is the baseline).
    `returns` are the unwhitened discounted returns."""
    _check_inputs(inputs, "reinforce_pp")
    returns = discounted_returns(token_level_rewards(inputs), inputs.mask, getattr(cfg, "gamma", 1.0))
    return AdvantageOutputs(advantages=whiten(returns, inputs.mask), returns=returns)


@ADVANTAGES.register("gae")
def gae(inputs: AdvantageInputs, cfg: Any) -> AdvantageOutputs:
    """PPO's generalised advantage estimation (Schulman et al.; verl compute_gae_advantage_return).

    Over valid tokens only: delta_t = r_t + gamma * V_next - V_t (V after the last valid token is
    0), A_t = delta_t + gamma * lam * A_next; returns = A + V (the critic's targets, before
    whitening); advantages are then whitened over the batch's valid tokens.
    """
    _check_inputs(inputs, "gae")
    if inputs.values is None:
        raise ValueError("gae needs critic values (AdvantageInputs.values [B, T]); "
                         "use grpo, rloo or reinforce_pp without a critic")
    gamma, lam = getattr(cfg, "gamma", 1.0), getattr(cfg, "lam", 1.0)
    valid = inputs.mask.bool()
    rewards = token_level_rewards(inputs)
    values = zero_padding(inputs.values.detach().float(), valid)
    next_value = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    adv = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        # padding carries the next valid token's value and advantage through unchanged
        next_adv = torch.where(valid[:, t], delta + gamma * lam * next_adv, next_adv)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        adv[:, t] = next_adv
    adv = zero_padding(adv, valid)
    return AdvantageOutputs(advantages=whiten(adv, valid), returns=zero_padding(adv + values, valid))
