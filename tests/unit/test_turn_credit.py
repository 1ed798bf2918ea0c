"""Per-turn credit (rft/algorithms/turn_credit.py) on fixed rows, the returns and the group
normalisation computed by hand: turns found in masks with observation holes, the episode reward's
rest on the last turn, trajectories of different lengths in ragged groups, and step_wise rows (one
turn each) credited exactly as the same trajectories held whole in multi_turn rows."""

import statistics

import pytest
import torch

from rft.algorithms.advantages import ADVANTAGES, AdvantageInputs
from rft.algorithms.turn_credit import turn_tensors
from rft.buffer.experience import Experience
from rft.config import AlgorithmConfig
from rft.trainer.step_batch import StepBatch, batch_advantages

GAMMA = 0.5
EPS = 1e-6


def multi_turn_row(steps: list[float], group: str, name: str, reward: float | None = None) -> Experience:
    """One whole trajectory: prompt [9, 9], then per turn two sampled tokens and one observation
    token (masked out) between turns."""
    ids, mask = [9, 9], [0, 0]
    for k in range(len(steps)):
        if k:
            ids, mask = ids + [7], mask + [0]
        ids, mask = ids + [k + 1, k + 1], mask + [1, 1]
    return Experience(token_ids=ids, loss_mask=mask, logprobs=[0.0] * len(ids), prompt_length=2,
                      reward=sum(steps) if reward is None else reward, step_rewards=steps, group_id=group,
                      trajectory_id=name, turns=len(steps))


def step_wise_rows(steps: list[float], group: str, name: str) -> list[Experience]:
    """The same trajectory as step_wise writes it: row k is the conversation up to turn k, trained
    on turn k only (its prompt ends where turn k starts)."""
    whole = multi_turn_row(steps, group, name)
    rows = []
    for k in range(len(steps)):
        start = 2 + 3 * k
        rows.append(Experience(token_ids=whole.token_ids[: start + 2], loss_mask=[0] * start + [1, 1],
                               logprobs=[0.0] * (start + 2), prompt_length=start, reward=whole.reward,
                               step_rewards=steps, step_index=k, group_id=group, trajectory_id=name, turns=k + 1))
    return rows


def returns(steps: list[float], gamma: float) -> list[float]:
    out, running = [], 0.0
    for r in reversed(steps):
        running = r + gamma * running
        out.insert(0, running)
    return out


def normalised(value: float, peers: list[float]) -> float:
    if len(peers) < 2:
        return 0.0
    return (value - statistics.fmean(peers)) / (statistics.stdev(peers) + EPS)


# group "g": three trajectories of 3, 2 and 3 turns; group "h": one trajectory (ragged: a group of one)
TRAJECTORIES = {"A": ([0.1, 0.1, 1.0], "g"), "B": ([-0.1, -0.1], "g"), "C": ([0.1, -0.1, -0.1], "g"),
                "D": ([0.5], "h")}


def expected_turn_advantages(gamma: float) -> dict[str, list[float]]:
    """name -> each turn's advantage, by hand: the turn-k return against the turn-k returns of the
    other trajectories of its group that have a turn k."""
    g = {name: returns(steps, gamma) for name, (steps, _) in TRAJECTORIES.items()}
    out = {}
    for name, (steps, group) in TRAJECTORIES.items():
        peers = [other for other, (_, grp) in TRAJECTORIES.items() if grp == group]
        out[name] = [normalised(g[name][k], [g[p][k] for p in peers if len(g[p]) > k]) for k in range(len(steps))]
    return out


def test_turns_are_the_runs_of_trained_tokens_and_the_reward_rest_goes_to_the_last_turn():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1], [0, 0, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]])
    turn_ids, turn_rewards = turn_tensors(mask, rewards=[1.0, 0.7, 0.3],
                                          step_rewards=[[0.1, -0.1, 1.0], [0.0, 0.2, 0.0], None],
                                          step_index=[0, 1, 0], turns=[3, 2, 1])
    assert turn_ids.tolist() == [[0, 0, -1, -1, 1, -1, 2, 2], [-1, -1, 1, 1, -1, -1, -1, -1],
                                 [0, 0, 0, -1, -1, -1, -1, -1]]
    # row 0: reward = sum of its step rewards, nothing added; row 1 (a step_wise row, turn 1 of a 3-turn
    # trajectory scored 0.7 by algorithm.reward): the rest 0.5 on the trajectory's last turn; row 2: no step
    # rewards, one turn with its reward
    torch.testing.assert_close(turn_rewards, torch.tensor([[0.1, -0.1, 1.0], [0.0, 0.2, 0.5], [0.3, 0.0, 0.0]]))


def test_merged_turns_or_a_turn_without_a_step_reward_are_refused():
    mask = torch.tensor([[1, 1, 1, 1, 0, 1]])  # 2 runs, but the row had 3 model turns: two of them touch
    with pytest.raises(ValueError, match="batch row 0 has 2 run.*turns=3.*step_wise"):
        turn_tensors(mask, [1.0], [[0.0, 0.0, 1.0]], [0], [3])
    with pytest.raises(ValueError, match="turns up to 1 but 1 step reward"):
        turn_tensors(mask, [1.0], [[1.0]], [0], [2])


def test_per_turn_advantages_are_discounted_returns_normalised_per_group_and_turn_position():
    rows = [multi_turn_row(steps, group, name) for name, (steps, group) in TRAJECTORIES.items()]
    batch = StepBatch.from_experiences(rows)
    out = batch_advantages(batch, AlgorithmConfig(advantage="grpo_per_turn", gamma=GAMMA), None).advantages
    expected = expected_turn_advantages(GAMMA)
    for i, (name, (steps, _)) in enumerate(TRAJECTORIES.items()):
        tokens = []  # response: per turn two trained tokens, an observation (0) between turns
        for k, adv in enumerate(expected[name]):
            tokens += ([0.0] if k else []) + [adv, adv]
        want = torch.tensor(tokens + [0.0] * (out.shape[1] - len(tokens)))
        torch.testing.assert_close(out[i], want, msg=name)
    # the turns of one episode get different advantages (the point of it); D, alone in its group, gets 0
    assert len({round(a, 6) for a in expected["A"]}) == 3 and expected["D"] == [0.0]


def test_step_wise_rows_get_the_credit_of_the_same_turns_held_whole():
    rows = [r for name, (steps, group) in TRAJECTORIES.items() for r in step_wise_rows(steps, group, name)]
    batch = StepBatch.from_experiences(rows)
    out = batch_advantages(batch, AlgorithmConfig(advantage="grpo_per_turn", gamma=GAMMA), None).advantages
    expected = expected_turn_advantages(GAMMA)
    want = [adv for name in TRAJECTORIES for adv in expected[name]]
    torch.testing.assert_close(out[:, :2], torch.tensor(want).reshape(-1, 1).expand(-1, 2))
    assert (out[:, 2:] == 0).all()


def test_turn_zero_with_gamma_one_is_grpos_episode_advantage():
    rows = [multi_turn_row(steps, group, name) for name, (steps, group) in TRAJECTORIES.items()]
    batch = StepBatch.from_experiences(rows)
    per_turn = batch_advantages(batch, AlgorithmConfig(advantage="grpo_per_turn", gamma=1.0), None).advantages
    episode = batch_advantages(batch, AlgorithmConfig(advantage="grpo"), None).advantages
    torch.testing.assert_close(per_turn[:, 0], episode[:, 0])


def test_without_turns_every_response_is_one_turn_as_grpo_and_padding_stays_zero():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    inputs = AdvantageInputs(rewards=torch.tensor([1.0, 0.0, 0.5, 2.0]), group_ids=torch.tensor([0, 0, 0, 1]),
                             mask=mask)
    cfg = AlgorithmConfig()
    torch.testing.assert_close(ADVANTAGES.get("grpo_per_turn")(inputs, cfg).advantages,
                               ADVANTAGES.get("grpo")(inputs, cfg).advantages)


def test_a_kl_reward_penalty_is_refused_rather_than_dropped():
    inputs = AdvantageInputs(rewards=torch.ones(2), group_ids=torch.zeros(2, dtype=torch.int64),
                             mask=torch.ones(2, 3), token_rewards=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="token_rewards"):
        ADVANTAGES.get("grpo_per_turn")(inputs, None)
