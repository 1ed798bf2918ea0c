"""Advantage estimators against plain-Python reference computations (loops over lists, statistics
module), never against the code under test."""

import math
import statistics

import pytest
import torch

from rft.algorithms.advantages import ADVANTAGES, AdvantageInputs
from rft.algorithms.kl import kl_penalty_rewards

NAN = float("nan")


def right_padded_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.tensor([[1.0 if t < n else 0.0 for t in range(width)] for n in lengths])


def contiguous(rewards, group_size: int, mask, **kw) -> AdvantageInputs:
    """Inputs whose groups are runs of `group_size` rows (the last may be shorter)."""
    n = len(rewards)
    return AdvantageInputs(rewards, torch.arange(n) // group_size, mask, **kw)


def run(name: str, inputs: AdvantageInputs, **cfg):
    return ADVANTAGES.get(name)(inputs, type("Cfg", (), cfg)())


# --- plain references ---------------------------------------------------------------------------

def ref_group_baseline(rewards: list[float], group_size: int, kind: str, eps: float = 1e-6) -> list[float]:
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        mean = sum(group) / len(group)
        for i, r in enumerate(group):
            if kind == "grpo":
                out.append((r - mean) / (statistics.stdev(group) + eps))
            elif kind == "dr_grpo":
                out.append(r - mean)
            elif kind == "rloo":
                others = group[:i] + group[i + 1:]
                out.append(r - sum(others) / len(others))
    return out


def broadcast(per_response: list[float], mask: torch.Tensor) -> list[list[float]]:
    return [[a if m else 0.0 for m in row] for a, row in zip(per_response, mask.tolist())]


def ref_token_rewards(rewards, mask, token_rewards=None) -> list[list[float]]:
    """Sequence reward on the last valid token, plus token rewards on valid tokens."""
    out = []
    for i, row in enumerate(mask.tolist()):
        valid = [t for t, m in enumerate(row) if m]
        r = [0.0] * len(row)
        for t in valid:
            r[t] = token_rewards[i][t] if token_rewards is not None else 0.0
        if valid:
            r[valid[-1]] += rewards[i]
        out.append(r)
    return out


def ref_whiten(values: list[list[float]], mask: torch.Tensor) -> list[list[float]]:
    flat = [v for row, mrow in zip(values, mask.tolist()) for v, m in zip(row, mrow) if m]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / len(flat)  # biased, as OpenRLHF
    scale = 1.0 / math.sqrt(max(var, 1e-8))
    return [[(v - mean) * scale if m else 0.0 for v, m in zip(row, mrow)]
            for row, mrow in zip(values, mask.tolist())]


def ref_reinforce_pp(rewards, mask, token_rewards, gamma):
    r = ref_token_rewards(rewards, mask, token_rewards)
    returns = []
    for i, row in enumerate(mask.tolist()):
        g, ret = 0.0, [0.0] * len(row)
        for t in reversed([t for t, m in enumerate(row) if m]):  # discount counts valid tokens only
            g = r[i][t] + gamma * g
            ret[t] = g
        returns.append(ret)
    return ref_whiten(returns, mask), returns


def ref_gae(rewards, mask, values, token_rewards, gamma, lam):
    r = ref_token_rewards(rewards, mask, token_rewards)
    adv_all, ret_all = [], []
    for i, row in enumerate(mask.tolist()):
        valid = [t for t, m in enumerate(row) if m]
        adv, ret = [0.0] * len(row), [0.0] * len(row)
        next_a = 0.0
        for k in reversed(range(len(valid))):
            t = valid[k]
            v_next = values[i][valid[k + 1]] if k + 1 < len(valid) else 0.0
            delta = r[i][t] + gamma * v_next - values[i][t]
            next_a = delta + gamma * lam * next_a
            adv[t], ret[t] = next_a, next_a + values[i][t]
        adv_all.append(adv)
        ret_all.append(ret)
    return ref_whiten(adv_all, mask), ret_all


def assert_close(actual: torch.Tensor, expected, tol: float = 1e-5):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64),
                               atol=tol, rtol=0)


# --- group baselines ----------------------------------------------------------------------------

# group 1 mixed, group 2 all equal; lengths include right padding and a length-1 response
REWARDS = [1.0, 0.0, 0.5, 1.0, 1.0, 1.0]
LENGTHS = [4, 1, 3, 2, 4, 1]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_baselines_match_reference(name):
    mask = right_padded_mask(LENGTHS, 4)
    out = run(name, contiguous(torch.tensor(REWARDS), 3, mask))
    expected = ref_group_baseline(REWARDS, 3, name)
    assert_close(out.advantages, broadcast(expected, mask))
    assert out.returns is None
    assert (out.advantages[3:] == 0).all()  # the all-equal group learns nothing


# ragged groups in any row order: group "b" lost a sample, rows of the groups interleaved
RAGGED_KEYS = ["a", "b", "a", "c", "b", "a", "c", "a"]
RAGGED_REWARDS = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 1.0]


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_baselines_over_ragged_interleaved_groups(name):
    from rft.algorithms.advantages import group_index

    mask = torch.ones(len(RAGGED_KEYS), 2)
    out = run(name, AdvantageInputs(torch.tensor(RAGGED_REWARDS), group_index(RAGGED_KEYS), mask))
    # reference: gather each group's rewards by key, compute in plain Python, put back in row order
    expected = [0.0] * len(RAGGED_KEYS)
    for key in set(RAGGED_KEYS):
        rows = [i for i, k in enumerate(RAGGED_KEYS) if k == key]
        values = ref_group_baseline([RAGGED_REWARDS[i] for i in rows], len(rows), name)
        for i, v in zip(rows, values):
            expected[i] = v
    assert_close(out.advantages, broadcast(expected, mask))
    # the same rows sorted into contiguous groups give the same advantage per row
    order = sorted(range(len(RAGGED_KEYS)), key=lambda i: RAGGED_KEYS[i])
    sorted_out = run(name, AdvantageInputs(torch.tensor([RAGGED_REWARDS[i] for i in order]),
                                           group_index([RAGGED_KEYS[i] for i in order]), mask))
    assert_close(sorted_out.advantages, [out.advantages[i].tolist() for i in order])


def test_grpo_without_std_is_dr_grpo():
    mask = right_padded_mask(LENGTHS, 4)
    inputs = contiguous(torch.tensor(REWARDS), 3, mask)
    assert torch.equal(run("grpo", inputs, norm_adv_by_std=False).advantages,
                       run("dr_grpo", inputs).advantages)


def test_grpo_by_hand():
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5) -> +-0.5 / 0.70711 = +-0.70711
    out = run("grpo", contiguous(torch.tensor([1.0, 0.0]), 2, torch.ones(2, 1)), eps=0.0)
    assert_close(out.advantages, [[math.sqrt(0.5)], [-math.sqrt(0.5)]])


def test_rloo_by_hand():
    # group [3, 1, 2]: 3 - (1+2)/2 = 1.5; 1 - (3+2)/2 = -1.5; 2 - (3+1)/2 = 0
    out = run("rloo", contiguous(torch.tensor([3.0, 1.0, 2.0]), 3, torch.ones(3, 2)))
    assert_close(out.advantages, [[1.5, 1.5], [-1.5, -1.5], [0.0, 0.0]])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_baselines_give_a_lone_sample_zero_and_reject_token_rewards(name):
    out = run(name, contiguous(torch.tensor([1.0, 0.0]), 1, torch.ones(2, 3)))
    assert (out.advantages == 0).all()  # no other sample to compare with
    with pytest.raises(ValueError, match="would ignore token_rewards"):
        run(name, contiguous(torch.ones(2), 2, torch.ones(2, 3), token_rewards=torch.zeros(2, 3)))


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"])
def test_inputs_with_wrong_shapes_are_rejected(name):
    mask = torch.ones(4, 3)
    with pytest.raises(ValueError, match="group_ids must be"):
        run(name, AdvantageInputs(torch.ones(4), torch.zeros(3, dtype=torch.int64), mask, values=torch.zeros(4, 3)))
    with pytest.raises(ValueError, match="rewards must be"):
        run(name, contiguous(torch.ones(5), 2, mask, values=torch.zeros(4, 3)))
    with pytest.raises(ValueError, match="values must have the mask's shape"):
        run(name, contiguous(torch.ones(4), 2, mask, values=torch.zeros(4, 2)))


# --- REINFORCE++ --------------------------------------------------------------------------------

def test_reinforce_pp_matches_reference_with_padding_holes_and_length_one():
    # row 2 has a masked hole (e.g. an environment observation) between response tokens
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 1, 1], [1, 1, 0, 0]], dtype=torch.float)
    rewards = [1.0, -0.5, 2.0, 0.0]
    token_rewards = [[0.1, -0.2, 0.3, NAN], [0.05, NAN, NAN, NAN], [-0.1, 7.0, 0.2, 0.0],
                     [0.0, 0.4, NAN, NAN]]
    out = run("reinforce_pp", contiguous(torch.tensor(rewards), 2, mask,
                                              token_rewards=torch.tensor(token_rewards)), gamma=0.9)
    clean = [[v if m else 0.0 for v, m in zip(row, mrow)] for row, mrow in zip(token_rewards, mask.tolist())]
    expected_adv, expected_ret = ref_reinforce_pp(rewards, mask, clean, gamma=0.9)
    assert_close(out.advantages, expected_adv)
    assert_close(out.returns, expected_ret)


def test_reinforce_pp_by_hand():
    # one row, 2 tokens, reward 1, gamma 0.5: returns [0.5, 1]; mean 0.75, biased std 0.25
    out = run("reinforce_pp", contiguous(torch.tensor([1.0]), 1, torch.ones(1, 2)), gamma=0.5)
    assert_close(out.returns, [[0.5, 1.0]])
    assert_close(out.advantages, [[-1.0, 1.0]])


def test_reinforce_pp_ignores_padding_width_and_contents():
    rewards = torch.tensor([1.0, 0.0])
    narrow = run("reinforce_pp", contiguous(rewards, 2, right_padded_mask([2, 1], 2)), gamma=0.9)
    wide_mask = right_padded_mask([2, 1], 5)
    noisy = torch.full((2, 5), NAN)
    noisy[wide_mask.bool()] = 0.0
    wide = run("reinforce_pp", contiguous(rewards, 2, wide_mask, token_rewards=noisy), gamma=0.9)
    assert torch.allclose(wide.advantages[:, :2], narrow.advantages)
    assert (wide.advantages[:, 2:] == 0).all()


def test_reinforce_pp_with_kl_penalty_rewards():
    mask = right_padded_mask([3, 2], 3)
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -1.7, 0.0]])
    token_rewards = kl_penalty_rewards(logp, ref, mask, "k1", coef=0.1)
    # -0.1 * (logp - ref) on valid tokens
    assert_close(token_rewards, [[-0.05, 0.1, 0.0], [0.0, -0.1, 0.0]])
    rewards = [1.0, 0.0]
    out = run("reinforce_pp", contiguous(torch.tensor(rewards), 1, mask, token_rewards=token_rewards))
    expected, _ = ref_reinforce_pp(rewards, mask, token_rewards.tolist(), gamma=1.0)
    assert_close(out.advantages, expected)


# --- GAE ----------------------------------------------------------------------------------------

def test_gae_by_hand():
    # V = [0.5, 0.25], reward 1 on the last token, gamma = lam = 1:
    # delta_1 = 1 + 0 - 0.25 = 0.75, delta_0 = 0 + 0.25 - 0.5 = -0.25
    # A = [-0.25 + 0.75, 0.75] = [0.5, 0.75]; returns = A + V = [1, 1] (the Monte-Carlo return)
    out = run("gae", contiguous(torch.tensor([1.0]), 1, torch.ones(1, 2),
                                     values=torch.tensor([[0.5, 0.25]])))
    assert_close(out.returns, [[1.0, 1.0]])
    # whitened [0.5, 0.75]: mean 0.625, biased std 0.125 -> [-1, 1]
    assert_close(out.advantages, [[-1.0, 1.0]])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_reference_with_padding_and_length_one(gamma, lam):
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0]], dtype=torch.float)
    rewards = [1.0, 0.5, -1.0, 2.0]
    values = [[0.2, 0.4, -0.1, 0.3], [0.7, NAN, 9.0, NAN], [0.1, -0.3, 5.0, -5.0], [0.0, 1e9, 0.6, NAN]]
    token_rewards = [[0.01, 0.0, -0.02, 0.03], [0.1, NAN, NAN, NAN], [0.0, 0.05, NAN, 1.0],
                     [0.2, NAN, -0.1, NAN]]
    out = run("gae", contiguous(torch.tensor(rewards), 2, mask, values=torch.tensor(values),
                                     token_rewards=torch.tensor(token_rewards)), gamma=gamma, lam=lam)
    expected_adv, expected_ret = ref_gae(rewards, mask, values, token_rewards, gamma, lam)
    assert_close(out.advantages, expected_adv, tol=1e-4)
    assert_close(out.returns, expected_ret, tol=1e-5)


def test_gae_length_one_response_is_reward_minus_value():
    out = run("gae", contiguous(torch.tensor([2.0, 0.0]), 2, right_padded_mask([1, 1], 3),
                                     values=torch.tensor([[0.5, 3.0, 3.0], [0.25, 3.0, 3.0]])))
    # A = r - V: [1.5, -0.25]; returns = A + V = r
    assert_close(out.returns, [[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # whitened: mean 0.625, biased std 0.875 -> [1, -1]
    assert_close(out.advantages, [[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])


def test_gae_needs_values():
    with pytest.raises(ValueError, match="gae needs critic values"):
        run("gae", contiguous(torch.ones(2), 2, torch.ones(2, 3)))


def test_whitening_of_equal_returns_gives_zero_not_nan():
    out = run("reinforce_pp", contiguous(torch.tensor([1.0, 1.0]), 2, right_padded_mask([1, 1], 2)))
    assert (out.advantages == 0).all()
