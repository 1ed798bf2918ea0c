"""GRPO advantages and losses against values computed by hand."""

import math

import pytest
import torch

from rft.algorithms.grpo import group_advantages, k3_kl, masked_mean, policy_loss, sft_loss


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    adv = group_advantages(rewards, group_size=4)
    # group 1: mean 0.5, unbiased std sqrt(1/3) -> +-0.5/0.57735 = +-0.8660
    expected_1 = 0.5 / math.sqrt(1 / 3)
    assert adv[:4].tolist() == pytest.approx([expected_1, -expected_1, -expected_1, expected_1], rel=1e-4)
    # group 2: mean 0.75, std 0.5 -> 0.25/0.5 = 0.5 and -0.75/0.5 = -1.5
    assert adv[4:].tolist() == pytest.approx([0.5, 0.5, 0.5, -1.5], rel=1e-4)


def test_group_with_equal_rewards_gets_zero_advantage():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), group_size=3)
    assert torch.all(adv == 0)


def test_advantages_without_std_are_only_centred():
    adv = group_advantages(torch.tensor([2.0, 0.0]), group_size=2, norm_by_std=False)
    assert adv.tolist() == [1.0, -1.0]


def test_advantages_reject_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.ones(6), group_size=4)


def test_policy_loss_token_mean_and_clipping():
    # two sequences, 3 token slots; second sequence has 2 real tokens
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[1.5, 1.0, 0.5], [1.1, 0.7, 9.9]]))  # ratios
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, clipfrac = policy_loss(new, old, adv, mask, clip_eps=0.2)
    # seq 1 (A=+1): max(-r, -clip(r)) per token: r=1.5 -> max(-1.5,-1.2)=-1.2 (clipped);
    #   r=1.0 -> -1.0; r=0.5 -> max(-0.5,-0.8)=-0.5
    # seq 2 (A=-2): r=1.1 -> max(2.2, 2.2)=2.2; r=0.7 -> max(1.4, 1.6)=1.6 (clipped)
    expected = (-1.2 - 1.0 - 0.5 + 2.2 + 1.6) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert clipfrac.item() == pytest.approx(2 / 5)


def test_policy_loss_gradient_is_zero_where_clipped():
    new = torch.log(torch.tensor([[1.5]])).requires_grad_()
    loss, _ = policy_loss(new, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), 0.2)
    loss.backward()
    assert new.grad.item() == 0.0


def test_k3_kl_matches_formula_and_is_zero_at_equality():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.0, -1.5])
    kl = k3_kl(logp, ref)
    assert kl[0].item() == pytest.approx(0.0, abs=1e-7)
    r = 0.5
    assert kl[1].item() == pytest.approx(math.exp(r) - r - 1, rel=1e-6)


def test_sft_loss_is_masked_negative_log_likelihood():
    logp = torch.tensor([[-0.5, -1.5, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert sft_loss(logp, mask).item() == pytest.approx(1.0)


def test_masked_mean_of_empty_mask_is_zero():
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0
