"""Per-turn credit for multi-step workflows: each model turn's advantage from the rewards of that
turn and the turns after it, instead of one episode return spread over the whole trajectory.

Built-in "grpo_per_turn" (registered in ADVANTAGES with `per_turn=True`: the trainer then fills
`AdvantageInputs.turn_ids` and `turn_rewards` with `turn_tensors`, rft/trainer/train_step.py):

    r_k  = step_rewards[k]; the last turn also gets  reward - sum(step_rewards)
           (0 where the reward is the summed step rewards, as multi_turn's; the whole score
           where an environment leaves scoring to algorithm.reward on its final answer)
    G_k  = sum_{j >= k} gamma^(j - k) r_j                 (cfg.gamma: the discount per turn)
    A_k  = (G_k - mean) / (std + eps)                     (cfg.norm_adv_by_std, cfg.eps as grpo)

mean and std (unbiased) are taken over the turns at the same position k of the trajectories of
one group (the samples of one task): the turn-k return of a trajectory is compared with the
turn-k returns of the other attempts at the same task. At k = 0 every attempt is in the task's
start state, so turn 0 gets GRPO's episode advantage (with gamma 1); later turns are compared with
the attempts still going at that turn, as GiGPO (verl-agent) compares steps taken from the same
state. A turn no other trajectory of its group reached gets 0, as grpo gives a group of one.
Each token of turn k gets A_k; tokens outside any turn (observations, padding) get 0.

Turns of a row: a multi_turn row holds a whole trajectory, its model turns the runs of 1s of the
loss mask (environment messages between them are 0s); a step_wise row holds one turn, step
`step_index` of its trajectory, with the trajectory's step rewards. Both come down to
turn = step_index + (runs of 1s so far) - 1, and `turn_tensors` checks the count against the
row's `turns` (its model turns so far): an observation that renders to no tokens would merge two
turns into one run, and the credit of one turn would then land on another.
"""

from __future__ import annotations

from typing import Any

from rft.algorithms.advantages import ADVANTAGES, AdvantageInputs, AdvantageOutputs, _check_inputs, group_stats
from rft.algorithms.aggregation import zero_padding
from rft.lazy import lazy_module

# imported where first used: the launcher checks names here without torch (rft/lazy.py)
torch = lazy_module("torch")


def turn_tensors(mask: torch.Tensor, rewards: list[float], step_rewards: list[list[float] | None] | None,
                 step_index: list[int] | None, turns: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(turn_ids [B, T] int64, turn_rewards [B, K]) of B response-aligned rows, from each row's
    experience fields (rft/buffer/experience.py); rows without step rewards (single-turn
    workflows, or the lists None) are one turn rewarded with their reward. ValueError where a
    row's turns and step rewards disagree."""
    rows = mask.shape[0]
    step_rewards = step_rewards or [None] * rows
    step_index = step_index or [0] * rows
    valid = mask.bool()
    starts = valid.clone()
    starts[:, 1:] &= ~valid[:, :-1]  # a 1 after a 0 (or at the start) opens a turn
    runs = starts.long().cumsum(dim=1)
    first = torch.tensor(step_index, dtype=torch.int64).reshape(-1, 1)
    turn_ids = torch.where(valid, first + runs - 1, torch.full_like(runs, -1))
    per_row = []
    for i in range(rows):
        steps = [float(r) for r in step_rewards[i] or []]
        found = int(runs[i, -1]) if runs.shape[1] else 0
        if not steps:  # one turn, whatever the mask: the row's reward on all its tokens
            turn_ids[i] = torch.where(valid[i], 0, -1)
            per_row.append([float(rewards[i])])
            continue
        if turns is not None and found and step_index[i] + found != turns[i]:
            raise ValueError(
                f"per-turn credit: batch row {i} has {found} run(s) of trained tokens from turn "
                f"{step_index[i]} on but says turns={turns[i]}: two model turns with no untrained token between "
                "them (an observation that renders to no tokens) cannot be told apart; use "
                "rollout.workflow=step_wise (a row per turn) or an episode-level advantage such as grpo")
        if step_index[i] + found > len(steps):
            raise ValueError(
                f"per-turn credit: batch row {i} has model turns up to {step_index[i] + found - 1} but "
                f"{len(steps)} step reward(s): each model turn needs the reward of its environment step "
                "(Experience.step_rewards)")
        steps[-1] += float(rewards[i]) - sum(steps)  # the reward's part not in the step rewards: the last turn's
        per_row.append(steps)
    width = max((len(r) for r in per_row), default=0)
    turn_rewards = torch.zeros(rows, width)
    for i, r in enumerate(per_row):
        turn_rewards[i, : len(r)] = torch.tensor(r)
    return turn_ids, turn_rewards


def turn_returns(turn_rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_k = r_k + gamma * G_{k+1} per row [B, K] (padding past a row's turns is 0 and adds nothing)."""
    out = torch.zeros_like(turn_rewards)
    running = torch.zeros(turn_rewards.shape[0], dtype=turn_rewards.dtype)
    for k in reversed(range(turn_rewards.shape[1])):
        running = turn_rewards[:, k] + gamma * running
        out[:, k] = running
    return out


@ADVANTAGES.register("grpo_per_turn", per_turn=True, needs_group=True)
def grpo_per_turn(inputs: AdvantageInputs, cfg: Any) -> AdvantageOutputs:
    """Per-turn GRPO: discounted per-turn returns normalised over the group's turns at the same
    position (module docstring). Without inputs.turn_ids and turn_rewards each response is one
    turn, and the result is grpo's."""
    _check_inputs(inputs, "grpo_per_turn")
    turn_ids, turn_rewards = inputs.turn_ids, inputs.turn_rewards
    if turn_ids is None or turn_rewards is None:  # no turns given: each response is one turn (grpo)
        turn_ids = torch.where(inputs.mask.bool(), 0, -1)
        turn_rewards = inputs.rewards.reshape(-1, 1)
    if turn_ids.shape != inputs.mask.shape or turn_rewards.shape[0] != inputs.mask.shape[0]:
        raise ValueError(f"grpo_per_turn: turn_ids must have the mask's shape {tuple(inputs.mask.shape)} and "
                         f"turn_rewards one row per response, got {tuple(turn_ids.shape)} and "
                         f"{tuple(turn_rewards.shape)}")
    if inputs.token_rewards is not None:
        raise ValueError("grpo_per_turn uses one reward per turn and would ignore token_rewards; "
                         "use reinforce_pp or gae for per-token rewards, or a KL loss term")
    valid = inputs.mask.bool() & (turn_ids >= 0)
    if not valid.any():
        return AdvantageOutputs(advantages=torch.zeros_like(inputs.mask, dtype=torch.float32))
    returns = turn_returns(turn_rewards.detach().float(), getattr(cfg, "gamma", 1.0))
    width = returns.shape[1]
    if int(turn_ids[valid].max()) >= width:
        raise ValueError(f"grpo_per_turn: a token of turn {int(turn_ids[valid].max())} but turn_rewards "
                         f"hold {width} turn(s)")
    # the (row, turn) pairs that have a token to train: a step_wise row holds one of its trajectory's turns
    present = torch.zeros(returns.shape, dtype=torch.bool)
    rows = torch.arange(returns.shape[0]).reshape(-1, 1).expand(valid.shape)
    present[rows[valid], turn_ids[valid]] = True
    row, turn = present.nonzero(as_tuple=True)
    values = returns[row, turn]
    # a baseline per (task, turn position). Pooling all turns of the group instead (one baseline per
    # task) measured no better on the grid world (docs/guides/agents.md) and compares a turn's
    # return-to-go with returns from other points of the episode
    count, total, std = group_stats(values, inputs.group_ids[row] * width + turn)
    centred = values - total / count
    if getattr(cfg, "norm_adv_by_std", True):
        centred = centred / (std + getattr(cfg, "eps", 1e-6))
    per_turn = torch.zeros_like(returns)
    per_turn[row, turn] = centred
    advantages = per_turn.gather(1, turn_ids.clamp(min=0, max=width - 1))
    return AdvantageOutputs(advantages=zero_padding(advantages, valid))
